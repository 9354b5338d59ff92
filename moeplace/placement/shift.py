"""The shift estimate: what a placement keeps on one new workload unlike its planning data, with an 80 %
prediction interval, per kind of "new" the inputs can say (docs/placement.md "Shift estimate").

*Groupings* (:func:`shift_groupings`): what is left out together. The inputs' tags (a Loads file's or a
trace's metadata ``tags`` object, or ``--tag PATH:KEY=VALUE``; ``--group`` is the tag ``group``) give one
grouping per tag key: leaving out every input with one value of ``dataset`` in turn estimates "a new
dataset", of ``lang`` "a new language". Without tags the inputs are clustered (average linkage on the
total-variation distance of their expert shares, the number of groups by the best silhouette) and the
grouping is printed with its stability under resampling the layers; one tagged trace uses its windows'
domain tags; a single untagged input, contiguous runs of its windows.

*Estimate* (:func:`shift_estimate`): for each left-out group, the policy is planned on the rest with the
written placement's settings and scored on the group; the figure for a grouping is the mean over its
groups, the range an 80 % prediction interval for one more group (:func:`prediction_interval`: the
left-out groups' order statistics where there are enough of them to give a distribution-free 80 %, else a
Student-t interval, or on a layer sample a generalized pivot that takes the sample's own noise out:
:func:`pivot_half_width`). Paired differences between policies (:func:`versus`) use the same left-out groups.

*Deterministic*: the MoE layers are all of them or a sample chosen by seed and count
(:func:`shift_layers`), never by elapsed time; a time limit can only omit the estimate, not change it.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize, special

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import worker_signals
from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import PlacementProblem, TimeLimitReached, is_anytime
from moeplace.placement.record import Placement
from moeplace.placement.windows import window_span
from moeplace.traces.loads import Loads

COVERAGE = 0.80  # the nominal coverage of every printed range
# A range wider than this says what would narrow it (the planning target: a range a user can plan with).
WIDE = 0.20
MIN_INTERVAL_GROUPS = 3  # fewer left-out groups than this: no range (the spread rests on 1 or 2 numbers)
MAX_CLUSTERS = 8
WINDOW_GROUPS = 4
BOOTSTRAP = 100  # layer resamples behind the clustering's stability
MIN_LAYERS = 3  # a layer sample smaller than this leaves no usable estimate of its own error

# Below this mean dominant-tag share per window, domain-tag scenarios overlap and flatter the shift estimate:
# on a drifting synthetic trace tagged per window, 96 % of the left-out domain's deviation lay in the planning
# windows' top variation directions, against 18 % with the same trace split cleanly by each token's domain.
PURE_WINDOW_SHARE = 0.95

# two-sided 80 % Student-t quantiles t_{0.90, df} for df = 1..30 (above: the normal's 1.2816)
T80 = (3.0777, 1.8856, 1.6377, 1.5332, 1.4759, 1.4398, 1.4149, 1.3968, 1.3830, 1.3722,
       1.3634, 1.3562, 1.3502, 1.3450, 1.3406, 1.3368, 1.3334, 1.3304, 1.3277, 1.3253,
       1.3232, 1.3212, 1.3195, 1.3178, 1.3163, 1.3150, 1.3137, 1.3125, 1.3114, 1.3104)
Z80 = 1.2816


def t80(df: int) -> float:
    return T80[df - 1] if 1 <= df <= len(T80) else Z80


# ---------------------------------------------------------------------------- distances, clustering
def layer_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per MoE layer, the total-variation distance between two ``[L, E]`` count arrays' expert shares
    (0 = the same distribution, 1 = disjoint experts); NaN where either has no tokens."""
    sa, sb = a.sum(-1), b.sum(-1)
    out = np.full(a.shape[0], np.nan)
    both = (sa > 0) & (sb > 0)
    out[both] = 0.5 * np.abs(a[both] / sa[both, None] - b[both] / sb[both, None]).sum(-1)
    return out


def load_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Distance between two ``[L, E]`` count arrays: :func:`layer_distances`' mean over the layers where
    both have tokens; 1 when no layer has tokens in both."""
    d = layer_distances(a, b)
    return float(np.nanmean(d)) if np.isfinite(d).any() else 1.0


def _labels(clusters: list[list[int]], n: int) -> list[int]:
    """Each of ``n`` inputs' group, groups numbered in order of their first input."""
    out = [0] * n
    for g, members in enumerate(sorted(clusters, key=min)):
        for i in members:
            out[i] = g
    return out


