"""The comparison behind ``place optimize``: plan every policy on the first part of the routing, score
it on that part and on the windows it did not see. A library function so the CLI and the dashboard
print the same rows.

Inputs reduce to Loads windows (:func:`routing_windows`): traces through ``traces.stats.trace_loads``,
Loads ``.npz`` files as they are;
several inputs are concatenated window-wise (labels prefixed with the input's name).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import placement_estimate, require_memory
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import bar, track
from moeplace.placement.evaluate import Metrics, evaluate
from moeplace.placement.policies import (
    PlacementProblem,
    TimeLimitReached,
    get_policy,
    is_anytime,
    is_quick,
    policy_names,
)
from moeplace.placement.record import Placement
from moeplace.traces.loads import Loads, is_loads_file, load_loads
from moeplace.traces.stats import compute_stats

DEFAULT_WINDOW_TOKENS = 4096


def default_redundant(num_experts: int, num_gpus: int) -> int:
    """Smallest R making E + R divisible by G; one extra slot per GPU when E already divides."""
    r = (-num_experts) % num_gpus
    return r if r else num_gpus


# ---------------------------------------------------------------------------- inputs -> Loads
def trace_to_loads(path: str | Path, window_tokens: int) -> Loads:
    """A trace's Loads with its token sample (each sampled token tagged with its window) and, in the
    provenance, each window's dominant domain tag (``window_domains``) when the trace has a domain column
    — the scenarios of the shift estimate. One streaming pass; the trace statistics are not computed."""
    return compute_stats(path, window_tokens, loads_only=True)


def routing_windows(inputs: list[str | Path], *, model: ModelSpec | None = None,
                    window_tokens: int = DEFAULT_WINDOW_TOKENS) -> Loads:
    """Read traces and/or Loads files into one Loads (windows concatenated in input order).
    ``model`` overrides the model recorded in the inputs (it must have the same shape). The provenance
    records each window's input (``window_inputs``) and, where every input has them, domain tags
    (``window_domains``); the token sample keeps each token's window."""
    if not inputs:
        raise InputError("no traces or Loads files given")
    parts: list[Loads] = []
    seen: dict[Path, str] = {}
    for src in inputs:
        p = Path(src)
        if not p.exists():
            raise InputError(f"{p}: no such file or directory")
        # The same routing twice would put planning windows among the "held-out" ones.
        rp = p.resolve()
        for q, first in seen.items():
            if rp == q or q in rp.parents or rp in q.parents:
                raise InputError(f"{src}: the same routing as {first} (given twice); held-out windows would "
                                 "repeat planning windows")
        seen[rp] = str(src)
        ld = load_loads(p) if is_loads_file(p) else trace_to_loads(p, window_tokens)
        if model is not None:
            if (model.num_moe_layers, model.num_experts) != ld.counts.shape[1:]:
                raise InputError(f"{p}: has {ld.counts.shape[1]} MoE layers x {ld.counts.shape[2]} experts "
                                 "but "
                                 f"--model '{model.name}' has {model.num_moe_layers} x {model.num_experts}")
            ld = Loads(ld.counts, model, ld.window_tokens, ld.labels, ld.provenance, ld.samples, ld.sample_windows)
        if ld.counts.sum() == 0:
            raise InputError(f"{p}: no tokens (all expert counts are zero)")
        for other, prev in zip(inputs, parts):  # a copy under another name is the same routing too
            if prev.counts.shape == ld.counts.shape and np.array_equal(prev.counts, ld.counts):
                raise InputError(f"{src}: the same expert counts as {other} (a copy?); held-out windows would "
                                 "repeat planning windows")
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
    # the token samples travel along (traffic objective and sample-based traffic in evaluate), each token
    # with its window in the concatenation
    have = [ld for ld in parts if ld.samples is not None and len(ld.samples)]
    samples = sample_windows = None
    if len(have) == len(parts):
        samples = np.concatenate([ld.samples for ld in parts])
        if all(ld.sample_windows is not None for ld in parts):
            offsets = np.cumsum([0] + [ld.num_windows for ld in parts[:-1]])
            sample_windows = np.concatenate([ld.sample_windows + o for ld, o in zip(parts, offsets)])
    prov: dict[str, Any] = {"inputs": [str(s) for s in inputs],
                            "window_inputs": [i for i, ld in enumerate(parts) for _ in range(ld.num_windows)]}
    for key in ("window_domains", "window_domain_share"):
        if all(key in ld.provenance for ld in parts):
            prov[key] = [d for ld in parts for d in ld.provenance[key]]
        elif len(parts) == 1 and parts[0].provenance.get(key):
            prov[key] = list(parts[0].provenance[key])
    return Loads(counts, first, wt, tuple(labels), prov, samples, sample_windows)


