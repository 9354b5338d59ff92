"""The trace gate: every check of the trace contract (``traces/format.py``), and the only way a trace
enters a command.

Entry points (all raise :class:`~foundation.errors.InputError` with the *first* problem as one line, the same
line ``place trace validate`` prints first for that trace):

- :func:`open_trace` -> :class:`Trace`: the file-level checks (every file opens as Parquet, ``moeplace.format``
  is a version this code reads, ``moeplace.model`` parses and is the same model in every file, required
  columns exist with the contract's types, every file has the same optional columns, the trace has rows).
  Readers that stream row groups themselves (``traces.stats``) open the trace with it and run
  :func:`check_row_group` on every row group they decode plus :class:`RowOrder` on the results in trace
  order — validation inside the one streaming pass, no second read.
- :func:`check_trace` -> :class:`Trace`: :func:`open_trace` plus every row group — for readers that load
  rows another way (the simulator, ``evaluate``'s token replay, the dashboard).
- :func:`validate_report`: the same checks in the same order, collecting every problem instead of stopping
  at the first (``place trace validate``); ``max_per_kind`` only limits how many are *listed*, never the
  verdict.

Row checks, per row group: no nulls; ``layer`` is an MoE layer of the model; expert ids ``< num_experts``
and no expert repeated in one row's top-k; gate weights finite and non-negative; ``phase`` 0 or 1;
``request_id`` in ``[0, 2^39)``, ``position`` in ``[0, 2^24)``. Across row groups and files (in the sorted
order of :func:`traces.format.trace_files`): ``step`` never decreases, the rows of one token — a
(``step``, ``request_id``, ``position``) — are consecutive with strictly ascending MoE layers, so a token
never has two rows for one layer; after the last row group (:meth:`RowOrder.finish`): a
(``request_id``, ``position``) appears in one step only, and every token has a row in every MoE layer the
trace holds (a trace may hold some of the model's MoE layers only, but then every token holds the same ones).

Every problem is one line naming the file, the row (or row group) and the field.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from foundation.errors import InputError, where
from foundation.model import ModelSpec, format_ranges, spec_from_json
from traces.format import (
    FORMAT_VERSION,
    META_FORMAT,
    META_MODEL,
    META_PROVENANCE,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    trace_files,
)

DEFAULT_MAX_PER_KIND = 5
# a token is packed as request_id << 24 | position by the readers that replay tokens: 2^24 positions is
# 16x K3's 1 M-token context, 2^39 request ids more than any engine log numbers
MAX_POSITION = (1 << 24) - 1
MAX_REQUEST_ID = (1 << 39) - 1
_STRING_TYPES = (pa.string(), pa.large_string())
# deferred row problems (step order, token rows) a row group hands on, per kind: enough for any listing
_MAX_DEFERRED = 1000


# ---------------------------------------------------------------------------- problems and sinks
@dataclass(frozen=True)
class Problem:
    """One violation. ``kind`` groups problems for the per-kind listing limit (e.g. ``"expert_range"``)."""

    kind: str
    path: str
    row: int | str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        return where(self.path, self.row, self.field) + self.message


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_report`. ``ok`` depends on every problem found (``total``), never on how
    many are listed: ``problems`` holds the first problem found and then up to ``max_per_kind`` per kind;
    ``suppressed`` counts the rest per kind."""

    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_rows: int = 0
    num_tokens: int = 0
    model: ModelSpec | None = None
    suppressed: Counter = field(default_factory=Counter)  # kind -> problems found but not listed
    total: int = 0

    @property
    def ok(self) -> bool:
        return self.total == 0

    @property
    def first(self) -> Problem | None:
        """The problem every reader of this trace stops at (its one-line error)."""
        return self.problems[0] if self.problems else None

    def lines(self) -> list[str]:
        """One line per listed problem (the first is the readers' error), then one per kind with problems
        not listed."""
        out = [str(p) for p in self.problems]
        for kind, n in sorted(self.suppressed.items()):
            out.append(f"... and {n} more '{kind}' problem(s) not listed")
        return out

    def summary(self) -> str:
        m = self.model
        model = (
            f"model '{m.name}': {m.num_moe_layers} MoE layers x {m.num_experts} experts, top-{m.top_k}"
            if m is not None
            else "no model"
        )
        return f"OK: {self.num_files} file(s), {self.num_rows:,} rows, {self.num_tokens:,} tokens ({model})"