def linkage_levels(d: np.ndarray) -> list[list[int]]:
    """Average-linkage agglomerative clustering on the distance matrix ``d`` (``[n, n]``): every level,
    finest first — the group of each input, from each input its own group down to one group. A level
    merges the closest two groups of the one before (mean distance over their members' pairs; ties: the
    first pair in order)."""
    n = d.shape[0]
    clusters = [[i] for i in range(n)]
    levels = [_labels(clusters, n)]
    while len(clusters) > 1:
        best, pair = None, (0, 1)
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                x = float(d[np.ix_(clusters[a], clusters[b])].mean())
                if best is None or x < best - 1e-15:
                    best, pair = x, (a, b)
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters.pop(b))
        levels.append(_labels(clusters, n))
    return levels


def silhouette(d: np.ndarray, labels: list[int]) -> float:
    """Mean silhouette width (Rousseeuw 1987) of a partition under distances ``d``; an input alone in its
    group scores 0."""
    lab = np.asarray(labels)
    n = lab.size
    s = np.zeros(n)
    for i in range(n):
        own = (lab == lab[i]) & (np.arange(n) != i)
        if not own.any():
            continue
        a = d[i, own].mean()
        b = min(d[i, lab == g].mean() for g in set(lab.tolist()) if g != lab[i])
        s[i] = (b - a) / max(a, b) if max(a, b) > 0 else 0.0
    return float(s.mean())


def adjusted_rand(a: list[int], b: list[int]) -> float:
    """Adjusted Rand index of two partitions (1 = the same, about 0 = as alike as chance)."""
    a, b = np.asarray(a), np.asarray(b)
    n = a.size
    table = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(table, (a, b), 1)
    comb = lambda x: x * (x - 1) / 2
    idx = comb(table).sum()
    ra, rb = comb(table.sum(1)).sum(), comb(table.sum(0)).sum()
    expected = ra * rb / comb(n) if n > 1 else 0.0
    top = (ra + rb) / 2 - expected
    return 1.0 if top == 0 else float((idx - expected) / top)


def _choose_level(d: np.ndarray, max_groups: int) -> tuple[list[int], float]:
    """The level of :func:`linkage_levels` with 3..``max_groups`` groups (``n`` inputs: at most n) of the
    best mean silhouette (ties: fewer groups); an input per group scores 0, so inputs merge only where
    merging separates them better than not."""
    n = d.shape[0]
    best: tuple[list[int], float] | None = None
    for lab in linkage_levels(d):
        k = max(lab) + 1
        if not 3 <= k <= max_groups:
            continue
        s = silhouette(d, lab)
        if best is None or s >= best[1] - 1e-12:
            best = (lab, s)
    return best if best is not None else (list(range(n)), 0.0)


@dataclass(frozen=True)
class Clustering:
    labels: list[int]
    silhouette: float
    stability: float  # mean adjusted Rand index of the grouping found on layer resamples
    same: float  # share of layer resamples that find exactly this grouping
    resamples: int


def cluster_inputs(per_input: list[np.ndarray], seed: int = 0, max_groups: int = MAX_CLUSTERS) -> Clustering:
    """Group related inputs (``[L, E]`` counts each) when nothing says which are related: average-linkage
    clustering on :func:`load_distance`, the level with 3 to ``max_groups`` groups of the best silhouette.
    Its stability: the same choice made on :data:`BOOTSTRAP` resamples of the MoE layers (with
    replacement, seeded by ``seed``), compared with the grouping found (adjusted Rand index, mean; and the
    share of resamples finding exactly it). With 3 inputs or fewer each input is its own group."""
    n = len(per_input)
    if n <= 3:
        return Clustering(list(range(n)), 0.0, 1.0, 1.0, 0)
    per_layer = np.array([[layer_distances(per_input[i], per_input[j]) if i != j else
                           np.zeros(per_input[0].shape[0]) for j in range(n)] for i in range(n)])  # [n, n, L]
    ok = np.isfinite(per_layer).all(axis=(0, 1))
    per_layer = per_layer[:, :, ok] if ok.any() else np.ones((n, n, 1)) - np.eye(n)[:, :, None]
    labels, sil = _choose_level(per_layer.mean(-1), max_groups)
    L = per_layer.shape[-1]
    rng = np.random.default_rng([seed, 45])
    aris, same = [], 0
    for _ in range(BOOTSTRAP):
        lab, _ = _choose_level(per_layer[:, :, rng.integers(0, L, L)].mean(-1), max_groups)
        aris.append(adjusted_rand(labels, lab))
        same += lab == labels
    return Clustering(labels, sil, float(np.mean(aris)), same / BOOTSTRAP, BOOTSTRAP)


