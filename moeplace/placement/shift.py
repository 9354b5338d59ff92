"""The shift estimate: what a placement keeps on workloads unlike its planning data. Planning windows are
grouped into scenarios (inputs grouped by the similarity of their expert loads, else domain tags, else
contiguous windows); each group is left out in turn, the policy is planned on the rest with the written
placement's settings and scored on the group it did not see; the spread over folds and the layer-sample
error give the ranges."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import worker_signals
from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import (
    PlacementProblem,
    is_anytime,
)
from moeplace.placement.record import Placement
from moeplace.placement.windows import window_span
from moeplace.traces.loads import Loads

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


def _labels(clusters: list[list[int]], n: int) -> list[int]:
    """Each of ``n`` inputs' group, groups numbered in order of their first input."""
    out = [0] * n
    for g, members in enumerate(sorted(clusters, key=min)):
        for i in members:
            out[i] = g
    return out


def input_dendrogram(per_input: list[np.ndarray]) -> list[tuple[list[int], float]]:
    """Average-linkage agglomerative clustering of inputs (``[L, E]`` counts each) on :func:`load_distance`:
    every level of the hierarchy, finest first — ``(group per input, distance of the merge that made this
    level)``, from each input its own group (distance 0) down to one group. A level merges the closest two
    groups of the one before (mean distance over their members' pairs)."""
    n = len(per_input)
    d = np.array([[load_distance(per_input[i], per_input[j]) if i != j else 0.0 for j in range(n)]
                  for i in range(n)])
    clusters = [[i] for i in range(n)]
    levels = [(_labels(clusters, n), 0.0)]
    while len(clusters) > 1:
        best, pair = None, None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                x = float(d[np.ix_(clusters[a], clusters[b])].mean())
                if best is None or x < best:
                    best, pair = x, (a, b)
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters.pop(b))
        levels.append((_labels(clusters, n), best))
    return levels


def group_inputs(per_input: list[np.ndarray], rel: float = GROUP_DISTANCE) -> list[int]:
    """Group related inputs (``[L, E]`` counts each) so the shift estimate leaves them out together: the
    level of :func:`input_dendrogram` reached by merging while the merge distance is under ``rel`` x the
    median distance between all pairs of inputs. Returns each input's group (0, 1, ... in order of first
    input). Two inputs never merge (the median is their own distance): with nothing to compare them to,
    they count as unrelated."""
    n = len(per_input)
    if n < 3:
        return list(range(n))
    d = [load_distance(per_input[i], per_input[j]) for i in range(n) for j in range(i + 1, n)]
    cut = rel * float(np.median(d))
    out = list(range(n))
    for labels, dist in input_dendrogram(per_input)[1:]:
        if dist >= cut:
            break
        out = labels
    return out


def input_groupings(per_input: list[np.ndarray], max_groups: int = MAX_SCENARIOS,
                    min_groups: int = WEAK_GROUPS) -> list[list[int]]:
    """The plausible groupings of related inputs the default shift estimate spans (finest first): every
    level of :func:`input_dendrogram` with at most ``max_groups`` and at least ``min_groups`` groups (fewer
    leave too few folds for a spread); with ``min_groups`` inputs or fewer, down to 2 groups (the estimate
    then says it is weak).

    Why several: which inputs are "related" (the same dataset in two languages, two datasets of one
    task) decides how much of a left-out group the other folds have already seen, and the expert loads
    alone cannot tell a language pair from two datasets (on real routing both sit 0.25-0.40 apart).
    Unseen production traffic may be a relative of a planning input (the fine levels predict that) or a
    new dataset (the coarse levels); spanning the levels covers both, and ``--group`` says which."""
    n = len(per_input)
    if n <= 2:
        return [list(range(n))]
    lo = min_groups if n > min_groups else 2
    return [lab for lab, _ in input_dendrogram(per_input) if lo <= max(lab) + 1 <= max_groups]


