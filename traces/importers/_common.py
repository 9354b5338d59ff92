"""Shared pieces of the importers: JSONL reading with line numbers, output helpers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from traces.errors import InputError
from traces.files import atomic_path
from traces.format import TraceWriter
from traces.model import ModelSpec
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