# ---------------------------------------------------------------------------- groupings
@dataclass(frozen=True)
class Grouping:
    """One way of leaving out whole groups of planning windows: ``ids`` int ``[W]`` (group per window),
    the groups' ``names``, the tag ``key`` it comes from, ``what`` a left-out group stands for ("a new
    dataset") and ``how`` it was found."""

    key: str
    what: str
    ids: np.ndarray
    names: list[str]
    how: str

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "what": self.what, "groups": list(self.names), "how": self.how}


def input_tags(loads: Loads) -> tuple[list[dict[str, str]], list[str]]:
    """Each input's tags (``provenance["input_tags"]``: from the inputs' metadata and ``--tag``; with
    ``--group``, the key ``group`` first) and the tag keys in order of first appearance."""
    prov = loads.provenance
    files = prov.get("inputs", [])
    tags = [dict(t or {}) for t in (prov.get("input_tags") or [{} for _ in files])]
    given = prov.get("input_groups")
    if given is not None and len(given) == len(files):
        tags = [{"group": str(g), **{k: v for k, v in t.items() if k != "group"}} for g, t in zip(given, tags)]
    keys = list(dict.fromkeys(k for t in tags for k in t))
    return tags, keys


def _what(key: str) -> str:
    return {"lang": "a new language", "language": "a new language", "group": "a new group of related inputs",
            "domain": "a new domain"}.get(key, f"a new {key}")


def shift_groupings(loads: Loads, seed: int = 0) -> tuple[list[Grouping], list[str]]:
    """The groupings the estimate leaves out (the first is the one the table's figures quote) and notes
    about what could not be used. Multiple inputs: one grouping per tag key with at least 2 values
    (every input must carry every key used); untagged, the clustering of :func:`cluster_inputs`. One
    input: its windows' domain tags, else :data:`WINDOW_GROUPS` contiguous runs of windows."""
    W = loads.num_windows
    prov = loads.provenance
    notes: list[str] = []
    win_inputs = prov.get("window_inputs")
    files = prov.get("inputs", [])
    if win_inputs is not None and len(win_inputs) == W and len(set(win_inputs)) >= 2:
        present = list(dict.fromkeys(win_inputs))
        fname = {i: Path(files[i]).name if i < len(files) else str(i) for i in present}
        tags, keys = input_tags(loads)
        out = []
        for key in keys:
            missing = [fname[i] for i in present if key not in tags[i]]
            if missing:
                raise InputError(f"tag '{key}': given for {len(present) - len(missing)} of {len(present)} planning "
                                 f"inputs; tag every input or none (missing: {', '.join(missing)})")
            values = {i: str(tags[i][key]) for i in present}
            names = list(dict.fromkeys(values[i] for i in present))
            if len(names) < 2:
                notes.append(f"tag {key}: one value ({names[0]}) among the planning inputs, nothing to leave out")
                continue
            ids = np.array([names.index(values[i]) for i in win_inputs], np.int64)
            src = "--group" if key == "group" else "the inputs' tags"
            out.append(Grouping(key, _what(key), ids, names,
                                f"leave out each {key} in turn ({len(names)} values, from {src})"))
        if out:
            return out, notes
        per = [loads.counts[[w for w, t in enumerate(win_inputs) if t == i]].sum(axis=0).astype(np.float64)
               for i in present]
        c = cluster_inputs(per, seed)
        members: dict[int, list[str]] = {}
        for j, g in enumerate(c.labels):
            members.setdefault(g, []).append(fname[present[j]])
        names = ["+".join(members[g]) for g in sorted(members)]
        ids = np.array([c.labels[present.index(t)] for t in win_inputs], np.int64)
        if c.resamples == 0:
            how = (f"leave out each input in turn (untagged; {len(present)} inputs: too few to cluster, each its "
                   "own group)")
        else:
            k = len(names)
            how = (f"untagged: clustered into {k} groups of related inputs (average linkage on the total-variation "
                   f"distance of per-layer expert shares, {k} groups by the best silhouette {c.silhouette:.2f}); "
                   f"confidence: {c.same:.0%} of {c.resamples} layer resamples find this grouping (agreement "
                   f"{c.stability:.2f}, adjusted Rand); if these are not the related inputs, tag them "
                   "(--tag PATH:dataset=NAME, --group) so whole datasets are left out")
        return [Grouping("cluster", "a new group of related inputs", ids, names, how)], notes
    dom = prov.get("window_domains")
    if dom is not None and len(dom) == W and len(set(dom)) >= 2:
        names = [str(x) for x in dict.fromkeys(dom)]
        ids = np.array([names.index(str(x)) for x in dom], np.int64)
        how = f"leave out each domain tag of the trace's windows in turn ({len(names)} values)"
        share = prov.get("window_domain_share")
        if share is not None and len(share) == W and float(np.mean(share)) < PURE_WINDOW_SHARE:
            how += (f"; optimistic: windows mix domains (a window's dominant tag holds {np.mean(share):.0%} of "
                    "its tokens on average), so the left-out tag's traffic is partly in the planning "
                    "scenarios; one input per workload gives a clean estimate")
        return [Grouping("domain", "a new domain", ids, names, how)], notes
    n = min(WINDOW_GROUPS, W)
    ids = (np.arange(W) * n) // W
    names = [window_span(np.flatnonzero(ids == g), "window") for g in range(n)]
    return [Grouping("windows", "a later stretch of this input", ids, names,
                     f"leave out each of {n} contiguous runs of windows in turn (one untagged input)")], notes


