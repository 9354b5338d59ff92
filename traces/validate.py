"""Trace validation: every violation of the trace contract (``traces/format.py``) a user can make, found
by streaming the Parquet files row group by row group with vectorized numpy checks.

What is checked, per file:

- the file opens as Parquet (truncated / corrupt files are named, not crashed on);
- ``moeplace.model`` metadata is present, parses, and is the same model in every file of a directory;
- required columns exist with the contract's types (``expert_ids`` a fixed-size list of ``top_k`` uint16,
  ``gate_weights`` of ``top_k`` float32, ...);
- per row: no nulls, ``layer`` is an MoE layer of the declared model, expert ids ``< num_experts``, no expert
  repeated in one token's top-k, gate weights neither NaN/inf nor negative, ``phase`` is 0 or 1,
  ``position`` is non-negative, and ``step`` never decreases (within a file and from one file to the next,
  in the sorted order :func:`traces.format.trace_files` reads them);
- every row group decodes (a corrupt page is reported with its row group).

All problems are reported (up to ``max_per_kind`` examples of each kind, then a count of the rest), each as
one line naming the file, the row (or row group) and the field.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from foundation.errors import InputError, where
from foundation.model import ModelSpec, format_ranges, spec_from_json
from traces.format import META_MODEL, REQUIRED_COLUMNS, trace_files

DEFAULT_MAX_PER_KIND = 5

# column -> (expected arrow type as text, predicate on the arrow type)
_STRING_TYPES = (pa.string(), pa.large_string())


@dataclass(frozen=True)
class Problem:
    """One violation. ``kind`` groups problems for the per-kind limit (e.g. ``"expert_range"``)."""

    kind: str
    path: str
    row: int | str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        return where(self.path, self.row, self.field) + self.message


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_report`: problems (capped per kind) plus totals of what was read."""

    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_rows: int = 0
    num_tokens: int = 0
    model: ModelSpec | None = None
    suppressed: Counter = field(default_factory=Counter)  # kind -> problems beyond the per-kind limit

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """One line per problem, then one line per kind whose further problems were not listed."""
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


class _Collector:
    def __init__(self, report: ValidationReport, max_per_kind: int) -> None:
        self.report = report
        self.max_per_kind = max_per_kind
        self.count: Counter = Counter()

    def add(self, kind: str, path, row, fld, message: str) -> None:
        self.count[kind] += 1
        if self.count[kind] <= self.max_per_kind:
            self.report.problems.append(Problem(kind, str(path), row, fld, message))
        else:
            self.report.suppressed[kind] += 1

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        """Report the rows where boolean mask ``bad`` is set; ``msg_of_index(i)`` words row ``i`` (local)."""
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            return
        room = max(self.max_per_kind - self.count[kind], 0)
        for i in idx[:room]:
            self.add(kind, path, row0 + int(i), fld, msg_of_index(int(i)))
        rest = idx.size - min(room, idx.size)
        if rest:
            self.count[kind] += rest
            self.report.suppressed[kind] += rest


def _type_text(t: pa.DataType) -> str:
    return str(t)


def _expected_types(model: ModelSpec) -> dict[str, tuple[str, callable]]:
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


def _schema_problems(col: _Collector, path: Path, schema: pa.Schema, model: ModelSpec) -> set[str]:
    """Check names and types; return the set of columns that are usable for row checks."""
    expected = _expected_types(model)
    usable = set()
    for name in REQUIRED_COLUMNS:
        if schema.get_field_index(name) < 0:
            col.add(
                "missing_column", path, None, name, f"required column missing (expected {expected[name][0]})"
            )
    for name, (text, ok) in expected.items():
        i = schema.get_field_index(name)
        if i < 0:
            continue
        t = schema.field(i).type
        if ok(t):
            usable.add(name)
            continue
        if (
            name in ("expert_ids", "gate_weights")
            and pa.types.is_fixed_size_list(t)
            and t.list_size != model.top_k
        ):
            col.add(
                "wrong_k",
                path,
                None,
                name,
                f"lists of {t.list_size} per row, expected k = {model.top_k} (top_k of model '{model.name}')",
            )
        else:
            col.add("column_type", path, None, name, f"type {_type_text(t)}, expected {text}")
    return usable


def _file_model(col: _Collector, path: Path, meta: dict) -> ModelSpec | None:
    if META_MODEL not in meta:
        col.add(
            "metadata",
            path,
            None,
            None,
            "metadata 'moeplace.model' missing: not a moeplace trace (import it with `place trace import`)",
        )
        return None
    try:
        return spec_from_json(meta[META_MODEL].decode())
    except (ValueError, UnicodeDecodeError, InputError, TypeError, KeyError) as exc:
        col.add("metadata", path, None, None, f"metadata 'moeplace.model' is not a valid model spec ({exc})")
        return None


