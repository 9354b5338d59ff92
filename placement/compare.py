"""The comparison behind ``place optimize``: plan every policy on the first part of the routing, score
it on that part and on the windows it did not see. A library function so the CLI and the dashboard
print the same rows.

Inputs reduce to Loads windows (:func:`routing_windows`): traces through ``traces.stats.trace_loads``,
Loads ``.npz`` files as they are;
several inputs are concatenated window-wise (labels prefixed with the input's name).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from foundation.cluster import ClusterSpec
from foundation.errors import InputError
from foundation.model import ModelSpec
from placement.evaluate import Metrics, evaluate
from placement.policies import PlacementProblem, get_policy, policy_names
from placement.record import Placement
from traces.loads import Loads, is_loads_file, load_loads
from traces.stats import trace_loads

DEFAULT_WINDOW_TOKENS = 4096


def default_redundant(num_experts: int, num_gpus: int) -> int:
    """Smallest R making E + R divisible by G; one extra slot per GPU when E already divides."""
    r = (-num_experts) % num_gpus
    return r if r else num_gpus


# ---------------------------------------------------------------------------- inputs -> Loads
def trace_to_loads(path: str | Path, window_tokens: int) -> Loads:
    """Per-window expert counts of a trace (:func:`traces.stats.trace_loads`)."""
    return trace_loads(path, window_tokens)


def routing_windows(inputs: list[str | Path], *, model: ModelSpec | None = None,
                    window_tokens: int = DEFAULT_WINDOW_TOKENS) -> Loads:
    """Read traces and/or Loads files into one Loads (windows concatenated in input order).
    ``model`` overrides the model recorded in the inputs (it must have the same shape)."""
    if not inputs:
        raise InputError("no traces or Loads files given")
    parts: list[Loads] = []
    for src in inputs:
        p = Path(src)
        if not p.exists():
            raise InputError(f"{p}: no such file or directory")
        ld = load_loads(p) if is_loads_file(p) else trace_to_loads(p, window_tokens)
        if model is not None:
            if (model.num_moe_layers, model.num_experts) != ld.counts.shape[1:]:
                raise InputError(f"{p}: has {ld.counts.shape[1]} MoE layers x {ld.counts.shape[2]} experts "
                                 "but "
                                 f"--model '{model.name}' has {model.num_moe_layers} x {model.num_experts}")
            ld = Loads(ld.counts, model, ld.window_tokens, ld.labels, ld.provenance, ld.samples)
        if ld.counts.sum() == 0:
            raise InputError(f"{p}: no tokens (all expert counts are zero)")
        parts.append(ld)
    first = parts[0].model
    for src, ld in zip(inputs[1:], parts[1:]):
        if ld.model != first:
            raise InputError(f"{src}: model '{ld.model.name}' differs from {inputs[0]} ('{first.name}'); "
                             "inputs of one comparison must be of one model")
    multi = len(parts) > 1
    labels = []
    for src, ld in zip(inputs, parts):
        own = ld.labels or tuple(f"window {i}" for i in range(ld.num_windows))
        labels += [f"{Path(src).name}: {lb}" if multi else lb for lb in own]
    counts = np.concatenate([ld.counts for ld in parts])
    wt = parts[0].window_tokens if all(ld.window_tokens == parts[0].window_tokens for ld in parts) else 0
    # the token samples travel along (traffic objective and sample-based traffic in evaluate)
    have = [ld.samples for ld in parts if ld.samples is not None and len(ld.samples)]
    samples = np.concatenate(have) if len(have) == len(parts) else None
    return Loads(counts, first, wt, tuple(labels), {"inputs": [str(s) for s in inputs]}, samples)


def split_windows(num_windows: int, plan_fraction: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """Plan on the first ``ceil(F * W)`` windows (at least one), score held-out on the rest. With one
    window there is nothing held out: both parts are that window (flag returned True)."""
    if not 0 < plan_fraction <= 1:
        raise InputError(f"--plan-fraction must be in (0, 1], got {plan_fraction}")
    if num_windows == 1:
        return np.array([0]), np.array([0]), True
    n_plan = min(max(1, math.ceil(plan_fraction * num_windows)), num_windows - 1)
    return np.arange(n_plan), np.arange(n_plan, num_windows), False


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True, eq=False)
class PolicyResult:
    policy: str
    placement: Placement
    seconds: float
    plan: Metrics
    held_out: Metrics

    def row(self) -> dict[str, Any]:
        """Flat table row (JSON-ready)."""
        return {
            "policy": self.policy,
            "seconds": self.seconds,
            "plan": self.plan.summary(),
            "held_out": self.held_out.summary(),
            "duplicate_on_gpu_layers": int(self.placement.duplicate_on_gpu().sum()),
        }


@dataclass(frozen=True, eq=False)
class Comparison:
    results: list[PolicyResult]
    plan_windows: np.ndarray
    held_windows: np.ndarray
    single_window: bool
    engine: str
    cluster: ClusterSpec
    num_redundant: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "cluster": self.cluster.to_dict(), "num_redundant": self.num_redundant,
                "plan_windows": self.plan_windows.tolist(), "held_out_windows": self.held_windows.tolist(),
                "single_window": self.single_window, "notes": list(self.notes),
                "rows": [r.row() for r in self.results]}


def compare_policies(loads: Loads, cluster: ClusterSpec, *, num_redundant: int,
                     policies: list[str] | None = None, engine: str = "vllm", plan_fraction: float = 0.5,
                     seed: int = 0, time_limit: float | None = None, options: dict[str, Any] | None = None,
                     samples: np.ndarray | None = None) -> Comparison:
    """Plan each policy on the planning windows, score it (``evaluate``, Loads-level, ``engine`` rule)
    on the planning and on the held-out windows. ``policies``: registry names (default: all).
    ``samples`` (default: ``loads.samples``): the token sample given to the policies and used for the
    traffic columns."""
    if samples is None:
        samples = loads.samples
    names = policies or policy_names()
    fns = {n: get_policy(n) for n in names}  # fails early on an unknown name
    plan_idx, held_idx, single = split_windows(loads.num_windows, plan_fraction)
    plan = loads.counts[plan_idx].astype(np.float64)
    held = loads.counts[held_idx].astype(np.float64)
    problem = PlacementProblem(loads=plan, model=loads.model, cluster=cluster, num_redundant=num_redundant,
                               engine=engine, seed=seed, time_limit=time_limit, samples=samples,
                               options=dict(options or {}))
    results = []
    for name, fn in fns.items():
        t0 = time.perf_counter()
        pl = fn(problem)
        dt = time.perf_counter() - t0
        pl.check_model(loads.model, f"policy '{name}'")
        results.append(PolicyResult(name, pl, dt,
                                    evaluate(pl, plan, engine, model=loads.model, cluster=cluster,
                                             samples=samples),
                                    evaluate(pl, held, engine, model=loads.model, cluster=cluster,
                                             samples=samples)))
    notes = ("only one window: the held-out columns score the planning window itself",) if single else ()
    return Comparison(results, plan_idx, held_idx, single, engine, cluster, num_redundant, notes)


def format_table(cmp: Comparison) -> str:
    """The text table ``place optimize`` prints."""
    head = ["policy", "time s", "plan bal", "plan gap", "held bal", "held worst", "held max/mean",
            "held bound", "held gap", "x-node", "nodes/tok", "dup GPUs"]
    rows = []
    for r in cmp.results:
        p, h = r.plan, r.held_out
        rows.append([r.policy, f"{r.seconds:.2f}", f"{p.balancedness:.4f}", f"{p.gap_budget:+.2%}",
                     f"{h.balancedness:.4f}", f"{h.worst_window_balancedness:.4f}", f"{h.max_over_mean:.4f}",
                     f"{h.bound_balancedness_budget:.4f}", f"{h.gap_budget:+.2%}",
                     f"{h.cross_node_share:.3f}", f"{h.remote_per_token['node']:.3f}",
                     str(int(r.placement.duplicate_on_gpu().sum()))])
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    c = cmp.cluster
    lines = [(f"engine {cmp.engine}, {c.name} ({c.num_gpus} GPUs), {cmp.num_redundant} redundant slots; "
             f"plan windows {_span(cmp.plan_windows)}, held-out windows {_span(cmp.held_windows)}"),
             fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    lines.append("bal = mean/max tokens per GPU per layer, averaged (SGLang form); bound = best balancedness "
                 "any placement with this slot budget can reach; gap = max/bound - 1; x-node = share of "
                 "expert selections served on another node; nodes/tok = other nodes a token is sent to per "
                 "MoE layer (on the trace's token sample, which --objective traffic also plans on); dup GPUs "
                 "= layers with two replicas of one expert on one GPU")
    lines += [f"note: {n}" for n in cmp.notes]
    return "\n".join(lines)


def _span(idx: np.ndarray) -> str:
    return f"{int(idx[0])}" if idx.size == 1 else f"{int(idx[0])}-{int(idx[-1])}"
