"""Shared pieces of the importers: JSONL reading with line numbers, output helpers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from foundation.errors import InputError
from foundation.files import atomic_path
from foundation.model import ModelSpec
from traces.format import TraceWriter
from traces.validate import check_trace

try:  # orjson parses engine logs several times faster; the stdlib parser is the fallback and the referee
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency, but keep working without it
    _fast_loads = json.loads


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line; a line that is not a JSON object is an error."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the with below; open errors need their own message
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from None
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = _fast_loads(line)
            except ValueError:
                # orjson rejects NaN/Infinity, which Python's json.dumps writes: let the stdlib decide so
                # such values reach the field checks and get their precise message
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise InputError(f"{path}: line {lineno}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def require(obj: dict, key: str, path: Path, where: str, types, what: str):
    """``obj[key]`` if present and of ``types`` (bool never counts as int), else an :class:`InputError`."""
    if key not in obj:
        raise InputError(f"{path}: {where}: field '{key}' missing (expected {what})")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, types):
        raise InputError(f"{path}: {where}: field '{key}' is {json.dumps(v)[:60]}, expected {what}")
    return v


def int_matrix(value, path: Path, where: str, key: str, *, integral: bool = True) -> np.ndarray:
    """A rectangular numeric 2-D list -> float64/int64 array; errors name the field."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError):
        raise InputError(f"{path}: {where}: field '{key}' is not a rectangular list of numbers") from None
    if arr.ndim != 2:
        raise InputError(
            f"{path}: {where}: field '{key}' has {arr.ndim} dimension(s), expected 2 ([layers][slots])"
        )
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{path}: {where}: field '{key}' holds a non-finite number")
    if integral:
        if np.any(arr != np.round(arr)):
            raise InputError(f"{path}: {where}: field '{key}' holds a non-integer value, expected integers")
        return arr.astype(np.int64)
    return arr


def write_validated_trace(
    out: Path, model: ModelSpec, provenance: dict, write_chunks, **writer_options
) -> int:
    """Write a trace atomically: ``write_chunks(writer)`` fills a :class:`TraceWriter` in a temporary
    directory, the result is validated, and only a valid trace is renamed onto ``out``. Returns rows."""
    with atomic_path(out, directory=True) as tmp:
        stage = tmp / "trace"
        with TraceWriter(stage, model, provenance, **writer_options) as w:
            write_chunks(w)
        check_trace(stage)
        for f in stage.iterdir():
            f.rename(tmp / f.name)
        shutil.rmtree(stage)
        return w.rows_written


def expert_id_matrix(value, path: Path, where: str, field: str, num_experts: int, top_k: int,
                     row_label=None) -> np.ndarray:
    """Expert ids of tokens as an ``[n, top_k]`` uint16 array, checked the way the trace validator would
    check the output, but naming the *input*: integer dtype (bools and floats refused), ``top_k`` ids per
    token, every id in ``[0, num_experts)``, no id twice in one token's top-k. ``row_label(i)`` names row
    ``i`` in messages (default ``"token i"``)."""
    label = row_label or (lambda i: f"token {i}")
    arr = np.asarray(value)
    prefix = f"{path}: {where}: field '{field}'"
    if arr.dtype == object or arr.dtype.kind not in "iu":
        raise InputError(f"{prefix}: expected integer expert ids, got {arr.dtype if arr.dtype != object else 'a ragged or mixed list'}")
    if arr.ndim != 2 or arr.shape[1] != top_k:
        raise InputError(f"{prefix}: shape {list(arr.shape)}, expected [tokens, {top_k}] (the model's top-k)")

    if arr.size:
        bad = (arr < 0) | (arr >= num_experts)
        if bad.any():
            t, j = map(int, np.argwhere(bad)[0])
            raise InputError(f"{prefix}: {label(t)}: expert id {int(arr[t, j])} out of range [0, {num_experts})")
        srt = np.sort(arr, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if dup.any():
            t = int(np.flatnonzero(dup)[0])
            raise InputError(f"{prefix}: {label(t)}: expert ids {arr[t].tolist()} repeat an expert")
    return arr.astype(np.uint16)


def moe_layer_axis(arr: np.ndarray, model: ModelSpec, path: Path, where: str, field: str) -> np.ndarray:
    """``arr[tokens, layers, k]`` with the layer axis cut to the model's MoE layers: the axis holds every
    decoder layer (``num_layers``; dense rows are dropped) or the MoE layers only (``num_moe_layers``)."""
    n = arr.shape[1]
    if n == model.num_layers:
        return arr[:, list(model.moe_layers)]
    if n == model.num_moe_layers:
        return arr
    raise InputError(f"{path}: {where}: field '{field}': layer axis has {n} entries; model '{model.name}' has "
                     f"{model.num_layers} decoder layers ({model.num_moe_layers} MoE): expected one of the two")
