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
    names = [window_span(np.flatnonzero(ids == g), "window") for g in range(n)]
    return ids, names, f"leave-one-window-group-out ({n} contiguous groups)" + _weak(n)


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


def shift_estimate(fn, name: str, loads: Loads, cluster: ClusterSpec, *, num_redundant: int, rule: str,
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
                                                num_redundant=num_redundant, rule=rule, seed=seed,
                                                time_limit=time_limit, samples=samples, options=fo),
                     counts[ids == sc]))
    if pool:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        ex = ProcessPoolExecutor(max_workers=min(folds.size, cpus), mp_context=ctx, initializer=worker_signals)
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
    m = evaluate(placement, test, problem.rule, model=problem.model, cluster=problem.cluster)
    return m.balancedness, m.layer_balancedness


