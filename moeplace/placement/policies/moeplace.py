"""The ``moeplace`` policy: the optimizer of ``placement/optimizer`` behind the policy registry.

Reads its knobs from ``PlacementProblem`` (engine, seed, time_limit) and ``problem.options`` (what
``place optimize`` passes): ``robust`` (bool), ``cvar`` (float), ``objective``
(``balance|traffic|balance+traffic``), ``traffic_weight``, ``balance_floor``, ``pareto`` (bool),
``dilate`` (with ``robust``: a factor >= 1, ``"jackknife"`` or ``"auto"``, see :func:`dilation`),
``spread`` (with ``robust``: a number of standard deviations >= 0 or ``"auto"``, see :func:`spread_choice`) with
``scenarios`` (int ``[W]``, each planning window's scenario group; default: 4 contiguous groups),
``from`` (a Placement or a path to one; the migration origin), ``max_moves``, ``workers``,
``lns_rounds``. Per-layer objective, proven bound and gap land in the placement's provenance
(``params.layers``), with a summary in ``params.summary``. What the time limit skipped or cut short is
counted there too (``time_limited``: ``{"skipped": {stage: layers}, "cut": {stage: layers}}``) and
``reproducible`` says whether the same seed gives this placement again: true exactly when nothing was.
"""
from __future__ import annotations

import time
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

_FROM_PROBLEM = {"engine", "seed", "time_limit"}  # the problem's own fields, not options
_HEDGE_RULES = {"dilate", "spread"}  # a number, or a rule name ("auto", "jackknife") resolved here
_OPTION_KEYS = {f.name for f in fields(OptimizerConfig)} - _FROM_PROBLEM - _HEDGE_RULES
declare_options({
    **{k: t for k, t in field_types(OptimizerConfig).items() if k in _OPTION_KEYS},
    **{k: float | str for k in _HEDGE_RULES if k in field_types(OptimizerConfig)},
    "from": Any,  # the migration origin: a placement file's path, or a Placement
    "current": Any,  # the same, as the simulator's rebalancer passes it
    "scenarios": Any,  # int [W]: each planning window's scenario group (place optimize computes it)
})
DILATE_RULES = ("jackknife", "auto")
WINDOW_GROUPS = 4  # scenario groups when the caller names none: contiguous runs of windows


def config_from_problem(problem: PlacementProblem) -> OptimizerConfig:
    """The optimizer's config: engine / seed / time limit from the problem, the rest from its options
    (checked by :func:`check_options`: an unknown key or a wrongly typed value is an error; ``None`` is
    unset)."""
    opts = check_options("options", problem.options)
    kw = {k: opts[k] for k in _OPTION_KEYS if k in opts}
    return OptimizerConfig(engine=problem.engine, seed=int(problem.seed), time_limit=problem.time_limit, **kw)


def scenario_groups(problem: PlacementProblem) -> np.ndarray:
    """int ``[W]``: each planning window's scenario group, from ``options['scenarios']`` (what ``place
    optimize`` passes: input file, else domain tag, else contiguous windows — the shift estimate's
    scenarios), else ``WINDOW_GROUPS`` contiguous runs of windows."""
    W = problem.loads.shape[0]
    ids = problem.options.get("scenarios")
    if ids is None:
        n = min(WINDOW_GROUPS, W)
        return (np.arange(W) * n) // W
    ids = np.asarray(ids, dtype=np.int64)
    if ids.shape != (W,):
        raise InputError(f"scenarios must give one group per planning window ({W}), got shape {ids.shape}")
    return ids


def jackknife_factor(groups: np.ndarray, loads: np.ndarray) -> float:
    """``D / (D - 1)`` for the D groups with tokens (1 for fewer than 2): the leave-one-group-out offset
    of a group from the others' centroid is ``D / (D - 1)`` times its offset from the centroid of all D."""
    D = sum(1 for g in np.unique(groups) if loads[groups == g].sum() > 0)
    return D / (D - 1) if D >= 2 else 1.0


