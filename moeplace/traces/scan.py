"""The streaming pass of :func:`traces.stats.compute_stats`: one read of the Parquet row groups, each
decoded, checked by the gate (``traces.validate``) and reduced to a partial (its windows' counts,
requests, domain rows, sample candidates) by one of ``workers`` threads — one per core for big traces —
and the partials merge in trace order, so the result does not depend on the number of workers. Memory is
bounded by a few row groups per thread, the per-window counts and the sample — never by the trace.

Threads, not processes: the costly steps run without the GIL (pyarrow's decoding and decompression, the
compiled loop over the expert-id byte planes, numpy's large array operations), and threads share the
memory-mapped trace, the counts and the partials with no fork, no copy-on-write faults and no pickling
(measured on 2 cores against forked workers: ~0.2 CPU-s less per pass of a 147 M-selection K3 trace). What
still holds the GIL (the gate's small numpy steps) bounds the speed-up to a few cores; the Ray reduction
(:class:`RayReducer`) is the way past one machine. A partial carries the counts of the windows its row
group touches; the caller adds them up in trace order, so no two threads ever write one array.

**Sample**: a token is sampled by a seeded hash of ``(request_id, position // 2)`` — the ``N`` smallest
hashes win (a bottom-N sketch, one pass, no token count needed up front) — so sampled tokens come with
their request neighbour, which gives the temporal-locality statistic (top-k overlap of positions
``p`` and ``p + 1``) for free.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces import jit
from moeplace.traces.format import ID_PLANES, READ_CHECKSUMS, id_planes, numpy_values
from moeplace.traces.gate.files import Trace, open_failure
from moeplace.traces.gate.order import RowOrder
from moeplace.traces.gate.report import Detect, ProblemFound, Raise
from moeplace.traces.gate.rows import (
    RowGroup,
    check_lists,
    check_row_group,
    check_weights,
    corrupt_group,
    read_columns,
)

PARALLEL_MIN_SELECTIONS = 16_000_000  # smaller traces are read on one thread (a second gains < ~20 ms)

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M3 = np.uint64(0xBF58476D1CE4E5B9)


# ---------------------------------------------------------------------------- the token sample
def _token_hash(request_id: np.ndarray, pair: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit mix of (request id, position // 2) per row (splitmix64 finalizer)."""
    with np.errstate(over="ignore"):
        h = request_id.astype(np.uint64) * _M1 ^ (pair.astype(np.uint64) + np.uint64(seed & 0xFFFFFFFF)) * _M2
        h ^= h >> np.uint64(31)
        h *= _M3
        h ^= h >> np.uint64(29)
    return h


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


class Sampler:
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
        """Keep rows already selected by :func:`_sample_candidates` (e.g. by a worker thread or a Ray task)."""
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
        rid, pos = rid[order], pos[order]  # the rows' other fields are read through ``order`` once, below
        new = np.ones(len(rid), bool)
        new[1:] = (rid[1:] != rid[:-1]) | (pos[1:] != pos[:-1])
        starts = np.flatnonzero(new)
        tok = np.cumsum(new) - 1
        tok_h = h[order[starts]]
        num_tokens = len(tok_h)
        keep_tok = np.ones(num_tokens, bool)
        if num_tokens > self.n:
            # the N tokens with the smallest unit hashes (a unit = positions 2i, 2i+1 of a request)
            first = np.lexsort((pos[starts], tok_h))[: self.n]
            keep_tok[:] = False
            keep_tok[first] = True
        new_id = np.cumsum(keep_tok) - 1
        rows = keep_tok[tok]
        src = order[rows]  # the kept rows, in the candidates' own order
        out = np.full((int(keep_tok.sum()), num_layers, k), -1, np.int32)
        out[new_id[tok[rows]], li[src]] = ex[src]
        tok_win = np.minimum.reduceat(win[order], starts) if num_tokens else np.zeros(0, np.int64)
        return out, rid[starts][keep_tok], pos[starts][keep_tok], tok_win[keep_tok]


