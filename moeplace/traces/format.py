"""The routing-trace format (docs/design.md "Contracts").

A trace is one Parquet file or a directory tree of them (``part-*.parquet``), read lazily with polars.
One row per (token, MoE layer):

==============  ========================  ==================================================================
column          type                      meaning
==============  ========================  ==================================================================
request_id      int64                     request the token belongs to
position        int32                     token position within its request (0-based)
phase           uint8                     0 = prefill, 1 = decode (decode step = position - prompt length)
step            int64                     ordering step (engine iteration / arrival order); non-decreasing
layer           uint16                    decoder-layer index (0-based, HF numbering); must be an MoE layer
expert_ids      fixed_size_list<uint16>   the top-k logical expert ids, in the router's order (k = top_k)
gate_weights    fixed_size_list<float32>  optional: the gate weights of those experts
token_id        int32                     optional: vocabulary id of the token
domain          string                    optional: workload domain tag
==============  ========================  ==================================================================

A token is a ``(step, request_id, position)``; its MoE-layer rows are consecutive, layers ascending, so
it never has two rows for one layer, and it has a row in every MoE layer the trace holds (a trace may hold
some of the model's MoE layers only). Every reader takes a trace through ``traces.validate`` (the gate).

Self-describing: every file's Parquet key-value metadata carries ``moeplace.format`` (version),
``moeplace.model`` (the :class:`~foundation.model.ModelSpec` as JSON) and ``moeplace.provenance``
(JSON: ``{"kind": "synthetic"|"captured"|"imported", ...parameters}``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, atomic_path, register_kind
from moeplace.foundation.model import ModelSpec

FORMAT_VERSION = "1"
META_FORMAT = b"moeplace.format"
META_MODEL = b"moeplace.model"
META_PROVENANCE = b"moeplace.provenance"
# Parquet's own page checksums (CRC-32 of each page as written, in its header): written into every page,
# verified by every reader of a trace (the gate decodes every row through pyarrow with verification
# before any reader, polars included, uses a row; polars itself does not verify them). The key marks
# files that carry them, so a file without (an earlier release's) is told apart from one that has them.
META_CHECKSUMS = b"moeplace.page_checksums"
WRITE_CHECKSUMS = {"write_page_checksum": True}
READ_CHECKSUMS = {"page_checksum_verification": True}

PHASE_PREFILL = 0
PHASE_DECODE = 1

PART_PREFIX = "part-"  # the TraceWriter's files: part-00000.parquet, part-00001.parquet, ...
PART_NAME = re.compile(re.escape(PART_PREFIX) + r"\d+\.parquet$")

REQUIRED_COLUMNS = ("request_id", "position", "phase", "step", "layer", "expert_ids")
OPTIONAL_COLUMNS = ("gate_weights", "token_id", "domain")


def arrow_schema(top_k: int, *, gate_weights: bool = False, token_id: bool = False,
                 domain: bool = False) -> pa.Schema:
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("phase", pa.uint8(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("layer", pa.uint16(), nullable=False),
        pa.field("expert_ids", pa.list_(pa.uint16(), top_k), nullable=False),
    ]
    if gate_weights:
        fields.append(pa.field("gate_weights", pa.list_(pa.float32(), top_k), nullable=False))
    if token_id:
        fields.append(pa.field("token_id", pa.int32(), nullable=False))
    if domain:
        fields.append(pa.field("domain", pa.string(), nullable=False))
    return pa.schema(fields)


def file_metadata(model: ModelSpec, provenance: dict[str, Any]) -> dict[bytes, bytes]:
    return {
        META_FORMAT: FORMAT_VERSION.encode(),
        META_MODEL: model.to_json().encode(),
        META_PROVENANCE: json.dumps(provenance, sort_keys=True).encode(),
        META_CHECKSUMS: b"crc32",
    }


class TraceWriter:
    """Streams trace rows into ``out`` (a directory of ``part-NNNNN.parquet`` files), atomically: the
    directory appears under its final name only when :meth:`close` succeeds; on error nothing is left.

    Use as a context manager. ``write`` takes numpy arrays of one chunk of rows (shapes ``[n]`` and
    ``[n, k]`` for ``expert_ids`` / ``gate_weights``).
    """

    def __init__(self, out: str | Path, model: ModelSpec, provenance: dict[str, Any], *,
                 gate_weights: bool = False, token_id: bool = False, domain: bool = False,
                 rows_per_file: int = 8_000_000, row_group_rows: int = 1 << 20,
                 compression: str = "zstd", compression_level: int | None = 1) -> None:
        self.out = Path(out)
        self.model = model
        self.schema = arrow_schema(model.top_k, gate_weights=gate_weights, token_id=token_id,
                                   domain=domain).with_metadata(file_metadata(model, provenance))
        self.rows_per_file = rows_per_file
        self.row_group_rows = row_group_rows
        self.compression = compression
        self.compression_level = compression_level
        self._ctx = atomic_path(self.out, directory=True)
        self._tmp: Path | None = None
        self._writer: pq.ParquetWriter | None = None
        self._file_rows = 0
        self._num_files = 0
        self.rows_written = 0

    def __enter__(self) -> TraceWriter:  # noqa: PYI034 - final class, not meant to be subclassed
        self._tmp = self._ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if exc_type is None and self.rows_written == 0:
            exc_type, exc = InputError, InputError(f"{self.out}: no trace rows to write")
            self._ctx.__exit__(exc_type, exc, None)
            raise exc
        return bool(self._ctx.__exit__(exc_type, exc, tb))

    def _exact(self, name: str, values, dtype) -> np.ndarray:
        """``values`` as ``dtype`` unchanged: a fraction or a value the column type cannot hold is an error
        (a cast would truncate or wrap it silently)."""
        a = np.asarray(values)
        if a.dtype == dtype or a.size == 0:
            return np.ascontiguousarray(a, dtype=dtype)
        info = np.iinfo(dtype)
        if a.dtype.kind not in "iufb":
            raise InputError(f"{self.out}: field '{name}': {a.dtype} values, expected integers")
        bad = (a < info.min) | (a > info.max)
        if a.dtype.kind == "f":
            bad |= ~np.isfinite(a) | (a != np.floor(np.where(np.isfinite(a), a, 0)))
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), a.shape)
            v = a[i].item()
            what = "is not an integer" if not np.isfinite(v) or v != np.floor(v) else f"is outside the {dtype.__name__} range"
            raise InputError(f"{self.out}: field '{name}': value {v} (row {self.rows_written + int(i[0])} of the "
                             f"output) {what}; values are never truncated or wrapped")
        return np.ascontiguousarray(a, dtype=dtype)

    def write(self, *, request_id, position, phase, step, layer, expert_ids, gate_weights=None,
              token_id=None, domain=None) -> None:
        n = len(layer)
        expert_ids = self._exact("expert_ids", expert_ids, np.uint16)
        k = self.model.top_k
        if expert_ids.shape != (n, k):
            raise InputError(f"expert_ids has shape {expert_ids.shape}, expected ({n}, {k})")
        cols: dict[str, pa.Array] = {
            "request_id": pa.array(self._exact("request_id", request_id, np.int64)),
            "position": pa.array(self._exact("position", position, np.int32)),
            "phase": pa.array(self._exact("phase", phase, np.uint8)),
            "step": pa.array(self._exact("step", step, np.int64)),
            "layer": pa.array(self._exact("layer", layer, np.uint16)),
            "expert_ids": pa.FixedSizeListArray.from_arrays(pa.array(expert_ids.reshape(-1)), k),
        }
        names = self.schema.names
        if "gate_weights" in names:
            gw = np.ascontiguousarray(gate_weights, dtype=np.float32).reshape(-1)
            cols["gate_weights"] = pa.FixedSizeListArray.from_arrays(pa.array(gw), k)
        if "token_id" in names:
            cols["token_id"] = pa.array(self._exact("token_id", token_id, np.int32))
        if "domain" in names:
            cols["domain"] = pa.array(domain if not isinstance(domain, str) else [domain] * n, pa.string())
        table = pa.Table.from_pydict(cols, schema=self.schema)
        start = 0
        while start < n:
            if self._writer is None:
                path = self._tmp / f"{PART_PREFIX}{self._num_files:05d}.parquet"
                self._writer = pq.ParquetWriter(path, self.schema, compression=self.compression,
                                                compression_level=self.compression_level, **WRITE_CHECKSUMS)
                self._num_files += 1
                self._file_rows = 0
            take = min(n - start, self.rows_per_file - self._file_rows)
            self._writer.write_table(table.slice(start, take), row_group_size=self.row_group_rows)
            self._file_rows += take
            self.rows_written += take
            start += take
            if self._file_rows >= self.rows_per_file:
                self._writer.close()
                self._writer = None


# ---------------------------------------------------------------------------- reading
def trace_files(path: str | Path) -> list[Path]:
    """The Parquet files of a trace: the file itself, or every ``*.parquet`` under a directory (sorted,
    hidden temporaries skipped); each a regular file (:func:`moeplace.foundation.reading.require_regular`)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet")
                       if not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise InputError(f"{p}: no .parquet trace files in this directory")
    else:
        files = [p]
    for f in files:  # a FIFO, device or socket named like a part file is refused, never opened
        try:
            reading.require_regular(f, "a trace part" if f != p else "")
        except FileNotFoundError:
            raise InputError(f"{f}: no such file or directory") from None
    return files


# ---------------------------------------------------------------------------- the trace as an output kind
def is_trace_part(p: Path) -> bool:
    """A Parquet file carrying a moeplace trace's model metadata (reads the footer only)."""
    return META_MODEL in (pq.read_schema(p).metadata or {})


def holds_trace_parts(d: Path) -> bool:
    """``d`` directly holds a part file of a moeplace trace directory (one listing, no recursion; a
    single-file trace next to other files does not make its directory a trace)."""
    try:
        with os.scandir(d) as it:
            parts = [Path(e.path) for e in it if PART_NAME.match(e.name) and e.is_file()]
    except OSError:
        return False
    return bool(parts) and is_trace_part(parts[0])


def _is_trace_dir(p: Path) -> bool:
    """A directory whose every file (recursively) is a Parquet file of a moeplace trace."""
    files = [f for f in p.rglob("*") if not f.is_dir()]
    return bool(files) and all(f.suffix == ".parquet" and is_trace_part(f) for f in files)


TRACE_DIRECTORY = register_kind(OutputKind("trace directory", True, _is_trace_dir, guards_tree=holds_trace_parts))