class _Raise:
    """Sink of the gate: the first problem is an :class:`InputError`."""

    collecting = False

    def add(self, kind: str, path, row, fld, message: str) -> None:
        raise InputError(str(Problem(kind, str(path), row, fld, message)))

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        """Report the rows where boolean mask ``bad`` is set; ``msg_of_index(i)`` words local row ``i``."""
        if bad.any():
            i = int(np.argmax(bad))
            self.add(kind, path, row0 + i, fld, msg_of_index(i))

    def more(self, kind: str, n: int) -> None:  # pragma: no cover - never reached: add raised
        pass


class ProblemFound(Exception):
    """Raised by a :class:`Detect` sink: the checks found a problem (not worded)."""


class Detect:
    """Sink that only tells whether there is a problem: the first raises :class:`ProblemFound`, no message
    is built. For fast paths that, on a problem, run the checks again with a reporting sink."""

    collecting = False

    def add(self, kind: str, path, row, fld, message: str) -> None:
        raise ProblemFound(kind)

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        if bad.any():
            raise ProblemFound(kind)

    def more(self, kind: str, n: int) -> None:  # pragma: no cover - never reached: add raised
        pass


class _Collect:
    """Sink of ``place trace validate``: counts every problem, lists the first one and up to
    ``max_per_kind`` of each kind."""

    collecting = True

    def __init__(self, report: ValidationReport, max_per_kind: int) -> None:
        self.report = report
        self.max_per_kind = max(int(max_per_kind), 0)
        self.listed: Counter = Counter()

    def add(self, kind: str, path, row, fld, message: str) -> None:
        rep = self.report
        rep.total += 1
        if rep.total == 1 or self.listed[kind] < self.max_per_kind:
            rep.problems.append(Problem(kind, str(path), row, fld, message))
            self.listed[kind] += 1
        else:
            rep.suppressed[kind] += 1

    def more(self, kind: str, n: int) -> None:
        """``n`` further problems of ``kind`` that were found but not worded."""
        if n > 0:
            self.report.total += n
            self.report.suppressed[kind] += n

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            return
        room = max(self.max_per_kind - self.listed[kind], 1 if self.report.total == 0 else 0)
        for i in idx[:room]:
            self.add(kind, path, row0 + int(i), fld, msg_of_index(int(i)))
        self.more(kind, idx.size - min(room, idx.size))


# ---------------------------------------------------------------------------- file level
@dataclass(frozen=True)
class TraceFile:
    """One Parquet file of a trace: its row-group sizes and the contract columns it holds with the right
    types (``columns``)."""

    path: Path
    row_groups: tuple[int, ...]
    columns: frozenset[str]

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


@dataclass(frozen=True)
class Trace:
    """A trace past the gate's file-level checks (:func:`open_trace`). ``files`` in reading order;
    ``columns``: the contract columns every file holds (required ones plus the same optional ones)."""

    path: Path
    model: ModelSpec
    provenance: dict[str, Any]
    files: tuple[TraceFile, ...]

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    @property
    def columns(self) -> frozenset[str]:
        return self.files[0].columns

    @property
    def file_paths(self) -> list[Path]:
        return [f.path for f in self.files]

    def row_groups(self) -> list[tuple[int, int, int]]:
        """``(file index, row group, first row of the group in the trace)`` for every row group, in order."""
        out, row0 = [], 0
        for fi, f in enumerate(self.files):
            for rg, n in enumerate(f.row_groups):
                out.append((fi, rg, row0))
                row0 += n
        return out


