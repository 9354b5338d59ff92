"""The gate's checks of one row group (``traces.validate``): no nulls; ``layer`` is an MoE layer of the
model; expert ids ``< num_experts`` and no expert repeated in one row's top-k; gate weights finite and
non-negative; ``phase`` 0 or 1; ``request_id`` in ``[0, 2^39)``, ``position`` in ``[0, 2^24)`` — reported
in that fixed order — plus the group's order facts (:class:`Edge`: step decreases, token runs, first and
last rows), which :class:`traces.gate.order.RowOrder` checks against the groups before it."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.traces.format import ID_PLANES, decode_expert_ids, id_planes, numpy_values
from moeplace.traces.gate.files import Trace, TraceFile
from moeplace.traces.gate.report import Problem

# a token is packed as request_id << 24 | position by the readers that replay tokens: 2^24 positions is
# 16x K3's 1 M-token context, 2^39 request ids more than any engine log numbers
MAX_POSITION = (1 << 24) - 1
MAX_REQUEST_ID = (1 << 39) - 1
# deferred row problems (step order, token rows) a row group hands on, per kind: enough for any listing
MAX_DEFERRED = 1000


def _may_hold_nulls(md: pq.FileMetaData, rg: int, name: str) -> bool:
    """From the footer statistics (free): can column ``name`` of row group ``rg`` hold nulls?"""
    rgm = md.row_group(rg)
    for i in range(rgm.num_columns):
        c = rgm.column(i)
        if c.path_in_schema == name or c.path_in_schema.startswith(name + "."):
            st = c.statistics
            if st is None or not st.has_null_count or st.null_count > 0:
                return True
    return False


def corrupt_group(path: Path, rg: int, exc: Exception) -> str:
    """The line for a row group that does not decode (one wording for every reader)."""
    return str(Problem("corrupt", str(path), f"row group {rg}", None, decode_failure(exc)))


def decode_failure(exc: BaseException) -> str:
    """Why a row group did not decode, in words: a page checksum that does not match says the bytes changed
    after they were written (format.READ_CHECKSUMS); running out of memory is not corruption."""
    text = str(exc)
    if "CRC checksum" in text or "page integrity" in text:
        return f"page checksum mismatch: its bytes changed after they were written (corrupt data; {text})"
    if "Cannot allocate memory" in text or isinstance(exc, MemoryError):
        raise MemoryError(text)
    return f"cannot be decoded: corrupt data ({text})"


def read_columns(trace: Trace, fi: int, rg: int, pf: pq.ParquetFile, extra=()) -> list[str]:
    """Columns a reader decodes for row group ``rg`` of file ``fi``: what the row checks need (``token_id``
    only when the footer statistics say it may hold nulls: it has no other check and no reader of rows
    needs it) plus ``extra``."""
    tf = trace.files[fi]
    cols = tf.columns
    need = [c for c in ("request_id", "position", "phase", "step", "layer", "expert_ids", "gate_weights",
                        "domain") if c in cols]
    for c in ("token_id",):
        if c in cols and (c in extra or _may_hold_nulls(pf.metadata, rg, c)):
            need.append(c)
    return tf.physical(need)


def present_columns(tf: TraceFile, table: pa.Table | pa.RecordBatch) -> set[str]:
    """The logical columns of ``tf`` that ``table`` (decoded from it) holds."""
    names = set(table.column_names)
    return {c for c in tf.columns if all(p in names for p in tf.physical([c]))}


def _plain(table: pa.Table, name: str, dtype) -> np.ndarray:
    a = table.column(name)
    a = a.chunk(0) if a.num_chunks == 1 else a.combine_chunks()
    if a.null_count:
        a = a.fill_null(0)
    return np.asarray(numpy_values(a), dtype=dtype)


def _fixed_list(table: pa.Table, name: str, k: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """``[n, k]`` values of a fixed-size-list column and a row-null mask (None when there are no nulls: a row
    is null when the list itself or any of its values is null). Zero-copy without nulls."""
    col = table.column(name)
    a = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    n = len(a)
    # .values ignores the array's slice offset; slice it so row i maps to values [i*k, (i+1)*k)
    values = a.values.slice(a.offset * k, n * k)
    nulls = None
    if a.null_count:
        nulls = np.asarray(a.is_null().to_numpy(zero_copy_only=False))
    if values.null_count:
        vn = np.asarray(values.is_null().to_numpy(zero_copy_only=False)).reshape(-1, k).any(axis=1)
        nulls = vn if nulls is None else (nulls | vn)
        values = values.fill_null(0)
    vals = np.asarray(numpy_values(values), dtype=dtype).reshape(n, k)
    if nulls is not None:
        vals = vals.copy()
        # null rows (reported as such) get distinct in-range ids / zero weights: no follow-on problems
        vals[nulls] = np.arange(k) if np.issubdtype(dtype, np.integer) else 0.0
    return vals, nulls


_DUP_CHUNK = 1 << 14  # rows per block: the transposed block and the comparisons stay in L2
# per thread (the stats pass reads row groups on several): transposed ids and the comparison buffer, reused
_DUP_BUFFERS = threading.local()


def repeated_expert_rows(ids: np.ndarray) -> np.ndarray | None:
    """Rows of ``ids [n, k]`` that name one expert twice (bool ``[n]``), or None when there is none.

    Compares the k(k-1)/2 column pairs on cache-sized transposed blocks (~15 ms per million top-16 rows,
    about a third of a row sort); the exact rows are computed only when a block has a repeat."""
    n, k = ids.shape
    if k < 2 or n == 0:
        return None
    bufs = getattr(_DUP_BUFFERS, "arrays", None)
    if bufs is None or bufs[0].dtype != ids.dtype or bufs[0].shape[0] != k:
        bufs = _DUP_BUFFERS.arrays = [np.empty((k, _DUP_CHUNK), ids.dtype), np.empty((k - 1) * _DUP_CHUNK, bool)]
    tbuf, ebuf = bufs
    found = False
    for s0 in range(0, n, _DUP_CHUNK):
        blk = ids[s0:s0 + _DUP_CHUNK]
        m = len(blk)
        t = tbuf[:, :m]
        np.copyto(t, blk.T)
        for s in range(1, k):
            e = ebuf[:(k - s) * m].reshape(k - s, m)
            np.equal(t[s:], t[:k - s], out=e)
            if e.any():
                found = True
                break
        if found:
            break
    if not found:
        return None
    srt = np.sort(ids, axis=1)
    return (srt[:, 1:] == srt[:, :-1]).any(axis=1)


@dataclass
class RowGroup:
    """The decoded, checked columns of one row group (numpy, ``[n]`` / ``[n, k]``) for the reader to use,
    plus what :class:`RowOrder` needs to check it against the row groups before (``edge``)."""

    n: int
    layer: np.ndarray
    layer_idx: np.ndarray  # int32 index into model.moe_layers
    experts: np.ndarray | None  # None when checked without the list columns (check_lists)
    request_id: np.ndarray
    position: np.ndarray
    edge: Edge


@dataclass
class Edge:
    """Order facts of one row group: its first/last row's (step, request, position, layer); the problems
    found inside it that are reported in row order with the cross-group ones (``step_rows``/``token_rows``:
    local row indices, at most ``MAX_DEFERRED``, plus totals); the tokens of its first and last step
    (``head``/``tail``: request ids, positions, first local row of each token run)."""

    path: str
    row0: int
    n: int
    first: tuple[int, int, int, int] | None = None
    last: tuple[int, int, int, int] | None = None
    step_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    step_total: int = 0
    step_prev: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # step of the row before
    step_vals: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_problems: list[tuple[int, str, str, str]] = field(default_factory=list)  # (local row, kind, field, text)
    token_total: Counter = field(default_factory=Counter)
    head: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    tail: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    head_runs_from: int = 0  # index of the first head run that does not continue the previous group's token
    # every token run's (request_id << 24 | position), step, first local row and rows, for one token per
    # step and one row per MoE layer the trace holds
    run_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    run_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    run_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    run_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # rows per MoE layer of the model (int64 ``[L]``; None when the group has no order facts)
    layer_rows: np.ndarray | None = None
    moe_layers: tuple[int, ...] = ()
    partial: bool = False  # the trace declares the MoE layers it holds (some of its model's)


def _token_rows(edge: Edge, step, rid, pos, layer, moe: np.ndarray) -> None:
    """A token (step, request, position) has consecutive rows with strictly ascending MoE layers: find the
    violations inside one row group and the tokens of its first and last step. ``moe``: bool ``[n]``, rows
    whose layer is an MoE layer (the others are reported already and not ordered)."""
    n = len(step)
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(step[1:], step[:-1], out=new[1:])
    new[1:] |= rid[1:] != rid[:-1]
    new[1:] |= pos[1:] != pos[:-1]
    same = ~new[1:] & moe[1:] & moe[:-1]
    dup = same & (layer[1:] == layer[:-1])
    down = same & (layer[1:] < layer[:-1])
    probs = edge.token_problems
    total = edge.token_total
    for mask, kind in ((dup, "duplicate_row"), (down, "row_order")):
        if mask.any():
            idx = np.flatnonzero(mask) + 1
            total[kind] += idx.size
            for i in idx[:MAX_DEFERRED].tolist():
                probs.append((i, kind, "layer", layer_order_message(
                    int(layer[i]), int(layer[i - 1]), int(rid[i]), int(pos[i]), int(step[i]))))
    starts = np.flatnonzero(new)
    rs, rr, rp = step[starts], rid[starts], pos[starts]
    if starts.size > 1:
        order = np.lexsort((starts, rp, rr, rs))
        again = (rs[order][1:] == rs[order][:-1]) & (rr[order][1:] == rr[order][:-1]) & (rp[order][1:] == rp[order][:-1])
        if again.any():
            later = starts[order[1:][again]]
            earlier = starts[order[:-1][again]]
            total["row_order"] += later.size
            for i, j in list(zip(later.tolist(), earlier.tolist()))[:MAX_DEFERRED]:
                probs.append((i, "row_order", "position", resume_message(int(rid[i]), int(pos[i]), int(step[i]),
                                                              f"row {edge.row0 + j}")))
    edge.run_keys = (rr.astype(np.int64) << 24) | rp.astype(np.int64)
    edge.run_steps = rs.astype(np.int64)
    edge.run_rows = starts.astype(np.int64)
    # every row counts, a non-MoE one too (reported already): a token's length is then not short by it
    edge.run_lens = np.diff(np.append(starts, n)).astype(np.int64)
    head = rs == rs[0]
    tail = rs == rs[-1]
    edge.head = (rr[head], rp[head], starts[head])
    edge.tail = (rr[tail], rp[tail], starts[tail])


def layer_order_message(layer: int, before: int, rid: int, pos: int, step: int) -> str:
    tok = f"token (request {rid}, position {pos}, step {step})"
    if layer == before:
        return f"layer {layer} repeated for {tok}: one row per token and MoE layer"
    return f"layer {layer} after layer {before} for {tok}: a token's rows must be in ascending layer order"


def resume_message(rid: int, pos: int, step: int, first: str) -> str:
    return (f"token (request {rid}, position {pos}, step {step}) has rows here and from {first}, with other "
            "rows between: a token's rows must be consecutive")


@dataclass(frozen=True)
class _At:
    """Where a row group's problems go: the sink, the file and the file row of the group's first row."""

    sink: Any
    path: Path
    row0: int

    def rows(self, kind: str, bad: np.ndarray, fld: str, msg_of_index) -> None:
        self.sink.add_rows(kind, self.path, bad, self.row0, fld, msg_of_index)


def check_row_group(sink, trace: Trace, fi: int, rg: int, table: pa.Table, lists: bool = True) -> RowGroup:
    """The per-row-group checks of row group ``rg`` of file ``fi`` (``table`` holds at least
    :func:`read_columns`), in the fixed order every reader reports them. Problems go to ``sink`` (the
    gate's raises at the first); the step-order and token-row problems are handed on in the result's
    ``edge`` for :class:`RowOrder`, which reports them in row order with those spanning row groups.

    ``lists=False``: ``table`` need not hold the list columns (``expert_ids``, ``gate_weights``), which the
    caller checks itself batch by batch with :func:`check_lists` (``experts`` is then None). Problems
    found that way are not in the fixed order: use it with a :class:`Detect` sink and, on a problem,
    check the whole row group again (as ``traces.stats`` does)."""
    model = trace.model
    tf = trace.files[fi]
    at = _At(sink, tf.path, sum(tf.row_groups[:rg]))  # rows are numbered within their file
    n = table.num_rows
    present = present_columns(tf, table)
    for name in ("request_id", "position", "phase", "step", "layer", "token_id", "domain"):
        if name in present and table.column(name).null_count:
            nulls = np.asarray(table.column(name).is_null().to_numpy(zero_copy_only=False))
            at.rows("null", nulls, name, lambda i: "null value (the column must be complete)")
    layer, li = _check_layers(at, table, model, "layer" in present)
    ids = _check_lists(at, table, model, present, tf.version) if lists else None
    if "phase" in present and n:
        phase = _plain(table, "phase", np.uint8)
        if int(phase.max()) > 1:
            at.rows("phase", phase > 1, "phase", lambda i: f"phase {phase[i]}, expected 0 (prefill) or 1 (decode)")
    rid = _plain(table, "request_id", np.int64) if "request_id" in present else np.zeros(n, np.int64)
    pos = _plain(table, "position", np.int32) if "position" in present else np.zeros(n, np.int32)
    if n and "request_id" in present and (int(rid.min()) < 0 or int(rid.max()) > MAX_REQUEST_ID):
        at.rows("request_id", (rid < 0) | (rid > MAX_REQUEST_ID), "request_id",
                lambda i: f"request_id {rid[i]} outside [0, {MAX_REQUEST_ID}]")
    if n and "position" in present and (int(pos.min()) < 0 or int(pos.max()) > MAX_POSITION):
        at.rows("position", (pos < 0) | (pos > MAX_POSITION), "position",
                lambda i: f"position {pos[i]} is negative" if pos[i] < 0
                else f"position {pos[i]} beyond {MAX_POSITION}, the longest context a trace holds")
    edge = Edge(str(at.path), at.row0, n)
    if n and {"step", "request_id", "position", "layer"} <= present:
        _order_facts(edge, _plain(table, "step", np.int64), rid, pos, layer, li, model)
    return RowGroup(n, layer, li, ids, rid, pos, edge)


def check_lists(sink, trace: Trace, fi: int, rg: int, batch: pa.RecordBatch | pa.Table, row: int = 0
                ) -> np.ndarray:
    """The checks of the list columns (expert ids, gate weights) on ``batch``: rows ``[row, row + len)``
    of row group ``rg`` of file ``fi``. Returns the expert ids uint16 ``[len, k]``. See
    :func:`check_row_group` (``lists=False``)."""
    tf = trace.files[fi]
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    at = _At(sink, tf.path, sum(tf.row_groups[:rg]) + row)
    return _check_lists(at, table, trace.model, present_columns(tf, table), tf.version)


def check_weights(sink, trace: Trace, fi: int, rg: int, table: pa.Table) -> None:
    """The gate weights' checks on row group ``rg`` of file ``fi`` (when it has them), into ``sink``."""
    tf = trace.files[fi]
    if "gate_weights" in tf.columns:
        _check_weights(_At(sink, tf.path, sum(tf.row_groups[:rg])), table, trace.model.top_k)


def _check_lists(at: _At, table: pa.Table, model: ModelSpec, present, version: int = 2) -> np.ndarray:
    if version >= 2:
        ids = _check_planes(at, table, model, "expert_ids" in present)
    else:
        ids = _check_experts(at, table, model, "expert_ids" in present)
    if "gate_weights" in present:
        _check_weights(at, table, model.top_k)
    return ids


def _check_layers(at: _At, table: pa.Table, model: ModelSpec, present: bool) -> tuple[np.ndarray, np.ndarray]:
    """Decoder layers ``[n]`` and their MoE-layer indices (int32, -1 where not an MoE layer: reported)."""
    n = table.num_rows
    if not present:
        return np.full(n, model.moe_layers[0], np.uint16), np.zeros(n, np.int32)
    layer = _plain(table, "layer", np.uint16)
    li = _layer_index(model)[layer]
    bad = li < 0
    if bad.any():
        held = (f"not among the {model.layers_label} the trace declares it holds ({format_ranges(model.moe_layers)})"
                if model.is_partial else f"not an MoE layer of model '{model.name}' (MoE layers: "
                f"{format_ranges(model.moe_layers)})")
        at.rows("layer", bad, "layer", lambda i: f"layer {layer[i]} is {held}")
    return layer, li


def _check_experts(at: _At, table: pa.Table, model: ModelSpec, present: bool) -> np.ndarray:
    """Expert ids ``[n, k]`` uint16: no nulls, in range, no expert twice in a row."""
    k, num_experts = model.top_k, model.num_experts
    if not present:
        return np.tile(np.arange(k, dtype=np.uint16), (table.num_rows, 1))
    ids, nulls = _fixed_list(table, "expert_ids", k, np.uint16)
    if nulls is not None:
        at.rows("null", nulls, "expert_ids", lambda i: "null value (every row needs its top-k expert ids)")
    if ids.size and int(ids.max()) >= num_experts:
        too_big = ids >= num_experts
        at.rows("expert_range", too_big.any(axis=1), "expert_ids", lambda i: (
            f"expert id {int(ids[i][too_big[i]][0])} >= num_experts {num_experts} of model '{model.name}'"))
    dup = repeated_expert_rows(ids)
    if dup is not None:
        def dup_msg(i: int) -> str:
            s = np.sort(ids[i])
            return f"expert {int(s[1:][s[1:] == s[:-1]][0])} repeated in one token's top-{k} {ids[i].tolist()}"
        at.rows("duplicate_expert", dup, "expert_ids", dup_msg)
    return ids


def _check_planes(at: _At, table: pa.Table, model: ModelSpec, present: bool) -> np.ndarray:
    """Expert ids ``[n, k]`` uint16 (ascending) from the byte planes of format version 2: no nulls, in
    range (the row's last id, its largest, below num_experts), no expert twice (a zero delta after the
    first). Reported as ``expert_ids``, the logical column, with the row's decoded ids."""
    k, num_experts = model.top_k, model.num_experts
    n = table.num_rows
    if not present:
        return np.tile(np.arange(k, dtype=np.uint16), (n, 1))
    cols = [table.column(c) for c in ID_PLANES]
    cols = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in cols]
    nulls = None
    if cols[0].null_count or cols[1].null_count:
        nulls = np.asarray(cols[0].is_null().to_numpy(zero_copy_only=False)) | np.asarray(
            cols[1].is_null().to_numpy(zero_copy_only=False))
    lo, hi = id_planes(cols[0], cols[1], k)
    if nulls is not None:
        lo, hi = lo.copy(), hi.copy()
        # null rows (reported as such) get distinct in-range ids: no follow-on problems
        lo[nulls], hi[nulls] = np.minimum(1, np.arange(k)), 0
        at.rows("null", nulls, "expert_ids", lambda i: "null value (every row needs its top-k expert ids)")
    ids = decode_expert_ids(lo, hi)
    if n and int(ids[:, -1].max()) >= num_experts:
        too_big = ids >= num_experts
        at.rows("expert_range", too_big.any(axis=1), "expert_ids", lambda i: (
            f"expert id {int(ids[i][too_big[i]][0])} >= num_experts {num_experts} of model '{model.name}'"))
    if k > 1 and n:
        zero = lo[:, 1:] == 0
        if zero.any():
            zero &= hi[:, 1:] == 0
            dup = zero.any(axis=1)
            if dup.any():
                def dup_msg(i: int) -> str:
                    s = ids[i]
                    return f"expert {int(s[1:][s[1:] == s[:-1]][0])} repeated in one token's top-{k} {s.tolist()}"
                at.rows("duplicate_expert", dup, "expert_ids", dup_msg)
    return np.minimum(ids, 65535).astype(np.uint16)