def _input_scenarios(loads: Loads, tags: list[int]) -> tuple[list[Any], list[str], str, list[list[Any]]]:
    """Each window's scenario key, the scenario names, the method and the other groupings the estimate
    spans (each a key per window, finest first; empty when there is one grouping) for windows tagged by
    input (``tags``: input index per window): the groups ``--group`` named (provenance ``input_groups``, a
    group name per input: the one grouping), else the plausible groupings of :func:`input_groupings`, the
    scenarios named by the coarsest of them; an input per scenario when no two are related."""
    prov = loads.provenance
    files = prov.get("inputs", [])
    present = list(dict.fromkeys(tags))
    fname = {i: Path(files[i]).name if i < len(files) else str(i) for i in present}
    given = prov.get("input_groups")
    if given is not None and len(given) == len(files):
        key = {i: str(given[i]) for i in present}
        keys = [key[t] for t in tags]
        return keys, list(dict.fromkeys(keys)), "leave-one-input-group-out (groups as given (--group))", []
    per = [loads.counts[[w for w, t in enumerate(tags) if t == i]].sum(axis=0).astype(np.float64)
           for i in present]

    def window_keys(g: list[int]) -> list[str]:
        members = {k: [fname[present[j]] for j in range(len(present)) if g[j] == k] for k in set(g)}
        key = {i: "+".join(members[g[j]]) for j, i in enumerate(present)}
        return [key[t] for t in tags]

    levels = input_groupings(per)
    keys = window_keys(levels[-1])
    names = list(dict.fromkeys(keys))
    if len(levels) == 1:
        if len(names) == len(present):  # every input its own scenario
            return keys, names, "leave-one-input-file-out", []
        return keys, names, "leave-one-input-group-out", []
    sizes = [max(g) + 1 for g in levels]
    how = (f"spanning {len(levels)} groupings of related inputs ({sizes[0]} to {sizes[-1]} groups, the levels of "
           "average-linkage clustering on the total-variation distance of per-layer expert shares): the figures "
           "at the coarsest, the ranges over every grouping, since which inputs are related cannot be told from "
           "their loads alone (--group names the groups and narrows the ranges)")
    return keys, names, f"leave-one-input-group-out, {how}", [window_keys(g) for g in levels]


def scenario_groupings(loads: Loads, max_scenarios: int = MAX_SCENARIOS) -> tuple[np.ndarray, list[str], str,
                                                                                     list[np.ndarray]]:
    """:func:`scenarios` plus the groupings the estimate spans: int ``[W]`` scenario ids per grouping, finest
    first, the last one the returned ids (empty: one grouping, the returned ids)."""
    W = loads.num_windows
    prov = loads.provenance
    for key, what in (("window_inputs", "input file"), ("window_domains", "domain tag")):
        tags = prov.get(key)
        if tags is None or len(tags) != W:
            continue
        if len(set(tags)) < 2:
            continue
        alt: list[list[Any]] = []
        if key == "window_inputs":
            tags, shown, method, alt = _input_scenarios(loads, list(tags))
            names = list(shown)
        else:
            names = list(dict.fromkeys(tags))
            shown = [str(n) for n in names]
            method = f"leave-one-{what.replace(' ', '-')}-out"
        ids = np.array([names.index(t) for t in tags], np.int64)
        if len(names) > max_scenarios:
            ids %= max_scenarios
            shown = ["+".join(shown[j::max_scenarios]) for j in range(max_scenarios)]
        groupings = []
        for keys in alt:
            order = list(dict.fromkeys(keys))
            groupings.append(np.array([order.index(k) for k in keys], np.int64))
        share = prov.get("window_domain_share") if key == "window_domains" else None
        if share is not None and len(share) == W and float(np.mean(share)) < PURE_WINDOW_SHARE:
            method += (f"; optimistic: windows mix domains (a window's dominant tag holds {np.mean(share):.0%} of "
                       "its tokens on average), so the left-out tag's traffic is partly in the planning "
                       "scenarios; one input per workload gives a clean estimate")
        return ids, shown, method + _weak(len(shown)), groupings
    n = min(WINDOW_GROUPS, W)
    ids = (np.arange(W) * n) // W
    names = [window_span(np.flatnonzero(ids == g), "window") for g in range(n)]
    return ids, names, f"leave-one-window-group-out ({n} contiguous groups)" + _weak(n), []


def scenarios(loads: Loads, max_scenarios: int = MAX_SCENARIOS) -> tuple[np.ndarray, list[str], str]:
    """Each window's scenario for the leave-one-scenario-out estimate: ``(ids int [W], names, method)``.
    A scenario is a group of related input files (several inputs: :func:`_input_scenarios`; without
    ``--group`` the coarsest of the groupings the estimate spans, see :func:`scenario_groupings`), else a
    domain tag (a trace's dominant domain per window, when it has >= 2), else one of ``WINDOW_GROUPS``
    contiguous groups of windows. More than ``max_scenarios`` groups or domains are merged round-robin
    into that many. With fewer than ``WEAK_GROUPS`` scenarios the method says the estimate is weak."""
    return scenario_groupings(loads, max_scenarios)[:3]


