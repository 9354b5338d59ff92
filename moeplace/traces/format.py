"""The routing-trace format (docs/design.md "Contracts"; docs/traces.md "The trace format").

A trace is one Parquet file or a directory tree of them (``part-*.parquet``), read lazily with polars.
One row per (token, MoE layer):

===============  ========================  ==================================================================
column           type                      meaning
===============  ========================  ==================================================================
request_id       int64                     request the token belongs to
position         int32                     token position within its request (0-based)
phase            uint8                     0 = prefill (prompt), 1 = decode (generated; step = position - prompt length)
step             int64                     ordering step (engine iteration / arrival order); non-decreasing
layer            uint16                    decoder-layer index (0-based, HF numbering); must be an MoE layer
expert_delta_lo  fixed_size_binary[k]      the token's top-k expert ids as a set, ascending: byte j is the low
expert_delta_hi  fixed_size_binary[k]      / high byte of ``id_j - id_{j-1}`` (``id_{-1} = 0``); see below
gate_weights     fixed_size_list<float32>  optional: the gate weights of those experts, in the same order
token_id         int32                     optional: vocabulary id of the token
domain           string                    optional: workload domain tag
===============  ========================  ==================================================================

**Expert ids (format version 2).** A row's k expert ids are stored sorted, as deltas: ``d_0 = id_0``,
``d_j = id_j - id_{j-1}`` (>= 1 for distinct experts; a 0 is a repeated expert, which the gate refuses),
each delta a little-endian uint16 split into two byte planes (``expert_delta_lo[j] = d_j & 255``,
``expert_delta_hi[j] = d_j >> 8``): the low plane carries the information (K3: about 7.2 bits a delta), the
high plane is almost all zeros and compresses to almost nothing, and both decode as fixed-width arrays
straight into numpy (:func:`id_planes`, :func:`decode_expert_ids`). The router's order of the top-k is not
kept (nothing in moeplace reads it: loads, co-activation and dispatch are sets); gate weights move with
their experts, so the order by weight is still there. The logical column is ``expert_ids`` (uint16
``[n, k]``, ascending) in every reader and message. Format version 1 (still read) stored
``expert_ids fixed_size_list<uint16>[k]`` in the router's order.

Encodings: the per-token columns (repeated on the token's L rows) dictionary- and run-length-encoded, the
byte planes plain; every page zstd-compressed (level 1) and CRC-32-checksummed.

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

FORMAT_VERSION = "2"  # what the writer writes; the gate reads every version formats.FORMATS["trace"] lists
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

# logical columns: ``expert_ids`` is stored as the two byte planes ID_PLANES from version 2 on
REQUIRED_COLUMNS = ("request_id", "position", "phase", "step", "layer", "expert_ids")
OPTIONAL_COLUMNS = ("gate_weights", "token_id", "domain")
ID_PLANES = ("expert_delta_lo", "expert_delta_hi")


def id_columns(version: int) -> tuple[str, ...]:
    """The Parquet columns that hold ``expert_ids`` in a file of trace format ``version``."""
    return ID_PLANES if version >= 2 else ("expert_ids",)


def physical_columns(columns, version: int) -> list[str]:
    """``columns`` (logical names) as the Parquet columns of a file of ``version``, in order."""
    out: list[str] = []
    for c in columns:
        out.extend(id_columns(version) if c == "expert_ids" else (c,))
    return out


def arrow_schema(top_k: int, *, gate_weights: bool = False, token_id: bool = False,
                 domain: bool = False, version: int = int(FORMAT_VERSION)) -> pa.Schema:
    ids = ([pa.field(c, pa.binary(top_k), nullable=False) for c in ID_PLANES] if version >= 2
           else [pa.field("expert_ids", pa.list_(pa.uint16(), top_k), nullable=False)])
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("phase", pa.uint8(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("layer", pa.uint16(), nullable=False),
        *ids,
    ]
    if gate_weights:
        fields.append(pa.field("gate_weights", pa.list_(pa.float32(), top_k), nullable=False))
    if token_id:
        fields.append(pa.field("token_id", pa.int32(), nullable=False))
    if domain:
        fields.append(pa.field("domain", pa.string(), nullable=False))
    return pa.schema(fields)


def file_metadata(model: ModelSpec, provenance: dict[str, Any], version: int = int(FORMAT_VERSION)
                  ) -> dict[bytes, bytes]:
    return {
        META_FORMAT: str(version).encode(),
        META_MODEL: model.to_json().encode(),
        META_PROVENANCE: json.dumps(provenance, sort_keys=True).encode(),
        META_CHECKSUMS: b"crc32",
    }


# ---------------------------------------------------------------------------- expert ids as byte planes
def encode_expert_ids(ids: np.ndarray, weights: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``ids`` uint16 ``[n, k]`` (any order within a row) -> the byte planes ``(lo, hi)`` uint8 ``[n, k]``
    of the sorted rows' deltas, and ``weights`` ``[n, k]`` put in the same order (None stays None)."""
    ids = np.asarray(ids, np.uint16)
    if weights is None:
        srt = np.sort(ids, axis=1)
    else:
        order = np.argsort(ids, axis=1, kind="stable")
        srt = np.take_along_axis(ids, order, axis=1)
        weights = np.take_along_axis(weights, order, axis=1)
    d = np.empty_like(srt)
    if srt.size:
        # one contiguous subtraction over the flattened rows (a row's first delta, computed across the row
        # boundary, is then overwritten by its first id): ~4x faster than the row-wise [:, 1:] - [:, :-1]
        flat, flat_d = srt.reshape(-1), d.reshape(-1)
        np.subtract(flat[1:], flat[:-1], out=flat_d[1:])
        d[:, 0] = srt[:, 0]
    lo, hi = np.empty(d.shape, np.uint8), np.empty(d.shape, np.uint8)
    np.copyto(lo, d, casting="unsafe")  # the low byte (uint16 -> uint8 keeps it)
    np.right_shift(d, 8, out=hi, casting="unsafe")
    return lo, hi, weights