def _expected_types(model: ModelSpec) -> dict[str, tuple[str, Any]]:
    k = model.top_k

    def fixed_list(value_type):
        return lambda t: pa.types.is_fixed_size_list(t) and t.list_size == k and t.value_type == value_type

    return {
        "request_id": ("int64", lambda t: t == pa.int64()),
        "position": ("int32", lambda t: t == pa.int32()),
        "phase": ("uint8", lambda t: t == pa.uint8()),
        "step": ("int64", lambda t: t == pa.int64()),
        "layer": ("uint16", lambda t: t == pa.uint16()),
        "expert_ids": (f"fixed_size_list<uint16>[{k}]", fixed_list(pa.uint16())),
        "gate_weights": (f"fixed_size_list<float32>[{k}]", fixed_list(pa.float32())),
        "token_id": ("int32", lambda t: t == pa.int32()),
        "domain": (
            "string",
            lambda t: t in _STRING_TYPES or (pa.types.is_dictionary(t) and t.value_type in _STRING_TYPES),
        ),
    }


def _schema_columns(sink, path: Path, schema: pa.Schema, model: ModelSpec) -> set[str]:
    """Check names and types; return the columns that are usable for row checks."""
    expected = _expected_types(model)
    usable = set()
    for name in REQUIRED_COLUMNS:
        if schema.get_field_index(name) < 0:
            sink.add("missing_column", path, None, name, f"required column missing (expected {expected[name][0]})")
    for name, (text, ok) in expected.items():
        i = schema.get_field_index(name)
        if i < 0:
            continue
        t = schema.field(i).type
        if ok(t):
            usable.add(name)
        elif name in ("expert_ids", "gate_weights") and pa.types.is_fixed_size_list(t) and t.list_size != model.top_k:
            sink.add("wrong_k", path, None, name,
                     f"lists of {t.list_size} per row, expected k = {model.top_k} (top_k of model '{model.name}')")
        else:
            sink.add("column_type", path, None, name, f"type {t}, expected {text}")
    return usable


def _file_model(sink, path: Path, meta: dict) -> tuple[ModelSpec, dict] | None:
    """Model and provenance from one file's key-value metadata (after checking the format version)."""
    version = meta.get(META_FORMAT)
    if META_MODEL not in meta:
        sink.add("metadata", path, None, None,
                 "metadata 'moeplace.model' missing: not a moeplace trace (import it with `place trace import`)")
        return None
    if version is None:
        sink.add("metadata", path, None, None,
                 f"metadata 'moeplace.format' missing (expected trace format version {FORMAT_VERSION})")
        return None
    if version != FORMAT_VERSION.encode():
        shown = version.decode(errors="replace")[:40]
        sink.add("metadata", path, None, None,
                 f"metadata 'moeplace.format' is version {shown!r}; this moeplace reads trace format version "
                 f"{FORMAT_VERSION!r} only")
        return None
    try:
        model = spec_from_json(meta[META_MODEL].decode())
    except (ValueError, UnicodeDecodeError, InputError, TypeError, KeyError, AttributeError) as exc:
        sink.add("metadata", path, None, None, f"metadata 'moeplace.model' is not a valid model spec ({exc})")
        return None
    try:
        prov = json.loads(meta.get(META_PROVENANCE, b"{}").decode())
    except (ValueError, UnicodeDecodeError) as exc:
        sink.add("metadata", path, None, None, f"metadata 'moeplace.provenance' is not a JSON object ({exc})")
        return None
    if not isinstance(prov, dict):
        sink.add("metadata", path, None, None,
                 f"metadata 'moeplace.provenance' is a JSON {type(prov).__name__}, expected an object")
        return None
    return model, prov


