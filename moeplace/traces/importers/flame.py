"""FLAME-MoE routing traces (the ``CMU-FLAME/FLAME-MoE-Traces`` dataset) -> a trace.

Layout and schema from the dataset card (huggingface.co/datasets/CMU-FLAME/FLAME-MoE-Traces, README.md;
the FLAME-MoE code repository github cmu-flame/FLAME-MoE holds no trace code in the stored copy)::

    flame-moe-290m/
      samples/000.parquet ... NNN.parquet        token_id: int32, one row per token
      actives/iter_NNNN/layer_02.parquet ...     scores: list<float16>[6], indices: list<int16>[6]

Row ``i`` of every ``actives`` file is the token of row ``i`` of the samples files read in order (the same
data order for every checkpoint); ``indices`` are the routed experts (0-63; the 2 shared experts are not
logged), ``scores`` their router softmax probabilities, sorted descending. ``layer_NN`` counts transformer
layers from 1 (FLAME-MoE-290M: 9 layers, MoE layers 2-9), so ``layer_NN`` is decoder layer ``NN - 1`` here
(0-based) and must be an MoE layer of ``--model`` (a config.json with 64 experts, top-6).

Input: the model directory (``flame-moe-290m/``; ``--iteration N`` picks the checkpoint, default the
latest) or one ``actives/iter_NNNN`` directory. ``--max-tokens N`` keeps the first N tokens (a capture has
52,428,800). The captures are pretraining batches, not requests: ``request_id`` is the samples file,
``position`` the row within it, ``step`` the global row and ``phase`` prefill; ``scores`` become
``gate_weights`` and ``token_id`` comes from the samples.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import bar
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import expert_id_matrix, write_validated_trace
from moeplace.traces.phases import PHASES_KNOWN

_ITER = re.compile(r"^iter_(\d+)$")
_LAYER = re.compile(r"^layer_(\d+)\.parquet$")
CHUNK = 1 << 16


def _open(path: Path) -> pq.ParquetFile:
    reading.require_regular(path)  # a FIFO named like a layer file is refused, never opened
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None


def _resolve(src: Path, iteration: int | None) -> tuple[Path, Path]:
    """``(iteration directory, samples directory)``."""
    if (src / "actives").is_dir():
        dirs = [p for p in (src / "actives").iterdir() if p.name.startswith("iter_") and p.is_dir()]
        odd = sorted(p.name for p in dirs if not _ITER.match(p.name))
        if odd:  # skipping it would pick another iteration without a word (the latest of the rest)
            raise InputError(f"{src / 'actives'}: directory '{odd[0][:60]}' is not iter_NNNN (a number after "
                             "iter_); rename or remove it")
        iters = {int(_ITER.match(p.name).group(1)): p for p in dirs}
        if not iters:
            raise InputError(f"{src / 'actives'}: no iter_NNNN directories")
        if iteration is None:
            iteration = max(iters)
        if iteration not in iters:
            raise InputError(f"--iteration {iteration}: {src / 'actives'} holds iterations {sorted(iters)}")
        return iters[iteration], src / "samples"
    if _ITER.match(src.name) and src.parent.name == "actives":
        if iteration is not None and int(_ITER.match(src.name).group(1)) != iteration:
            raise InputError(f"--iteration {iteration} does not match {src}")
        return src, src.parent.parent / "samples"
    raise InputError(f"{src}: expected a FLAME-MoE model directory (with actives/ and samples/) or an "
                     "actives/iter_NNNN directory")


class _Column:
    """Rows of one column of a sequence of Parquet files, handed out in chunks of any size."""

    def __init__(self, files: list[Path], columns: list[str]):
        self.files, self.columns = files, columns
        self._it = self._batches()
        self._buf: list[pa.RecordBatch] = []
        self._have = 0

    def _batches(self):
        for i, f in enumerate(self.files):
            pf = _open(f)
            missing = [c for c in self.columns if c not in pf.schema_arrow.names]
            if missing:
                raise InputError(f"{f}: column '{missing[0]}' missing (expected {', '.join(self.columns)})")
            for b in pf.iter_batches(batch_size=CHUNK, columns=self.columns):
                yield i, b

    def take(self, n: int) -> list[tuple[int, pa.RecordBatch]]:
        out = []
        while n > 0:
            if not self._buf:
                try:
                    self._buf = [next(self._it)]
                except StopIteration:
                    break
            i, b = self._buf[0]
            if b.num_rows <= n:
                out.append((i, b))
                n -= b.num_rows
                self._buf.pop(0)
            else:
                out.append((i, b.slice(0, n)))
                self._buf[0] = (i, b.slice(n))
                n = 0
        return out


def _fixed_lists(arr: pa.Array, k: int, path: Path, row0: int, field: str) -> np.ndarray:
    """A list column of ``k`` values per row -> ``[n, k]`` numpy (lengths and nulls checked)."""
    if arr.null_count:
        r = row0 + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{path}: row {r}: field '{field}' is null")
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    bad = lengths != k
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise InputError(f"{path}: row {row0 + r}: field '{field}' holds {int(lengths[r])} values, expected {k} "
                         "(the model's top-k)")
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return values.reshape(len(arr), k)


def import_(srcs: list[Path], model: ModelSpec, out: Path | None, *, iteration: int | None = None,
            max_tokens: int | None = None, **_: object) -> ImportResult:
    t0 = time.perf_counter()
    if out is None:
        raise InputError("flame-moe traces become a trace: give --out DIR")
    if len(srcs) != 1 or not srcs[0].is_dir():
        raise InputError(f"{' '.join(map(str, srcs))}: flame-moe reads one model or actives/iter_NNNN directory")
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {max_tokens}")
    it_dir, samples_dir = _resolve(srcs[0], iteration)
    layer_files, samples, total = _inputs(it_dir, samples_dir, model)
    total = min(total, max_tokens) if max_tokens else total
    k, layers = model.top_k, sorted(layer_files)
    L = len(layers)
    readers = {d: _Column([layer_files[d]], ["indices", "scores"]) for d in layers}
    tokens = _Tokens(samples, samples_dir)
    layer_col = np.asarray(layers, dtype=np.uint16)
    state = {"row": 0}

    def write(w):
        with bar(total, "convert", "tok") as pb:
            write_rows(w, pb)

    def write_rows(w, pb):
        while state["row"] < total:
            n = min(CHUNK, total - state["row"])
            row0 = state["row"]
            tok, req, pos = tokens.take(n, row0)
            ids = np.empty((n, L, k), dtype=np.uint16)
            gw = np.empty((n, L, k), dtype=np.float32)
            for j, d in enumerate(layers):
                _layer_chunk(readers[d], layer_files[d], n, row0, model, ids[:, j], gw[:, j])
            if pos.max() > np.iinfo(np.int32).max:
                raise InputError(f"{samples_dir}: a samples file exceeds 2^31 rows (position is int32)")
            w.write(request_id=np.repeat(req, L), position=np.repeat(pos, L).astype(np.int32),
                    phase=np.zeros(n * L, dtype=np.uint8),
                    step=np.repeat(np.arange(row0, row0 + n, dtype=np.int64), L),
                    layer=np.tile(layer_col, n), expert_ids=ids.reshape(n * L, k),
                    gate_weights=gw.reshape(n * L, k), token_id=np.repeat(tok, L))
            state["row"] += n
            pb.update(n)

    prov = {"kind": "imported", "format": "flame-moe", "sources": [str(it_dir), str(samples_dir)],
            "iteration": int(_ITER.match(it_dir.name).group(1)) if _ITER.match(it_dir.name) else None,
            "layers_covered": layers, "layer_numbering": "layer_NN is 1-based: decoder layer NN-1",
            "tokens": total, "request_id": "samples file index (pretraining batches carry no requests)",
            "phase": "training forward pass: every token is a prompt token, all rows prefill (0)",
            PHASES_KNOWN: True}
    rows = write_validated_trace(out, model, prov, write, gate_weights=True, token_id=True)
    secs = time.perf_counter() - t0
    summary = {"format": "flame-moe", "records_read": total * L, "rows_written": rows, "tokens": total,
               "layers_covered": layers, "seconds": secs, "records_per_s": total * L / secs if secs > 0 else 0.0}
    return ImportResult("trace", trace=out, summary=summary)


def _inputs(it_dir: Path, samples_dir: Path, model: ModelSpec) -> tuple[dict[int, Path], list[Path], int]:
    """``(decoder layer -> layer file, samples files, rows)``: every layer file an MoE layer of ``model``,
    all with the same rows, and at least as many token rows in the samples."""
    layer_files = {}
    for p in sorted(it_dir.iterdir()):
        m = _LAYER.match(p.name)
        if not m:
            if p.name.startswith("."):
                continue
            # a layer file named otherwise would be a layer silently missing from the trace
            raise InputError(f"{p}: not a FLAME-MoE layer file name (expected layer_NN.parquet, NN the 1-based "
                             "transformer layer); rename or remove it")
        dec = int(m.group(1)) - 1
        if dec not in model.moe_layers:
            raise InputError(f"{p}: layer_{m.group(1)} is decoder layer {dec} (0-based), not an MoE layer of "
                             f"'{model.name}' (MoE layers {model.moe_layers[0]}..{model.moe_layers[-1]})")
        layer_files[dec] = p
    if not layer_files:
        raise InputError(f"{it_dir}: no layer_NN.parquet files")
    missing = [d for d in model.moe_layers if d not in layer_files]
    if missing:
        raise InputError(f"{it_dir}: no layer_{missing[0] + 1:02d}.parquet: MoE layer {missing[0]} of "
                         f"'{model.name}' is missing ({len(missing)} of {model.num_moe_layers} MoE layers have no "
                         "file); a trace holds every MoE layer of its model")
    samples = sorted(samples_dir.glob("*.parquet")) if samples_dir.is_dir() else []
    if not samples:
        raise InputError(f"{samples_dir}: no samples/*.parquet files (token ids aligned with the actives rows)")
    layers = sorted(layer_files)
    n_rows = {d: _open(p).metadata.num_rows for d, p in layer_files.items()}
    n_samples = sum(_open(p).metadata.num_rows for p in samples)
    if len(set(n_rows.values())) > 1:
        d = max(n_rows, key=n_rows.get)
        raise InputError(f"{layer_files[d]}: {n_rows[d]} rows, but {layer_files[layers[0]]} has "
                         f"{n_rows[layers[0]]}: the layers of one capture align row by row")
    total = n_rows[layers[0]]
    if n_samples != total:
        raise InputError(f"{samples_dir}: {n_samples} token rows, {'fewer' if n_samples < total else 'more'} than "
                         f"the {total} rows of the actives files (row i of every layer file is the token of row i "
                         "of the samples: they must match)")
    return layer_files, samples, total


class _Tokens:
    """The samples files read in order: token ids, and as request / position the file and the row in it."""

    def __init__(self, samples: list[Path], samples_dir: Path) -> None:
        self.samples, self.samples_dir = samples, samples_dir
        self.reader = _Column(samples, ["token_id"])
        self.file_rows = [0] * len(samples)  # rows consumed per samples file: position within the file

    def take(self, n: int, row0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``n`` tokens (the chunk starting at global row ``row0``): int64 ``[n]`` token ids,
        request ids, positions."""
        tok_parts, req_parts, pos_parts = [], [], []
        for i, b in self.reader.take(n):
            col = b.column("token_id")
            if col.null_count:
                raise InputError(f"{self.samples[i]}: row {self.file_rows[i]}: field 'token_id' is null")
            t = col.to_numpy(zero_copy_only=False)
            if t.dtype.kind not in "iu":
                raise InputError(f"{self.samples[i]}: field 'token_id' has type {col.type}, expected int32")
            tok_parts.append(t.astype(np.int64))
            req_parts.append(np.full(t.size, i, dtype=np.int64))
            pos_parts.append(np.arange(self.file_rows[i], self.file_rows[i] + t.size, dtype=np.int64))
            self.file_rows[i] += t.size
        tok, req, pos = np.concatenate(tok_parts), np.concatenate(req_parts), np.concatenate(pos_parts)
        if tok.size and (tok.min() < 0 or tok.max() > np.iinfo(np.int32).max):
            raise InputError(f"{self.samples_dir}: token ids outside int32 around row {row0}")
        return tok, req, pos


def _layer_chunk(reader: _Column, path: Path, n: int, row0: int, model: ModelSpec, ids: np.ndarray,
                 gw: np.ndarray) -> None:
    """Read the next ``n`` rows of one layer file into ``ids`` / ``gw`` ``[n, k]`` (checked expert ids;
    scores that are probabilities)."""
    k = model.top_k
    got = 0
    for _, b in reader.take(n):
        m = b.num_rows
        ind = _fixed_lists(b.column("indices"), k, path, row0 + got, "indices")
        ids[got:got + m] = expert_id_matrix(ind, path, f"rows {row0 + got}..{row0 + got + m - 1}",
                                            "indices", model.num_experts, k)
        sc = _fixed_lists(b.column("scores"), k, path, row0 + got, "scores").astype(np.float32)
        if not np.isfinite(sc).all() or (sc < 0).any():
            r = int(np.flatnonzero(~(np.isfinite(sc) & (sc >= 0)).all(axis=1))[0])
            raise InputError(f"{path}: row {row0 + got + r}: field 'scores' holds {sc[r].tolist()}, "
                             "expected probabilities")
        gw[got:got + m] = sc
        got += m
