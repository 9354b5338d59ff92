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
trace holds, and the trace holds every MoE layer its model declares (a layer without rows is refused: it would
read as a model without that layer).

Every problem is one line naming the file, the row (or row group) and the field. The checks live in
``gate/report`` (problems, sinks, the report), ``gate/files`` (file level), ``gate/rows`` (one row group)
and ``gate/order`` (across row groups and files); this module runs them over whole traces and is the one
import readers use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.format import (
    ID_PLANES,
    READ_CHECKSUMS,
    decode_expert_ids,
    id_planes,
    polars_expert_ids,
    trace_files,
)
from moeplace.traces.gate.files import Trace, TraceFile, open_failure, open_files, open_trace
from moeplace.traces.gate.order import RowOrder
from moeplace.traces.gate.report import (
    DEFAULT_MAX_PER_KIND,
    Collect,
    Detect,
    Problem,
    ProblemFound,
    Raise,
    ValidationReport,
)
from moeplace.traces.gate.rows import (
    MAX_POSITION,
    MAX_REQUEST_ID,
    RowGroup,
    check_lists,
    check_row_group,
    check_weights,
    corrupt_group,
    decode_failure,
    read_columns,
    repeated_expert_rows,
)
from moeplace.traces.scan import check_pass

__all__ = [
    "DEFAULT_MAX_PER_KIND",
    "MAX_POSITION",
    "MAX_REQUEST_ID",
    "Detect",
    "Problem",
    "ProblemFound",
    "Raise",
    "RowGroup",
    "RowOrder",
    "Trace",
    "TraceFile",
    "ValidationReport",
    "check_lists",
    "check_row_group",
    "check_trace",
    "check_weights",
    "corrupt_group",
    "open_failure",
    "open_trace",
    "read_columns",
    "read_expert_ids",
    "repeated_expert_rows",
    "validate_report",
    "validate_trace",
]


# ---------------------------------------------------------------------------- whole traces
def _check_rows(sink, trace: Trace, report: ValidationReport | None = None) -> None:
    """Stream every row group of ``trace`` through :func:`check_row_group` and :class:`RowOrder`."""
    order = RowOrder(sink)
    where_before = "the row before"
    for fi, tf in enumerate(trace.files):
        try:
            pf = pq.ParquetFile(tf.path, **READ_CHECKSUMS)
        except (pa.ArrowException, OSError, ValueError) as exc:
            sink.add("corrupt", tf.path, None, None, open_failure(exc))
            continue
        for rg in range(pf.num_row_groups):
            try:
                table = pf.read_row_group(rg, columns=read_columns(trace, fi, rg, pf))
            except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
                sink.add("corrupt", tf.path, f"row group {rg}", None, decode_failure(exc))
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
    :class:`InputError` with the first problem (the line ``place trace validate`` prints first). The rows
    are checked on the stats pass's fast path, on every core (:func:`traces.scan.check_pass`)."""
    trace = open_trace(path)
    check_pass(trace)
    return trace


def validate_report(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> ValidationReport:
    """Every problem of a trace (file or directory), by the gate's checks in the gate's order.

    ``max_per_kind`` (values below 0 count as 0) limits only how many problems of each kind are listed;
    the first problem is always listed and ``ok`` counts all. ``num_tokens`` counts the rows of the
    best-covered MoE layer. Raises :class:`InputError` only when ``path`` does not exist or holds no
    Parquet files."""
    report = ValidationReport()
    sink = Collect(report, max_per_kind)
    trace = open_files(sink, path)
    report.num_files = len(trace_files(path))
    if trace is None:
        return report
    report.model = trace.model
    report.num_rows = trace.num_rows
    if report.ok:
        # a valid trace (the common case) is proven on every core by the stats pass's checks; a problem
        # found there sends the trace through the listing pass below, which finds every one
        try:
            report.num_tokens = check_pass(trace)
            return report
        except InputError:
            pass
    _check_rows(sink, trace, report)
    return report


def validate_trace(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> list[Problem]:
    """The listed problems of a trace; empty when it is valid. See :func:`validate_report`."""
    return validate_report(path, max_per_kind=max_per_kind).problems


# ---------------------------------------------------------------------------- readers behind the gate
def read_trace_meta(path: str | Path) -> tuple[ModelSpec, dict[str, Any]]:
    """Model and provenance of a trace, after the gate's file-level checks (``open_trace``:
    readable files, a known format version, one model, the contract's columns, rows)."""
    trace = open_trace(path)
    return trace.model, trace.provenance


def scan_trace(path: str | Path) -> pl.LazyFrame:
    """Lazy polars frame over all rows of a trace (file or directory) that passed the whole gate
    (``check_trace``: every row is checked before any is handed out), with the logical columns of the
    format: ``expert_ids`` (``array[u16, k]``) decoded from the byte planes of version-2 files (each row's
    ids ascending; version-1 files as they were written, in the router's order)."""
    trace = check_trace(path)
    k = trace.model.top_k

    def logical(lf: pl.LazyFrame) -> pl.LazyFrame:
        names = lf.collect_schema().names()
        return lf.with_columns(polars_expert_ids(k)).select(
            ["expert_ids" if c == ID_PLANES[0] else c for c in names if c != ID_PLANES[1]])

    versions = {tf.version for tf in trace.files}
    if len(versions) == 1:
        lf = pl.scan_parquet([str(f) for f in trace.file_paths])
        return logical(lf) if versions.pop() >= 2 else lf
    # files of both versions (a directory that gathered an old and a new trace): one frame per file, in order
    return pl.concat([logical(pl.scan_parquet(str(tf.path))) if tf.version >= 2 else pl.scan_parquet(str(tf.path))
                      for tf in trace.files], how="diagonal_relaxed")


def read_expert_ids(trace: Trace, rows: np.ndarray | None = None) -> np.ndarray:
    """The expert ids uint16 ``[n, k]`` of a trace that passed the gate (:func:`check_trace`), each row's
    ids ascending (the logical ``expert_ids`` column of either format version), in trace order — the
    row order of ``pl.scan_parquet`` over ``trace.file_paths`` — or only the rows ``rows`` (ascending trace
    row indices; memory then follows them, not the trace). Reads the id columns only."""
    k = trace.model.top_k
    parts: list[np.ndarray] = []
    row0 = 0
    for tf in trace.files:
        pf = pq.ParquetFile(tf.path, memory_map=True, **READ_CHECKSUMS)
        cols = tf.physical(["expert_ids"])
        for rg, n in enumerate(tf.row_groups):
            take = None
            if rows is not None:
                a, b = np.searchsorted(rows, [row0, row0 + n])
                take = rows[a:b] - row0
            row0 += n
            if take is not None and not take.size:
                continue
            t = pf.read_row_group(rg, columns=cols, use_threads=False)
            if tf.version >= 2:
                lo, hi = id_planes(t.column(cols[0]), t.column(cols[1]), k)
                if take is not None:
                    lo, hi = lo[take], hi[take]
                ids = decode_expert_ids(lo, hi).astype(np.uint16)
            else:
                c = t.column("expert_ids").combine_chunks()
                ids = c.values.slice(c.offset * k, len(c) * k).to_numpy(zero_copy_only=False).reshape(-1, k)
                ids = np.sort(ids if take is None else ids[take], axis=1).astype(np.uint16, copy=False)
            parts.append(ids)
    return np.concatenate(parts) if parts else np.zeros((0, k), np.uint16)


def trace_num_rows(path: str | Path) -> int:
    """Rows of a trace, from its footers (after the gate's file-level checks)."""
    return open_trace(path).num_rows