def _open_files(sink, path: str | Path) -> Trace | None:
    """The file-level checks, in file order, problems into ``sink``. Returns the trace (its readable,
    consistent files) or None when no file has a usable header."""
    files = trace_files(path)
    ref: tuple[ModelSpec, dict, Path] | None = None
    opened: list[TraceFile] = []
    first_optional: tuple[list[str], Path] | None = None
    unreadable = False
    for f in files:
        try:
            md = pq.read_metadata(f)
            schema = md.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as exc:
            sink.add("corrupt", f, None, None, f"not a readable Parquet file: truncated or corrupt ({exc})")
            unreadable = True
            continue
        got = _file_model(sink, f, schema.metadata or {})
        if got is None:
            unreadable = True
            continue
        model, prov = got
        if ref is None:
            ref = (model, prov, f)
        elif model != ref[0]:
            sink.add("metadata", f, None, None,
                     f"metadata 'moeplace.model' declares model '{model.name}' ({model.num_moe_layers} MoE layers x "
                     f"{model.num_experts} experts, top-{model.top_k}), inconsistent with {ref[2]} ('{ref[0].name}'); "
                     "one trace directory holds one model")
            unreadable = True
            continue
        usable = _schema_columns(sink, f, schema, ref[0])
        tf = TraceFile(f, tuple(md.row_group(i).num_rows for i in range(md.num_row_groups)), frozenset(usable))
        optional = [c for c in OPTIONAL_COLUMNS if c in schema.names]
        if first_optional is None:
            first_optional = (optional, f)
        elif optional != first_optional[0]:
            sink.add("column_set", f, None, None,
                     f"optional columns {optional or 'none'} differ from {first_optional[1]}'s "
                     f"{first_optional[0] or 'none'}; every file of a trace has the same columns")
        opened.append(tf)
    if ref is None:
        return None
    trace = Trace(Path(path), ref[0], ref[1], tuple(opened))
    if trace.num_rows == 0 and not unreadable:
        sink.add("empty", path, None, None, "the trace has no rows (nothing to compute on)")
    return trace


def open_trace(path: str | Path) -> Trace:
    """The gate's file-level checks (see the module docstring); raises :class:`InputError` at the first
    problem. The rows are not read: stream them through :func:`check_row_group` and :class:`RowOrder`
    (as ``traces.stats`` does), or use :func:`check_trace`."""
    trace = _open_files(_Raise(), path)
    assert trace is not None  # _Raise raised otherwise
    return trace


# ---------------------------------------------------------------------------- row groups
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
    return str(Problem("corrupt", str(path), f"row group {rg}", None, f"cannot be decoded: corrupt data ({exc})"))


def read_columns(trace: Trace, fi: int, rg: int, pf: pq.ParquetFile, extra=()) -> list[str]:
    """Columns a reader decodes for row group ``rg`` of file ``fi``: what the row checks need (``token_id``
    only when the footer statistics say it may hold nulls: it has no other check and no reader of rows
    needs it) plus ``extra``."""
    cols = trace.files[fi].columns
    need = [c for c in ("request_id", "position", "phase", "step", "layer", "expert_ids", "gate_weights",
                        "domain") if c in cols]
    for c in ("token_id",):
        if c in cols and (c in extra or _may_hold_nulls(pf.metadata, rg, c)):
            need.append(c)
    return need


def _plain(table: pa.Table, name: str, dtype) -> np.ndarray:
    a = table.column(name)
    a = a.chunk(0) if a.num_chunks == 1 else a.combine_chunks()
    if a.null_count:
        a = a.fill_null(0)
    return np.asarray(a.to_numpy(zero_copy_only=False), dtype=dtype)


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
    vals = np.asarray(values.to_numpy(zero_copy_only=False), dtype=dtype).reshape(n, k)
    if nulls is not None:
        vals = vals.copy()
        # null rows (reported as such) get distinct in-range ids / zero weights: no follow-on problems
        vals[nulls] = np.arange(k) if np.issubdtype(dtype, np.integer) else 0.0
    return vals, nulls


_DUP_CHUNK = 1 << 14  # rows per block: the transposed block and the comparisons stay in L2
_DUP_BUFFERS: list[np.ndarray] = []  # per process: transposed ids and the comparison buffer, reused