def window_balancedness(p2l_lp: np.ndarray, loads_wle: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per-window balancedness ``[W]`` of ``phy2log [L, P]`` on token counts ``[W, L, E]`` under the even
    split (vLLM's rule in expectation): mean over the layers with tokens of ``mean / max`` GPU load."""
    W, L, E = loads_wle.shape
    S = p2l_lp.shape[1] // num_gpus
    out = np.zeros((W, L))
    have = loads_wle.sum(axis=2) > 0
    for l in range(L):
        cnt = np.bincount(p2l_lp[l], minlength=E)
        per = loads_wle[:, l, p2l_lp[l]] / cnt[p2l_lp[l]]                 # [W, P]
        gl = per.reshape(W, num_gpus, S).sum(axis=2)                      # [W, G]
        mx = gl.max(axis=1)
        out[:, l] = np.divide(gl.mean(axis=1), mx, out=np.ones(W), where=mx > 0)
    return np.array([out[w, have[w]].mean() if have[w].any() else np.nan for w in range(W)])


def dilation(rule, loads: np.ndarray, groups: np.ndarray, cfg: OptimizerConfig, num_gpus: int,
             run) -> tuple[float, dict]:
    """The ``dilate`` factor to plan with and what chose it. A number is used as is; ``"jackknife"`` is
    :func:`jackknife_factor` of the planning groups; ``"auto"`` picks between 1 (the windows as they are)
    and the jackknife factor by leave-one-group-out on the planning windows only: each rule plans on all
    groups but one (the factor recomputed from those) and is scored on the one left out (mean window
    balancedness); the better worst group wins, then the better mean, then 1. ``run(loads, groups, cfg)``
    plans ``[L, P]``; ``loads``: ``[W, L, E]``; ``groups``: int ``[W]``."""
    if rule is None:
        return 1.0, {}
    if rule not in DILATE_RULES:
        return float(rule), {}
    if rule == "jackknife":
        return jackknife_factor(groups, loads), {"dilate_rule": "jackknife"}
    key = leave_one_group_out(
        {"none": lambda ld, gr: 1.0, "jackknife": lambda ld, gr: jackknife_factor(gr, ld)}, "dilate", loads, groups, cfg, num_gpus, run)
    pick = "jackknife" if key.get("jackknife", (0.0, 0.0)) > key.get("none", (0.0, 0.0)) else "none"
    f = jackknife_factor(groups, loads) if pick == "jackknife" else 1.0
    return f, {"dilate_rule": "auto", "dilate_chosen": pick,
               "dilate_cv": {r: {"worst": k[0], "mean": k[1]} for r, k in key.items()}}


def leave_one_group_out(rules: dict, field_name: str, loads: np.ndarray, groups: np.ndarray, cfg: OptimizerConfig,
                        num_gpus: int, run) -> dict[str, tuple[float, float]]:
    """Score each rule by leave-one-group-out on the planning windows only: for each group with tokens,
    plan on the other groups (config field ``field_name`` set to ``rule(train_loads, train_groups)``) and
    score on the one left out (mean window balancedness). Returns ``{rule: (worst group, mean)}``; empty
    with fewer than 3 groups (with 2, each fold plans on one group: nothing for a hedge to widen)."""
    names = [g for g in np.unique(groups) if loads[groups == g].sum() > 0]
    scores: dict[str, list[float]] = {r: [] for r in rules}
    if len(names) < 3:
        return {}
    for g in names:
        test, train = groups == g, groups != g
        for r, value in rules.items():
            c = replace(cfg, **{field_name: value(loads[train], groups[train])})
            p2l = run(loads[train], groups[train], c)
            scores[r].append(float(np.nanmean(window_balancedness(p2l, loads[test], num_gpus))))
    return {r: (min(v), float(np.mean(v))) for r, v in scores.items()}


def spread_sd(num_gpus: int) -> float:
    """The ``--spread auto`` candidate: ``sqrt(2 ln G)``, about how many standard deviations the largest
    of G independent normal GPU loads sits above their mean — so ``mean + k * sd`` per GPU stands for the
    expected worst GPU (1 for a single GPU)."""
    return float(np.sqrt(2.0 * np.log(num_gpus))) if num_gpus > 1 else 1.0


def spread_choice(rule, loads: np.ndarray, groups: np.ndarray, cfg: OptimizerConfig, num_gpus: int,
                  run) -> tuple[float, dict]:
    """The ``spread`` to plan with and what chose it. A number is used as is; ``"auto"`` picks between 0
    (plain ``--robust``) and :func:`spread_sd` by leave-one-group-out on the planning windows only
    (:func:`leave_one_group_out`; the better worst group wins, then the better mean, then 0). ``run``,
    ``loads``, ``groups`` as for :func:`dilation`."""
    if rule is None:
        return 0.0, {}
    if rule != "auto":
        return float(rule), {}
    k = spread_sd(num_gpus)
    key = leave_one_group_out({"none": lambda ld, gr: 0.0, "sd": lambda ld, gr: k}, "spread", loads, groups, cfg,
                              num_gpus, run)
    pick = "sd" if key.get("sd", (0.0, 0.0)) > key.get("none", (0.0, 0.0)) else "none"
    return (k if pick == "sd" else 0.0), {"spread_rule": "auto", "spread_chosen": pick,
                                          "spread_cv": {r: {"worst": v[0], "mean": v[1]} for r, v in key.items()}}


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
    groups = scenario_groups(problem)
    t_end = None if cfg.time_limit is None else time.monotonic() + cfg.time_limit
    rule = problem.options.get("dilate")
    spread = problem.options.get("spread")
    info: dict = {}
    if rule is not None or spread is not None:
        if not cfg.robust:
            raise InputError("--dilate needs --robust (it widens the robust plan's scenarios)" if rule is not None
                             else "--spread needs --robust (it adds scenarios to the robust plan)")
        if rule == "auto" and spread == "auto":
            raise InputError("--dilate auto and --spread auto cannot be combined (choose one hedge to tune)")
        # "auto" plans 2 rules x D folds before the final plan: each gets an equal share of the limit
        runs = 2 * len(np.unique(groups)) + 1 if "auto" in (rule, spread) else 1

        def run(ld: np.ndarray, gr: np.ndarray, c: OptimizerConfig) -> np.ndarray:
            # the choice is about balance: no traffic search, no frontier in the folds
            c = replace(c, objective="balance", pareto=False,
                        time_limit=None if t_end is None else max(0.01, cfg.time_limit / runs))
            return np.stack([r.p2l for r in optimize_layers(ld, problem.num_slots, G, problem.cluster.gpus_per_node,
                                                            c, groups=gr)])

        factor, info = dilation(rule, loads, groups, cfg, G, run)
        cfg = replace(cfg, dilate=factor)
        k, more = spread_choice(spread, loads, groups, cfg, G, run)
        info.update(more)
        cfg = replace(cfg, spread=k, time_limit=None if t_end is None else max(0.01, t_end - time.monotonic()))
    results = optimize_layers(loads, problem.num_slots, G, problem.cluster.gpus_per_node, cfg,
                              None if samples is None else samples[:, active],
                              None if origin is None else origin[active], groups, layer_ids=active)
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
    summary.update(info)
    config = {k: v for k, v in asdict(replace(cfg, time_limit=problem.time_limit)).items()}
    return problem.placement(phy2log, "moeplace", config=config, summary=summary, layers=layers)