def _check_weights(at: _At, table: pa.Table, k: int) -> None:
    """Gate weights: no nulls, finite, non-negative."""
    w, nulls = _fixed_list(table, "gate_weights", k, np.float32)
    if nulls is not None:
        at.rows("null", nulls, "gate_weights", lambda i: "null value")
    if w.size and not np.isfinite(w.sum()):
        nan = ~np.isfinite(w)
        at.rows("weight_nan", nan.any(axis=1), "gate_weights",
                lambda i: f"gate weight {float(w[i][nan[i]][0])} is not a finite number")
    neg = w < 0
    if neg.any():
        at.rows("weight_negative", neg.any(axis=1), "gate_weights",
                lambda i: f"gate weight {float(w[i][neg[i]][0]):g} is negative")


def _order_facts(edge: Edge, step, rid, pos, layer, li, model: ModelSpec) -> None:
    """Fill ``edge`` with the group's step decreases, first/last rows, token-row facts and rows per MoE
    layer (``li``: MoE-layer index per row, -1 where not an MoE layer)."""
    moe = li >= 0
    L = model.num_moe_layers
    edge.layer_rows = np.bincount(li if moe.all() else li[moe], minlength=L).astype(np.int64, copy=False)
    edge.moe_layers = tuple(model.moe_layers)
    edge.partial = model.is_partial
    down = np.flatnonzero(step[1:] < step[:-1]) + 1
    if down.size:
        edge.step_total = int(down.size)
        edge.step_rows = down[:MAX_DEFERRED]
        edge.step_vals = step[edge.step_rows]
        edge.step_prev = step[edge.step_rows - 1]
    edge.first = (int(step[0]), int(rid[0]), int(pos[0]), int(layer[0]))
    edge.last = (int(step[-1]), int(rid[-1]), int(pos[-1]), int(layer[-1]))
    _token_rows(edge, step, rid, pos, layer, moe)


_LAYER_INDEX: dict[tuple[int, ...], np.ndarray] = {}


def _layer_index(model: ModelSpec) -> np.ndarray:
    """int32 ``[65536]``: decoder layer -> index into ``model.moe_layers``, -1 where not an MoE layer."""
    key = tuple(model.moe_layers)
    got = _LAYER_INDEX.get(key)
    if got is None:
        got = np.full(65536, -1, np.int32)
        got[list(model.moe_layers)] = np.arange(model.num_moe_layers)
        _LAYER_INDEX[key] = got  # published whole: other threads of a pass read it
    return got
