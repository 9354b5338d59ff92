"""Pure routing measures, shared by the generator (``traces.synth`` solves its parameters against them)
and the statistics (``traces.stats`` reports them), so both mean the same thing by skew, CV and overlap;
then the statistics ``traces.stats`` computes from a pass's counts and token sample: per-layer skew and
CV, window drift, inter-layer affinity (lift and top-20 % coverage) and temporal locality.

**Affinity lift** of adjacent MoE layers ``(l, l+1)``, on the sample: how much better a token's experts at
``l`` predict its experts at ``l+1`` than popularity alone (see :func:`affinity_lift`); 1 = independence.
"""
from __future__ import annotations

import numpy as np

from moeplace.traces import jit


def max_over_mean(x: np.ndarray) -> np.ndarray:
    """max/mean along the last axis (0 where the mean is 0), in ``x``'s dtype: ``[...]``."""
    return x.max(axis=-1) / np.maximum(x.mean(axis=-1), 1e-30)


def coef_of_variation(x: np.ndarray) -> np.ndarray:
    """std/mean along the last axis (0 where the mean is 0), in ``x``'s dtype: ``[...]``."""
    return x.std(axis=-1) / np.maximum(x.mean(axis=-1), 1e-30)


def topk_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of shared ids between rows of ``a`` and ``b`` (int ``[..., k]``, ids distinct per row):
    float ``[...]``. By sorting each row pair's ``2k`` ids and counting equal neighbours (O(k log k) per
    row, not the ``k x k`` comparison)."""
    k = a.shape[-1]
    both = np.concatenate(np.broadcast_arrays(a, b), axis=-1)
    both.sort(axis=-1)
    return (both[..., 1:] == both[..., :-1]).sum(axis=-1) / k


AFFINITY_TOP_SHARE = 0.2
MAX_AFFINITY_PAIRS = 8  # adjacent layer pairs evaluated (evenly spaced); the statistic is a mean
AFFINITY_COVERAGE_PAIRS = 4  # of those, the first pairs whose top-20% coverage is reported


# ---------------------------------------------------------------------------- statistics of a trace
def skew_and_cv(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer max/mean and std/mean of ``counts [L, E]`` (NaN for a layer without load)."""
    c = counts.astype(np.float64)
    idle = c.mean(axis=-1) == 0
    return np.where(idle, np.nan, max_over_mean(c)), np.where(idle, np.nan, coef_of_variation(c))


