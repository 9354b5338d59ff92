"""The gate's file-level checks (``traces.validate``): every file opens as Parquet, ``moeplace.format`` is a
version this code reads, ``moeplace.model`` parses and is the same model in every file, required columns
exist with the contract's types, every file has the same optional columns, the trace has rows. The result
is a :class:`Trace`: the files' row groups and usable columns, which the row checks walk."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation import formats, reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import display
from moeplace.foundation.model import ModelSpec, spec_from_json
from moeplace.traces.format import (
    ID_PLANES,
    META_CHECKSUMS,
    META_FORMAT,
    META_MODEL,
    META_PROVENANCE,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    id_columns,
    physical_columns,
    trace_files,
)
from moeplace.traces.gate.report import Raise

_STRING_TYPES = (pa.string(), pa.large_string())


@dataclass(frozen=True)
class TraceFile:
    """One Parquet file of a trace: its row-group sizes and the contract columns it holds with the right
    types (``columns``: logical names, ``expert_ids`` for the columns that hold the ids in its ``version``
    of the format, traces.format)."""

    path: Path
    row_groups: tuple[int, ...]
    columns: frozenset[str]
    checksums: bool = True  # its pages carry CRC-32 checksums (the footer's moeplace.page_checksums says so)
    version: int = 2  # its trace format version (1: expert_ids lists in the router's order; 2: byte planes)

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)

    def physical(self, columns) -> list[str]:
        """``columns`` (logical names) as this file's Parquet columns."""
        return physical_columns(columns, self.version)


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


def _expected_types(model: ModelSpec, version: int) -> dict[str, tuple[str, Any]]:
    k = model.top_k

    def fixed_list(value_type):
        return lambda t: pa.types.is_fixed_size_list(t) and t.list_size == k and t.value_type == value_type

    ids = ({c: (f"fixed_size_binary[{k}]", lambda t: pa.types.is_fixed_size_binary(t) and t.byte_width == k)
            for c in ID_PLANES} if version >= 2
           else {"expert_ids": (f"fixed_size_list<uint16>[{k}]", fixed_list(pa.uint16()))})
    return {
        "request_id": ("int64", lambda t: t == pa.int64()),
        "position": ("int32", lambda t: t == pa.int32()),
        "phase": ("uint8", lambda t: t == pa.uint8()),
        "step": ("int64", lambda t: t == pa.int64()),
        "layer": ("uint16", lambda t: t == pa.uint16()),
        **ids,
        "gate_weights": (f"fixed_size_list<float32>[{k}]", fixed_list(pa.float32())),
        "token_id": ("int32", lambda t: t == pa.int32()),
        "domain": (
            "string",
            lambda t: t in _STRING_TYPES or (pa.types.is_dictionary(t) and t.value_type in _STRING_TYPES),
        ),
    }


def _schema_columns(sink, path: Path, schema: pa.Schema, model: ModelSpec, version: int) -> set[str]:
    """Check names and types; return the (logical) columns that are usable for row checks."""
    expected = _expected_types(model, version)
    usable = set()
    for name in physical_columns(REQUIRED_COLUMNS, version):
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
        elif name in ID_PLANES and pa.types.is_fixed_size_binary(t):
            sink.add("wrong_k", path, None, name,
                     f"{t.byte_width} bytes per row, expected k = {model.top_k} (top_k of model '{model.name}')")
        else:
            sink.add("column_type", path, None, name, f"type {t}, expected {text}")
    ids = id_columns(version)
    if ids != ("expert_ids",):
        usable.discard("expert_ids")  # a version-1 column in a version-2 file is not the ids
        if all(c in usable for c in ids):
            usable.add("expert_ids")
        usable.difference_update(ids)
    return usable