def _weak(n: int) -> str:
    if n >= WEAK_GROUPS:
        return ""
    return (f"; weak: {n} scenario groups only (each fold plans on {n - 1} and the spread over folds rests on "
            f"{n} numbers; give {WEAK_GROUPS} or more unrelated workloads)")


def _plan(fn, name: str, loads: Loads, windows: np.ndarray, samples: np.ndarray | None, cluster: ClusterSpec,
          num_redundant: int, rule: str, seed: int, time_limit: float | None,
          options: dict[str, Any]) -> tuple[Placement, float]:
    problem = PlacementProblem(loads=loads.counts[windows].astype(np.float64), model=loads.model, cluster=cluster,
                               num_redundant=num_redundant, rule=rule, seed=seed, time_limit=time_limit,
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


def fold_seconds(plan_s: float, ids: np.ndarray, side_by_side: bool,
                 groupings: list[np.ndarray] | None = None) -> float:
    """Expected seconds of the shift estimate's folds (:func:`fold_windows` of ``ids`` and ``groupings``)
    over every layer, from the main plan's ``plan_s``: each fold plans on the other windows (time taken as
    proportional to windows); anytime policies run their folds side by side, one process per core."""
    W = ids.size
    folds = fold_windows(ids, groupings)
    work = sum((W - w.size) / W for w in folds) * plan_s
    lanes = min(len(folds), os.cpu_count() or 1) if side_by_side else 1
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


WIDE_RANGE = 0.30  # a printed range wider than this says why


def fold_windows(ids: np.ndarray, groupings: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The distinct left-out window sets of the groupings (``ids`` and each of ``groupings``, int ``[W]``
    scenario ids): one fold per group, a group shared by two groupings (the same windows) planned once."""
    seen: dict[tuple[int, ...], np.ndarray] = {}
    for g in [*(groupings or []), ids]:
        for sc in np.unique(g):
            w = np.flatnonzero(g == sc)
            seen.setdefault(tuple(w.tolist()), w)
    return list(seen.values())


def _wide_reason(levels: list[dict[str, Any]], key: str, width: float) -> str:
    """Why a range is wider than :data:`WIDE_RANGE`: the groupings disagree, the left-out groups of one
    grouping differ, or both (``levels``: each grouping's figures, finest first)."""
    fig = "mean" if key == "mean_range" else "worst"
    pts = [lv[fig] for lv in levels]
    spread = max(max(lv["per_scenario"]) - min(lv["per_scenario"]) for lv in levels)
    parts = []
    if len(levels) > 1 and max(pts) - min(pts) > 0.05:
        parts.append(f"the groupings of related inputs disagree ({fig} {pts[0]:.3f} with {levels[0]['groups']} "
                     f"groups, {pts[-1]:.3f} with {levels[-1]['groups']}): --group names the related inputs and "
                     "narrows it")
    if spread > 0.05 or not parts:
        parts.append(f"the left-out groups differ by up to {spread:.3f} from each other (the planning workloads are "
                     "that unlike each other; more unrelated workloads narrow it)")
    return f"{key.split('_')[0]} range {width:.2f} wide: " + "; ".join(parts)


def shift_estimate(fn, name: str, loads: Loads, cluster: ClusterSpec, *, num_redundant: int, rule: str,
                   seed: int, time_limit: float | None, options: dict[str, Any],
                   ids: np.ndarray, method: str, layers: np.ndarray | None = None,
                   groupings: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Leave-one-scenario-out: for every scenario group ``s`` of ``ids`` (int ``[W]``), plan ``fn`` on the
    other groups' windows with exactly the settings of the main plan (its options, and with a traffic
    objective the training windows' token sample)
    and score it on ``s``'s windows, on the MoE layers ``layers`` (default: all; see
    :func:`shift_layers`). ``groupings``: other plausible groupings of the windows (int ``[W]`` each, finest
    first; :func:`scenario_groupings`) whose folds are planned too (a group two groupings share, once).
    Returns ``{"mean": mean over groups of the left-out balancedness (grouping ``ids``), "worst": the
    lowest, "mean_range", "worst_range": [lo, hi] (:func:`shift_ranges` of every grouping, their union),
    "method": ..., "per_scenario": [...], "layers": [...], "layer_sample_se": standard error of "mean" from
    sampling layers (0 with every layer), "groupings": each grouping's figures (with ``groupings``),
    "wide": why a range is wider than WIDE_RANGE (when one is)}`` — what to expect on traffic unlike the
    planning data."""
    counts = loads.counts.astype(np.float64)
    L = counts.shape[1]
    if layers is not None and len(layers) < L:
        # the other layers carry no tokens: no policy plans on them and no score averages them in
        keep = np.zeros(L, dtype=bool)
        keep[np.asarray(layers)] = True
        counts = counts * keep[None, :, None]
    opts = {**options, "pareto": None}  # the frontier is a report: it does not change the placement
    traffic = (options.get("objective") or "balance") != "balance"
    folds = fold_windows(ids, groupings)
    cpus = os.cpu_count() or 1
    # An anytime policy (the optimizer) costs seconds per layer: its folds run side by side, one process
    # each, every fold's layers in that process (same placements: a layer's plan does not depend on the
    # process it runs in), instead of one fold after another, each spreading a few layers over the cores.
    pool = is_anytime(name) and len(folds) > 1 and cpus > 1 and opts.get("workers") in (None, 0)
    if pool:
        opts["workers"] = 1
    jobs = []
    W = counts.shape[0]
    for out in folds:
        train = np.setdiff1d(np.arange(W), out)
        fo = dict(opts)
        samples = loads.samples_in(train) if traffic else None
        if traffic and (samples is None or not len(samples)):
            fo["objective"] = "balance"  # no token sample of the training windows: nothing to refine on
        jobs.append((fn, name, PlacementProblem(loads=counts[train], model=loads.model, cluster=cluster,
                                                num_redundant=num_redundant, rule=rule, seed=seed,
                                                time_limit=time_limit, samples=samples, options=fo),
                     counts[out]))
    if pool:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        ex = ProcessPoolExecutor(max_workers=min(len(folds), cpus), mp_context=ctx, initializer=worker_signals)
        try:
            done = list(ex.map(_fold, jobs))
        except BaseException:  # Ctrl-C, SIGTERM: stop the folds now (``with`` would wait for every one)
            for p in list((getattr(ex, "_processes", None) or {}).values()):
                p.terminate()
            ex.shutdown(wait=False, cancel_futures=True)
            raise
        ex.shutdown()
    else:
        done = [_fold(j) for j in jobs]
    result = {tuple(w.tolist()): d for w, d in zip(folds, done)}

    def of(g: np.ndarray) -> list[tuple[float, np.ndarray]]:
        return [result[tuple(np.flatnonzero(g == sc).tolist())] for sc in np.unique(g)]

    main = of(ids)
    per = [b for b, _ in main]
    per_layer = [lb for _, lb in main]
    scored = np.flatnonzero(counts.sum(axis=(0, 2)) > 0)
    active = int((loads.counts.sum(axis=(0, 2)) > 0).sum())
    u = np.nanmean(np.array(per_layer)[:, scored], axis=0)  # per layer, over the left-out scenarios
    k = u.size
    se = (float(np.std(u, ddof=1) / math.sqrt(k) * math.sqrt(1 - k / active)) if 1 < k < active else 0.0)
    mean_range, worst_range, _ = shift_ranges(per, se)
    out: dict[str, Any] = {"mean": float(np.mean(per)), "worst": float(np.min(per)), "mean_range": mean_range,
                           "worst_range": worst_range, "method": method,
                           "per_scenario": [float(x) for x in per], "layers": [int(x) for x in scored],
                           "layer_sample_se": se}
    levels = []
    for g in (groupings or [ids]):
        pg = [b for b, _ in of(g)]
        mr, wr, _ = shift_ranges(pg, se)
        levels.append({"groups": int(np.unique(g).size), "mean": float(np.mean(pg)), "worst": float(np.min(pg)),
                       "mean_range": mr, "worst_range": wr, "per_scenario": [float(x) for x in pg]})
    if groupings:
        # the union of every plausible grouping's range: the estimate cannot know which grouping is right
        out["mean_range"] = [min(lv["mean_range"][0] for lv in levels), max(lv["mean_range"][1] for lv in levels)]
        out["worst_range"] = [min(lv["worst_range"][0] for lv in levels),
                              max(lv["worst_range"][1] for lv in levels)]
        out["groupings"] = levels
    key = max(("mean_range", "worst_range"), key=lambda x: out[x][1] - out[x][0])
    width = out[key][1] - out[key][0]
    if width > WIDE_RANGE:
        out["wide"] = _wide_reason(levels, key, width)
    return out


def _fold(job) -> tuple[float, np.ndarray]:
    """One leave-one-out fold: plan the policy's problem, score it on the left-out windows' counts;
    (balancedness, per-layer balancedness ``[L]``)."""
    fn, name, problem, test = job
    placement = fn(problem)
    placement.check_model(problem.model, f"policy '{name}'")
    m = evaluate(placement, test, problem.rule, model=problem.model, cluster=problem.cluster)
    return m.balancedness, m.layer_balancedness


