"""Streaming statistics of a routing trace: the Loads contract ``[windows, L, E]`` plus what placement
needs to know about the routing (skew, drift, inter-layer affinity, temporal locality, domain mix) and
a seeded token sample for co-activation objectives.

One pass over the Parquet row groups (pyarrow): each row group is decoded and reduced to a partial
(its windows' counts, requests, domain rows, sample candidates) by one of ``workers`` forked processes
— one per core for big traces, so decoding and counting run on every core without sharing a GIL — and
the partials merge in trace order, so the result does not depend on the number of workers. Memory is
bounded by a few row groups per process, the per-window counts and the sample — never by the
trace. **Windows** are by tokens in file (step) order: window ``w`` holds rows
``[w * W * L, (w + 1) * W * L)`` (``W`` = window tokens, ``L`` = MoE layers), i.e. exactly ``W`` tokens
when each token has its ``L`` rows, as ``place trace synth`` and captures write them.

**Sample**: a token is sampled by a seeded hash of ``(request_id, position // 2)`` — the ``N`` smallest
hashes win (a bottom-N sketch, one pass, no token count needed up front) — so sampled tokens come with
their request neighbour, which gives the temporal-locality statistic (top-k overlap of positions
``p`` and ``p + 1``) for free.

**Affinity lift** of adjacent MoE layers ``(l, l+1)``, on the sample: how much better a token's experts at
``l`` predict its experts at ``l+1`` than popularity alone (see :func:`affinity_lift`); 1 = independence.
"""
from __future__ import annotations

import itertools
import math
import mmap
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from foundation.errors import InputError
from foundation.model import ModelSpec
from traces.loads import Loads
from traces.measures import coef_of_variation, max_over_mean, topk_overlap
from traces.validate import (
    Detect,
    ProblemFound,
    RowGroup,
    RowOrder,
    Trace,
    _Raise,
    check_lists,
    check_row_group,
    corrupt_group,
    open_trace,
    read_columns,
)

DEFAULT_WINDOW_TOKENS = 4096
DEFAULT_SAMPLE_TOKENS = 4096
AFFINITY_TOP_SHARE = 0.2
MAX_AFFINITY_PAIRS = 8  # adjacent layer pairs evaluated (evenly spaced); the statistic is a mean
AFFINITY_COVERAGE_PAIRS = 4  # of those, the first pairs whose top-20% coverage is reported
PARALLEL_MIN_SELECTIONS = 16_000_000  # smaller traces are read in-process (forking costs ~50 ms)
_PASS_IDS = itertools.count()

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M3 = np.uint64(0xBF58476D1CE4E5B9)