def split_windows(num_windows: int, plan_fraction: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """Plan on the first ``ceil(F * W)`` windows (at least one), score held-out on the rest. ``F = 1``
    plans on every window (nothing held out: the shift estimate stands in). With one window and
    ``F < 1`` there is nothing to hold out either: both parts are that window (flag returned True)."""
    if not 0 < plan_fraction <= 1:
        raise InputError(f"--plan-fraction must be in (0, 1], got {plan_fraction}")
    if plan_fraction == 1:
        return np.arange(num_windows), np.zeros(0, np.int64), False
    if num_windows == 1:
        return np.array([0]), np.array([0]), True
    n_planning = min(max(1, math.ceil(plan_fraction * num_windows)), num_windows - 1)
    return np.arange(n_planning), np.arange(n_planning, num_windows), False


def split_samples(loads: Loads, planning_idx: np.ndarray, held_idx: np.ndarray
                  ) -> tuple[np.ndarray | None, np.ndarray | None, str | None]:
    """The token sample of the planning windows and that of the held-out windows (disjoint tokens), plus
    a note when the sample cannot be split (a Loads file whose sample carries no windows: then it is not
    used at all, since any part of it may be a held-out token)."""
    s = loads.samples
    if s is None or not len(s):
        return None, None, None
    if loads.sample_windows is None:
        if held_idx.size == 0 or np.array_equal(planning_idx, held_idx):
            return s, s, None
        return None, None, ("the token sample records no windows (an older Loads file): not used, since "
                            "any of its tokens may be held out; traffic columns are estimates")
    planning = loads.samples_in(planning_idx)
    held = loads.samples_in(held_idx) if held_idx.size else None
    return (planning if len(planning) else None), (held if held is not None and len(held) else None), None


# ---------------------------------------------------------------------------- scenarios (shift estimate)
MAX_SCENARIOS = 8
WINDOW_GROUPS = 4
# Inputs are related (left out together) when the average distance between their expert-load distributions
# is under this share of the median distance between the inputs (see :func:`group_inputs`).
GROUP_DISTANCE = 0.5
WEAK_GROUPS = 3  # fewer scenario groups than this: each fold plans on one group, the estimate is weak


# Below this mean dominant-tag share per window, domain-tag scenarios overlap and flatter the shift estimate:
# on a drifting synthetic trace tagged per window, 96 % of the left-out domain's deviation lay in the planning
# windows' top variation directions, against 18 % with the same trace split cleanly by each token's domain.
PURE_WINDOW_SHARE = 0.95


def load_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Distance between two ``[L, E]`` count arrays: the total-variation distance between their expert
    shares, mean over the layers where both have tokens (0 = the same distribution, 1 = disjoint experts);
    1 when no layer has tokens in both."""
    sa, sb = a.sum(-1), b.sum(-1)
    both = (sa > 0) & (sb > 0)
    if not both.any():
        return 1.0
    pa = a[both] / sa[both, None]
    pb = b[both] / sb[both, None]
    return float(0.5 * np.abs(pa - pb).sum(-1).mean())


def group_inputs(per_input: list[np.ndarray], rel: float = GROUP_DISTANCE) -> list[int]:
    """Group related inputs (``[L, E]`` counts each) so the shift estimate leaves them out together:
    average-linkage agglomerative clustering on :func:`load_distance` — the closest two groups (mean
    distance over their members' pairs) merge while that distance is under ``rel`` x the median distance
    between all pairs of inputs. Returns each input's group (0, 1, ... in order of first input). Two
    inputs never merge (the median is their own distance): with nothing to compare them to, they count as
    unrelated."""
    n = len(per_input)
    if n < 3:
        return list(range(n))
    d = np.array([[load_distance(per_input[i], per_input[j]) if i != j else 0.0 for j in range(n)]
                  for i in range(n)])
    cut = rel * float(np.median(d[np.triu_indices(n, 1)]))
    clusters = [[i] for i in range(n)]
    while len(clusters) > 1:
        best, pair = None, None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                x = float(d[np.ix_(clusters[a], clusters[b])].mean())
                if best is None or x < best:
                    best, pair = x, (a, b)
        if best >= cut:
            break
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters.pop(b))
    clusters.sort(key=min)
    out = [0] * n
    for g, members in enumerate(clusters):
        for i in members:
            out[i] = g
    return out


def _input_scenarios(loads: Loads, tags: list[int]) -> tuple[list[Any], list[str], str]:
    """Each window's scenario key, the scenario names and the method for windows tagged by input
    (``tags``: input index per window): the groups ``--group`` named (provenance ``input_groups``, a group
    name per input), else :func:`group_inputs` by load similarity; an input per scenario when no two are
    related."""
    prov = loads.provenance
    files = prov.get("inputs", [])
    present = list(dict.fromkeys(tags))
    fname = {i: Path(files[i]).name if i < len(files) else str(i) for i in present}
    given = prov.get("input_groups")
    if given is not None and len(given) == len(files):
        key = {i: str(given[i]) for i in present}
        how = "groups as given (--group)"
    else:
        per = [loads.counts[[w for w, t in enumerate(tags) if t == i]].sum(axis=0).astype(np.float64)
               for i in present]
        g = group_inputs(per)
        members = {k: [fname[present[j]] for j in range(len(present)) if g[j] == k] for k in set(g)}
        key = {i: "+".join(members[g[j]]) for j, i in enumerate(present)}
        how = (f"inputs grouped by the similarity of their expert loads: average-linkage clustering on the "
               f"total-variation distance of per-layer expert shares, merging while under {GROUP_DISTANCE:g} x "
               "the median distance between inputs")
    keys = [key[t] for t in tags]
    names = list(dict.fromkeys(keys))
    if len(names) == len(present) and given is None:  # every input its own scenario
        return keys, names, "leave-one-input-file-out"
    return keys, names, f"leave-one-input-group-out ({how})"


def scenarios(loads: Loads, max_scenarios: int = MAX_SCENARIOS) -> tuple[np.ndarray, list[str], str]:
    """Each window's scenario for the leave-one-scenario-out estimate: ``(ids int [W], names, method)``.
    A scenario is a group of related input files (several inputs: :func:`_input_scenarios`), else a
    domain tag (a trace's dominant domain per window, when it has >= 2), else one of ``WINDOW_GROUPS``
    contiguous groups of windows. More than ``max_scenarios`` groups or domains are merged round-robin
    into that many. With fewer than ``WEAK_GROUPS`` scenarios the method says the estimate is weak."""
    W = loads.num_windows
    prov = loads.provenance
    for key, what in (("window_inputs", "input file"), ("window_domains", "domain tag")):
        tags = prov.get(key)
        if tags is None or len(tags) != W:
            continue
        if len(set(tags)) < 2:
            continue
        if key == "window_inputs":
            tags, shown, method = _input_scenarios(loads, list(tags))
            names = list(shown)
        else:
            names = list(dict.fromkeys(tags))
            shown = [str(n) for n in names]
            method = f"leave-one-{what.replace(' ', '-')}-out"
        ids = np.array([names.index(t) for t in tags], np.int64)
        if len(names) > max_scenarios:
            ids %= max_scenarios
            shown = ["+".join(shown[j::max_scenarios]) for j in range(max_scenarios)]
        share = prov.get("window_domain_share") if key == "window_domains" else None
        if share is not None and len(share) == W and float(np.mean(share)) < PURE_WINDOW_SHARE:
            method += (f"; optimistic: windows mix domains (a window's dominant tag holds {np.mean(share):.0%} of "
                       "its tokens on average), so the left-out tag's traffic is partly in the planning "
                       "scenarios; one input per workload gives a clean estimate")
        return ids, shown, method + _weak(len(shown))
    n = min(WINDOW_GROUPS, W)
    ids = (np.arange(W) * n) // W
    names = [_span(np.flatnonzero(ids == g), "window") for g in range(n)]
    return ids, names, f"leave-one-window-group-out ({n} contiguous groups)" + _weak(n)


def _weak(n: int) -> str:
    if n >= WEAK_GROUPS:
        return ""
    return (f"; weak: {n} scenario groups only (each fold plans on {n - 1} and the spread over folds rests on "
            f"{n} numbers; give {WEAK_GROUPS} or more unrelated workloads)")


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True, eq=False)
class PolicyResult:
    policy: str
    placement: Placement
    seconds: float
    planning: Metrics  # scored on the planning windows
    held_out: Metrics | None
    shift: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """Flat table row (JSON-ready)."""
        return {
            "policy": self.policy,
            "seconds": self.seconds,
            "plan": self.planning.summary(),
            "held_out": None if self.held_out is None else self.held_out.summary(),
            "duplicate_on_gpu_layers": duplicate_layers(self.placement, self.planning),
        }


def duplicate_layers(placement: Placement, scored: Metrics) -> int:
    """Scored MoE layers whose placement puts two replicas of one expert on one GPU."""
    return int((placement.duplicate_on_gpu() & scored.scored_wl.any(axis=0)).sum())


@dataclass(frozen=True, eq=False)
class Comparison:
    results: list[PolicyResult]
    planning_windows: np.ndarray
    held_windows: np.ndarray
    single_window: bool
    engine: str
    cluster: ClusterSpec
    num_redundant: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    scored_layers: int = 0
    moe_layers: int = 0
    shift_method: str | None = None
    shift_scenarios: tuple[str, ...] = ()
    planning_sample_tokens: int = 0
    held_sample_tokens: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {"engine": self.engine, "cluster": self.cluster.to_dict(), "num_redundant": self.num_redundant,
             "plan_windows": self.planning_windows.tolist(), "held_out_windows": self.held_windows.tolist(),
             "single_window": self.single_window, "notes": list(self.notes),
             "scored_layers": self.scored_layers, "moe_layers": self.moe_layers, "tokens": self.tokens,
             "sample_tokens": {"plan": self.planning_sample_tokens, "held_out": self.held_sample_tokens},
             "rows": [r.row() for r in self.results]}
        if self.shift_method is not None:
            d["shift"] = {r.policy: r.shift for r in self.results if r.shift is not None}
            d["shift_scenarios"] = list(self.shift_scenarios)
        return d


def planned_on(loads: Loads, planning_idx: np.ndarray) -> dict[str, Any]:
    """What a placement was planned on, for whoever scores it later (``place simulate`` routes on the
    rest of the trace): the inputs, the planning windows and, for one token-windowed trace, the first
    token (in file order) that planning did not see."""
    d: dict[str, Any] = {"inputs": list(loads.provenance.get("inputs", [])),
                         "windows": [int(planning_idx[0]), int(planning_idx[-1]) + 1],
                         "window_tokens": int(loads.window_tokens)}
    contiguous = np.array_equal(planning_idx, np.arange(planning_idx.size))
    if len(d["inputs"]) == 1 and loads.window_tokens > 0 and contiguous and planning_idx.size < loads.num_windows:
        d["held_out_from_token"] = int(planning_idx.size * loads.window_tokens)
    return d


def _check_objective(names, options: dict[str, Any], planning_samples: np.ndarray | None, loads: Loads) -> None:
    obj = options.get("objective") or "balance"
    if obj != "balance" and "moeplace" in names and (planning_samples is None or not len(planning_samples)):
        src = ", ".join(map(str, loads.provenance.get("inputs", []))) or "the input"
        raise InputError(f"--objective {obj} needs a token sample of the planning windows (a trace, or a Loads "
                         f"file written by 'place trace stats'); {src} has none")


def _plan(fn, name: str, loads: Loads, windows: np.ndarray, samples: np.ndarray | None, cluster: ClusterSpec,
          num_redundant: int, engine: str, seed: int, time_limit: float | None,
          options: dict[str, Any]) -> tuple[Placement, float]:
    problem = PlacementProblem(loads=loads.counts[windows].astype(np.float64), model=loads.model, cluster=cluster,
                               num_redundant=num_redundant, engine=engine, seed=seed, time_limit=time_limit,
                               samples=samples, options=options)
    t0 = time.perf_counter()
    placement = fn(problem)
    dt = time.perf_counter() - t0
    placement.check_model(loads.model, f"policy '{name}'")
    return placement, dt


SHIFT_BUDGET_S = 60.0  # the shift estimate plans every layer when that is expected to take at most this long
SHIFT_MIN_LAYERS = 3
# Least half-width of a shift range (before the layer-sample term): the folds' spread rests on a handful of
# groups and can come out near zero by chance (three synthetic domains within 0.01 of each other, the unseen
# ones 0.02 lower: bench/shift_groups.py); 0.03 is about the smallest per-domain error of the estimate on the
# project's leave-one-domain-out data (bench/shift_lodo.py: 0.016-0.078 per held-out domain).
SHIFT_MIN_HALF_WIDTH = 0.03
# two-sided 80 % Student-t quantiles t_{0.90, df} for df = 1..10 (above: the normal's 1.2816)
T80 = (3.0777, 1.8856, 1.6377, 1.5332, 1.4759, 1.4398, 1.4149, 1.3968, 1.3830, 1.3722)


def t80(df: int) -> float:
    return T80[df - 1] if 1 <= df <= len(T80) else 1.2816


def shift_layers(planning: Loads, ids: np.ndarray, layers: int | str = "auto",
                 all_layers_s: float | None = None) -> np.ndarray:
    """The MoE layers (indices, ascending) the shift estimate plans and scores: evenly spaced over the
    layers with tokens. ``"all"``: every one; an int: that many; ``"auto"``: every layer when the folds'
    planning is expected to take at most ``SHIFT_BUDGET_S`` over all layers (``all_layers_s``: that
    expectation; ``None``: unknown, every layer), else as many as fit that budget, at least
    ``SHIFT_MIN_LAYERS``. Every policy here places each layer from that layer's loads alone, so a sampled
    layer gets exactly the placement a plan of all layers gives it; what sampling changes is only which
    layers the mean runs over (its standard error is reported and widens the ranges)."""
    active = np.flatnonzero(planning.counts.sum(axis=(0, 2)) > 0)
    if layers == "all":
        return active
    if layers == "auto":
        if all_layers_s is None or all_layers_s <= SHIFT_BUDGET_S:
            return active
        k = max(SHIFT_MIN_LAYERS, int(active.size * SHIFT_BUDGET_S / all_layers_s))
    else:
        k = int(layers)
        if k < 1:
            raise InputError(f"--shift-layers must be >= 1 or 'all', got {layers}")
    if k >= active.size:
        return active
    return active[np.unique(np.round(np.linspace(0, active.size - 1, k)).astype(np.int64))]


def fold_seconds(plan_s: float, ids: np.ndarray, side_by_side: bool) -> float:
    """Expected seconds of the shift estimate's folds over every layer, from the main plan's ``plan_s``:
    each fold plans on the other scenarios' windows (time taken as proportional to windows); anytime
    policies run their folds side by side, one process per core."""
    W = ids.size
    work = sum((W - int((ids == sc).sum())) / W for sc in np.unique(ids)) * plan_s
    lanes = min(np.unique(ids).size, os.cpu_count() or 1) if side_by_side else 1
    return work / lanes


def shift_ranges(per: list[float], layer_se: float) -> tuple[list[float], list[float], float]:
    """``(mean_range, worst_range, half_width)`` of the shift estimate from the per-fold balancedness
    ``per`` (one number per left-out scenario group) and the layer sample's standard error: the mean and
    the worst group each +- ``max(t80(D-1) * s * sqrt(1 + 1/D), SHIFT_MIN_HALF_WIDTH) + 2 * layer_se`` —
    an 80 % prediction interval for one more group like the D left out (``s``: their standard deviation),
    at least ``SHIFT_MIN_HALF_WIDTH``, plus two standard errors of the layer sample; clipped to [0, 1].
    With one fold the spread is unknown: [0, 1]."""
    D = len(per)
    m, w = float(np.mean(per)), float(np.min(per))
    if D < 2:
        return [0.0, 1.0], [0.0, 1.0], 1.0
    h = max(t80(D - 1) * float(np.std(per, ddof=1)) * math.sqrt(1 + 1 / D), SHIFT_MIN_HALF_WIDTH) + 2 * layer_se
    clip = lambda x: min(1.0, max(0.0, x))
    return [clip(m - h), clip(m + h)], [clip(w - h), clip(w + h)], h


def shift_estimate(fn, name: str, loads: Loads, cluster: ClusterSpec, *, num_redundant: int, engine: str,
                   seed: int, time_limit: float | None, options: dict[str, Any],
                   ids: np.ndarray, method: str, layers: np.ndarray | None = None) -> dict[str, Any]:
    """Leave-one-scenario-out: for every scenario group ``s`` of ``ids`` (int ``[W]``), plan ``fn`` on the
    other groups' windows with exactly the settings of the main plan (its options, and with a traffic
    objective the training windows' token sample)
    and score it on ``s``'s windows, on the MoE layers ``layers`` (default: all; see
    :func:`shift_layers`). Returns ``{"mean": mean over groups of the left-out balancedness, "worst": the
    lowest, "mean_range", "worst_range": [lo, hi] (:func:`shift_ranges`), "method": ...,
    "per_scenario": [...], "layers": [...], "layer_sample_se": standard error of "mean" from sampling
    layers (0 with every layer)}`` — what to expect on traffic unlike the planning data."""
    counts = loads.counts.astype(np.float64)
    L = counts.shape[1]
    if layers is not None and len(layers) < L:
        # the other layers carry no tokens: no policy plans on them and no score averages them in
        keep = np.zeros(L, dtype=bool)
        keep[np.asarray(layers)] = True
        counts = counts * keep[None, :, None]
    opts = {**options, "pareto": None}  # the frontier is a report: it does not change the placement
    traffic = (options.get("objective") or "balance") != "balance"
    folds = np.unique(ids)
    cpus = os.cpu_count() or 1
    # An anytime policy (the optimizer) costs seconds per layer: its folds run side by side, one process
    # each, every fold's layers in that process (same placements: a layer's plan does not depend on the
    # process it runs in), instead of one fold after another, each spreading a few layers over the cores.
    pool = is_anytime(name) and folds.size > 1 and cpus > 1 and opts.get("workers") in (None, 0)
    if pool:
        opts["workers"] = 1
    jobs = []
    for sc in folds:
        train = np.flatnonzero(ids != sc)
        fo = dict(opts)
        samples = loads.samples_in(train) if traffic else None
        if traffic and (samples is None or not len(samples)):
            fo["objective"] = "balance"  # no token sample of the training windows: nothing to refine on
        jobs.append((fn, name, PlacementProblem(loads=counts[train], model=loads.model, cluster=cluster,
                                                num_redundant=num_redundant, engine=engine, seed=seed,
                                                time_limit=time_limit, samples=samples, options=fo),
                     counts[ids == sc]))
    if pool:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(max_workers=min(folds.size, cpus), mp_context=ctx) as ex:
            done = list(ex.map(_fold, jobs))
    else:
        done = [_fold(j) for j in jobs]
    per = [b for b, _ in done]
    per_layer = [lb for _, lb in done]
    scored = np.flatnonzero(counts.sum(axis=(0, 2)) > 0)
    active = int((loads.counts.sum(axis=(0, 2)) > 0).sum())
    u = np.nanmean(np.array(per_layer)[:, scored], axis=0)  # per layer, over the left-out scenarios
    k = u.size
    se = (float(np.std(u, ddof=1) / math.sqrt(k) * math.sqrt(1 - k / active)) if 1 < k < active else 0.0)
    mean_range, worst_range, _ = shift_ranges(per, se)
    return {"mean": float(np.mean(per)), "worst": float(np.min(per)), "mean_range": mean_range,
            "worst_range": worst_range, "method": method,
            "per_scenario": [float(x) for x in per], "layers": [int(x) for x in scored],
            "layer_sample_se": se}


def _fold(job) -> tuple[float, np.ndarray]:
    """One leave-one-out fold: plan the policy's problem, score it on the left-out windows' counts;
    (balancedness, per-layer balancedness ``[L]``)."""
    fn, name, problem, test = job
    placement = fn(problem)
    placement.check_model(problem.model, f"policy '{name}'")
    m = evaluate(placement, test, problem.engine, model=problem.model, cluster=problem.cluster)
    return m.balancedness, m.layer_balancedness


EVAL_GUESS = 0.2  # seconds to score one policy, reserved before any scoring has been timed


def compare_policies(loads: Loads, cluster: ClusterSpec, *, num_redundant: int,
                     policies: list[str] | None = None, engine: str = "vllm", plan_fraction: float = 0.5,
                     seed: int = 0, time_limit: float | None = None, options: dict[str, Any] | None = None,
                     samples: np.ndarray | None = None, shift: bool = False,
                     deadline: float | None = None, shift_sample: int | str = "auto") -> Comparison:
    """Plan each policy on the planning windows, score it (``evaluate``, Loads-level, ``engine`` rule)
    on the planning and on the held-out windows. ``policies``: registry names (default: all).
    The token sample is split by window: policies plan on the planning windows' tokens only and the
    held-out traffic columns replay the held-out windows' tokens only. ``samples`` overrides the
    planning sample (the caller vouches that it holds no held-out token).
    ``shift``: also run the leave-one-scenario-out estimate (:func:`shift_estimate`, one extra plan per
    scenario and policy) on the planning windows, on the MoE layers :func:`shift_layers` picks with
    ``shift_sample`` (``"auto"``: every layer when the folds are expected to take at most
    ``SHIFT_BUDGET_S``, judged from the policy's own main plan, else a sample that fits it).

    ``time_limit``: seconds for the whole comparison, planning and scoring every policy, counted from this
    call, or ``deadline`` (a ``time.monotonic()`` instant: a command's start plus its limit). Policies that
    cannot stop early run first (the one-pass baselines, then EPLB) with what is left, each reserving only
    its own scoring, so a short limit still runs the cheap ones; anytime policies (``moeplace``) then share
    the rest, less the time scoring takes; the shift estimate gets what remains after that. A policy the limit
    leaves no time for, or that runs past it, is left out of the results and named in ``notes`` ("eplb
    skipped: time limit"), as is every stage an anytime policy skipped or cut short."""
    options = dict(options or {})
    names = policies or policy_names()
    fns = {n: get_policy(n) for n in names}  # fails early on an unknown name
    # every placement is kept for the table: refuse what cannot fit before planning any (docs/design.md)
    m = loads.model
    require_memory(placement_estimate(m.num_moe_layers, m.num_experts, cluster.num_gpus, num_redundant,
                                      num_placements=len(fns), engine=engine))
    if deadline is None and time_limit is not None:
        deadline = time.monotonic() + time_limit
    planning_idx, held_idx, single = split_windows(loads.num_windows, plan_fraction)
    planning_samples, held_samples, sample_note = split_samples(loads, planning_idx, held_idx)
    if samples is not None:
        planning_samples = samples
    _check_objective(names, options, planning_samples, loads)
    planning_counts = loads.counts[planning_idx].astype(np.float64)
    held = loads.counts[held_idx].astype(np.float64)
    # the estimate comes from the planning windows alone, so it is a prediction the held-out columns check
    planning = loads.select(planning_idx)
    ids, sc_names, method = scenarios(planning) if shift else (None, [], None)
    if shift and len(sc_names) < 2:
        ids, method = None, None
    active_layers = int((planning.counts.sum(axis=(0, 2)) > 0).sum())
    notes = []
    if single:
        notes.append("only one window: the held-out columns score the planning window itself")
    if sample_note:
        notes.append(sample_note)
    if shift and ids is None:
        notes.append("one planning window only: no shift estimate")

    def share(name: str, rest: list[str], reserve: float) -> float | None:
        """Seconds for ``name`` out of what the deadline leaves (``None``: no limit); <= 0: none left."""
        if deadline is None:
            return None
        left = deadline - time.monotonic() - reserve
        if is_anytime(name):  # always returns a valid placement, however small its share
            return max(0.01, left / sum(is_anytime(n) for n in rest))
        return left

    done: dict[str, tuple] = {}
    eval_cost = EVAL_GUESS
    # stable: one-pass baselines first, then the other fixed-cost policies, anytime ones last
    order = sorted(names, key=lambda n: (is_anytime(n), not is_quick(n)))
    pb = bar(len(order), "policies", "policy")
    for i, name in enumerate(order):
        pb.set_description(f"policy {name}", refresh=False)
        pb.update(0 if i == 0 else 1)
        # a fixed-cost policy (the baselines: milliseconds to a second) reserves only its own scoring, so a
        # short limit still runs them; anytime policies reserve the scoring of every policy left
        limit = share(name, order[i:], (len(order[i:]) if is_anytime(name) else 1) * eval_cost)
        if limit is not None and limit <= 0:
            notes.append(f"{name} skipped: time limit (no time left to run it)")
            continue
        try:
            placement, dt = _plan(fns[name], name, loads, planning_idx, planning_samples, cluster, num_redundant,
                                  engine, seed, limit, options)
        except TimeLimitReached:
            notes.append(f"{name} skipped: time limit (not finished after {limit:.2f} s)")
            continue
        placement.provenance["planned_on"] = planned_on(loads, planning_idx)
        t1 = time.perf_counter()
        m_planning = evaluate(placement, planning_counts, engine, model=loads.model, cluster=cluster, samples=planning_samples)
        m_held = (evaluate(placement, held, engine, model=loads.model, cluster=cluster, samples=held_samples)
                  if held_idx.size else None)
        eval_cost = max(eval_cost, time.perf_counter() - t1)
        done[name] = (placement, dt, m_planning, m_held)
        notes += [f"{name}: {line}" for line in time_limit_lines(placement)]
    pb.close()
    shifts: dict[str, dict | None] = {}
    if ids is not None:
        todo = [n for n in order if n in done]
        for i, name in enumerate(track(todo, "shift estimate", "policy")):
            folds = len(np.unique(ids))
            limit = share(name, todo[i:], 0.0)
            if limit is not None:
                limit /= folds
                if limit <= 0:
                    notes.append(f"{name}: shift estimate skipped: time limit")
                    continue
            sampled = shift_layers(planning, ids, shift_sample,
                                   fold_seconds(done[name][1], ids, is_anytime(name)))
            how = method
            if sampled.size < active_layers:
                how += (f"; on {sampled.size} of {active_layers} MoE layers, evenly spaced (each placed as a plan "
                        f"of every layer places it; every layer would take about "
                        f"{fold_seconds(done[name][1], ids, is_anytime(name)):.0f} s)")
            try:
                shifts[name] = shift_estimate(fns[name], name, planning, cluster, num_redundant=num_redundant,
                                              engine=engine, seed=seed, time_limit=limit, options=options,
                                              ids=ids, method=how, layers=sampled)
            except TimeLimitReached:
                notes.append(f"{name}: shift estimate skipped: time limit")
    results = [PolicyResult(n, *done[n], shifts.get(n)) for n in names if n in done]
    scored = int((loads.counts.sum(axis=(0, 2)) > 0).sum())
    return Comparison(results, planning_idx, held_idx, single, engine, cluster, num_redundant, tuple(notes),
                      scored, loads.model.num_moe_layers, method, tuple(sc_names) if ids is not None else (),
                      0 if planning_samples is None else len(planning_samples),
                      0 if held_samples is None else len(held_samples), loads_tokens(loads))


def time_limit_lines(placement: Placement) -> list[str]:
    """What the time limit skipped or cut short in an anytime policy's run (from its provenance's
    ``params.summary.time_limited``: ``{"skipped"|"cut": {stage: layers}}``), e.g. ``traffic refinement
    skipped: time limit (92 of 92 layers)``; empty when it changed nothing."""
    summary = placement.provenance.get("params", {}).get("summary") or {}
    lim = summary.get("time_limited") or {}
    planned = summary.get("planned_layers", placement.num_layers)
    lines = [f"{stage} {'skipped' if kind == 'skipped' else 'cut short'}: time limit ({n} of {planned} layers)"
             for kind in ("skipped", "cut") for stage, n in lim.get(kind, {}).items()]
    if lines:
        lines.append("the time limit changed this placement: the same seed can give another one (it would not "
                     "without a binding limit)")
    return lines


def loads_tokens(loads: Loads) -> int:
    """Tokens behind a Loads: selections of its fullest layer / top-k (what ``place trace import`` and
    ``place trace stats`` count as tokens)."""
    return int(loads.counts.sum(axis=(0, 2)).max() // loads.model.top_k)


def _traffic_cells(m: Metrics) -> tuple[str, str]:
    """nodes/tok and remote-node KiB/tok cells; ``~`` marks the independence estimate (no token sample)."""
    est = "~" if not m.traffic_method.startswith(("token sample", "exact")) else ""
    return f"{est}{m.remote_per_token['node']:.3f}", f"{est}{m.dispatch_bytes_per_token['node'] / 1024:.0f}"


def format_table(cmp: Comparison) -> str:
    """The text table ``place optimize`` prints."""
    has_held = cmp.held_windows.size > 0
    if has_held:
        head = ["policy", "time s", "plan bal", "held bal", "held worst", "held max/mean", "held nodes/tok",
                "held KiB/tok", "dup GPUs"]
    else:
        head = ["policy", "time s", "plan bal", "shift mean", "shift worst", "plan nodes/tok", "plan KiB/tok",
                "dup GPUs"]
    rows = []
    for r in cmp.results:
        p, h = r.planning, r.held_out
        dup = str(duplicate_layers(r.placement, p))
        if has_held:
            rows.append([r.policy, f"{r.seconds:.2f}", f"{p.balancedness:.4f}", f"{h.balancedness:.4f}",
                         f"{h.worst_window_balancedness:.4f}", f"{h.max_over_mean:.4f}", *_traffic_cells(h), dup])
        else:
            sm = f"{r.shift['mean']:.4f}" if r.shift else "-"
            sw = f"{r.shift['worst']:.4f}" if r.shift else "-"
            rows.append([r.policy, f"{r.seconds:.2f}", f"{p.balancedness:.4f}", sm, sw, *_traffic_cells(p), dup])
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    c = cmp.cluster
    span = (f"plan windows {_span(cmp.planning_windows)}, held-out windows {_span(cmp.held_windows)}" if has_held
            else f"planned on every window ({_span(cmp.planning_windows)}), nothing held out")
    layers = (f"; scored on {cmp.scored_layers} of {cmp.moe_layers} MoE layers (the others have no tokens)"
              if cmp.scored_layers < cmp.moe_layers else "")
    tokens = f"{cmp.tokens:,} tokens in {cmp.planning_windows.size + cmp.held_windows.size} windows; " if cmp.tokens else ""
    lines = [(f"engine {cmp.engine}, {c.name} ({c.num_gpus} GPUs), {cmp.num_redundant} redundant slots; "
              f"{tokens}{span}{layers}"), fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    sampled = (f"{cmp.held_sample_tokens} sampled held-out tokens" if has_held
               else f"{cmp.planning_sample_tokens} sampled planning tokens (in-sample)")
    lines.append("bal = mean/max tokens per GPU per layer, averaged over layers with tokens (SGLang form); "
                 "worst = lowest window; nodes/tok = other nodes a token is sent to per MoE layer and "
                 "KiB/tok = the bytes those sends carry per token over all MoE layers (one send per remote "
                 f"node, DeepEP-style), replayed on {sampled}"
                 "; ~ = estimate (no token sample: k selections taken as independent draws); dup GPUs = "
                 "layers with two replicas of one expert on one GPU")
    lines += [f"note: {n}" for n in cmp.notes]
    return "\n".join(lines)


def format_shift(cmp: Comparison) -> list[str]:
    """Lines under the table: per policy, the balancedness to expect on traffic unlike the planning data,
    with its range (spread over the left-out groups plus the layer sample's error)."""
    rows = [r for r in cmp.results if r.shift]
    if not rows:
        return []
    base, *details = cmp.shift_method.split("; ")
    out = [(f"shift estimate ({base} over {len(cmp.shift_scenarios)} scenarios of the planning "
            f"data: {', '.join(cmp.shift_scenarios)}; plan on the rest with the same settings, score on the one "
            f"left out{''.join('; ' + d for d in details)}) — balancedness to expect on traffic unlike the "
            "planning data (range: 80 % prediction interval from the spread over the left-out groups, plus 2 "
            "standard errors of the layer sample):")]
    for r in rows:
        sh = r.shift
        se = sh.get("layer_sample_se") or 0.0
        err = f" (± {se:.4f} from the layer sample)" if se else ""
        extra = sh["method"][len(cmp.shift_method):].lstrip("; ") if sh["method"].startswith(cmp.shift_method) else ""
        rng = ""
        if "mean_range" in sh:
            rng = (f" [{sh['mean_range'][0]:.3f}, {sh['mean_range'][1]:.3f}]")
        wr = f" [{sh['worst_range'][0]:.3f}, {sh['worst_range'][1]:.3f}]" if "worst_range" in sh else ""
        out.append(f"  {r.policy}: mean {sh['mean']:.4f}{rng}{err}, worst scenario {sh['worst']:.4f}{wr}"
                   + (f" ({extra})" if extra else ""))
    return out


def _span(idx: np.ndarray, noun: str = "") -> str:
    """``"3"`` / ``"0-12"`` (``"window 3"`` / ``"windows 0-12"`` with a noun); ``"none"`` when empty."""
    if idx.size == 0:
        return "none"
    if idx.size == 1:
        return f"{noun} {int(idx[0])}".strip()
    return f"{noun}s {int(idx[0])}-{int(idx[-1])}" if noun else f"{int(idx[0])}-{int(idx[-1])}"
