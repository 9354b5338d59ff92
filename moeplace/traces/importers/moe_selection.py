"""Per-query JSON files of the "MoE expert selection trace" dataset -> a trace.

Source: the dataset card of huggingface.co/datasets/core12345/MoE_expert_selection_trace (supplement of
"Orders in Chaos: Enhancing Large-Scale MoE LLM Serving with Data Movement Forecasting", arXiv 2510.05497):
traces of DeepSeek-R1 (AWQ), Llama-4-Maverick and Qwen3-235B-A22B-FP8 over MMLU, HellaSwag, LiveCodeBench
and others, laid out ``profiling_result/<org>/<model>/<benchmark>/<subject>/<query>.json``; "for each query
or request, we log the activated expert ID of every model layer of every generated token".

The files themselves are gated (access needs an accepted licence) and no stored copy shows one, so the
schema read here is the closest reading of that description, stated as an assumption: a query file holds
an array ``[generated tokens][layers][top_k]`` of expert ids, either as the whole document or as the one
field of an object whose value has that shape (other fields, e.g. the prompt text, are ignored), or as an
object mapping layer keys (``"3"``, ``"layer_3"``) to ``[generated tokens][top_k]``. The layer axis holds
every decoder layer (dense rows dropped) or the MoE layers only; keyed layers are decoder indices.

Trace: one request per file (sorted path order), ``phase`` decode (generated tokens only; the prompt is
not logged), ``position`` the generated-token index, ``step`` the order of tokens as listed, and ``domain``
= ``<benchmark>/<subject>`` (the two directories above the file) when the input is a directory tree.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import track
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import expert_id_matrix, moe_layer_axis, write_validated_trace
from moeplace.traces.phases import PHASES_KNOWN

_LAYER_KEY = re.compile(r"^(?:layer[_-]?)?(\d+)$")


def _files(srcs: list[Path]) -> list[tuple[Path, str | None]]:
    out = []
    for s in srcs:
        if s.is_dir():
            for f in sorted(s.rglob("*.json")):
                rel = f.relative_to(s).parts
                out.append((f, "/".join(rel[-3:-1]) if len(rel) >= 3 else None))
        else:
            out.append((s, None))
    if not out:
        raise InputError(f"{' '.join(map(str, srcs))}: no .json query files")
    return out


def _first_bool(value) -> list[int] | None:
    """The index of the first ``true``/``false`` in nested lists (numpy would read it as 1/0), or None."""
    stack = [(value, [])]
    while stack:
        v, at = stack.pop()
        for i, x in enumerate(v):
            if isinstance(x, bool):
                return [*at, i]
        stack.extend((x, [*at, i]) for i, x in reversed(list(enumerate(v))) if isinstance(x, list))
    return None


def _int_array(value, path: Path, what: str, ndim: int) -> np.ndarray | None:
    """``value`` as an integer array of ``ndim`` dimensions, or None if it is not one; a boolean among
    the ids is an error (``true`` is not expert 1)."""
    if not isinstance(value, list) or not value:
        return None
    try:
        arr = np.asarray(value)
    except ValueError:
        return None
    if arr.ndim != ndim or arr.dtype == object or arr.dtype.kind not in "iub":
        return None
    at = _first_bool(value)  # numpy reads [1, true] as [1, 1] and [true, false] as booleans
    if at is not None:
        x = value
        for i in at:
            x = x[i]
        raise InputError(f"{path}: field '{what}': {''.join(f'[{i}]' for i in at)} is {str(x).lower()}, expected "
                         "an integer expert id (JSON true/false are not ids)")
    return arr


def _parse(doc, path: Path, model: ModelSpec) -> np.ndarray:
    """``[tokens, MoE layers, k]`` expert ids of one query file."""
    arr = _int_array(doc, path, "(top level)", 3)
    if arr is not None:
        return moe_layer_axis(arr, model, path, "document", "(top level)")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected [tokens][layers][top_k] expert ids or an object holding them")
    keyed = {k: _LAYER_KEY.match(str(k)) for k in doc}
    if doc and all(keyed.values()):
        layers = {int(m.group(1)): k for k, m in keyed.items()}
        bad = [d for d in layers if d not in model.moe_layers]
        if bad:
            raise InputError(f"{path}: field '{layers[bad[0]]}': layer {bad[0]} is not an MoE layer of '{model.name}'")
        missing = [d for d in model.moe_layers if d not in layers]
        if missing:
            raise InputError(f"{path}: no entry for MoE layer {missing[0]} (every MoE layer is logged)")
        per = []
        for d in model.moe_layers:
            a = _int_array(doc[layers[d]], path, layers[d], 2)
            if a is None:
                raise InputError(f"{path}: field '{layers[d]}': expected [tokens][top_k] integer expert ids")
            per.append(a)
        n = {a.shape[0] for a in per}
        if len(n) > 1:
            raise InputError(f"{path}: the layers log different token counts {sorted(n)}")
        if {a.shape[1] for a in per} != {model.top_k}:
            raise InputError(f"{path}: a layer logs {next(a.shape[1] for a in per if a.shape[1] != model.top_k)} "
                             f"experts per token, the model's top-k is {model.top_k}")
        return np.stack(per, axis=1)
    found = [(k, a) for k, v in doc.items() if (a := _int_array(v, path, k, 3)) is not None]
    if len(found) != 1:
        names = ", ".join(repr(k) for k, _ in found) or "none"
        raise InputError(f"{path}: expected exactly one field holding [tokens][layers][top_k] expert ids, found "
                         f"{names}")
    key, arr = found[0]
    return moe_layer_axis(arr, model, path, "query", key)


def import_(srcs: list[Path], model: ModelSpec, out: Path | None, **_: object) -> ImportResult:
    t0 = time.perf_counter()
    if out is None:
        raise InputError("moe-selection-json queries become a trace: give --out DIR")
    files = _files(srcs)
    queries = []
    for path, domain in track(files, "read queries", "file"):
        doc = reading.read_json(path)
        arr = _parse(doc, path, model)
        n, L = arr.shape[:2]
        ids = expert_id_matrix(arr.reshape(n * L, arr.shape[2]), path, "query", "expert ids", model.num_experts,
                               model.top_k, lambda r, L=L: f"token {r // L} (layer {model.moe_layers[r % L]})"
                               ).reshape(n, L, model.top_k)
        queries.append((ids, domain))
    with_domain = any(d is not None for _, d in queries)
    layers = np.asarray(model.moe_layers, dtype=np.uint16)
    L = layers.size
    state = {"step": 0, "tokens": 0}

    def write(w):
        for rid, (ids, domain) in enumerate(queries):
            n = ids.shape[0]
            if n == 0:
                continue
            s = state["step"]
            w.write(request_id=np.full(n * L, rid, dtype=np.int64), position=np.repeat(np.arange(n, dtype=np.int32), L),
                    phase=np.ones(n * L, dtype=np.uint8), step=np.repeat(np.arange(s, s + n, dtype=np.int64), L),
                    layer=np.tile(layers, n), expert_ids=ids.reshape(n * L, model.top_k),
                    domain=(domain or "") if with_domain else None)
            state["step"] += n
            state["tokens"] += n

    prov = {"kind": "imported", "format": "moe-selection-json", "sources": [str(s) for s in srcs],
            "queries": [str(p) for p, _ in files],
            "phase": "generated tokens only (the dataset logs no prompt routing); all rows decode (1)",
            PHASES_KNOWN: True,
            "schema": "assumed [tokens][layers][top_k] per query (gated dataset; see traces/importers/moe_selection.py)"}
    rows = write_validated_trace(out, model, prov, write, domain=with_domain)
    secs = time.perf_counter() - t0
    summary = {"format": "moe-selection-json", "records_read": len(files), "rows_written": rows,
               "tokens": state["tokens"], "layers_covered": list(model.moe_layers), "seconds": secs,
               "records_per_s": len(files) / secs if secs > 0 else 0.0}
    return ImportResult("trace", trace=out, summary=summary)