@dataclass(frozen=True, eq=False)
class TraceStats:
    """Statistics of one trace. Arrays: ``layer_skew``/``layer_cv`` float ``[L]`` (whole trace);
    ``drift_corr``/``drift_js`` float ``[W-1]`` (consecutive windows, mean over layers);
    ``affinity_pairs`` int ``[P]`` (index ``l`` of pair ``(l, l+1)``), ``affinity_lift``,
    ``affinity_coverage``, ``affinity_coverage_shuffled`` float ``[P]``; ``domain_tokens`` float
    ``[W, D]``."""

    path: str
    loads: Loads
    num_rows: int
    num_tokens: int
    num_requests: int
    domains: tuple[str, ...]
    domain_tokens: np.ndarray
    layer_skew: np.ndarray
    layer_cv: np.ndarray
    drift_corr: np.ndarray
    drift_js: np.ndarray
    affinity_pairs: np.ndarray
    affinity_lift: np.ndarray
    affinity_coverage: np.ndarray
    affinity_coverage_shuffled: np.ndarray
    locality: float
    locality_pairs: int
    bytes_on_disk: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> ModelSpec:
        return self.loads.model

    @property
    def num_selections(self) -> int:
        return self.num_rows * self.model.top_k

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (no per-window loads)."""
        def f(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

        samples = self.loads.samples
        return {
            "path": self.path, "model": self.model.name, "rows": self.num_rows, "tokens": self.num_tokens,
            "selections": self.num_selections, "requests": self.num_requests,
            "windows": self.loads.num_windows, "window_tokens": self.loads.window_tokens,
            "domains": list(self.domains),
            "domain_mix_per_window": np.round(self.domain_tokens / np.maximum(
                self.domain_tokens.sum(axis=1, keepdims=True), 1), 4).tolist(),
            "skew_median": f(float(np.median(self.layer_skew))), "skew_max": f(float(self.layer_skew.max())),
            "skew_per_layer": np.round(self.layer_skew, 3).tolist(),
            "cv_median": f(float(np.median(self.layer_cv))), "cv_per_layer": np.round(self.layer_cv, 3).tolist(),
            "drift_corr_mean": f(float(self.drift_corr.mean())) if len(self.drift_corr) else None,
            "drift_js_mean": f(float(self.drift_js.mean())) if len(self.drift_js) else None,
            "drift_corr": np.round(self.drift_corr, 4).tolist(), "drift_js": np.round(self.drift_js, 5).tolist(),
            "affinity_lift_mean": (f(float(np.nanmean(self.affinity_lift)))
                                   if np.isfinite(self.affinity_lift).any() else None),
            "affinity_top20_coverage_mean": (f(float(np.nanmean(self.affinity_coverage)))
                                             if np.isfinite(self.affinity_coverage).any() else None),
            "affinity_top20_coverage_permuted_mean": (f(float(np.nanmean(self.affinity_coverage_shuffled)))
                                                      if np.isfinite(self.affinity_coverage).any() else None),
            "affinity_pairs": self.affinity_pairs.tolist(),
            "affinity_lift": np.round(self.affinity_lift, 4).tolist(),
            "locality": f(self.locality), "locality_pairs": self.locality_pairs,
            "sample_tokens": 0 if samples is None else int(samples.shape[0]),
            "bytes_on_disk": self.bytes_on_disk,
            "bytes_per_selection": self.bytes_on_disk / max(self.num_selections, 1),
            "seconds": self.seconds, "selections_per_s": self.num_selections / max(self.seconds, 1e-9),
            **self.extra,
        }


# ---------------------------------------------------------------------------- pure statistics
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
    (``src``/``dst`` int ``[n, k]``, ``counts`` ``[E, E]``)."""
    k = dst.shape[1]
    c = counts.astype(np.float32)
    hits = 0.0
    for b0 in range(0, len(src), block):
        score = c[src[b0:b0 + block]].sum(axis=1)
        pred = np.argpartition(-score, k - 1, axis=1)[:, :k]
        hits += topk_overlap(pred, dst[b0:b0 + block]).sum()
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
    return _affinity_arrays(jobs, results)


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


def _affinity_arrays(jobs, results) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not jobs:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0)
    lift, cov, cov_perm = (np.array(x) for x in zip(*results))
    return np.array([li for li, *_ in jobs], np.int64), lift, cov, cov_perm