def repeated_expert_rows(ids: np.ndarray) -> np.ndarray | None:
    """Rows of ``ids [n, k]`` that name one expert twice (bool ``[n]``), or None when there is none.

    Compares the k(k-1)/2 column pairs on cache-sized transposed blocks (~15 ms per million top-16 rows,
    about a third of a row sort); the exact rows are computed only when a block has a repeat."""
    n, k = ids.shape
    if k < 2 or n == 0:
        return None
    if not _DUP_BUFFERS or _DUP_BUFFERS[0].dtype != ids.dtype or _DUP_BUFFERS[0].shape[0] != k:
        _DUP_BUFFERS[:] = [np.empty((k, _DUP_CHUNK), ids.dtype), np.empty((k - 1) * _DUP_CHUNK, bool)]
    tbuf, ebuf = _DUP_BUFFERS
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
    edge: _Edge


@dataclass
class _Edge:
    """Order facts of one row group: its first/last row's (step, request, position, layer); the problems
    found inside it that are reported in row order with the cross-group ones (``step_rows``/``token_rows``:
    local row indices, at most ``_MAX_DEFERRED``, plus totals); the tokens of its first and last step
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


def _token_rows(edge: _Edge, step, rid, pos, layer, moe: np.ndarray) -> None:
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
            for i in idx[:_MAX_DEFERRED].tolist():
                probs.append((i, kind, "layer", _layer_order_message(
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
            for i, j in list(zip(later.tolist(), earlier.tolist()))[:_MAX_DEFERRED]:
                probs.append((i, "row_order", "position", _resume_message(int(rid[i]), int(pos[i]), int(step[i]),
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


def _layer_order_message(layer: int, before: int, rid: int, pos: int, step: int) -> str:
    tok = f"token (request {rid}, position {pos}, step {step})"
    if layer == before:
        return f"layer {layer} repeated for {tok}: one row per token and MoE layer"
    return f"layer {layer} after layer {before} for {tok}: a token's rows must be in ascending layer order"


def _resume_message(rid: int, pos: int, step: int, first: str) -> str:
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
    present = tf.columns & set(table.column_names)
    for name in ("request_id", "position", "phase", "step", "layer", "token_id", "domain"):
        if name in present and table.column(name).null_count:
            nulls = np.asarray(table.column(name).is_null().to_numpy(zero_copy_only=False))
            at.rows("null", nulls, name, lambda i: "null value (the column must be complete)")
    layer, li = _check_layers(at, table, model, "layer" in present)
    ids = _check_lists(at, table, model, present) if lists else None
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
    edge = _Edge(str(at.path), at.row0, n)
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
    return _check_lists(at, table, trace.model, tf.columns & set(table.column_names))


def _check_lists(at: _At, table: pa.Table, model: ModelSpec, present) -> np.ndarray:
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
        at.rows("layer", bad, "layer", lambda i: (f"layer {layer[i]} is not an MoE layer of model '{model.name}' "
                                                  f"(MoE layers: {format_ranges(model.moe_layers)})"))
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


def _order_facts(edge: _Edge, step, rid, pos, layer, li, model: ModelSpec) -> None:
    """Fill ``edge`` with the group's step decreases, first/last rows, token-row facts and rows per MoE
    layer (``li``: MoE-layer index per row, -1 where not an MoE layer)."""
    moe = li >= 0
    L = model.num_moe_layers
    edge.layer_rows = np.bincount(li if moe.all() else li[moe], minlength=L).astype(np.int64, copy=False)
    edge.moe_layers = tuple(model.moe_layers)
    down = np.flatnonzero(step[1:] < step[:-1]) + 1
    if down.size:
        edge.step_total = int(down.size)
        edge.step_rows = down[:_MAX_DEFERRED]
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
        got = _LAYER_INDEX[key] = np.full(65536, -1, np.int32)
        got[list(model.moe_layers)] = np.arange(model.num_moe_layers)
    return got


class RowOrder:
    """The checks that span row groups and files, fed every row group's :class:`RowGroup` ``edge`` in trace
    order (:meth:`feed`): ``step`` never decreases; a token's rows are consecutive with ascending layers.
    Problems go to ``sink`` in row order, step order first — as :func:`check_row_group` defers them.
    :meth:`finish` checks what needs the whole trace: one step per token, one row per held MoE layer."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self.prev: _Edge | None = None
        self.prev_where = ""
        self.open_step: int | None = None
        # tokens of the open step seen in earlier row groups: request ids, positions, first row, file
        self.open_tokens: list[tuple[np.ndarray, np.ndarray, np.ndarray, str]] = []
        # every token run so far: packed (request_id, position), step, trace row, file, rows; for :meth:`finish`
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray]] = []
        # rows per MoE layer of the model so far: the layers the trace holds are those with rows
        self.layer_rows: np.ndarray | None = None
        self.moe_layers: tuple[int, ...] = ()

    def feed(self, edge: _Edge, where_before: str) -> None:
        """Check ``edge`` against what came before. ``where_before`` words the row before its first row
        (``"the row before"`` or ``"the last row of part-00000.parquet"``) for the step message."""
        if edge.first is None:
            return
        self._steps(edge, where_before)
        probs = self._token_problems(edge)
        probs.sort(key=lambda t: t[0])
        for r, kind, fld, msg in probs:
            self.sink.add(kind, edge.path, edge.row0 + r, fld, msg)
        for kind, n in edge.token_total.items():
            self.sink.more(kind, n - min(n, _MAX_DEFERRED))
        # the open step's tokens, for the groups after
        trid, tpos, tstart = edge.tail
        tail = (trid, tpos, tstart.astype(np.int64) + edge.row0, edge.path)
        if edge.last[0] == edge.first[0] and edge.first[0] == self.open_step:
            self.open_tokens.append(tail)
        else:
            self.open_step = edge.last[0]
            self.open_tokens = [tail]
        if edge.run_keys.size:
            self.runs.append((edge.run_keys, edge.run_steps, edge.run_rows + edge.row0, edge.path, edge.run_lens))
        if edge.layer_rows is not None:
            self.layer_rows = edge.layer_rows.copy() if self.layer_rows is None else self.layer_rows + edge.layer_rows
            self.moe_layers = edge.moe_layers
        self.prev = edge

    def finish(self) -> None:
        """After the last row group: a token (request_id, position) is processed in one step only, so it
        names one token wherever it appears (the replay in ``place evaluate`` and the simulator rely on it),
        reported at the later step's first row; then every token has a row in each MoE layer the trace
        holds (those rows are consecutive and ascending, so counting them suffices), reported at the
        token's first row in trace order."""
        if not self.runs:
            return
        keys = np.concatenate([r[0] for r in self.runs])
        steps = np.concatenate([r[1] for r in self.runs])
        rows = np.concatenate([r[2] for r in self.runs])
        lens = np.concatenate([r[4] for r in self.runs])
        src = np.concatenate([np.full(len(r[0]), j) for j, r in enumerate(self.runs)])
        order = np.lexsort((np.arange(len(keys)), steps, keys))
        k, st = keys[order], steps[order]
        twice = (k[1:] == k[:-1]) & (st[1:] != st[:-1])
        hits = np.flatnonzero(twice)
        # the first run of each (token, step): a token cut by a row-group boundary is two runs
        new = np.ones(len(k), bool)
        new[1:] = (k[1:] != k[:-1]) | (st[1:] != st[:-1])
        run_start = np.maximum.accumulate(np.where(new, np.arange(len(k)), 0))
        self._twice(hits, order, run_start, keys, steps, rows, src)
        self._incomplete(order, new, k, lens, keys, steps, rows, src)
        self.runs = []

    def _twice(self, hits, order, run_start, keys, steps, rows, src) -> None:
        """One problem per (token, later step) of a token seen in two steps."""
        seen: set[tuple[int, int]] = set()
        for h in hits.tolist():
            a, b = int(order[run_start[h]]), int(order[h + 1])
            if (int(keys[b]), int(steps[b])) in seen:
                continue
            seen.add((int(keys[b]), int(steps[b])))
            rid, pos = int(keys[b]) >> 24, int(keys[b]) & ((1 << 24) - 1)
            first = f"row {int(rows[a])}" + ("" if self.runs[src[a]][3] == self.runs[src[b]][3] else f" of {Path(self.runs[src[a]][3]).name}")
            self.sink.add("token_twice", self.runs[src[b]][3], int(rows[b]), "position",
                          f"token (request {rid}, position {pos}) in step {int(steps[b])} was already in step "
                          f"{int(steps[a])} ({first}): a (request_id, position) is one token, processed in "
                          "one step")

    def _incomplete(self, order, new, k, lens, keys, steps, rows, src) -> None:
        """Tokens with fewer rows than the MoE layers the trace holds (runs of one (token, step) summed:
        a token cut by a row-group boundary is whole again). A token also seen in another step is reported
        as that, not again as this."""
        if self.layer_rows is None:
            return
        held = np.flatnonzero(self.layer_rows > 0)
        m = int(held.size)
        first = np.flatnonzero(new)
        total = np.add.reduceat(lens[order], first) if first.size else first
        short = total < m
        if not short.any():
            return
        key_new = np.ones(len(k), bool)
        key_new[1:] = k[1:] != k[:-1]
        key_of = (np.cumsum(key_new) - 1)[first]
        short &= np.bincount(key_of)[key_of] == 1
        at = np.sort(order[first[short]])  # trace order: the runs are numbered in it
        n_at = np.zeros(len(keys), np.int64)
        n_at[order[first]] = total
        layers = format_ranges([self.moe_layers[i] for i in held])
        for i in at[:_MAX_DEFERRED].tolist():
            rid, pos = int(keys[i]) >> 24, int(keys[i]) & ((1 << 24) - 1)
            self.sink.add("incomplete_token", self.runs[src[i]][3], int(rows[i]), "layer",
                          f"token (request {rid}, position {pos}, step {int(steps[i])}) has rows in {int(n_at[i])} "
                          f"of the {m} MoE layers the trace holds ({layers}); a token needs one row in each")
        self.sink.more("incomplete_token", at.size - min(at.size, _MAX_DEFERRED))

    def _steps(self, edge: _Edge, where_before: str) -> None:
        """Step order: the boundary row, then the group's own decreases, in row order."""
        prev = self.prev
        rows = [(int(r), int(v), int(p), "the row before") for r, v, p in
                zip(edge.step_rows, edge.step_vals, edge.step_prev)]
        if prev is not None and prev.last is not None and edge.first[0] < prev.last[0]:
            rows.insert(0, (0, edge.first[0], prev.last[0], where_before))
        for r, v, p, wb in rows:
            if r == 0:
                msg = f"step {v} decreases from step {p} ({wb}); steps must be non-decreasing"
            else:
                msg = f"step {v} decreases from step {p} in the row before; steps must be non-decreasing"
            self.sink.add("step_order", edge.path, edge.row0 + r, "step", msg)
        self.sink.more("step_order", edge.step_total - len(edge.step_rows))

    def _token_problems(self, edge: _Edge) -> list[tuple[int, str, str, str]]:
        """The group's own token-row problems, plus: its first row continuing the previous group's last
        token with a layer not above it; a token of the open step (seen in earlier groups) starting again."""
        prev = self.prev
        probs = list(edge.token_problems)
        rid, pos, start = edge.head
        skip = 0
        if prev is not None and prev.last is not None and edge.first[:3] == prev.last[:3]:
            skip = 1  # the first run continues the previous group's last token
            if edge.first[3] <= prev.last[3]:
                step, rid0, pos0, layer0 = edge.first
                kind = "duplicate_row" if layer0 == prev.last[3] else "row_order"
                probs.append((0, kind, "layer", _layer_order_message(layer0, prev.last[3], rid0, pos0, step)))
        if self.open_step is None or edge.first[0] != self.open_step or not self.open_tokens or len(rid) <= skip:
            return probs
        orid, opos, orow = (np.concatenate(x) for x in zip(*(t[:3] for t in self.open_tokens)))
        opath = [t[3] for t in self.open_tokens]
        src_of = np.concatenate([np.full(len(t[0]), j) for j, t in enumerate(self.open_tokens)])
        hr, hp, hs = rid[skip:], pos[skip:], start[skip:]
        allr, allp = np.concatenate([orid, hr]), np.concatenate([opos, hp])
        src = np.concatenate([np.full(len(orid), -1, np.int64), np.arange(len(hr))])
        order = np.lexsort((src, allp, allr))  # per token: the open step's entries first
        same = (allr[order][1:] == allr[order][:-1]) & (allp[order][1:] == allp[order][:-1])
        hit = same & (src[order][1:] >= 0) & (src[order][:-1] < 0)
        for a, b in zip(order[:-1][hit], order[1:][hit]):
            i, j = int(src[b]), int(src_of[a])
            first = f"row {int(orow[a])}" + ("" if opath[j] == edge.path else f" of {Path(opath[j]).name}")
            probs.append((int(hs[i]), "row_order", "position",
                          _resume_message(int(hr[i]), int(hp[i]), edge.first[0], first)))
        return probs