def window_drift(counts: np.ndarray, chunk: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Drift between consecutive windows of ``counts [W, L, E]``: mean over layers of the Pearson
    correlation and of the Jensen-Shannon divergence (natural log, in [0, ln 2]) of the load vectors.
    Returns two float arrays ``[W-1]``; layers without load in either window are skipped. Computed
    ``chunk`` window pairs at a time (the float temporaries of a whole long trace would be large; every
    reduction is per (window, layer) row, so the result does not depend on ``chunk``)."""
    if counts.shape[0] < 2:
        return np.zeros(0), np.zeros(0)
    corrs, jss = [], []
    for w0 in range(0, counts.shape[0] - 1, chunk):
        c = counts[w0:w0 + chunk + 1].astype(np.float64)
        a, b = c[:-1], c[1:]
        ac = a - a.mean(axis=-1, keepdims=True)
        bc = b - b.mean(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = (ac * bc).sum(-1) / np.sqrt((ac**2).sum(-1) * (bc**2).sum(-1))
            p = a / a.sum(-1, keepdims=True)
            q = b / b.sum(-1, keepdims=True)
            m = (p + q) / 2

            def kl(x, y):
                return np.where(x > 0, x * np.log(np.where(x > 0, x, 1) / np.where(y > 0, y, 1)), 0.0).sum(-1)

            js = (kl(p, m) + kl(q, m)) / 2
            corrs.append(np.nanmean(corr, axis=1))
            jss.append(np.nanmean(js, axis=1))
    return np.concatenate(corrs), np.concatenate(jss)


def top_share(counts: np.ndarray, share: float = AFFINITY_TOP_SHARE) -> float:
    """Share of the total held by the largest ``share`` fraction of cells of ``counts`` (any shape)."""
    flat = counts.ravel()
    total = flat.sum()
    if total == 0:
        return float("nan")
    m = max(1, round(share * flat.size))
    if np.issubdtype(flat.dtype, np.integer) and 0 <= flat.min() and flat.max() <= 4 * flat.size:
        # small counts (co-activation cells): the top-m sum from the histogram of values, exact; a
        # partition of a mostly-zero array degrades to ~100 ms for 896^2 cells
        hist = np.bincount(flat)
        vals = np.arange(len(hist))[::-1]
        cum = np.cumsum(hist[::-1])  # cells holding a value >= vals[i]
        i = int(np.searchsorted(cum, m))  # the value class that the m-th largest cell falls in
        top = int((vals[:i] * hist[::-1][:i]).sum()) + (m - (int(cum[i - 1]) if i else 0)) * int(vals[i])
        return float(top / total)
    return float(np.partition(flat, flat.size - m)[flat.size - m:].sum() / total)


def pair_counts(src: np.ndarray, dst: np.ndarray, num_experts: int) -> np.ndarray:
    """Co-activation counts ``[E, E]`` over all ``k x k`` pairs of rows of ``src``/``dst`` (int ``[N, k]``,
    -1 = missing)."""
    ok = (src >= 0).all(axis=1) & (dst >= 0).all(axis=1)
    s, d = src[ok].astype(np.int64), dst[ok].astype(np.int64)
    idx = (s[:, :, None] * num_experts + d[:, None, :]).ravel()
    return np.bincount(idx, minlength=num_experts * num_experts).reshape(num_experts, num_experts)


def _predict_hits(counts: np.ndarray, src: np.ndarray, dst: np.ndarray, block: int = 256) -> float:
    """Mean share of ``dst``'s top-k found among the top-k experts scored by ``sum_{e in src} counts[e]``
    (``src``/``dst`` int ``[n, k]``, ``counts`` ``[E, E]``). Ties go to the lower expert id: each score
    becomes the integer ``score * 2^b + (2^b - 1 - e)`` (``2^b >= E``), so the k largest keys are one set
    whatever selection algorithm numpy runs on the machine (its SIMD paths order equal scores differently)."""
    k = dst.shape[1]
    E = counts.shape[1]
    shift = max(1, (E - 1).bit_length())
    top_score = int(counts.max(initial=0)) * src.shape[1]
    dtype = np.int32 if (top_score + 1) << shift < 2 ** 31 else np.int64
    c = counts.astype(dtype) << shift  # scores in the high bits, the tie-break in the low ones
    tie = ((1 << shift) - 1 - np.arange(E)).astype(dtype)
    hits = 0.0
    compiled = jit.native()
    if compiled is not None and len(src):
        # the same per-row hit counts from C (one pass over E per row, no [block, E] temporaries), summed
        # as shares block by block like the numpy loop below: the same float
        found = np.empty(len(src), np.int64)
        compiled.topk_hits(np.ascontiguousarray(c), np.ascontiguousarray(tie),
                           np.ascontiguousarray(src, np.int32), np.ascontiguousarray(dst, np.int32), found)
        for b0 in range(0, len(src), block):
            hits += (found[b0:b0 + block] / k).sum()
        return float(hits / max(len(src), 1))
    for b0 in range(0, len(src), block):
        s = src[b0:b0 + block]
        score = c[s[:, 0]]  # sum of the rows of the token's experts, one slot at a time (cache-sized)
        for j in range(1, s.shape[1]):
            score += c[s[:, j]]
        score += tie
        # the keys are distinct: the top k are the keys at or above the k-th largest, one partition (no
        # indices) finds it, and a dst expert is a hit when its key is among them; the per-row shares
        # are those of topk_overlap(top k, dst), summed in the same order
        kth = np.partition(score, E - k, axis=1)[:, E - k]
        found = np.take_along_axis(score, dst[b0:b0 + block], axis=1) >= kth[:, None]
        hits += (found.sum(axis=1) / k).sum()
    return float(hits / max(len(src), 1))


def affinity_lift(samples: np.ndarray, num_experts: int, seed: int = 0, max_pairs: int = MAX_AFFINITY_PAIRS,
                  max_tokens: int = 2048, coverage_pairs: int = AFFINITY_COVERAGE_PAIRS
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inter-layer affinity of adjacent MoE layers on ``samples [N, L, k]`` (-1 = missing), for up to
    ``max_pairs`` evenly spaced pairs ``(l, l+1)``.

    Lift: learn co-activation counts ``C[e, e']`` on half of the sampled tokens, predict each held-out
    token's top-k at ``l+1`` as the k best of ``sum over its experts e at l of C[e]``, and divide the hit rate
    by that of the same predictor learned with layer ``l+1`` taken from a permuted token (same marginals
    and sample size, no affinity: a popularity predictor). 1 = the experts at ``l`` tell nothing about
    ``l+1`` beyond popularity.
    Coverage (the published "top 20% of pairs cover X%" figure, docs/design.md Sources §4): share of all ``k x k`` pair observations in the
    top 20% of the ``E^2`` cells, actual vs permuted, on the first ``coverage_pairs`` pairs (NaN after).
    Returns ``(pairs, lift, coverage, coverage_permuted)``, arrays ``[P]``."""
    jobs = affinity_jobs(samples, seed, max_pairs, max_tokens)
    results = [affinity_pair(samples[:, li:li + 2], num_experts, train, test, perm, i < coverage_pairs)
               for i, (li, train, test, perm) in enumerate(jobs)]
    return affinity_arrays(jobs, results)


def affinity_jobs(samples: np.ndarray, seed: int = 0, max_pairs: int = MAX_AFFINITY_PAIRS,
                  max_tokens: int = 2048) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """The random part of :func:`affinity_lift`, drawn in pair order: per evaluated pair ``(l, l+1)`` of
    ``samples [N, L, k]``, ``(l, train, test, perm)`` (token indices; empty ``train`` when the pair has
    too few complete tokens). The pairs are then independent (:func:`affinity_pair`)."""
    n, num_layers, _ = samples.shape
    if n < 4 or num_layers < 2:
        return []
    pairs = np.unique(np.linspace(0, num_layers - 2, min(max_pairs, num_layers - 1)).round().astype(np.int64))
    rng = np.random.default_rng([seed, 0xAFF])
    jobs = []
    empty = np.zeros(0, np.int64)
    for li in pairs:
        src_all, dst_all = samples[:, li], samples[:, li + 1]
        ok = np.flatnonzero((src_all >= 0).all(axis=1) & (dst_all >= 0).all(axis=1))
        ok = rng.permutation(ok)[:max_tokens]
        half = len(ok) // 2
        if half < 2:
            jobs.append((int(li), empty, empty, empty))
            continue
        train, test = ok[:half], ok[half:]
        jobs.append((int(li), train, test, rng.permutation(train)))
    return jobs


def affinity_pair(two_layers: np.ndarray, num_experts: int, train: np.ndarray, test: np.ndarray,
                  perm: np.ndarray, coverage: bool) -> tuple[float, float, float]:
    """Lift, coverage and permuted coverage (NaN unless ``coverage``) of one pair, from the sampled tokens'
    experts at its two layers ``two_layers [N, 2, k]`` and the token split of :func:`affinity_jobs`."""
    if len(train) < 2:
        return np.nan, np.nan, np.nan
    src_all, dst_all = two_layers[:, 0], two_layers[:, 1]
    c_real = pair_counts(src_all[train], dst_all[train], num_experts)
    c_perm = pair_counts(src_all[train], dst_all[perm], num_experts)
    hit_perm = _predict_hits(c_perm, src_all[test], dst_all[test])
    hit_real = _predict_hits(c_real, src_all[test], dst_all[test])
    lift = hit_real / hit_perm if hit_perm > 0 else np.nan
    if coverage:
        return lift, top_share(c_real), top_share(c_perm)
    return lift, np.nan, np.nan


def affinity_arrays(jobs, results) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not jobs:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0)
    lift, cov, cov_perm = (np.array(x) for x in zip(*results))
    return np.array([li for li, *_ in jobs], np.int64), lift, cov, cov_perm


def token_locality(samples: np.ndarray, rid: np.ndarray, pos: np.ndarray) -> tuple[float, int]:
    """Mean top-k overlap of sampled tokens at positions p and p+1 of the same request (over layers
    present in both). Returns ``(overlap, number of token pairs)``; NaN when there is no pair."""
    if len(rid) < 2:
        return float("nan"), 0
    nxt = (rid[1:] == rid[:-1]) & (pos[1:] == pos[:-1] + 1)
    i = np.flatnonzero(nxt)
    if not len(i):
        return float("nan"), 0
    a, b = samples[i], samples[i + 1]
    ok = (a[..., 0] >= 0) & (b[..., 0] >= 0)
    ov = topk_overlap(a, b)
    return float(ov[ok].mean()), len(i)