def _token_hash(request_id: np.ndarray, pair: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit mix of (request id, position // 2) per row (splitmix64 finalizer)."""
    with np.errstate(over="ignore"):
        h = request_id.astype(np.uint64) * _M1 ^ (pair.astype(np.uint64) + np.uint64(seed & 0xFFFFFFFF)) * _M2
        h ^= h >> np.uint64(31)
        h *= _M3
        h ^= h >> np.uint64(29)
    return h


# ---------------------------------------------------------------------------- the streaming pass
def _sample_candidates(rid, pos, li, experts, seed: int, threshold: int,
                       win: np.ndarray | int = 0) -> tuple[np.ndarray, ...] | None:
    """The rows of a batch whose token hash is under the sketch's threshold: ``(hash, request id,
    position, MoE layer index, experts, window)``, or None. ``win``: the window of every row (``[n]``
    or one for all)."""
    h = _token_hash(rid, pos >> 1, seed)
    sel = np.flatnonzero(h <= np.uint64(threshold))
    if not len(sel):
        return None
    w = np.broadcast_to(np.asarray(win, dtype=np.int64), rid.shape)[sel]
    return (h[sel], rid[sel].astype(np.int64), pos[sel].astype(np.int64), li[sel].astype(np.int16),
            experts[sel], w)


class _Sampler:
    """Bottom-N sketch of tokens by hash, over rows streamed in any order."""

    def __init__(self, sample_tokens: int, expected_tokens: int, seed: int) -> None:
        self.n = sample_tokens
        self.seed = seed
        # keep rows whose hash falls under a threshold that admits N tokens plus a margin of ~8 standard
        # deviations (tokens come in units of 2), and keep the N smallest at the end. ``expected_tokens``
        # (rows / L) never exceeds the trace's tokens, so fewer than N are admitted only by a > 8-sigma draw.
        frac = min(1.0, (sample_tokens + 8 * math.sqrt(2 * sample_tokens) + 64) / max(expected_tokens, 1))
        self.threshold = np.uint64(min(2**64 - 1, int(frac * 2**64))) if frac < 1 else np.uint64(2**64 - 1)
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.kept = 0

    def add(self, rid, pos, li, experts, win: np.ndarray | int = 0) -> None:
        """Keep the candidate rows of a batch (request ids, positions, MoE layer indices ``[n]``,
        experts ``[n, k]``, windows ``[n]`` or one for all)."""
        if self.n > 0:
            self.add_candidates(_sample_candidates(rid, pos, li, experts, self.seed, int(self.threshold), win))

    def add_candidates(self, part: tuple[np.ndarray, ...] | None) -> None:
        """Keep rows already selected by :func:`_sample_candidates` (e.g. in a worker process)."""
        if part is not None:
            self.parts.append(part)
            self.kept += len(part[0])

    def result(self, num_layers: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``samples`` int32 ``[N, L, k]`` (-1 where a layer is missing) in (request, position) order,
        plus the request ids, positions and windows ``[N]`` of the sampled tokens (a token's window is
        that of its first row: planning and held-out samples must not share a token)."""
        if not self.parts:
            z = np.zeros(0, np.int64)
            return np.full((0, num_layers, k), -1, np.int32), z, z, z
        h, rid, pos, li, ex, win = (np.concatenate(x) for x in zip(*self.parts))
        # distinct tokens by (request, position); their unit hash decides; the N smallest units win
        if len(rid) and rid.min() >= 0 and rid.max() < 2**32 and pos.min() >= 0 and pos.max() < 2**31:
            # one stable sort of an order-preserving combined key: the permutation of the lexsort below
            order = np.argsort((rid << 31) | pos, kind="stable")
        else:
            order = np.lexsort((pos, rid))
        rid, pos, li, ex, h, win = rid[order], pos[order], li[order], ex[order], h[order], win[order]
        new = np.ones(len(rid), bool)
        new[1:] = (rid[1:] != rid[:-1]) | (pos[1:] != pos[:-1])
        tok = np.cumsum(new) - 1
        tok_h = h[new]
        num_tokens = len(tok_h)
        keep_tok = np.ones(num_tokens, bool)
        if num_tokens > self.n:
            # the N tokens with the smallest unit hashes (a unit = positions 2i, 2i+1 of a request)
            first = np.lexsort((pos[new], tok_h))[: self.n]
            keep_tok[:] = False
            keep_tok[first] = True
        new_id = np.cumsum(keep_tok) - 1
        rows = keep_tok[tok]
        out = np.full((int(keep_tok.sum()), num_layers, k), -1, np.int32)
        out[new_id[tok[rows]], li[rows]] = ex[rows]
        tok_win = np.full(num_tokens, np.iinfo(np.int64).max)
        np.minimum.at(tok_win, tok, win)
        return out, rid[new][keep_tok], pos[new][keep_tok], tok_win[keep_tok]


def _locality(samples: np.ndarray, rid: np.ndarray, pos: np.ndarray) -> tuple[float, int]:
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


@dataclass(frozen=True)
class _PassSpec:
    """What every row-group job of one pass needs (inherited by forked workers, never pickled)."""

    trace: Trace
    jobs: tuple[tuple[int, int, int], ...]  # (file index, row group, first row of the group in the trace)
    extra_columns: tuple[str, ...]  # decoded beyond what the gate's row checks read
    model: ModelSpec
    rows_per_window: int
    num_windows: int
    sample_tokens: int
    sample_threshold: int
    seed: int
    # [workers, windows, L, E] in shared memory: worker i adds its row groups' counts into [i] (no transfer)
    shared_counts: np.ndarray | None = None


@dataclass
class _Partial:
    """The reduction of one row group: counts of the windows ``[w0, w0 + len(counts))`` it touches
    (int64 ``[nw, L, E]``; None when added to the worker's shared counts), its distinct request ids, its domain names (dictionary order) with rows per
    (name, window) ``[D_g, num_windows]``, and its sample candidates (hash, request, position, MoE layer
    index, experts) — everything merges by addition / union / concatenation in job order."""

    w0: int
    counts: np.ndarray | None
    requests: np.ndarray
    domain_names: list[str]
    domain_rows: np.ndarray | None
    sample: tuple[np.ndarray, ...] | None
    edge: Any = None  # the row group's order facts for the gate's cross-group checks (traces.validate)


_PASSES: dict[int, _PassSpec] = {}  # pass id -> spec; forked workers inherit it
_WORKER_OPEN: dict[Path, pq.ParquetFile] = {}  # in a forked worker (lives for one pass): files it opened
_WORKER_SLOT: list[int | None] = [None]  # in a forked worker: its index into the pass's shared counts


def _init_worker(counter) -> None:
    with counter.get_lock():
        _WORKER_SLOT[0] = counter.value
        counter.value += 1
    _keep_freed_memory()


def _keep_freed_memory() -> None:
    """In a (short-lived) worker: let glibc keep freed memory for the next row group's arrays of the same
    sizes instead of returning it to the OS — each re-fault zeroes fresh (huge) pages again."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: do not trim the heap top
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: arrays up to 32 MB come from the heap, reused
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _open_file(f: Path, opened: dict[Path, pq.ParquetFile]) -> pq.ParquetFile:
    pf = opened.get(f)
    if pf is None:
        try:
            dict_cols = ["domain"] if "domain" in pq.read_schema(f).names else None
            # memory-mapped: pages are decoded straight from the page cache (no read() copies)
            pf = pq.ParquetFile(f, read_dictionary=dict_cols, memory_map=True)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{f}: not a readable Parquet file: truncated or corrupt ({exc})") from None
        opened[f] = pf
    return pf


COUNT_CHUNK_ROWS = 1 << 13  # rows per bincount: the (row, expert) index of a chunk (1 MB for top-16) stays in L2
_INDEX_BUFFER = [np.empty(0, np.int64)]  # per process, reused for every chunk


def _index_buffer(size: int) -> np.ndarray:
    if _INDEX_BUFFER[0].size < size:
        _INDEX_BUFFER[0] = np.empty(size, np.int64)
    return _INDEX_BUFFER[0][:size]


def _count(base: np.ndarray, experts: np.ndarray, counts: np.ndarray) -> None:
    """``counts += bincount(base[:, None] + experts)``, ``COUNT_CHUNK_ROWS`` rows at a time (a whole row
    group's int64 index would be ~100 MB of cold memory per pass; a chunk's is reused hot)."""
    n, k = experts.shape
    chunk = min(n, COUNT_CHUNK_ROWS)
    buf = _index_buffer(chunk * k).reshape(chunk, k)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        idx = buf[:e - s]
        np.add(base[s:e, None], experts[s:e], out=idx, casting="unsafe")
        counts += np.bincount(idx.reshape(-1), minlength=len(counts))


LIST_COLUMNS = ("expert_ids", "gate_weights")
BATCH_ROWS = 1 << 16  # rows per decoded batch of the list columns: their buffers stay in cache, reused


def _reduce_group(spec: _PassSpec, j: int, opened: dict[Path, pq.ParquetFile]) -> _Partial:
    """Decode row group ``j`` of the pass, run the gate's row checks on it (``traces.validate``: the first
    problem raises) and reduce it to a :class:`_Partial`; ``opened`` caches the pass's open files.

    The list columns (16 values a row: ~90 % of the bytes) are decoded in batches of ``BATCH_ROWS`` rows,
    checked and counted batch by batch: the decoder's buffers and the count's index stay in cache and are
    reused (decoding the whole group at once costs about twice as much, in page faults and cache misses).
    Batch-wise checks only *detect* a problem; then the row group is decoded and checked whole, which
    raises the gate's first problem in the gate's order (:func:`_reduce_checked`)."""
    fi, rg, _ = spec.jobs[j]
    trace = spec.trace
    pf = _open_file(trace.files[fi].path, opened)
    cols = read_columns(trace, fi, rg, pf, spec.extra_columns)
    lists = [c for c in cols if c in LIST_COLUMNS]
    try:
        table = pf.read_row_group(rg, columns=[c for c in cols if c not in LIST_COLUMNS], use_threads=False)
        group = check_row_group(Detect(), trace, fi, rg, table, lists=False)
        if "expert_ids" not in lists:
            raise ProblemFound("expert_ids")

        def batches() -> Iterator[np.ndarray]:
            row = 0
            for batch in pf.iter_batches(BATCH_ROWS, row_groups=[rg], columns=lists, use_threads=False):
                yield check_lists(Detect(), trace, fi, rg, batch, row)
                row += batch.num_rows
            if row != group.n:
                raise ProblemFound("corrupt")

        return _reduce_rows(spec, j, table, group, batches())
    except (ProblemFound, pa.ArrowException, OSError, ValueError, KeyError):
        return _reduce_checked(spec, j, pf)


def _reduce_checked(spec: _PassSpec, j: int, pf: pq.ParquetFile) -> _Partial:
    """:func:`_reduce_group` on the whole row group at once, checked by the gate's reporting sink."""
    fi, rg, _ = spec.jobs[j]
    trace = spec.trace
    try:
        table = pf.read_row_group(rg, columns=read_columns(trace, fi, rg, pf, spec.extra_columns),
                                  use_threads=False)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise InputError(corrupt_group(trace.files[fi].path, rg, exc)) from None
    group = check_row_group(_Raise(), trace, fi, rg, table)
    return _reduce_rows(spec, j, table, group, iter([group.experts]))


def _reduce_rows(spec: _PassSpec, j: int, table: pa.Table, group: RowGroup, experts: Iterator[np.ndarray]
                 ) -> _Partial:
    """The partial of checked row group ``j``: ``group`` holds its per-row columns, ``experts`` yields its
    expert ids ``[m, k]`` in consecutive batches of rows."""
    row0 = spec.jobs[j][2]
    model = spec.model
    num_layers, num_experts = model.num_moe_layers, model.num_experts
    n = group.n
    rpw = spec.rows_per_window
    w0 = row0 // rpw
    if n == 0:
        return _Partial(w0, np.zeros((0, num_layers, num_experts), np.int64), np.zeros(0, np.int64), [], None, None,
                        group.edge)
    li, rid, pos = group.layer_idx, group.request_id, group.position
    # one bincount over (window, layer, expert) for the whole row group
    w1 = (row0 + n - 1) // rpw
    bins_per_window = num_layers * num_experts
    if w0 == w1:
        base = li * num_experts
        win: np.ndarray | int = w0
    else:
        win = np.arange(row0, row0 + n, dtype=np.int64) // rpw
        base = (win - w0).astype(np.int32) * bins_per_window + li * num_experts
    counts = np.zeros((w1 - w0 + 1) * bins_per_window, np.int64)
    samples = []
    s = 0
    for ids in experts:
        e = s + len(ids)
        _count(base[s:e], ids, counts)
        if spec.sample_tokens > 0:
            cand = _sample_candidates(rid[s:e], pos[s:e], li[s:e], ids, spec.seed, spec.sample_threshold,
                                      win if isinstance(win, int) else win[s:e])
            if cand is not None:
                samples.append(cand)
        s = e
    if s != n:  # a reader that yields fewer rows than the group holds: nothing to count on
        raise ProblemFound("corrupt")
    sample = tuple(np.concatenate(x) for x in zip(*samples)) if samples else None
    counts = counts.reshape(w1 - w0 + 1, num_layers, num_experts)
    if spec.shared_counts is not None and _WORKER_SLOT[0] is not None:
        spec.shared_counts[_WORKER_SLOT[0], w0:w1 + 1] += counts
        counts = None
    runs = np.flatnonzero(rid[1:] != rid[:-1]) + 1
    requests = np.unique(rid[np.concatenate([[0], runs])])
    names: list[str] = []
    per = None
    if "domain" in spec.extra_columns:
        dcol = table.column("domain").combine_chunks()
        if isinstance(dcol, pa.DictionaryArray):
            codes = dcol.indices.to_numpy(zero_copy_only=False)
            names = dcol.dictionary.to_pylist()
        else:
            enc = dcol.dictionary_encode()
            codes, names = enc.indices.to_numpy(zero_copy_only=False), enc.dictionary.to_pylist()
        win_rows = np.arange(row0, row0 + n, dtype=np.int64) // rpw
        gd = codes.astype(np.int64) * spec.num_windows + win_rows
        per = np.bincount(gd, minlength=len(names) * spec.num_windows).reshape(-1, spec.num_windows)
    return _Partial(w0, counts, requests, names, per, sample, group.edge)


def _reduce_group_by_id(pass_id: int, j: int) -> _Partial:
    return _reduce_group(_PASSES[pass_id], j, _WORKER_OPEN)


def _num_workers(workers: int | None, num_jobs: int, total_selections: int) -> int:
    """Worker processes of a pass: ``workers`` if given, else one per usable core when the trace is big
    enough to pay for the forks (>= ~16 M selections), else 1 (in this process)."""
    if workers is not None and workers < 1:
        raise InputError(f"workers must be >= 1, got {workers}")
    if "fork" not in mp.get_all_start_methods() or mp.current_process().daemon:
        return 1  # workers inherit the pass by fork; a daemonic process may not have children
    if workers is not None:
        return min(workers, max(num_jobs, 1))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if total_selections < PARALLEL_MIN_SELECTIONS:
        return 1
    return max(1, min(cores, num_jobs))


def _partials(spec: _PassSpec, pool: ProcessPoolExecutor | None, workers: int) -> Iterator[_Partial]:
    """The row groups' partials in job (= trace) order: in this process, or from the ``workers`` processes
    of ``pool`` with at most ``2 * workers`` results in flight (memory stays bounded by row groups)."""
    num_jobs = len(spec.jobs)
    if pool is None:
        opened: dict[Path, pq.ParquetFile] = {}
        for j in range(num_jobs):
            yield _reduce_group(spec, j, opened)
        return
    pass_id = next(_PASS_IDS)
    _PASSES[pass_id] = spec
    try:
        ahead = 2 * workers
        futures = deque(pool.submit(_reduce_group_by_id, pass_id, j) for j in range(min(ahead, num_jobs)))
        for j in range(num_jobs):
            part = futures.popleft().result()
            if j + ahead < num_jobs:
                futures.append(pool.submit(_reduce_group_by_id, pass_id, j + ahead))
            yield part
    finally:
        _PASSES.pop(pass_id, None)


@contextmanager
def _worker_pool(workers: int, num_jobs: int):
    """A pool of ``workers`` forked processes, or None (work in this process). Fork: the workers
    inherit the pass spec and the imported modules at no cost; each decodes whole row groups on its own
    core, so decoding and counting no longer share one GIL. Workers start on the first submit, after the
    pass spec is registered."""
    if workers <= 1 or num_jobs <= 1:
        yield None
        return
    # pyarrow imports pandas on the first Arrow -> NumPy conversion (~0.2 s): do it once here, not in
    # every forked worker
    pa.array([0], pa.int64()).to_numpy()
    ctx = mp.get_context("fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(ctx.Value("i", 0),)) as pool:
        yield pool


def compute_stats(path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                  sample_tokens: int = DEFAULT_SAMPLE_TOKENS, seed: int = 0,
                  workers: int | None = None, loads_only: bool = False) -> TraceStats | Loads:
    """One streaming pass over the trace at ``path`` (file or directory). See the module docstring.

    ``workers``: processes that decode and reduce row groups (forked; 1 = in this process; default: one
    per core for traces of >= 16 M selections). The result does not depend on it: partials merge in trace
    order. ``loads_only``: return just the :class:`Loads` (counts, token sample and, in its provenance,
    each window's dominant domain ``window_domains`` when the trace has domains), skipping the statistics
    (affinity, locality, drift), which cost more than the pass on small traces."""
    t0 = time.perf_counter()
    if window_tokens < 1:
        raise InputError(f"--window-tokens must be >= 1, got {window_tokens}")
    if sample_tokens < 0:
        raise InputError(f"--sample-tokens must be >= 0, got {sample_tokens}")
    trace = open_trace(path)  # the gate: file-level checks here, row checks on every decoded row group
    files = trace.file_paths
    model, provenance = trace.model, trace.provenance
    num_layers, num_experts, k = model.num_moe_layers, model.num_experts, model.top_k
    # a log of some MoE layers only (an import records which) has that many rows per token
    covered = provenance.get("layers_covered") if isinstance(provenance, dict) else None
    rows_per_token = num_layers
    if isinstance(covered, list) and covered and set(covered) <= set(model.moe_layers):
        rows_per_token = len(set(covered))
    rows_per_window = window_tokens * rows_per_token
    jobs = trace.row_groups()
    total_rows = trace.num_rows
    num_windows = -(-total_rows // rows_per_window)
    extra = ("domain",) if "domain" in trace.columns else ()
    sampler = _Sampler(sample_tokens, total_rows // rows_per_token, seed)
    num_workers = _num_workers(workers, len(jobs), total_rows * k)
    shared = None
    if num_workers > 1:
        # anonymous shared memory, inherited by the forked workers: counts never travel through pipes
        shared = mmap.mmap(-1, num_workers * num_windows * num_layers * num_experts * 8)
    spec = _PassSpec(trace=trace, jobs=tuple(jobs), extra_columns=extra, model=model,
                     rows_per_window=rows_per_window, num_windows=num_windows, sample_tokens=sample_tokens,
                     sample_threshold=int(sampler.threshold), seed=seed,
                     shared_counts=None if shared is None else np.frombuffer(shared, np.int64).reshape(
                         num_workers, num_windows, num_layers, num_experts))

    counts = np.zeros((num_windows, num_layers, num_experts), np.int64)
    domain_ids: dict[str, int] = {}
    domain_rows: list[np.ndarray] = []  # per domain: rows per window
    requests: set[int] = set()
    order = RowOrder(_Raise())
    with _worker_pool(num_workers, len(jobs)) as pool:
        for j, part in enumerate(_partials(spec, pool, num_workers)):
            fi, rg, _ = jobs[j]
            order.feed(part.edge, f"the last row of {files[fi - 1].name}" if rg == 0 and fi > 0 else "the row before")
            if part.counts is not None:
                counts[part.w0:part.w0 + len(part.counts)] += part.counts
            requests.update(part.requests.tolist())
            if part.domain_rows is not None:
                # domains numbered by first appearance in trace order, as the rows come
                for name, rows in zip(part.domain_names, part.domain_rows):
                    d = domain_ids.setdefault(name, len(domain_ids))
                    if d == len(domain_rows):
                        domain_rows.append(np.zeros(num_windows, np.int64))
                    domain_rows[d] += rows
            sampler.add_candidates(part.sample)
        order.finish()

        if spec.shared_counts is not None:
            counts += spec.shared_counts.sum(axis=0)
            spec = None  # release the shared memory
        samples, s_rid, s_pos, s_win = sampler.result(num_layers, k)
        # the affinity pairs (the costly statistic) on the workers while this process does the rest
        aff_jobs = affinity_jobs(samples, seed)
        aff_args = [(samples[:, li:li + 2], num_experts, train, test, perm, i < AFFINITY_COVERAGE_PAIRS)
                    for i, (li, train, test, perm) in enumerate(aff_jobs)]
        aff_futures = [pool.submit(affinity_pair, *a) for a in aff_args] if pool is not None else None
        rows_per_layer = counts.sum(axis=(0, 2)) // k
        num_tokens = int(rows_per_layer.max())
        window_rows = np.minimum(rows_per_window, total_rows - np.arange(num_windows) * rows_per_window)
        labels = tuple(f"tokens {w * window_tokens}-{w * window_tokens + int(r) // rows_per_token}"
                       for w, r in enumerate(window_rows))
        loads = Loads(counts, model, window_tokens, labels,
                      {"kind": "trace", "path": str(path), "trace": provenance}, samples, s_win)
        if loads_only:  # the statistics below cost more than the pass itself on small traces
            if domain_rows:  # each window's dominant domain: the scenarios of the shift estimate
                names = sorted(domain_ids, key=domain_ids.get)
                dom = [names[int(i)] for i in np.stack(domain_rows, axis=1).argmax(axis=1)]
                loads = Loads(counts, model, window_tokens, labels, {**loads.provenance, "window_domains": dom},
                              samples, s_win)
            return loads
        skew, cv = skew_and_cv(counts.sum(axis=0))
        locality, n_pairs = _locality(samples, s_rid, s_pos)
        # here, not on a worker: shipping the counts (~32 MB for 200k K3 tokens) costs more than this
        corr, js = window_drift(counts)
        aff_results = ([f.result() for f in aff_futures] if aff_futures is not None
                       else [affinity_pair(*a) for a in aff_args])
    pairs, lift, cov, cov_ind = _affinity_arrays(aff_jobs, aff_results)
    domains = tuple(sorted(domain_ids, key=domain_ids.get))
    domain_tokens = (np.stack(domain_rows, axis=1) / rows_per_token if domain_rows
                     else np.zeros((num_windows, 0)))
    disk = sum(f.stat().st_size for f in files)
    return TraceStats(path=str(path), loads=loads, num_rows=total_rows, num_tokens=num_tokens,
                      num_requests=len(requests), domains=domains, domain_tokens=domain_tokens,
                      layer_skew=skew, layer_cv=cv, drift_corr=corr, drift_js=js, affinity_pairs=pairs,
                      affinity_lift=lift, affinity_coverage=cov, affinity_coverage_shuffled=cov_ind,
                      locality=locality, locality_pairs=n_pairs, bytes_on_disk=disk,
                      seconds=time.perf_counter() - t0, extra={"workers": num_workers})


def trace_loads(path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                sample_tokens: int = DEFAULT_SAMPLE_TOKENS, seed: int = 0, workers: int | None = None) -> Loads:
    """The Loads ``[windows, L, E]`` of a trace (with the token sample), by one streaming pass."""
    return compute_stats(path, window_tokens, sample_tokens, seed, workers, loads_only=True)