# ---------------------------------------------------------------------------- row groups on worker threads
@dataclass(frozen=True)
class PassSpec:
    """What every row-group job of one pass needs (shared by the worker threads; pickled only for Ray)."""

    trace: Trace
    jobs: tuple[tuple[int, int, int], ...]  # (file index, row group, first row of the group in the trace)
    extra_columns: tuple[str, ...]  # decoded beyond what the gate's row checks read
    model: ModelSpec
    rows_per_window: int
    num_windows: int
    sample_tokens: int
    sample_threshold: int
    seed: int
    count: bool = True  # False: the gate's checks only (check_pass), no Loads


@dataclass
class _Partial:
    """The reduction of one row group: counts of the windows ``[w0, w0 + len(counts))`` it touches
    (int64 ``[nw, L, E]``; None when nothing is counted), its distinct request ids, its domain names (dictionary order) with rows per
    (name, window) ``[D_g, num_windows]``, and its sample candidates (hash, request, position, MoE layer
    index, experts) — everything merges by addition / union / concatenation in job order."""

    w0: int
    counts: np.ndarray | None
    requests: np.ndarray
    domain_names: list[str]
    domain_rows: np.ndarray | None
    sample: tuple[np.ndarray, ...] | None
    edge: Any = None  # the row group's order facts for the gate's cross-group checks (traces.validate)


_THREAD = threading.local()  # a worker thread's files opened (lives with its pool)


def _open_file(f: Path, opened: dict[Path, pq.ParquetFile]) -> pq.ParquetFile:
    pf = opened.get(f)
    if pf is None:
        try:
            dict_cols = ["domain"] if "domain" in pq.read_schema(f).names else None
            # memory-mapped: pages are decoded straight from the page cache (no read() copies)
            pf = pq.ParquetFile(f, read_dictionary=dict_cols, memory_map=True, **READ_CHECKSUMS)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{f}: {open_failure(exc)}") from None
        opened[f] = pf
    return pf


COUNT_CHUNK_ROWS = 1 << 13  # rows per bincount: the (row, expert) index of a chunk (1 MB for top-16) stays in L2
# per thread, reused for every chunk: the chunk's keys and deltas (never shared: a bincount reads its input
# twice, for its size and for its counts, and another thread's keys between the two would write past it)
_BUFFERS = threading.local()


def _index_buffer(size: int) -> np.ndarray:
    return _buffer("index", (size,), np.int64)


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


def _reduce_group(spec: PassSpec, j: int, opened: dict[Path, pq.ParquetFile]) -> _Partial:
    """Decode row group ``j`` of the pass, run the gate's row checks on it and reduce it to a
    :class:`_Partial` (``opened`` caches the pass's open files): the byte planes of format version 2
    through :func:`_reduce_planes`, version 1's lists through :func:`_reduce_lists`. Either fast path only
    *detects* a problem; then the row group is decoded and checked whole by the gate's reporting sink,
    which raises its first problem in the gate's order (:func:`_reduce_checked`)."""
    fi = spec.jobs[j][0]
    pf = _open_file(spec.trace.files[fi].path, opened)
    try:
        if spec.trace.files[fi].version >= 2:
            return _reduce_planes(spec, j, pf)
        return _reduce_lists(spec, j, pf)
    except (ProblemFound, pa.ArrowException, OSError, ValueError, KeyError):
        return _reduce_checked(spec, j, pf)


CHUNK_ROWS = 1 << 14  # rows per count step of the planes: their int64 keys (2 MB for top-16) stay in L2
PLANE_BATCH_ROWS = 1 << 16  # rows per decoded batch of the byte planes (2 MB for top-16)
_PATTERN: dict[int, np.ndarray] = {}  # MoE-layer index of trace row r = pattern[r % L] (read-only once made)