def scenarios(loads: Loads, seed: int = 0) -> tuple[np.ndarray, list[str], str]:
    """The first grouping of :func:`shift_groupings`: ``(group per window int [W], names, how)``."""
    g = shift_groupings(loads, seed)[0][0]
    return g.ids, list(g.names), g.how


def fold_windows(groupings: list[Grouping]) -> list[np.ndarray]:
    """The distinct left-out window sets of the groupings: one fold per group, a group two groupings
    share (the same windows) planned once."""
    seen: dict[tuple[int, ...], np.ndarray] = {}
    for g in groupings:
        for sc in range(len(g.names)):
            w = np.flatnonzero(g.ids == sc)
            seen.setdefault(tuple(w.tolist()), w)
    return list(seen.values())


# ---------------------------------------------------------------------------- layers and cost
def shift_layers(planning: Loads, num_folds: int, layers: int | str = "auto", seed: int = 0) -> np.ndarray:
    """The MoE layers (indices, ascending) the estimate plans and scores, from the layers with tokens:
    ``"all"`` every one; an int that many; ``"auto"`` as many as keep its work (folds x layers) within the
    main plan's (one plan of every layer), at least :data:`MIN_LAYERS`. A sample is drawn without
    replacement by ``seed``: the same command picks the same layers on any machine. Every policy places
    each layer from that layer's loads alone, so a sampled layer gets exactly the placement a plan of all
    layers gives it; sampling changes which layers the mean runs over (its standard error widens the
    ranges)."""
    active = np.flatnonzero(planning.counts.sum(axis=(0, 2)) > 0)
    if layers == "all":
        return active
    if layers == "auto":
        k = max(min(MIN_LAYERS, active.size), active.size // max(1, num_folds))
    else:
        k = int(layers)
        if k < 1:
            raise InputError(f"--shift-layers must be >= 1 or 'all', got {layers}")
    if k >= active.size:
        return active
    return np.sort(np.random.default_rng([seed, 4545]).choice(active, size=k, replace=False))


def cost_line(num_folds: int, layers: int, active: int, seed: int, policies: int) -> str:
    """The estimate's work, stated before it starts, against the main plan's."""
    plans = num_folds * layers
    sample = (f"all {active} MoE layers" if layers == active
              else f"{layers} of {active} MoE layers (drawn by --seed {seed})")
    ratio = plans / max(1, active)
    return (f"{num_folds} folds x {sample} = {plans} layer plans per policy ({policies} polic"
            f"{'y' if policies == 1 else 'ies'}), "
            f"{ratio:.2g}x the main plan's {active}" + ("" if ratio <= 1 else
                                                       f" (the least sample, {MIN_LAYERS} layers, costs more)"))


# ---------------------------------------------------------------------------- intervals
def rank_groups_needed(coverage: float = COVERAGE) -> int:
    """Fewest left-out groups whose order statistics give a distribution-free ``coverage`` interval."""
    a = round((1 - coverage) / 2, 9)
    n = 2
    while math.floor(a * (n + 1)) < 1:
        n += 1
    return n


@dataclass(frozen=True)
class LayerSample:
    """What a layer sample adds to the left-out groups' figures (:func:`group_figures`): ``k`` of ``active``
    MoE layers; ``interaction``, the group-by-layer interaction's mean square over the sample (two-way ANOVA,
    ``df = (D - 1)(k - 1)`` degrees of freedom), which estimates ``sigma2_gl``, the variance of one group's
    figure on one layer about its group and layer means."""
    interaction: float
    df: int
    k: int
    active: int

    @property
    def noise(self) -> float:
        """The variance the sample adds to each group's figure on its own, and a figure over every layer
        does not carry: ``sigma2_gl (1/k - 1/active)``."""
        return self.interaction * (1 / self.k - 1 / self.active)


PIVOT_GRID = 128  # chi-square quantiles per mean square in the pivot (128 x 128 points: widths within 0.1 %)


def pivot_half_width(between: float, D: int, sample: LayerSample, se: float) -> tuple[float, float]:
    """Half-width of the 80 % range for one more group's figure over every layer from a layer sample, and
    the spread it implies (the ``s`` of a Student-t range as wide: what :func:`narrower` reasons with): a
    generalized pivotal quantity (Weerahandi 1993; for a new group's mean in a random-effects model,
    Krishnamoorthy & Mathew 2009, ch. 6).

    Two-way model of the groups' per-layer figures: group effects of variance ``sigma2_g``, interaction
    terms of variance ``sigma2_gl``. The groups' k-layer figures vary by ``between`` (``D - 1`` df), whose
    expectation is ``theta_B = sigma2_g + sigma2_gl / k``; the interaction mean square estimates
    ``theta_I = sigma2_gl`` (``df`` df). A new group's figure over every layer, less the groups' mean on
    the sample, varies by ``sigma2_g (1 + 1/D) + sigma2_gl (1/active + 1/(D k)) + se^2``
    ``= theta_B (1 + 1/D) - theta_I (1/k - 1/active) + se^2``. Each pair of chi-square quantiles
    ``(U_B, U_I)`` on a fixed grid gives ``theta_B = (D - 1) between / U_B`` and ``theta_I = df
    interaction / U_I``, so a value of that variance (held at least at ``se^2``); the range is the 10 %
    and 90 % points of the normal mixture over the grid. Both mean squares' uncertainty enters; nothing is
    the larger of two noisy estimates, and the range never stops at the sample's ``se`` where the groups'
    figures differ by more than the sample's noise. With no noise to take out (``theta_I = 0``) it is the
    Student-t range."""
    p = (np.arange(PIVOT_GRID) + 0.5) / PIVOT_GRID
    tb = (D - 1) * between / special.chdtri(D - 1, 1 - p)  # chdtri: the upper-tail inverse
    ti = sample.df * sample.interaction / special.chdtri(sample.df, 1 - p)
    V = np.maximum(tb[:, None] * (1 + 1 / D) - (1 / sample.k - 1 / sample.active) * ti[None, :], 0.0) + se * se
    sd = np.sqrt(V).ravel()
    top = float(sd.max())
    if top == 0.0:
        return 0.0, 0.0
    sd = np.maximum(sd, 1e-12 * top)  # a point with no variance: at the mean
    target = (1 + COVERAGE) / 2
    q = optimize.brentq(lambda q: float(special.ndtr(q / sd).mean()) - target, 0.0, Z80 * top * 1.0001,
                        xtol=1e-9 * top)
    return q, math.sqrt(max((q / t80(D - 1)) ** 2 - se * se, 0.0) / (1 + 1 / D))


def prediction_interval(per: list[float], se: float = 0.0, sample: LayerSample | None = None) -> dict[str, Any]:
    """An 80 % prediction interval for one more group's figure from the ``D`` left-out groups' figures
    ``per`` (``se``: the layer sample's standard error of their mean; ``sample``: the layer sample, whose
    noise the spread of ``per`` carries and a figure over every layer does not: :func:`group_figures`):

    - ``D >= 9``: the order statistics ``[x_(k), x_(D+1-k)]``, ``k = floor(0.1 (D + 1))`` — at least 80 %
      for any distribution when the new group's figure is exchangeable with the left-out ones' (the
      rank argument behind split conformal and jackknife+, Barber et al. 2021), widened by ``z · se``
      (the sample's noise stays in: the order statistics are of the figures as sampled, a safe side);
    - ``3 <= D < 9``, every layer: ``mean ± t_{0.9, D-1} · sqrt(s² (1 + 1/D) + se²)`` — exactly 80 % when
      the groups' figures are normal (Student-t);
    - ``3 <= D < 9``, a layer sample: the generalized pivot of :func:`pivot_half_width` over the groups'
      spread and the sample's interaction mean square (the same range as Student-t's when the sample
      adds no noise);
    - ``D < 3``: none (the spread rests on one or two numbers).

    Clipped to [-1, 1] for differences, [0, 1] otherwise is the caller's business (``clip``)."""
    x = np.asarray(per, dtype=np.float64)
    D = x.size
    m = float(x.mean())
    out: dict[str, Any] = {"mean": m, "worst": float(x.min()), "per_group": [float(v) for v in x],
                           "layer_sample_se": float(se), "coverage": COVERAGE}
    if D < MIN_INTERVAL_GROUPS:
        out.update(range=None, interval=f"none: {D} left-out group{'s' if D != 1 else ''} (needs "
                                        f"{MIN_INTERVAL_GROUPS})")
        return out
    raw = float(x.std(ddof=1))
    pivot = sample is not None and sample.noise > 0
    if pivot:
        out["spread_sampled_layers"] = raw  # the sample's noise still in
    if D >= rank_groups_needed():
        k = math.floor(round((1 - COVERAGE) / 2, 9) * (D + 1))
        xs = np.sort(x)
        lo, hi = float(xs[k - 1]) - Z80 * se, float(xs[D - k]) + Z80 * se
        s = math.sqrt(max(raw * raw - sample.noise, 0.0)) if pivot else raw
        how = (f"order statistics {k} and {D + 1 - k} of {D} left-out groups: distribution-free, at least "
               f"{COVERAGE:.0%} when a new group is like the left-out ones")
    elif pivot:
        h, s = pivot_half_width(raw * raw, D, sample, se)
        lo, hi = m - h, m + h
        how = (f"generalized pivot over {D} left-out groups and {sample.k} of {sample.active} layers: "
               f"{COVERAGE:.0%} when their figures are normal (with {rank_groups_needed()} or more groups, a "
               "distribution-free range)")
    else:
        s = raw
        h = t80(D - 1) * math.sqrt(s * s * (1 + 1 / D) + se * se)
        lo, hi = m - h, m + h
        how = (f"Student-t over {D} left-out groups: {COVERAGE:.0%} when their figures are normal (with "
               f"{rank_groups_needed()} or more groups, a distribution-free range)")
    out.update(range=[lo, hi], interval=how, spread=s)
    return out


def _clip(r: dict[str, Any], lo: float, hi: float) -> dict[str, Any]:
    if r.get("range") is not None:
        r["range"] = [min(hi, max(lo, r["range"][0])), min(hi, max(lo, r["range"][1]))]
        r["width"] = r["range"][1] - r["range"][0]
    return r


def _groups_for(width: float, s: float, se: float, start: int) -> int | None:
    """Fewest groups (from ``start``, under 200) whose Student-t range at spread ``s`` is at most ``width``."""
    for n in range(start, 200):
        if 2 * t80(n - 1) * math.sqrt(s * s * (1 + 1 / n) + se * se) <= width:
            return n
    return None


def narrower(r: dict[str, Any], key: str) -> str | None:
    """What would narrow a range wider than :data:`WIDE` (or give one where there is none): more values
    of the tag, by how many; every layer instead of a sample; or nothing — when the left-out groups differ
    so much that any new one varies by more than that."""
    D = len(r["per_group"])
    word, one = {"cluster": ("groups of related inputs", "group"), "windows": ("runs of windows", "input"),
                 "dataset": ("datasets", "dataset"), "lang": ("languages", "language"),
                 "language": ("languages", "language"), "domain": ("domains", "domain"),
                 "group": ("groups", "group")}.get(key, (f"values of {key}", f"value of {key}"))
    if r.get("range") is None:
        return (f"{D} {word} only: an {COVERAGE:.0%} range needs {MIN_INTERVAL_GROUPS} (plan on inputs of "
                f"{MIN_INTERVAL_GROUPS - D} more {one})")
    width = r["range"][1] - r["range"][0]
    if width <= WIDE:
        return None
    s, se = r.get("spread", 0.0), r.get("layer_sample_se", 0.0)
    parts = [f"range {width:.2f} wide: the {D} left-out {word} differ (sd {s:.3f})"]
    if se > 0:
        parts.append(f"the layer sample adds ± {se:.3f} (every layer, --shift-layers all, removes it at more cost)")
    if 2 * Z80 * s > WIDE:
        parts.append(f"a new one varies that much however many are planned on (at best {2 * Z80 * s:.2f} wide), so "
                     f"no estimate from these inputs narrows it below {WIDE:.2f}: check online rebalancing (place "
                     "simulate --recommend)")
        return "; ".join(parts)
    n = _groups_for(WIDE, s, se, D + 1)
    if n is not None:
        parts.append(f"about {n} of them (same spread) would narrow it to {WIDE:.2f}")
    elif (n := _groups_for(WIDE, s, 0.0, D)) is not None:
        parts.append(f"every layer and about {n} of them (same spread) would narrow it to {WIDE:.2f}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------- the estimate
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


def _fold(job) -> tuple[float, np.ndarray, bool]:
    """One leave-one-out fold: plan the policy's problem, score it on the left-out windows' counts;
    (balancedness, per-layer balancedness ``[L]``, whether a time limit changed the plan)."""
    fn, name, problem, test = job
    placement = fn(problem)
    placement.check_model(problem.model, f"policy '{name}'")
    m = evaluate(placement, test, problem.rule, model=problem.model, cluster=problem.cluster)
    return m.balancedness, m.layer_balancedness, _time_limited(placement)


def _time_limited(placement: Placement) -> bool:
    summary = placement.provenance.get("params", {}).get("summary") or {}
    lim = summary.get("time_limited") or {}
    return any(lim.get(kind) for kind in ("skipped", "cut"))


class EstimateCut(Exception):
    """The time limit would have cut the estimate short: it is omitted, not computed differently."""


def _run_folds(jobs: list, parallel: int) -> list[tuple[float, np.ndarray, bool]]:
    if parallel <= 1:
        return [_fold(j) for j in jobs]
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    ex = ProcessPoolExecutor(max_workers=parallel, mp_context=ctx, initializer=worker_signals)
    try:
        done = list(ex.map(_fold, jobs))
    except BaseException:  # Ctrl-C, SIGTERM: stop the folds now (``with`` would wait for every one)
        for p in list((getattr(ex, "_processes", None) or {}).values()):
            p.terminate()
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown()
    return done


def shift_estimate(fn, name: str, loads: Loads, cluster: ClusterSpec, *, num_redundant: int, rule: str,
                   seed: int, options: dict[str, Any], groupings: list[Grouping], layers: np.ndarray,
                   time_limit: float | None = None) -> dict[str, Any]:
    """Leave out each group of every grouping in turn: plan ``fn`` on the other windows with exactly the
    main plan's settings (its options, and with a traffic objective the training windows' token sample)
    and score it on the left-out windows, on the MoE layers ``layers`` (:func:`shift_layers`). A group
    two groupings share is planned once. ``time_limit`` (seconds) bounds the work only: a fold the limit
    would cut raises :class:`EstimateCut` (the caller omits the estimate).

    Returns ``{"by_tag": {key: {"what", "groups", "how", "mean", "worst", "range": [lo, hi] | None,
    "interval", "per_group", "layer_sample_se", "coverage", "width", "narrower"}}, "layers": [...],
    "_layer_scores": {key: [groups, layers] per-layer balancedness}}`` plus the first grouping's figures at
    the top level (``mean``, ``worst``, ``mean_range``, ``per_scenario``, ``method``, ``layer_sample_se``)."""
    counts = loads.counts.astype(np.float64)
    L = counts.shape[1]
    layers = np.asarray(layers, dtype=np.int64)
    if layers.size < L:
        # the other layers carry no tokens: no policy plans on them and no score averages them in
        keep = np.zeros(L, dtype=bool)
        keep[layers] = True
        counts = counts * keep[None, :, None]
    opts = {**options, "pareto": None}  # the frontier is a report: it does not change the placement
    traffic = (options.get("objective") or "balance") != "balance"
    folds = fold_windows(groupings)
    cpus = os.cpu_count() or 1
    # An anytime policy (the optimizer) costs seconds per layer: its folds run side by side, one process
    # each (same placements: a layer's plan does not depend on the process it runs in).
    parallel = min(len(folds), cpus) if (is_anytime(name) and len(folds) > 1 and cpus > 1
                                         and opts.get("workers") in (None, 0)) else 1
    if parallel > 1:
        opts["workers"] = 1
    W = counts.shape[0]
    jobs = []
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
    try:
        done = _run_folds(jobs, parallel)
    except TimeLimitReached as e:
        raise EstimateCut(str(e)) from None
    if any(cut for _, _, cut in done):
        raise EstimateCut("a fold's plan was cut short by the time limit")
    result = {tuple(w.tolist()): d for w, d in zip(folds, done)}
    active = int((loads.counts.sum(axis=(0, 2)) > 0).sum())
    out: dict[str, Any] = {"by_tag": {}, "layers": [int(x) for x in layers], "_layer_scores": {}}
    for g in groupings:
        per_layer = np.array([result[tuple(np.flatnonzero(g.ids == sc).tolist())][1][layers]
                              for sc in range(len(g.names))])  # [groups, sampled layers]
        out["_layer_scores"][g.key] = per_layer
        r = group_figures(per_layer, active)
        r = _clip(r, 0.0, 1.0)
        r.update(what=g.what, groups=list(g.names), how=g.how, narrower=narrower(r, g.key))
        out["by_tag"][g.key] = r
    first = out["by_tag"][groupings[0].key]
    out.update(mean=first["mean"], worst=first["worst"], mean_range=first["range"], coverage=COVERAGE,
               per_scenario=first["per_group"], layer_sample_se=first["layer_sample_se"],
               method=groupings[0].how)
    return out


def layer_sample_of(per_layer: np.ndarray, active: int) -> tuple[float, LayerSample | None]:
    """The layer sample's two errors on the groups' figures (``per_layer``: ``[groups, sampled layers]``,
    NaN where a group has no tokens in a layer; a simple random sample of ``k`` of ``active`` layers,
    finite-population corrected; nothing with every layer):

    - ``se``, the error of the figures' common mean: the per-layer means over groups' spread / sqrt(k);
    - the :class:`LayerSample`: the group-by-layer interaction's mean square (two-way ANOVA of
      ``per_layer``, ``(D-1)(k-1)`` degrees of freedom). None where a group has no tokens in a sampled
      layer (the figures' own spread is used then, the safe side)."""
    per = np.nanmean(per_layer, axis=1)
    u = np.nanmean(per_layer, axis=0)
    k, D = u.size, per.size
    se = float(np.std(u, ddof=1) / math.sqrt(k) * math.sqrt(1 - k / active)) if 1 < k < active else 0.0
    if not (1 < k < active and D > 1 and np.isfinite(per_layer).all()):
        return se, None
    resid = per_layer - per[:, None] - u[None, :] + per_layer.mean()
    df = (D - 1) * (k - 1)
    return se, LayerSample(float((resid ** 2).sum() / df), df, k, active)


def group_figures(per_layer: np.ndarray, active: int) -> dict[str, Any]:
    """:func:`prediction_interval` of the left-out groups' figures, each the mean of its row of
    ``per_layer`` (``[groups, sampled layers]``), with the layer sample's errors (:func:`layer_sample_of`).
    The spread of the groups' k-layer figures is the between-group spread of their figures over every
    layer (what a new group's figure varies by: the written placement is scored on every layer) plus the
    sample's noise; the range takes the noise out through the pivot instead of counting it twice."""
    se, sample = layer_sample_of(per_layer, active)
    return prediction_interval([float(x) for x in np.nanmean(per_layer, axis=1)], se, sample)


def versus(a: dict[str, Any], b: dict[str, Any], active: int) -> dict[str, dict[str, Any]]:
    """Policy A minus policy B on each grouping both were estimated on, paired over the same left-out
    groups and layers: the mean difference and an 80 % prediction interval for the difference on one
    more group (:func:`prediction_interval` of the per-group differences), with what it says."""
    out = {}
    for key, la in a["_layer_scores"].items():
        lb = b["_layer_scores"].get(key)
        if lb is None or lb.shape != la.shape:
            continue
        r = _clip(group_figures(la - lb, active), -1.0, 1.0)
        r.pop("worst", None)
        rng = r.get("range")
        r["verdict"] = ("too few groups for a range" if rng is None else "ahead" if rng[0] > 0 else "behind" if rng[1] < 0
                        else "no clear winner")
        out[key] = r
    return out


def public(sh: dict[str, Any]) -> dict[str, Any]:
    """The estimate without its working arrays (what ``--json`` carries)."""
    return {k: v for k, v in sh.items() if not k.startswith("_")}


def time_needed(main_seconds: float, plans: int, active: int) -> float:
    """Rough seconds of an estimate of ``plans`` layer plans from its policy's main plan of ``active``
    layers (stated when a time limit leaves too little; what is computed never depends on it)."""
    return main_seconds * plans / max(1, active)