def id_planes(lo: pa.Array, hi: pa.Array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The byte planes of ``expert_delta_lo`` / ``expert_delta_hi`` (``fixed_size_binary[k]`` arrays) as
    uint8 ``[n, k]`` numpy views (no copy; a null row's bytes are whatever the buffer holds: check nulls
    first)."""
    return _plane(lo, k), _plane(hi, k)


def _plane(a: pa.Array, k: int) -> np.ndarray:
    if isinstance(a, pa.ChunkedArray):
        a = a.chunk(0) if a.num_chunks == 1 else a.combine_chunks()
    n = len(a)
    buf = a.buffers()[1]
    if buf is None or n == 0:
        return np.zeros((n, k), np.uint8)
    return np.frombuffer(buf, np.uint8, count=n * k, offset=a.offset * k).reshape(n, k)


def numpy_values(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of an Arrow array as numpy: a view of its buffer (no copy) for a fixed-width integer or
    float array without nulls, else ``to_numpy``'s copy. pyarrow's ``to_numpy`` imports pandas on its first
    call (~0.2 s), which a stats pass of a demo-sized trace (a few hundred ms) should not pay."""
    if isinstance(a, pa.ChunkedArray):
        a = a.chunk(0) if a.num_chunks == 1 else a.combine_chunks()
    t = a.type
    if a.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t):
        dtype = np.dtype(t.to_pandas_dtype())
        if len(a) == 0:
            return np.zeros(0, dtype)
        return np.frombuffer(a.buffers()[1], dtype, count=len(a), offset=a.offset * dtype.itemsize)
    return a.to_numpy(zero_copy_only=False)