def _layer_pattern(num_layers: int, n: int) -> np.ndarray:
    """int32 ``[>= n + L]``: ``0, 1, ..., L-1, 0, 1, ...`` (cached, grown on demand)."""
    p = _PATTERN.get(num_layers)
    if p is None or len(p) < n + num_layers:
        p = _PATTERN[num_layers] = np.tile(np.arange(num_layers, dtype=np.int32), -(-(n + num_layers) // num_layers))
    return p


def _buffer(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """This thread's buffer ``name`` (grown on demand), viewed as ``shape``."""
    bufs = getattr(_BUFFERS, "arrays", None)
    if bufs is None:
        bufs = _BUFFERS.arrays = {}
    b = bufs.get(name)
    size = int(np.prod(shape))
    if b is None or b.size < size or b.dtype != dtype:
        b = bufs[name] = np.empty(size, dtype)
    return b[:size].reshape(shape)


_BYTES_EVEN = np.uint64(0x00FF00FF00FF00FF)
_LANES_SUM = np.uint64(0x0001000100010001)


def _byte_row_sums(plane: np.ndarray) -> np.ndarray:
    """uint64 ``[m]``: the sum of each row of ``plane`` uint8 ``[m, k]`` (k a multiple of 8), by SWAR on
    its 8-byte words: even and odd bytes added as four 16-bit lanes, the words of a row added, then the
    four lanes summed by one multiply into the top lane (every partial sum < 2^16 for k <= 256: no carry
    between lanes)."""
    x = plane.view(np.uint64)
    t = (x & _BYTES_EVEN) + ((x >> np.uint64(8)) & _BYTES_EVEN)
    acc = t[:, 0].copy()
    for w in range(1, x.shape[1]):
        acc += t[:, w]
    acc *= _LANES_SUM
    acc >>= np.uint64(48)
    return acc


def _repeats(deltas: np.ndarray) -> bool:
    """Whether a chunk's sorted-id deltas ``[m, k]`` (or anything zero exactly where they are) repeat an
    expert: a zero delta after a row's first, i.e. more zeros in the chunk than in its first column."""
    return deltas.size - np.count_nonzero(deltas) != len(deltas) - np.count_nonzero(deltas[:, 0])


def _check_chunk(lo: np.ndarray, hi: np.ndarray, num_experts: int) -> None:
    """The checks of a chunk of byte planes when nothing is counted (``check_pass``): a zero delta after
    a row's first is a repeated expert; a row's deltas summing to ``num_experts`` or more is an id out of
    range (the row's last, largest id). The same verdicts as the key-building path, without the keys."""
    if _repeats(lo | hi):
        raise ProblemFound("duplicate_expert")
    last = _byte_row_sums(lo)
    hi64 = hi.view(np.uint64)
    if hi64.any():
        last += _byte_row_sums(hi) << np.uint64(8)
    if not (last < np.uint64(num_experts)).all():
        raise ProblemFound("expert_range")


def _reduce_planes(spec: PassSpec, j: int, pf: pq.ParquetFile) -> _Partial:
    """The fast path of a version-2 row group: one read of the columns the pass needs, the gate's checks
    of the per-row columns (:func:`check_row_group`, a :class:`Detect` sink), then the expert ids counted
    straight from their byte planes, ``CHUNK_ROWS`` rows at a time: per chunk the sorted ids' running sum
    over the k deltas builds the (window, layer, expert) keys slot by slot (contiguous int64 rows: the
    transposed keys), one bincount adds them up, and the same pass detects a repeated expert (a zero
    delta after the first) and an id past num_experts (a row whose deltas sum to E or more).

    A valid trace holds whole tokens of one row per MoE layer, layers ascending, so the MoE-layer index of
    trace row ``r`` is ``r mod L``: checked row by row against that pattern (any other layer sequence is
    a problem the gate words), which makes the layer part of each key a slice of one cached array."""
    fi, rg, row0 = spec.jobs[j]
    trace = spec.trace
    model = spec.model
    num_layers, num_experts, k = model.num_moe_layers, model.num_experts, model.top_k
    cols = read_columns(trace, fi, rg, pf, spec.extra_columns)
    table = pf.read_row_group(rg, columns=[c for c in cols if c not in ID_PLANES], use_threads=False)
    group = check_row_group(Detect(), trace, fi, rg, table, lists=False)
    if "expert_ids" not in trace.files[fi].columns:
        raise ProblemFound("expert_ids")
    check_weights(Detect(), trace, fi, rg, table)
    n = group.n
    rpw = spec.rows_per_window
    w0 = row0 // rpw
    if n == 0:
        return _Partial(w0, np.zeros((0, num_layers, num_experts), np.int64), np.zeros(0, np.int64), [], None,
                        None, group.edge)
    pattern = _layer_pattern(num_layers, max(n, CHUNK_ROWS))  # base_all below takes L + CHUNK_ROWS of it
    phase = row0 % num_layers
    if not np.array_equal(group.layer_idx, pattern[phase:phase + n]):
        raise ProblemFound("layer")
    w1 = (row0 + n - 1) // rpw
    bins_per_window = num_layers * num_experts
    counts = np.zeros((w1 - w0 + 1) * bins_per_window, np.int64)
    base_all = _buffer("base", (num_layers + CHUNK_ROWS,), np.int64)
    np.multiply(pattern[:num_layers + CHUNK_ROWS], num_experts, out=base_all)
    keys = _buffer("keys", (k, CHUNK_ROWS), np.int64)
    d16 = _buffer("d16", (CHUNK_ROWS, k), np.uint16)
    top = _buffer("top", (CHUNK_ROWS,), np.int64)
    # the sampled tokens' rows (one hash per token run: all rows of a token share it), taken batch by batch
    edge = group.edge
    runs = edge.run_rows
    run_rid = edge.run_keys >> 24
    rows = sel = lens = h = run_pos = None
    if spec.sample_tokens > 0 and len(runs):
        run_pos = edge.run_keys & ((1 << 24) - 1)
        h = _token_hash(run_rid, run_pos >> 1, spec.seed)
        sel = np.flatnonzero(h <= np.uint64(spec.sample_threshold))
        if len(sel):
            lens = edge.run_lens[sel]
            rows = np.arange(int(lens.sum())) + np.repeat(runs[sel] - (np.cumsum(lens) - lens), lens)
    sampled: list[np.ndarray] = []
    compiled = jit.native()  # the C loop over the byte planes, or None: the numpy loop below
    b0 = 0
    # the planes in batches of PLANE_BATCH_ROWS rows: the decoded buffers stay in cache and are reused
    # (a whole group's planes, ~30 MB for K3, would stream through memory, which two workers share)
    for batch in pf.iter_batches(PLANE_BATCH_ROWS, row_groups=[rg], columns=list(ID_PLANES), use_threads=False):
        planes = [batch.column(c) for c in ID_PLANES]
        if any(c.null_count for c in planes):
            raise ProblemFound("null")
        lo, hi = id_planes(planes[0], planes[1], k)
        b1 = b0 + len(lo)
        if b1 > n:
            raise ProblemFound("corrupt")
        if compiled is not None:  # the C loop: checks and counts in one read of the planes
            status = compiled.count_planes(lo, hi, k, num_experts, num_layers, row0 + b0, rpw, w0,
                                         counts if spec.count else None)
            if status:
                raise ProblemFound("duplicate_expert" if status == 1 else "expert_range")
        s = len(lo) if compiled is not None else 0
        while s < len(lo):
            g = b0 + s  # the chunk's first row in the row group
            w = (row0 + g) // rpw
            e = min(len(lo), s + CHUNK_ROWS, (w + 1) * rpw - row0 - b0)  # a chunk stays in one window
            m = e - s
            lo_c, hi_c = lo[s:e], hi[s:e]
            if not spec.count and k % 8 == 0:
                _check_chunk(lo_c, hi_c, num_experts)  # the checks without the keys
                s = e
                continue
            if hi_c.any():  # the deltas: low bytes, plus the high bytes where a delta reaches 256
                d = d16[:m]
                np.left_shift(hi_c, 8, out=d, dtype=np.uint16)
                d |= lo_c
            else:
                d = lo_c
            if k > 1 and _repeats(d):
                raise ProblemFound("duplicate_expert")
            o = keys[:, :m]  # (layer, expert) keys within the chunk's window
            p = (phase + g) % num_layers
            base = base_all[p:p + m]
            np.add(base, d[:, 0], out=o[0])
            for i in range(1, k):
                np.add(o[i - 1], d[:, i], out=o[i])
            # the row's largest id is its last (the deltas summed): below num_experts
            np.add(base, num_experts, out=top[:m])
            if not np.less(o[k - 1], top[:m]).all():
                raise ProblemFound("expert_range")
            if spec.count:
                # one window's bins (not the row group's: a bincount's output is allocated and added whole)
                c0 = (w - w0) * bins_per_window
                counts[c0:c0 + bins_per_window] += np.bincount(o.reshape(-1), minlength=bins_per_window)
            s = e
        if rows is not None:
            a, b = np.searchsorted(rows, [b0, b1])
            if b > a:
                r = rows[a:b] - b0
                # the rows passed the range check above: their ids sum to < num_experts, no wrap in uint16
                ex = lo[r].astype(np.uint16)
                hi_rows = hi[r]
                if hi_rows.any():
                    ex |= hi_rows.astype(np.uint16) << 8
                for i in range(1, k):  # the running sum over the deltas, slot by slot
                    ex[:, i] += ex[:, i - 1]
                sampled.append(ex)
        b0 = b1
    if b0 != n:  # a reader that yields fewer rows than the group holds: nothing to count on
        raise ProblemFound("corrupt")
    counts = counts.reshape(w1 - w0 + 1, num_layers, num_experts) if spec.count else None
    requests = np.unique(run_rid)
    sample = None
    if rows is not None:
        sample = (np.repeat(h[sel], lens), np.repeat(run_rid[sel], lens), np.repeat(run_pos[sel], lens),
                  group.layer_idx[rows].astype(np.int16), np.concatenate(sampled), (row0 + rows) // rpw)
    names, per = _domain_rows(spec, table, row0, n)
    return _Partial(w0, counts, requests, names, per, sample, edge)


def _domain_rows(spec: PassSpec, table: pa.Table, row0: int, n: int) -> tuple[list[str], np.ndarray | None]:
    """The domain names of a row group (dictionary order) and its rows per (name, window)."""
    if "domain" not in spec.extra_columns:
        return [], None
    dcol = table.column("domain").combine_chunks()
    if isinstance(dcol, pa.DictionaryArray):
        codes = numpy_values(dcol.indices)
        names = dcol.dictionary.to_pylist()
    else:
        enc = dcol.dictionary_encode()
        codes, names = numpy_values(enc.indices), enc.dictionary.to_pylist()
    rpw = spec.rows_per_window
    w0, w1 = row0 // rpw, (row0 + n - 1) // rpw
    if w0 == w1:
        per = np.zeros((len(names), spec.num_windows), np.int64)
        per[:, w0] = np.bincount(codes, minlength=len(names))
        return names, per
    per = np.zeros((len(names), spec.num_windows), np.int64)
    for w in range(w0, w1 + 1):  # one bincount per window's slice of the rows
        a, b = max(w * rpw - row0, 0), min((w + 1) * rpw - row0, n)
        per[:, w] = np.bincount(codes[a:b], minlength=len(names))
    return names, per


def _reduce_lists(spec: PassSpec, j: int, pf: pq.ParquetFile) -> _Partial:
    """The fast path of a version-1 row group (expert ids as lists in the router's order).

    The list columns (16 values a row: ~90 % of the bytes) are decoded in batches of ``BATCH_ROWS`` rows,
    checked and counted batch by batch: the decoder's buffers and the count's index stay in cache and are
    reused (decoding the whole group at once costs about twice as much, in page faults and cache misses).
    Batch-wise checks only *detect* a problem; then the row group is decoded and checked whole, which
    raises the gate's first problem in the gate's order (:func:`_reduce_checked`)."""
    fi, rg, _ = spec.jobs[j]
    trace = spec.trace
    cols = read_columns(trace, fi, rg, pf, spec.extra_columns)
    lists = [c for c in cols if c in LIST_COLUMNS]
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


def _reduce_checked(spec: PassSpec, j: int, pf: pq.ParquetFile) -> _Partial:
    """:func:`_reduce_group` on the whole row group at once, checked by the gate's reporting sink."""
    fi, rg, _ = spec.jobs[j]
    trace = spec.trace
    try:
        table = pf.read_row_group(rg, columns=read_columns(trace, fi, rg, pf, spec.extra_columns),
                                  use_threads=False)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise InputError(corrupt_group(trace.files[fi].path, rg, exc)) from None
    group = check_row_group(Raise(), trace, fi, rg, table)
    return _reduce_rows(spec, j, table, group, iter([group.experts]))


def _reduce_rows(spec: PassSpec, j: int, table: pa.Table, group: RowGroup, experts: Iterator[np.ndarray]
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
    runs = np.flatnonzero(rid[1:] != rid[:-1]) + 1
    requests = np.unique(rid[np.concatenate([[0], runs])])
    names, per = _domain_rows(spec, table, row0, n)
    return _Partial(w0, counts, requests, names, per, sample, group.edge)


def _reduce_on_thread(spec: PassSpec, j: int) -> _Partial:
    return _reduce_group(spec, j, _THREAD.opened)


def pass_workers(workers: int | None, num_jobs: int, total_selections: int) -> int:
    """Worker threads of a pass: ``workers`` if given, else one per usable core when the trace is big
    enough to gain from a second (>= ~16 M selections), else 1 (in this thread)."""
    if workers is not None and workers < 1:
        raise InputError(f"workers must be >= 1, got {workers}")
    if workers is not None:
        return min(workers, max(num_jobs, 1))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if total_selections < PARALLEL_MIN_SELECTIONS:
        return 1
    return max(1, min(cores, num_jobs))


def partials(spec: PassSpec, pool: ThreadPoolExecutor | None, workers: int) -> Iterator[_Partial]:
    """The row groups' partials in job (= trace) order: in this thread, or from the ``workers`` threads
    of ``pool`` with at most ``2 * workers`` results in flight (memory stays bounded by row groups)."""
    num_jobs = len(spec.jobs)
    if pool is None:
        opened: dict[Path, pq.ParquetFile] = {}
        for j in range(num_jobs):
            yield _reduce_group(spec, j, opened)
        return
    ahead = 2 * workers
    futures = deque(pool.submit(_reduce_on_thread, spec, j) for j in range(min(ahead, num_jobs)))
    try:
        for j in range(num_jobs):
            part = futures.popleft().result()
            if j + ahead < num_jobs:
                futures.append(pool.submit(_reduce_on_thread, spec, j + ahead))
            yield part
    finally:  # an error or an early stop: the row groups not started yet are not read
        for f in futures:
            f.cancel()


def check_pass(trace: Trace, workers: int | None = None) -> int:
    """The gate's row checks of every row group of ``trace`` (past :func:`~traces.validate.open_trace`) on
    the stats pass's fast path, on every core, then the checks across row groups in trace order; raises
    the gate's first problem as an :class:`InputError` (the line ``place trace validate`` prints first).
    Returns the tokens (rows of the best-covered MoE layer). Nothing is counted: a few % of the stats
    pass's time goes to the keys the range check needs."""
    jobs = trace.row_groups()
    model = trace.model
    num_workers = pass_workers(workers, len(jobs), trace.num_rows * model.top_k)
    spec = PassSpec(trace=trace, jobs=tuple(jobs), extra_columns=(), model=model,
                    rows_per_window=max(trace.num_rows, 1), num_windows=1, sample_tokens=0, sample_threshold=0,
                    seed=0, count=False)
    order = RowOrder(Raise())
    files = trace.file_paths
    with worker_pool(num_workers, len(jobs)) as pool:
        for j, part in enumerate(partials(spec, pool, num_workers)):
            fi, rg, _ = jobs[j]
            order.feed(part.edge, f"the last row of {files[fi - 1].name}" if rg == 0 and fi > 0 else "the row before")
        tokens = int(order.layer_rows.max(initial=0)) if order.layer_rows is not None else 0
        order.finish()
    return tokens


# ---------------------------------------------------------------------------- row groups on a Ray cluster
def _reduce_jobs(spec: PassSpec, js: list[int]) -> list[_Partial]:
    """A Ray task: the partials of jobs ``js`` (consecutive row groups), reduced where the task runs."""
    opened: dict[Path, pq.ParquetFile] = {}
    return [_reduce_group(spec, j, opened) for j in js]


class RayReducer:
    """The row groups of a pass as Ray tasks (one per ``group_jobs`` consecutive row groups), on a cluster
    this process attached to or a local instance it started (``address`` None or ``"local"``: shut down
    again by :meth:`close`). Every node reads the trace at the same path (a shared file system). The tasks
    run the same reduction as the local workers and the partials merge here in trace order, so the result
    is the single-process one; at most ``2 x`` the cluster's CPUs tasks are in flight, so memory stays
    bounded by row groups on every node."""

    def __init__(self, address: str | None, num_cpus: int | None = None, group_jobs: int = 1) -> None:
        try:
            import ray  # optional: the [sweep] extra
        except ImportError:
            raise InputError("--ray needs Ray: pip install 'moeplace[sweep]'") from None
        self.ray = ray
        self.group_jobs = max(1, group_jobs)
        self.started = address in (None, "local")
        kw: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
        try:
            if self.started:
                ray.init(num_cpus=num_cpus, **kw)
            else:
                ray.init(address=address, runtime_env=_ray_runtime_env(), **kw)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"--ray {address or 'local'}: cannot start or attach to Ray: {exc}") from None
        self.capacity = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._task = ray.remote(num_cpus=1, max_retries=1)(_reduce_jobs)

    def partials(self, spec: PassSpec) -> Iterator[_Partial]:
        """The partials of every job of ``spec`` in job order."""
        ray = self.ray
        spec_ref = ray.put(spec)
        n = len(spec.jobs)
        groups = [list(range(a, min(n, a + self.group_jobs))) for a in range(0, n, self.group_jobs)]
        ahead = 2 * self.capacity
        refs = deque(self._task.remote(spec_ref, g) for g in groups[:ahead])
        for i in range(len(groups)):
            try:
                parts = ray.get(refs.popleft())
            except ray.exceptions.RayTaskError as exc:  # the task's own error (the gate's line), raised here
                raise (exc.cause if isinstance(exc.cause, BaseException) else exc) from None
            if i + ahead < len(groups):
                refs.append(self._task.remote(spec_ref, groups[i + ahead]))
            yield from parts

    def close(self) -> None:
        self.ray.shutdown()  # stops the instance it started; only disconnects from an attached cluster


@contextmanager
def ray_reducer(address: str | None, num_cpus: int | None):
    """A :class:`RayReducer` for ``address`` (closed at the end), or None when ``address`` is None."""
    if address is None:
        yield None
        return
    reducer = RayReducer(address, num_cpus)
    try:
        yield reducer
    finally:
        reducer.close()


def _ray_runtime_env() -> dict[str, Any]:
    """Ship this checkout's moeplace to an attached cluster's workers (their third-party packages must be
    installed there); ``MOEPLACE_RAY_SHIP_CODE=0`` when moeplace is installed on the cluster."""
    if os.environ.get("MOEPLACE_RAY_SHIP_CODE", "1") == "0":
        return {}
    return {"py_modules": [str(Path(__file__).resolve().parents[1])]}


@contextmanager
def worker_pool(workers: int, num_jobs: int):
    """A pool of ``workers`` threads, or None (work in this thread). Each thread keeps the files it
    opened for the pool's life."""
    if workers <= 1 or num_jobs <= 1:
        yield None
        return

    def start() -> None:
        _THREAD.opened = {}

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moeplace-pass", initializer=start) as pool:
        yield pool
