"""The ``moeplace`` policy: the optimizer of ``placement/optimizer`` behind the policy registry.

Reads its knobs from ``PlacementProblem`` (rule, seed, time_limit) and ``problem.options`` (what
``place optimize`` passes): ``robust`` (bool), ``cvar`` (float), ``objective``
(``balance|traffic|balance+traffic``), ``traffic_weight``, ``balance_floor``, ``pareto`` (bool),
``from`` (a Placement or a path to one; the migration origin), ``max_moves``, ``workers``,
``lns_rounds``. Per-layer objective, proven bound and gap land in the placement's provenance
(``params.layers``), with a summary in ``params.summary``. What the time limit skipped or cut short is
counted there too (``time_limited``: ``{"skipped": {stage: layers}, "cut": {stage: layers}}``) and
``reproducible`` says whether the same seed gives this placement again: true exactly when nothing was.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.settings import field_types
from moeplace.placement.optimizer import OptimizerConfig, optimize_layers
from moeplace.placement.optimizer.layer import PARETO_SLACKS
from moeplace.placement.policies import PlacementProblem, check_options, declare_options, register_policy
from moeplace.placement.record import Placement, check_compatible, load_placement

_FROM_PROBLEM = {"rule", "seed", "time_limit"}  # the problem's own fields, not options
_OPTION_KEYS = {f.name for f in fields(OptimizerConfig)} - _FROM_PROBLEM
declare_options({
    **{k: t for k, t in field_types(OptimizerConfig).items() if k in _OPTION_KEYS},
    "from": Any,  # the migration origin: a placement file's path, or a Placement
    "current": Any,  # the same, as the simulator's rebalancer passes it
})


def config_from_problem(problem: PlacementProblem) -> OptimizerConfig:
    """The optimizer's config: rule / seed / time limit from the problem, the rest from its options
    (checked by :func:`check_options`: an unknown key or a wrongly typed value is an error; ``None`` is
    unset)."""
    opts = check_options("options", problem.options)
    kw = {k: opts[k] for k in _OPTION_KEYS if k in opts}
    return OptimizerConfig(rule=problem.rule, seed=int(problem.seed), time_limit=problem.time_limit, **kw)


def migration_origin(problem: PlacementProblem) -> np.ndarray | None:
    """``phy2log [L, P]`` of ``options['from']`` (or ``'current'``), checked against the problem."""
    src = problem.options.get("from", problem.options.get("current"))
    if src is None:
        if problem.options.get("max_moves") is not None:
            raise InputError("--max-moves needs --from current.json (the placement to move from)")
        return None
    cur = src if isinstance(src, Placement) else load_placement(Path(src))
    where = src if not isinstance(src, Placement) else "current placement"
    # moves are counted slot by slot: same model, GPUs and slot budget needed
    check_compatible(cur, problem.model, problem.cluster, num_redundant=problem.num_redundant, what=str(where))
    return np.asarray(cur.phy2log, dtype=np.int64)


def canonical_slots(p2l: np.ndarray, num_gpus: int, origin: np.ndarray | None = None) -> np.ndarray:
    """Order slots inside each GPU (slot order on a GPU is free): experts the GPU already held stay in
    their old slot (no weight copy); the rest fill the free slots in ascending expert order.
    ``p2l``: ``[P]``. Without an origin, ascending order."""
    S = p2l.shape[0] // num_gpus
    out = np.empty_like(p2l)
    for g in range(num_gpus):
        mine = np.sort(p2l[g * S:(g + 1) * S])
        if origin is None:
            out[g * S:(g + 1) * S] = mine
            continue
        old = origin[g * S:(g + 1) * S]
        # multiset match: an origin holding one expert twice on this GPU (EPLB can) keeps it only as
        # often as the new placement has it there
        left = Counter(mine.tolist())
        row = np.full(S, -1, dtype=p2l.dtype)
        for i, e in enumerate(old.tolist()):
            if left[e] > 0:
                row[i] = e
                left[e] -= 1
        row[row < 0] = sorted(left.elements())
        out[g * S:(g + 1) * S] = row
    return out


def time_limited(layers: list[dict]) -> dict[str, dict[str, int]]:
    """``{"skipped": {stage: number of layers}, "cut": {...}}`` over the layers' stats; empty when the
    time limit changed nothing."""
    out: dict[str, dict[str, int]] = {}
    for kind in ("skipped", "cut"):
        for s in layers:
            for stage in s.get(kind, ()):
                out.setdefault(kind, {}).setdefault(stage, 0)
                out[kind][stage] += 1
    return out


@register_policy("moeplace", anytime=True)
def moeplace(problem: PlacementProblem) -> Placement:
    cfg = config_from_problem(problem)
    origin = migration_origin(problem)
    samples = problem.samples
    if samples is not None:
        samples = np.asarray(samples)
        if samples.ndim != 3 or samples.shape[1] != problem.model.num_moe_layers:
            raise InputError(f"samples must be [tokens, {problem.model.num_moe_layers}, k], got {samples.shape}")
        if len(samples) > cfg.max_traffic_samples:  # evenly spaced, deterministic
            samples = samples[np.linspace(0, len(samples) - 1, cfg.max_traffic_samples).astype(np.int64)]
    G = problem.cluster.num_gpus
    L, E = problem.model.num_moe_layers, problem.model.num_experts
    # Layers without a planning token (a log that holds only some MoE layers) carry no information: they
    # are not searched (each would cost a full layer budget) and get a plain one-copy-each layout, or
    # keep the migration origin's; they stay out of the summary's figures.
    active = np.flatnonzero(np.asarray(problem.loads).sum(axis=(0, 2)) > 0)
    if active.size == 0:
        raise InputError("the planning windows have no tokens in any MoE layer")
    loads = np.asarray(problem.loads, dtype=np.float64)[:, active]
    results = optimize_layers(loads, problem.num_slots, G, problem.cluster.gpus_per_node, cfg,
                              None if samples is None else samples[:, active],
                              None if origin is None else origin[active], layer_ids=active)
    phy2log = (origin.copy() if origin is not None
               else np.tile(np.arange(problem.num_slots, dtype=np.int64) % E, (L, 1)))
    for r in results:
        phy2log[r.layer] = canonical_slots(r.p2l, G, None if origin is None else origin[r.layer])
    layers = [r.stats() for r in results]
    bal = np.array([s["balancedness"] for s in layers])
    gap = np.array([s["gap"] for s in layers])
    summary = {"mean_balancedness": float(bal.mean()), "min_balancedness": float(bal.min()),
               "max_gap": float(gap.max()), "mean_gap": float(gap.mean()),
               "seconds": float(sum(s["seconds"] for s in layers)),
               "planned_layers": int(active.size), "moe_layers": int(L)}
    limited = time_limited(layers)
    summary["reproducible"] = not limited
    if limited:
        summary["time_limited"] = limited
    if origin is not None:
        summary["max_moves_used"] = int(max(s["moves"] for s in layers))
    if any("span" in s for s in layers):
        spans = [(s["span0"], s["span"]) for s in layers if "span" in s]
        summary["nodes_per_token_before"] = float(np.mean([a for a, _ in spans]))
        summary["nodes_per_token_after"] = float(np.mean([b for _, b in spans]))
    fronts = [s["pareto"] for s in layers if s.get("pareto")]
    if fronts:  # the balance-vs-traffic frontier, averaged over layers per floor
        summary["pareto"] = [{"floor_slack": PARETO_SLACKS[i],
                              "balancedness": float(np.mean([f[i]["balancedness"] for f in fronts])),
                              "nodes_per_token": float(np.mean([f[i]["span"] for f in fronts]))}
                             for i in range(len(fronts[0]))]
    config = {k: v for k, v in asdict(replace(cfg, time_limit=problem.time_limit)).items()}
    return problem.placement(phy2log, "moeplace", config=config, summary=summary, layers=layers)