def decode_expert_ids(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Sorted expert ids int64 ``[n, k]`` from the byte planes (int64: the deltas of a corrupt row can sum
    past uint16, which the gate reports as an id out of range rather than wrapping it)."""
    ids = lo.astype(np.int64)
    if hi.any():
        ids |= hi.astype(np.int64) << 8
    return np.cumsum(ids, axis=1, out=ids)


def polars_expert_ids(k: int):
    """A polars expression: the ``expert_ids`` (``array[u16, k]``, ascending) of a version-2 frame, decoded
    from its byte planes (a user's view of a trace in polars; ``traces.validate.scan_trace`` adds it)."""
    import polars as pl  # local: the writers and the stats pass never need polars

    def plane(name: str):
        return pl.col(name).bin.reinterpret(dtype=pl.Array(pl.UInt8, k)).cast(pl.Array(pl.UInt16, k))

    deltas = plane(ID_PLANES[0]) + plane(ID_PLANES[1]) * 256
    return deltas.arr.eval(pl.element().cum_sum()).cast(pl.Array(pl.UInt16, k)).alias("expert_ids")


def file_version(metadata: dict | None) -> int:
    """The trace format version a file's footer metadata states (1 for an unparsable value: the gate has
    refused such files before any reader gets here)."""
    v = (metadata or {}).get(META_FORMAT, b"1")
    return int(v) if v.isdigit() else 1


def batch_expert_ids(batch: pa.RecordBatch | pa.Table, version: int, k: int) -> np.ndarray:
    """The expert ids int64 ``[n, k]`` of decoded rows of a file of ``version`` (no checks: for readers
    behind the gate); version 2 rows ascending, version 1 rows in the file's order."""
    if version >= 2:
        return decode_expert_ids(*id_planes(batch.column(ID_PLANES[0]), batch.column(ID_PLANES[1]), k))
    col = batch.column("expert_ids")
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.values.slice(col.offset * k, len(col) * k).to_numpy(zero_copy_only=False).astype(
        np.int64).reshape(-1, k)


class TraceWriter:
    """Streams trace rows into ``out`` (a directory of ``part-NNNNN.parquet`` files), atomically: the
    directory appears under its final name only when :meth:`close` succeeds; on error nothing is left.

    Use as a context manager. ``write`` takes numpy arrays of one chunk of rows (shapes ``[n]`` and
    ``[n, k]`` for ``expert_ids`` / ``gate_weights``).
    """

    def __init__(self, out: str | Path, model: ModelSpec, provenance: dict[str, Any], *,
                 gate_weights: bool = False, token_id: bool = False, domain: bool = False,
                 rows_per_file: int = 8_000_000, row_group_rows: int = 1 << 20,
                 compression: str = "zstd", compression_level: int | None = 1,
                 version: int = int(FORMAT_VERSION)) -> None:
        self.out = Path(out)
        self.model = model
        self.version = version  # 1 only to write traces as earlier releases did (tests of old traces)
        self.schema = arrow_schema(model.top_k, gate_weights=gate_weights, token_id=token_id,
                                   domain=domain, version=version).with_metadata(
                                       file_metadata(model, provenance, version))
        # dictionary (and run-length) encoding for the per-token columns; the byte planes are plain
        self._dictionary = [f.name for f in self.schema if f.name not in ID_PLANES]
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
        }
        names = self.schema.names
        gw = (np.ascontiguousarray(gate_weights, dtype=np.float32).reshape(n, k) if "gate_weights" in names
              else None)
        if self.version >= 2:
            lo, hi, gw = encode_expert_ids(expert_ids, gw)
            for name, plane in zip(ID_PLANES, (lo, hi)):
                cols[name] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), n, [None, pa.py_buffer(plane)])
        else:
            cols["expert_ids"] = pa.FixedSizeListArray.from_arrays(pa.array(expert_ids.reshape(-1)), k)
        if gw is not None:
            cols["gate_weights"] = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(gw).reshape(-1)), k)
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
                                                compression_level=self.compression_level,
                                                use_dictionary=self._dictionary, **WRITE_CHECKSUMS)
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