# ---------------------------------------------------------------------------- whole traces
def _check_rows(sink, trace: Trace, report: ValidationReport | None = None) -> None:
    """Stream every row group of ``trace`` through :func:`check_row_group` and :class:`RowOrder`."""
    order = RowOrder(sink)
    where_before = "the row before"
    for fi, tf in enumerate(trace.files):
        try:
            pf = pq.ParquetFile(tf.path)
        except (pa.ArrowException, OSError, ValueError) as exc:
            sink.add("corrupt", tf.path, None, None, f"not a readable Parquet file: truncated or corrupt ({exc})")
            continue
        for rg in range(pf.num_row_groups):
            try:
                table = pf.read_row_group(rg, columns=read_columns(trace, fi, rg, pf))
            except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
                sink.add("corrupt", tf.path, f"row group {rg}", None, f"cannot be decoded: corrupt data ({exc})")
                continue
            group = check_row_group(sink, trace, fi, rg, table)
            order.feed(group.edge, where_before)
            where_before = (f"the last row of {tf.path.name}" if rg == pf.num_row_groups - 1
                            else "the row before")
    if report is not None and order.layer_rows is not None:
        report.num_tokens = int(order.layer_rows.max(initial=0))  # before finish, which may raise
    order.finish()


def check_trace(path: str | Path) -> Trace:
    """The gate, rows included: :func:`open_trace` plus every row group's checks; raises
    :class:`InputError` with the first problem (the line ``place trace validate`` prints first)."""
    trace = open_trace(path)
    _check_rows(_Raise(), trace)
    return trace


def validate_report(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> ValidationReport:
    """Every problem of a trace (file or directory), by the gate's checks in the gate's order.

    ``max_per_kind`` (values below 0 count as 0) limits only how many problems of each kind are listed;
    the first problem is always listed and ``ok`` counts all. ``num_tokens`` counts the rows of the
    best-covered MoE layer. Raises :class:`InputError` only when ``path`` does not exist or holds no
    Parquet files."""
    report = ValidationReport()
    sink = _Collect(report, max_per_kind)
    trace = _open_files(sink, path)
    report.num_files = len(trace_files(path))
    if trace is None:
        return report
    report.model = trace.model
    report.num_rows = trace.num_rows
    _check_rows(sink, trace, report)
    return report


def validate_trace(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> list[Problem]:
    """The listed problems of a trace; empty when it is valid. See :func:`validate_report`."""
    return validate_report(path, max_per_kind=max_per_kind).problems
