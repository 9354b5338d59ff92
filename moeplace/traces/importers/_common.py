"""Shared pieces of the importers: JSONL reading with line numbers, output helpers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import atomic_path
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.foundation.progress import bar
from moeplace.traces.format import TraceWriter
from moeplace.traces.validate import check_trace

try:  # orjson parses engine logs several times faster; the stdlib parser is the fallback and the referee
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency, but keep working without it
    _fast_loads = json.loads


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line; a line that is not a JSON object is an error."""
    try:
        fh = reading.open_regular(path)  # a FIFO, device or socket is refused, never opened
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from None
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    with fh, bar(size, f"read {path.name}", "B") as pb:
        for lineno, line in enumerate(fh, start=1):
            pb.update(len(line))
            if not line.strip():
                continue
            try:
                obj = _fast_loads(line)
                if reading.has_duplicate_keys(obj, line):  # orjson keeps the last of two keys: let the
                    obj = reading.parse_json(line, f"{path}: line {lineno}")  # stdlib reader decide
            except ValueError:
                # orjson rejects NaN/Infinity, which Python's json.dumps writes: let the stdlib decide so
                # such values reach the field checks and get their precise message
                obj = reading.parse_json(line, f"{path}: line {lineno}")  # depth and huge integers too
            if reading.may_be_too_deep(line):
                reading.check_depth(obj, f"{path}: line {lineno}")
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


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def exact_ints(value, prefix: str, lo: int, hi: int, label=None) -> np.ndarray:
    """``value`` (an array or nested list of numbers) as int64, never changed on the way: a bool array, a
    value that is not a whole number (``1.5``), a non-finite one or one outside ``[lo, hi]`` is an
    :class:`InputError` ``"{prefix}: {label(index)}..."`` (``prefix`` names file, record and field;
    ``label`` words an index tuple, default ``"[i, j]: "``)."""
    label = label or (lambda idx: f"[{', '.join(map(str, idx))}]: " if idx else "")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise InputError(f"{prefix}: not a rectangular array of integers") from None
    if arr.dtype.kind not in "iuf" or arr.dtype == object:
        what = "booleans" if arr.dtype.kind == "b" else "a ragged or mixed list" if arr.dtype == object else arr.dtype
        raise InputError(f"{prefix}: expected integers, got {what}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(np.where(np.isfinite(arr), arr, 0)))
        if bad.any():
            idx = tuple(int(x) for x in np.argwhere(bad)[0])
            raise InputError(f"{prefix}: {label(idx)}value {float(arr[idx]):.17g} is not an integer")
    # compare in the array's own type (uint64 and large floats would wrap or round in int64)
    low = (arr < lo) if not (arr.dtype.kind == "u" and lo <= 0) else np.zeros(arr.shape, bool)
    out = low | (arr > hi)
    if out.any():
        idx = tuple(int(x) for x in np.argwhere(out)[0])
        v = arr[idx]
        shown = int(v) if arr.dtype.kind in "iu" else f"{float(v):.17g}"
        if lo == 0 and v < 0:
            raise InputError(f"{prefix}: {label(idx)}value {shown} is negative")
        bound = {INT32_MAX: "the int32 maximum", INT64_MAX: "the int64 maximum"}.get(hi, str(hi))
        raise InputError(f"{prefix}: {label(idx)}value {shown} is outside [{lo}, {bound}]")
    return arr.astype(np.int64)


def check_total(total: float, prefix: str) -> None:
    """Counts whose sum could leave int64 are refused (every later sum stays exact below it)."""
    if total > INT64_MAX:
        raise InputError(f"{prefix}: the counts sum to {total:.4g} selections, beyond the int64 range of a "
                         "Loads file (corrupt or mis-typed counts?)")


def int_matrix(value, path: Path, where: str, key: str, *, integral: bool = True) -> np.ndarray:
    """A rectangular numeric 2-D list -> int64 (``integral``, exact: see :func:`exact_ints`) or float64
    array; errors name the field."""
    prefix = f"{path}: {where}: field '{key}'"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise InputError(f"{prefix} is not a rectangular list of numbers") from None
    if arr.dtype == object or arr.dtype.kind not in "iuf":
        raise InputError(f"{prefix} is not a rectangular list of numbers")
    if arr.ndim != 2:
        raise InputError(f"{prefix} has {arr.ndim} dimension(s), expected 2 ([layers][slots])")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise InputError(f"{prefix} holds a non-finite number")
    if integral:
        return exact_ints(arr, prefix, -INT64_MAX - 1, INT64_MAX,
                          lambda idx: f"[{idx[0]}][{idx[1]}]: ")
    return arr.astype(np.float64)


def write_validated_trace(
    out: Path, model: ModelSpec, provenance: dict, write_chunks, **writer_options
) -> int:
    """Write a trace atomically: ``write_chunks(writer)`` fills a :class:`TraceWriter` in a temporary
    directory, the result is validated, and only a valid trace is renamed onto ``out``. Returns rows."""
    with atomic_path(out, directory=True) as tmp:
        stage = tmp / "trace"
        try:
            with TraceWriter(stage, model, provenance, **writer_options) as w:
                write_chunks(w)
            with bar(None, f"validate {out.name}", "step") as pb:  # one streaming pass: say it is running
                check_trace(stage)
                pb.update(1)
        except InputError as exc:
            msg = str(exc)
            if str(stage) not in msg:
                raise
            # a problem the importer's record checks did not catch: name the inputs and the output, never
            # the temporary directory (which is gone when the user reads this)
            sources = ", ".join(map(str, provenance.get("sources", []))) or "the input"
            raise InputError(f"{sources}: converted, it would not be a valid trace: "
                             f"{msg.replace(str(stage), str(out))}") from None
        for f in stage.iterdir():
            f.rename(tmp / f.name)
        shutil.rmtree(stage)
        return w.rows_written


def incomplete_tokens_note(tokens: int, layers: list[int], groups: int, unit: str, first: str) -> str:
    """The line an importer prints (and the reason it records) for ``tokens`` it dropped because their
    forward pass / batch (``groups`` of ``unit``, the first described by ``first``) did not record every
    MoE layer in ``layers``, the layers the import holds: a trace has each token in each of them."""
    return (f"dropped {tokens:,} tokens recorded in only some of the {len(layers)} MoE layers the import holds "
            f"({format_ranges(layers)}): {groups:,} {unit}, the first {first}")


def nothing_complete(sources: str, layers: list[int], unit: str, first: str) -> InputError:
    """The refusal when no forward pass / batch recorded every MoE layer the import holds."""
    return InputError(f"{sources}: no {unit} records every MoE layer the import holds ({format_ranges(layers)}); "
                      f"the first {first}: nothing complete to import (each token needs a row in each layer)")


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
    decoder layer (``num_layers``; dense rows are dropped) or the MoE layers only (``num_moe_layers``).
    The top-k axis is checked here too, so that an error names the array's shape as the input holds it
    (not the ``[tokens x layers, k]`` the callers reshape it to)."""
    n = arr.shape[1]
    if arr.shape[2] != model.top_k:
        raise InputError(f"{path}: {where}: field '{field}': shape {list(arr.shape)}, expected [tokens, layers, "
                         f"{model.top_k}] (the model's top-k is {model.top_k})")
    if n == model.num_layers:
        return arr[:, list(model.moe_layers)]
    if n == model.num_moe_layers:
        return arr
    raise InputError(f"{path}: {where}: field '{field}': layer axis has {n} entries; model '{model.name}' has "
                     f"{model.num_layers} decoder layers ({model.num_moe_layers} MoE): expected one of the two")