def _fixed_list_numpy(arr: pa.ChunkedArray, k: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """``[n, k]`` values of a fixed-size-list column and a row-null mask (None when there are no nulls:
    a row is null when the list itself or any of its values is null)."""
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    # .values ignores the array's slice offset; slice it so row i maps to values [i*k, (i+1)*k).
    values = a.values.slice(a.offset * k, len(a) * k)
    nulls = None
    if a.null_count:
        nulls = np.asarray(a.is_null().to_numpy(zero_copy_only=False))
    if values.null_count:
        vn = np.asarray(values.is_null().to_numpy(zero_copy_only=False)).reshape(-1, k).any(axis=1)
        nulls = vn if nulls is None else (nulls | vn)
        values = values.fill_null(0)
    vals = np.asarray(values.to_numpy(zero_copy_only=False), dtype=dtype).reshape(-1, k)
    if nulls is not None:
        vals = vals.copy()
        # null rows (reported as such) get distinct in-range ids / zero weights: no follow-on problems
        vals[nulls] = np.arange(k) if np.issubdtype(dtype, np.integer) else 0.0
    return vals, nulls


def _plain_numpy(arr: pa.ChunkedArray, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if a.null_count:
        nulls = np.asarray(a.is_null().to_numpy(zero_copy_only=False))
        return np.asarray(a.fill_null(0).to_numpy(zero_copy_only=False), dtype=dtype), nulls
    return np.asarray(a.to_numpy(zero_copy_only=False), dtype=dtype), None


def _check_row_group(
    col: _Collector,
    path: Path,
    table: pa.Table,
    row0: int,
    model: ModelSpec,
    usable: set[str],
    prev_step: int | None,
    prev_where: str,
) -> tuple[int | None, np.ndarray | None]:
    """Vectorized checks of one row group. Returns (last step, per-layer row counts [num_layers] or None)."""
    k, num_experts = model.top_k, model.num_experts
    n = table.num_rows
    last_step = prev_step
    layer_counts = None

    for name in ("request_id", "position", "phase", "step", "layer", "token_id", "domain"):
        if name in usable and name in table.column_names and table.column(name).null_count:
            nulls = np.asarray(table.column(name).is_null().to_numpy(zero_copy_only=False))
            col.add_rows(
                "null", path, nulls, row0, name, lambda i: "null value (the column must be complete)"
            )

    if "layer" in usable:
        layer, _ = _plain_numpy(table.column("layer"), np.int64)
        is_moe = np.zeros(max(model.num_layers, int(layer.max(initial=0)) + 1), dtype=bool)
        is_moe[list(model.moe_layers)] = True
        bad = ~is_moe[layer]
        col.add_rows(
            "layer",
            path,
            bad,
            row0,
            "layer",
            lambda i: (
                f"layer {layer[i]} is not an MoE layer of model '{model.name}' "
                f"(MoE layers: {format_ranges(model.moe_layers)})"
            ),
        )
        good = layer[~bad]
        layer_counts = np.bincount(good, minlength=model.num_layers)[: model.num_layers]

    if "expert_ids" in usable:
        ids, nulls = _fixed_list_numpy(table.column("expert_ids"), k, np.uint16)
        if nulls is not None:
            col.add_rows(
                "null",
                path,
                nulls,
                row0,
                "expert_ids",
                lambda i: "null value (every row needs its top-k expert ids)",
            )
        too_big = ids >= num_experts
        bad = too_big.any(axis=1)
        col.add_rows(
            "expert_range",
            path,
            bad,
            row0,
            "expert_ids",
            lambda i: (
                f"expert id {int(ids[i][too_big[i]][0])} >= num_experts {num_experts} of model '{model.name}'"
            ),
        )
        if k > 1:
            srt = np.sort(ids, axis=1)
            dup_pos = srt[:, 1:] == srt[:, :-1]
            dup = dup_pos.any(axis=1)
            col.add_rows(
                "duplicate_expert",
                path,
                dup,
                row0,
                "expert_ids",
                lambda i: (
                    f"expert {int(srt[i, 1:][dup_pos[i]][0])} repeated in one token's top-{k} "
                    f"{ids[i].tolist()}"
                ),
            )

    if "gate_weights" in usable:
        w, nulls = _fixed_list_numpy(table.column("gate_weights"), k, np.float32)
        if nulls is not None:
            col.add_rows("null", path, nulls, row0, "gate_weights", lambda i: "null value")
        nan = ~np.isfinite(w)
        col.add_rows(
            "weight_nan",
            path,
            nan.any(axis=1),
            row0,
            "gate_weights",
            lambda i: f"gate weight {float(w[i][nan[i]][0])} is not a finite number",
        )
        neg = w < 0
        col.add_rows(
            "weight_negative",
            path,
            neg.any(axis=1),
            row0,
            "gate_weights",
            lambda i: f"gate weight {float(w[i][neg[i]][0]):g} is negative",
        )

    if "phase" in usable:
        phase, _ = _plain_numpy(table.column("phase"), np.int64)
        col.add_rows(
            "phase",
            path,
            phase > 1,
            row0,
            "phase",
            lambda i: f"phase {phase[i]}, expected 0 (prefill) or 1 (decode)",
        )

    if "position" in usable:
        pos, _ = _plain_numpy(table.column("position"), np.int64)
        col.add_rows("position", path, pos < 0, row0, "position", lambda i: f"position {pos[i]} is negative")

    if "step" in usable and n:
        step, _ = _plain_numpy(table.column("step"), np.int64)
        down = np.zeros(n, dtype=bool)
        down[1:] = step[1:] < step[:-1]
        if prev_step is not None and step[0] < prev_step:
            down[0] = True

        def msg(i: int) -> str:
            if i == 0:
                return (
                    f"step {step[0]} decreases from step {prev_step} ({prev_where}); "
                    "steps must be non-decreasing"
                )
            return (
                f"step {step[i]} decreases from step {step[i - 1]} in the row before; "
                "steps must be non-decreasing"
            )

        col.add_rows("step_order", path, down, row0, "step", msg)
        last_step = int(step[-1])
    return last_step, layer_counts




def _may_hold_nulls(pf: pq.ParquetFile, rg: int, name: str) -> bool:
    """From the footer statistics (free): can column ``name`` of row group ``rg`` hold nulls? Used to skip
    decoding the string column ``domain``, which has no other check."""
    rgm = pf.metadata.row_group(rg)
    for i in range(rgm.num_columns):
        c = rgm.column(i)
        if c.path_in_schema == name:
            st = c.statistics
            return st is None or not st.has_null_count or st.null_count > 0
    return False


def validate_report(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> ValidationReport:
    """Validate a trace (file or directory), streaming row group by row group.

    Returns a :class:`ValidationReport`; ``num_tokens`` counts the rows of the best-covered MoE layer (every
    token has at most one row per layer). Raises :class:`InputError` only when ``path`` does not exist or
    holds no Parquet files.
    """
    report = ValidationReport()
    col = _Collector(report, max_per_kind)
    files = trace_files(path)
    report.num_files = len(files)
    ref_model: ModelSpec | None = None
    ref_file: Path | None = None
    prev_step: int | None = None
    prev_where = ""
    layer_counts = None
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            meta = schema.metadata or {}
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            col.add("corrupt", f, None, None, f"not a readable Parquet file: truncated or corrupt ({exc})")
            continue
        model = _file_model(col, f, meta)
        if model is None:
            continue
        if ref_model is None:
            ref_model, ref_file = model, f
            report.model = model
            layer_counts = np.zeros(model.num_layers, dtype=np.int64)
        elif model != ref_model:
            col.add(
                "metadata",
                f,
                None,
                None,
                f"metadata 'moeplace.model' declares model '{model.name}' "
                f"({model.num_moe_layers} MoE layers x {model.num_experts} experts, top-{model.top_k}), "
                f"inconsistent with {ref_file} ('{ref_model.name}'); one trace directory holds one model",
            )
            continue
        usable = _schema_problems(col, f, schema, model)
        needed = [c for c in schema.names if c in usable and c != "domain"]
        row0 = 0
        for rg in range(pf.num_row_groups):
            try:
                domain = ["domain"] if "domain" in usable and _may_hold_nulls(pf, rg, "domain") else []
                table = pf.read_row_group(rg, columns=needed + domain)
            except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as exc:
                col.add("corrupt", f, f"row group {rg}", None, f"cannot be decoded: corrupt data ({exc})")
                row0 += pf.metadata.row_group(rg).num_rows
                continue
            prev_step, counts = _check_row_group(col, f, table, row0, model, usable, prev_step, prev_where)
            if counts is not None:
                layer_counts += counts
            row0 += table.num_rows
            prev_where = f"the last row of {f.name}" if rg == pf.num_row_groups - 1 else "the row before"
        report.num_rows += row0
    if layer_counts is not None:
        report.num_tokens = int(layer_counts.max(initial=0))
    return report


def validate_trace(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> list[Problem]:
    """All problems of a trace (file or directory); empty when it is valid. See :func:`validate_report`."""
    return validate_report(path, max_per_kind=max_per_kind).problems


def check_trace(path: str | Path, *, max_per_kind: int = DEFAULT_MAX_PER_KIND) -> ValidationReport:
    """Validate; raise :class:`InputError` (first problem, and how many more) unless the trace is valid."""
    report = validate_report(path, max_per_kind=max_per_kind)
    if report.problems:
        more = len(report.problems) - 1 + sum(report.suppressed.values())
        raise InputError(str(report.problems[0]) + (f" (and {more} more problem(s))" if more else ""))
    return report