def _file_model(sink, path: Path, meta: dict) -> tuple[ModelSpec, dict, int] | None:
    """Model, provenance and trace format version from one file's key-value metadata (the version checked
    by foundation.formats' rules: one this release reads)."""
    version = meta.get(META_FORMAT)
    if META_MODEL not in meta:
        sink.add("metadata", path, None, None,
                 "metadata 'moeplace.model' missing: not a moeplace trace (import it with `place trace import`)")
        return None
    if version is None:
        versions = ", ".join(map(str, formats.FORMATS["trace"].versions))
        sink.add("metadata", path, None, None,
                 f"metadata 'moeplace.format' missing (expected trace format version {versions})")
        return None
    try:
        v = formats.check_version("trace", version.decode(errors="replace"), "", "moeplace.format")
    except InputError as exc:
        sink.add("metadata", path, None, None, str(exc))
        return None
    try:
        model = spec_from_json(meta[META_MODEL].decode())
    except (ValueError, UnicodeDecodeError, InputError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        sink.add("metadata", path, None, None, f"metadata 'moeplace.model' is not a valid model spec ({exc})")
        return None
    try:
        prov = reading.parse_json(meta.get(META_PROVENANCE, b"{}").decode(), "its text")
    except (InputError, UnicodeDecodeError) as exc:
        sink.add("metadata", path, None, None, f"metadata 'moeplace.provenance' is not a JSON object ({exc})")
        return None
    if not isinstance(prov, dict):
        sink.add("metadata", path, None, None,
                 f"metadata 'moeplace.provenance' is a JSON {type(prov).__name__}, expected an object")
        return None
    return model, prov, v


def open_files(sink, path: str | Path) -> Trace | None:
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
            sink.add("corrupt", f, None, None, open_failure(exc))
            unreadable = True
            continue
        got = _file_model(sink, f, schema.metadata or {})
        if got is None:
            unreadable = True
            continue
        model, prov, version = got
        if ref is None:
            ref = (model, prov, f)
        elif model != ref[0]:
            sink.add("metadata", f, None, None,
                     f"metadata 'moeplace.model' declares model '{model.name}' ({model.num_moe_layers} MoE layers x "
                     f"{model.num_experts} experts, top-{model.top_k}), inconsistent with {ref[2]} ('{ref[0].name}'); "
                     "one trace directory holds one model")
            unreadable = True
            continue
        usable = _schema_columns(sink, f, schema, ref[0], version)
        tf = TraceFile(f, tuple(md.row_group(i).num_rows for i in range(md.num_row_groups)), frozenset(usable),
                       META_CHECKSUMS in (schema.metadata or {}), version)
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
    _note_unchecked(trace)
    if trace.num_rows == 0 and not unreadable:
        sink.add("empty", path, None, None, "the trace has no rows (nothing to compute on)")
    return trace


def open_failure(exc: BaseException) -> str:
    """Why a Parquet file did not open, in words; running out of memory (a memory map refused under
    ``ulimit -v``) is not corruption: it propagates as :class:`MemoryError` (the CLI words it)."""
    text = str(exc)
    if "Cannot allocate memory" in text or isinstance(exc, MemoryError):
        raise MemoryError(text)
    return f"not a readable Parquet file: truncated or corrupt ({text})"


_NOTED: set[Path] = set()  # traces already noted as carrying no checksums, in this process


def _note_unchecked(trace: Trace) -> None:
    """A trace written before page checksums (an earlier moeplace, or another tool) is read as before, with
    one note per trace and process: its bytes cannot be verified, so a flipped byte inside a page may
    decode as data (the row checks still catch values out of range)."""
    bare = [tf.path for tf in trace.files if not tf.checksums]
    key = Path(trace.path).absolute()
    if not bare or key in _NOTED:
        return
    _NOTED.add(key)
    more = f" and {len(bare) - 1} more of its files" if len(bare) > 1 else ""
    print(f"place: note: {display(bare[0])}{more}: written without page checksums (an earlier "
          "moeplace version?): corrupted bytes inside its pages cannot be detected; re-import or re-synthesize "
          "the trace to get them (docs/traces.md, Checksums)", file=sys.stderr)


def open_trace(path: str | Path) -> Trace:
    """The gate's file-level checks (see the module docstring); raises :class:`InputError` at the first
    problem. The rows are not read: stream them through :func:`check_row_group` and :class:`RowOrder`
    (as ``traces.stats`` does), or use :func:`check_trace`."""
    trace = open_files(Raise(), path)
    assert trace is not None  # Raise raised otherwise
    return trace
