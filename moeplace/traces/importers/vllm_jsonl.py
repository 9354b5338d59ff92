"""Per-token routing logs in the public vLLM-MoE-Logger JSONL form -> a trace directory.

A log is one meta line, then one ``route`` line per (token, logged MoE layer)::

    {"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "layers_logged": [0], "top_k": 4, ...}
    {"type": "route", "req_id": "r1", "token_idx": 0, "layer": 0, "topk_ids": [43, 5, 7, 58],
     "topk_weights": [0.097, 0.052, 0.039, 0.037]}

The logger appends, so one file can hold several runs, each starting with its own meta line (a *session*;
request ids are qualified by session). Handling of what real logs look like:

- **Warm-up rows.** vLLM's profiling / graph-capture passes run dummy batches before real traffic, so logs
  begin with thousands of rows that route every token identically. Within each layer's stream (file order),
  every maximal run of at least ``warmup_min_run`` consecutive rows with identical ``topk_ids`` and
  ``topk_weights`` is dropped (real traffic does not repeat a bit-identical top-k with identical weights
  that many times in a row); the count is reported. ``warmup_min_run=0`` keeps everything.
- **Layer numbering.** A log's ``layer`` is either the MoE-layer ordinal (0 = first MoE layer; what the
  public logger's ``VLLM_MOE_LAYER`` means) or the decoder-layer index (HF ``model.layers.{i}``).
  ``layer_numbering="auto"`` decides from the values: a value that is a dense layer, or the count of MoE
  layers, rules out "decoder"; a value ``>= num_moe_layers`` rules out "moe". When both fit and the model
  has dense layers, "moe" is assumed (the logger's convention) and the summary says it was ambiguous;
  pass ``"decoder"`` or ``"moe"`` to decide explicitly. Traces store decoder-layer indices.
- **Token identity.** The public logger restarts ``token_idx`` at 0 for every forward batch and often logs
  one fixed ``req_id``, so (``req_id``, ``token_idx``) does not name a token. Each layer's stream of one
  (session, ``req_id``) is cut into *batches* where ``token_idx`` fails to increase (a batch boundary); a
  token is (session, ``req_id``, batch, ``token_idx``) and its rows at different layers are joined on that.
  Every batch becomes its own ``request_id`` in the trace, so (``request_id``, ``position``) names one token
  and the trace replays (``place evaluate``). A token that has rows at some logged layers but not at others
  means the layers' streams do not line up: the import is refused, naming the token.
- **Per-layer files.** A logger that logs one layer per run writes one session per layer. Sessions that log
  disjoint layer sets are one run's per-layer logs only if they saw the same tokens (the same
  (``req_id``, ``token_idx``) stream): then they are joined into one session; otherwise the import is
  refused (the rows of separate runs are different tokens and cannot be joined into one).
- **Partial coverage.** Logs that cover some MoE layers only are accepted when they declare those layers
  (the meta records' ``layers_logged``, or ``layers`` from ``--layers``): the trace's model spec is the
  model restricted to them (``ModelSpec.restrict``), so every reader works on those layers and labels its
  results "N of M layers". A log that does not declare its layers must hold all of them; a declared layer
  without rows is a gap and refused.

What the log does not say is not invented: ``position`` is the logged ``token_idx``, ``phase`` is 0 (the log
does not distinguish prefill from decode), ``request_id`` numbers (session, ``req_id``, batch) triples.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import INT32_MAX, jsonl_records, write_validated_trace
from moeplace.traces.phases import PHASES_KNOWN

DEFAULT_WARMUP_MIN_RUN = 16
NUMBERINGS = ("auto", "moe", "decoder")


FLUSH_ROWS = 1 << 16  # route rows parsed into Python lists before they move to compact numpy chunks


class _Log:
    """Columns parsed from one or more JSONL files (row = one route line). Rows are checked and moved from
    Python lists into numpy chunks every ``FLUSH_ROWS`` rows, so memory stays near the numpy size
    (uint16 ids, float32 weights) instead of Python objects."""

    COLUMNS = ("file_idx", "lineno", "request", "token_idx", "layer", "ids", "weights")

    def __init__(self, srcs: list[Path], model: ModelSpec) -> None:
        self.srcs, self.model = srcs, model
        self.pending: dict[str, list] = {c: [] for c in self.COLUMNS}
        self.chunks: dict[str, list[np.ndarray]] = {c: [] for c in self.COLUMNS}
        self.has_weights: bool | None = None
        self.request_of: dict[tuple[int, object], int] = {}
        self.num_meta = 0
        self.num_other = 0
        self.model_ids: list[str] = []
        self.layers_logged: set[int] | None = None

    def _where(self, bad: np.ndarray) -> str:
        i = int(np.flatnonzero(bad)[0])
        return f"{self.srcs[self.pending['file_idx'][i]]}: line {self.pending['lineno'][i]}"

    def flush(self) -> None:
        """Check the pending rows' ids and weights (vectorized) and move them into numpy chunks."""
        p = self.pending
        n = len(p["ids"])
        if n == 0:
            return
        ids = self._ids(n)
        weights = self._weights(n) if self.has_weights else np.zeros((n, 0), dtype=np.float32)
        c = self.chunks
        c["ids"].append(ids.astype(np.uint16))
        c["weights"].append(weights)
        c["file_idx"].append(np.asarray(p["file_idx"], dtype=np.int32))
        c["lineno"].append(np.asarray(p["lineno"], dtype=np.int64))
        for col in ("request", "token_idx", "layer"):
            c[col].append(np.asarray(p[col], dtype=np.int64))
        for v in p.values():
            v.clear()

    def _ids(self, n: int) -> np.ndarray:
        """The pending ``topk_ids`` as an integer ``[n, k]`` array: integers, in the model's range, no
        expert twice in a row."""
        p = self.pending
        k, num_experts, name = self.model.top_k, self.model.num_experts, self.model.name
        try:  # no dtype: a float id must stay visible (int64 conversion would truncate 1.5 to 1)
            ids = np.asarray(p["ids"])
        except (ValueError, TypeError, OverflowError):
            ids = None
        if ids is None or ids.shape != (n, k) or ids.dtype.kind not in "iu":
            def is_int(x) -> bool:
                return isinstance(x, int) and not isinstance(x, bool)

            bad = np.array([not all(map(is_int, r)) for r in p["ids"]])
            if bad.any():
                v = next(x for x in p["ids"][int(np.flatnonzero(bad)[0])] if not is_int(x))
                raise InputError(f"{self._where(bad)}: field 'topk_ids' holds {json.dumps(v)[:40]}, "
                                 "expected integer expert ids")
            # integers beyond int64: out of any expert range
            big = np.array([any(not 0 <= x < num_experts for x in r) for r in p["ids"]])
            v = next(x for x in p["ids"][int(np.flatnonzero(big)[0])] if not 0 <= x < num_experts)
            raise InputError(f"{self._where(big)}: field 'topk_ids': expert {v} outside 0..{num_experts - 1} "
                             f"(model '{name}')")
        rng = (ids < 0) | (ids >= num_experts)
        if rng.any():
            row = rng.any(axis=1)
            i = int(np.flatnonzero(row)[0])
            raise InputError(
                f"{self._where(row)}: field 'topk_ids': expert "
                f"{int(ids[i][rng[i]][0])} outside 0..{num_experts - 1} (model '{name}')"
            )
        srt = np.sort(ids, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if dup.any():
            i = int(np.flatnonzero(dup)[0])
            raise InputError(f"{self._where(dup)}: field 'topk_ids': expert repeated in {ids[i].tolist()}")
        return ids

    def _weights(self, n: int) -> np.ndarray:
        """The pending ``topk_weights`` as float32 ``[n, k]``: numbers, finite and non-negative."""
        p = self.pending
        try:
            w64 = np.asarray(p["weights"], dtype=np.float64)
        except (ValueError, TypeError):
            bad = np.array(
                [
                    not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)
                    for r in p["weights"]
                ]
            )
            raise InputError(f"{self._where(bad)}: field 'topk_weights' holds a non-number") from None
        bad = ~np.isfinite(w64) | (w64 < 0)
        if bad.any():
            row = bad.any(axis=1)
            i = int(np.flatnonzero(row)[0])
            raise InputError(
                f"{self._where(row)}: field 'topk_weights': weight "
                f"{float(w64[i][bad[i]][0])} is not a finite non-negative number"
            )
        return w64.astype(np.float32)  # the trace stores float32

    def column(self, name: str) -> np.ndarray:
        return np.concatenate(self.chunks[name])

    def chunks_rows(self) -> int:
        """Route rows parsed (after :meth:`flush`)."""
        return sum(len(c) for c in self.chunks["layer"])

    def where_row(self, i: int) -> str:
        fi = int(np.concatenate(self.chunks["file_idx"])[i])
        return f"{self.srcs[fi]}: line {int(np.concatenate(self.chunks['lineno'])[i])}"


def _parse(srcs: list[Path], model: ModelSpec, log: _Log) -> None:
    for fi, path in enumerate(srcs):
        session = -1
        for lineno, obj in jsonl_records(path):
            typ = obj.get("type")
            if typ == "route":
                if session < 0:
                    raise InputError(
                        f"{path}: line {lineno}: a 'route' record before any 'meta' record "
                        '(a log starts with {"type": "meta", ..., "top_k": K})'
                    )
                _add_route(log, obj, fi, path, lineno, session, model.top_k)
            elif typ == "meta":
                _read_meta(log, obj, path, lineno, model)
                session = log.num_meta
                log.num_meta += 1
            else:
                log.num_other += 1
        if session < 0:
            raise InputError(f"{path}: no 'meta' record: not a vLLM MoE routing log")
    log.flush()


def _add_route(log: _Log, obj: dict, fi: int, path: Path, lineno: int, session: int, k: int) -> None:
    """Check one route record's scalar fields and list lengths and append it to ``log``'s pending rows
    (ids and weights are checked, vectorized, when they are flushed)."""
    pend = log.pending
    tok, layer, ids = obj.get("token_idx"), obj.get("layer"), obj.get("topk_ids")
    w = obj.get("topk_weights")
    # the trace stores positions as int32 and layers as uint16: larger values are errors
    for key, v, hi in (("token_idx", tok, INT32_MAX), ("layer", layer, 65535)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise InputError(
                f"{path}: line {lineno}: field '{key}' is {v!r}, expected an integer in [0, {hi}]"
            )
    if not isinstance(ids, list) or len(ids) != k:
        got = f"{len(ids)} ids" if isinstance(ids, list) else repr(ids)[:40]
        raise InputError(
            f"{path}: line {lineno}: field 'topk_ids' has {got}, expected a list of "
            f"top_k = {k} expert ids"
        )
    if log.has_weights is None:
        log.has_weights = w is not None
    if (w is not None) != log.has_weights:
        raise InputError(
            f"{path}: line {lineno}: field 'topk_weights' "
            f"{'present' if w is not None else 'missing'}, unlike the lines before"
        )
    if w is not None and (not isinstance(w, list) or len(w) != k):
        raise InputError(
            f"{path}: line {lineno}: field 'topk_weights' is not a list of {k} numbers"
        )
    req = obj.get("req_id")
    if req is None or isinstance(req, (list, dict)):
        raise InputError(f"{path}: line {lineno}: field 'req_id' missing or not a string/integer")
    key = (session, req)
    r = log.request_of.get(key)
    if r is None:
        r = log.request_of[key] = len(log.request_of)
    pend["file_idx"].append(fi)
    pend["lineno"].append(lineno)
    pend["request"].append(r)
    pend["token_idx"].append(tok)
    pend["layer"].append(layer)
    pend["ids"].append(ids)
    pend["weights"].append(w)
    if len(pend["ids"]) >= FLUSH_ROWS:
        log.flush()


def _read_meta(log: _Log, obj: dict, path: Path, lineno: int, model: ModelSpec) -> None:
    """A meta record (a new session): its ``top_k`` must be the model's; ``layers_logged`` and
    ``model_id`` are kept."""
    top_k = obj.get("top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise InputError(
            f"{path}: line {lineno}: field 'top_k' missing or not an integer in the meta record"
        )
    if top_k != model.top_k:
        raise InputError(
            f"{path}: line {lineno}: field 'top_k' is {top_k}, but model '{model.name}' "
            f"routes top-{model.top_k} (wrong --model?)"
        )
    logged = obj.get("layers_logged")
    if isinstance(logged, list) and all(isinstance(x, int) for x in logged):
        log.layers_logged = (log.layers_logged or set()) | set(logged)
    if isinstance(obj.get("model_id"), str):
        log.model_ids.append(obj["model_id"])


def warmup_mask(layer: np.ndarray, ids: np.ndarray, weights: np.ndarray | None, min_run: int) -> np.ndarray:
    """Rows inside warm-up runs: maximal runs of >= ``min_run`` consecutive rows of one layer's stream (file
    order) with identical ids and weights.

    ``layer``: int64 ``[n]``; ``ids``: ``[n, k]``; ``weights``: ``[n, k]`` or None. Returns bool ``[n]``.
    """
    n = layer.shape[0]
    drop = np.zeros(n, dtype=bool)
    if min_run <= 0 or n == 0:
        return drop
    order = np.argsort(layer, kind="stable")  # each layer's rows, in file order
    lay, i_ = layer[order], ids[order]
    same = (lay[1:] == lay[:-1]) & (i_[1:] == i_[:-1]).all(axis=1)
    if weights is not None:
        w_ = weights[order]
        same &= (w_[1:] == w_[:-1]).all(axis=1)
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    lengths = np.diff(np.concatenate((starts, [n])))
    long_runs = lengths >= min_run
    run_of = np.repeat(np.arange(starts.size), lengths)
    drop[order] = long_runs[run_of]
    return drop


def detect_numbering(values: np.ndarray, model: ModelSpec, requested: str = "auto") -> tuple[str, bool]:
    """Which layer numbering the logged ``values`` use: ``("moe"|"decoder", ambiguous)``.

    Raises :class:`InputError` when the values fit neither (or not the requested one).
    """
    vals = np.unique(values)
    moe = np.asarray(model.moe_layers)
    fits_decoder = bool(np.isin(vals, moe).all())
    fits_moe = bool(vals.max(initial=0) < model.num_moe_layers)
    if requested == "decoder" and not fits_decoder:
        bad = vals[~np.isin(vals, moe)]
        raise InputError(
            f"layer {int(bad[0])} is not an MoE decoder layer of model '{model.name}' "
            "(--layer-numbering decoder)"
        )
    if requested == "moe" and not fits_moe:
        raise InputError(
            f"layer {int(vals.max())} >= {model.num_moe_layers} MoE layers of model '{model.name}' "
            "(--layer-numbering moe)"
        )
    if requested in ("moe", "decoder"):
        return requested, False
    if fits_moe and fits_decoder:
        return "moe", tuple(model.moe_layers) != tuple(range(model.num_moe_layers))
    if fits_moe:
        return "moe", False
    if fits_decoder:
        return "decoder", False
    raise InputError(
        f"logged layers {vals.tolist()[:8]} fit neither numbering of model '{model.name}': "
        f"MoE-layer ordinals must be < {model.num_moe_layers}, decoder indices must be MoE layers "
        f"({model.moe_layers[0]}..{model.moe_layers[-1]}, dense: {list(model.dense_layers)[:6]})"
    )


def import_(
    srcs: list[Path],
    model: ModelSpec,
    out: Path | None,
    *,
    layer_numbering: str = "auto",
    warmup_min_run: int = DEFAULT_WARMUP_MIN_RUN,
    layers: tuple[int, ...] | None = None,
) -> ImportResult:
    """Import the logs ``srcs`` of ``model`` into the trace directory ``out``. ``layers``: the MoE layers the
    log holds (decoder-layer indices), declared by the user; otherwise the meta records' ``layers_logged``
    declare them. A log of some MoE layers only is imported when they are declared (its trace's model is
    ``model.restrict(layers)``: every reader works on those layers and says "N of M layers"); an
    undeclared gap is refused."""
    t0 = time.perf_counter()
    if out is None:
        raise InputError("vllm-jsonl logs become a trace: give --out DIR")
    if layer_numbering not in NUMBERINGS:
        raise InputError(
            f"layer numbering '{layer_numbering}' unknown (expected one of {', '.join(NUMBERINGS)})"
        )
    log = _read(srcs, model)
    n = log.chunks_rows()
    kept = _kept_rows(log, srcs, model, layer_numbering, warmup_min_run)
    tokens = _token_identity(log, kept)
    final = np.lexsort((kept.dec_layer, tokens.step))
    covered = sorted(int(x) for x in np.unique(kept.dec_layer))
    held, declared_by = _held_layers(log, srcs, model, kept, covered, layers)
    model = model.restrict(held)
    chunk = 1 << 20

    def write(w):
        for s in range(0, final.size, chunk):
            sel = final[s : s + chunk]
            w.write(
                request_id=tokens.request[sel],
                position=kept.tok[sel],
                phase=np.zeros(sel.size, dtype=np.uint8),
                step=tokens.step[sel],
                layer=kept.dec_layer[sel],
                expert_ids=kept.ids[sel],
                gate_weights=None if kept.weights is None else kept.weights[sel],
            )

    prov = {
        "kind": "imported", "format": "vllm-jsonl", "sources": [str(s) for s in srcs],
        "model_ids": sorted(set(log.model_ids)), "layer_numbering": kept.numbering,
        "layer_numbering_ambiguous": kept.ambiguous, "warmup_rows_dropped": kept.num_warmup,
        "warmup_min_run": warmup_min_run, "layers_covered": covered, "layers_declared_by": declared_by,
        "phase": "unknown in the log; all rows marked prefill (0)", PHASES_KNOWN: False,
        "token_identity": (f"{tokens.num_streams} logged (session, req_id) streams cut at token_idx restarts into "
                           f"{tokens.num_batches} batches, one request_id each"
                           + (f"; {tokens.sessions_joined} per-layer sessions of one run joined"
                              if tokens.sessions_joined else "")),
    }
    rows = write_validated_trace(out, model, prov, write, gate_weights=kept.weights is not None)
    secs = time.perf_counter() - t0
    ambiguous = " (ambiguous: also valid as the other numbering; set --layer-numbering to decide)"
    summary = {
        "format": "vllm-jsonl", "records_read": n, "meta_records": log.num_meta,
        "other_records_skipped": log.num_other, "warmup_rows_dropped": kept.num_warmup, "rows_written": rows,
        "tokens": tokens.num_tokens, "requests": tokens.num_batches, "sessions_joined": tokens.sessions_joined,
        "layers_covered": covered, "model_moe_layers": len(model.model_moe_layers), "layers_declared_by": declared_by,
        "layer_numbering": kept.numbering + (ambiguous if kept.ambiguous else ""),
        "seconds": secs, "records_per_s": n / secs if secs > 0 else 0.0,
    }
    return ImportResult("trace", trace=out, summary=summary)


def _held_layers(log: _Log, srcs: list[Path], model: ModelSpec, kept: _Kept, covered: list[int],
                 layers: tuple[int, ...] | None) -> tuple[list[int], str]:
    """The MoE layers (decoder indices) the import holds and who declared them: ``layers`` (``--layers``),
    else the meta records' ``layers_logged`` (in the log's numbering), else every MoE layer of the model.
    Each declared layer must have rows (a declared layer without rows is a gap) and rows must lie in
    declared layers."""
    where = ", ".join(map(str, srcs))
    full = list(model.moe_layers)
    if layers is not None:
        declared, by = sorted(layers), "--layers"
        outside = [x for x in declared if x not in full]
        if outside:
            raise InputError(f"--layers {format_ranges(declared)}: {format_ranges(outside)} not MoE layers of model "
                             f"'{model.name}' (its MoE layers: {format_ranges(full)})")
        extra = [x for x in covered if x not in declared]
        if extra:
            i = int(np.flatnonzero(np.isin(kept.dec_layer, extra))[0])
            raise InputError(f"{log.where_row(int(kept.row[i]))}: field 'layer' is decoder layer {extra[0]}, not "
                             f"among the layers --layers declares ({format_ranges(declared)})")
    elif log.layers_logged is not None:
        logged = sorted(log.layers_logged)
        if kept.numbering == "moe":
            bad = [x for x in logged if not 0 <= x < len(full)]
            declared = [full[x] for x in logged if 0 <= x < len(full)]
        else:
            bad = [x for x in logged if x not in full]
            declared = [x for x in logged if x in full]
        if bad:
            raise InputError(f"{where}: the meta record's layers_logged {format_ranges(logged)} names "
                             f"{format_ranges(bad)}, not MoE layers of model '{model.name}' in {kept.numbering} "
                             f"numbering (wrong --model or --layer-numbering?)")
        by = "the log's layers_logged"
    else:
        declared, by = full, ""
    missing = [d for d in declared if d not in covered]
    if missing:
        what = (f"declares MoE layers {format_ranges(declared)} ({by})" if by else
                f"does not declare the layers it holds (no layers_logged in its meta records, no --layers), so "
                f"it must hold all {len(full)} of model '{model.name}' ({format_ranges(full)})")
        raise InputError(f"{where}: the log {what} but has no rows for {format_ranges(missing)} (it holds "
                         f"{format_ranges(covered)}): "
                         + ("declare the layers a partial log holds with --layers" if not by else
                            "a trace holds every layer it declares"))
    return declared, by


def _read(srcs: list[Path], model: ModelSpec) -> _Log:
    """Parse every file into a :class:`_Log`; a log without route records is an error."""
    log = _Log(srcs, model)
    # The parse creates millions of small lists; the cyclic GC would rescan them over and over (no cycles
    # are created here), which costs more than the parsing itself.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _parse(srcs, model, log)
    finally:
        if gc_was_enabled:
            gc.enable()
    if not log.chunks["ids"]:
        raise InputError(f"{', '.join(map(str, srcs))}: no 'route' records")
    return log


@dataclass(frozen=True)
class _Kept:
    """The route rows past the layer checks and the warm-up filter (``[n]`` / ``[n, k]``, file order):
    global row number, logged layer, decoder layer, ``token_idx``, ids, weights (None without)."""

    row: np.ndarray
    layer: np.ndarray
    dec_layer: np.ndarray
    tok: np.ndarray
    ids: np.ndarray
    weights: np.ndarray | None
    numbering: str
    ambiguous: bool
    num_warmup: int


def _kept_rows(log: _Log, srcs: list[Path], model: ModelSpec, layer_numbering: str,
               warmup_min_run: int) -> _Kept:
    """Check the logged layers (against ``layers_logged``; which numbering) and drop the warm-up rows."""
    ids, layer = log.column("ids"), log.column("layer")
    weights = log.column("weights") if log.has_weights else None
    n = layer.shape[0]
    if log.layers_logged is not None:
        outside = ~np.isin(layer, list(log.layers_logged))
        if outside.any():
            raise InputError(
                f"{log.where_row(int(np.flatnonzero(outside)[0]))}: field 'layer' is "
                f"{int(layer[outside][0])}, not in the meta record's layers_logged "
                f"{sorted(log.layers_logged)}"
            )
    try:
        numbering, ambiguous = detect_numbering(layer, model, layer_numbering)
    except InputError as exc:
        raise InputError(f"{srcs[0]}: field 'layer': {exc}") from None
    drop = warmup_mask(layer, ids, weights, warmup_min_run)
    keep = ~drop
    if not keep.any():
        raise InputError(
            f"{', '.join(map(str, srcs))}: all {n} route rows look like warm-up (runs of >= "
            f"{warmup_min_run} identical rows); lower --warmup-min-run or 0 to keep them"
        )
    layer = layer[keep]
    dec_layer = np.asarray(model.moe_layers)[layer] if numbering == "moe" else layer
    return _Kept(np.flatnonzero(keep), layer, dec_layer, log.column("token_idx")[keep], ids[keep],
                 weights[keep] if weights is not None else None, numbering, ambiguous, int(drop.sum()))


@dataclass(frozen=True)
class _Tokens:
    """Token identity of the kept rows: the trace's ``request_id`` and ``step`` per row, and counts."""

    request: np.ndarray
    step: np.ndarray
    num_tokens: int
    num_batches: int
    num_streams: int
    sessions_joined: int


def _token_identity(log: _Log, kept: _Kept) -> _Tokens:
    """A token is (request, batch, token_idx); a batch ends where ``token_idx`` fails to increase in the
    (request, layer) stream. Every (request, batch) becomes one trace request (numbered by first
    appearance) and every token one step (in order of its first row); the layers must line up."""
    row, layer, tok = kept.row, kept.layer, kept.tok
    request, sessions_joined = _join_per_layer_sessions(log, log.column("request")[row], layer, tok, row)
    order = np.lexsort((row, layer, request))  # each (request, layer) stream in file order
    r_o, l_o, t_o = request[order], layer[order], tok[order]
    new_stream = np.ones(order.size, dtype=bool)
    new_stream[1:] = (r_o[1:] != r_o[:-1]) | (l_o[1:] != l_o[:-1])
    restart = np.zeros(order.size, dtype=np.int64)
    restart[1:] = (~new_stream[1:]) & (t_o[1:] <= t_o[:-1])
    csum = np.cumsum(restart)
    stream_id = np.cumsum(new_stream) - 1
    batch = np.empty(order.size, dtype=np.int64)
    batch[order] = csum - csum[np.flatnonzero(new_stream)][stream_id]
    # request id of the trace: one per (request, batch), numbered by first appearance
    rb = request * (int(batch.max()) + 1) + batch
    _, first_rb, inv_rb = np.unique(rb, return_index=True, return_inverse=True)
    rank = np.empty(first_rb.size, dtype=np.int64)
    rank[np.argsort(row[first_rb], kind="stable")] = np.arange(first_rb.size)
    trace_req = rank[inv_rb.reshape(-1)]
    token_key = trace_req * (int(tok.max()) + 1) + tok
    uniq, first_row, token_of = np.unique(token_key, return_index=True, return_inverse=True)
    _check_aligned(log, token_of, layer, row, trace_req, tok, kept.dec_layer)
    step_of_token = np.empty(uniq.size, dtype=np.int64)
    step_of_token[np.argsort(row[first_row], kind="stable")] = np.arange(uniq.size)
    return _Tokens(trace_req, step_of_token[token_of], int(uniq.size), int(first_rb.size),
                   int(np.unique(request).size), sessions_joined)


def _join_per_layer_sessions(log: _Log, request: np.ndarray, layer: np.ndarray, tok: np.ndarray,
                             row: np.ndarray) -> tuple[np.ndarray, int]:
    """Request numbers ``[n]`` with the per-layer sessions of one run merged: when every session logs a
    disjoint set of layers, they are one run's per-layer logs only if each saw the same
    (``req_id``, ``token_idx``) stream; then a request of a later session takes the number of the same
    ``req_id`` in the first. Returns ``(request, sessions joined)``; refuses separate runs."""
    sess_req = sorted(log.request_of.items(), key=lambda kv: kv[1])  # [((session, req_id), number)]
    session_of = np.array([k[0] for k, _ in sess_req], dtype=np.int64)
    labels = {}
    label_of = np.array([labels.setdefault(k[1], len(labels)) for k, _ in sess_req], dtype=np.int64)
    sess = session_of[request]
    ids = np.unique(sess)
    if ids.size < 2:
        return request, 0
    layer_sets = [frozenset(np.unique(layer[sess == s]).tolist()) for s in ids]
    if len(set(layer_sets)) == 1:
        return request, 0  # several runs of the same layers: their tokens are distinct tokens
    union = frozenset().union(*layer_sets)
    files = log.column("file_idx")

    def where(s) -> str:
        return str(log.srcs[int(files[row[np.flatnonzero(sess == s)[0]]])])

    if sum(len(x) for x in layer_sets) != len(union):
        raise InputError(f"{where(ids[0])}: its sessions (meta records) log different but overlapping layer sets "
                         f"({', '.join(str(sorted(x)) for x in layer_sets[:4])}): neither one run's per-layer "
                         "logs nor repeated runs of the same layers; import them separately")

    def stream(s) -> np.ndarray:
        first_layer = min(layer_sets[list(ids).index(s)])
        m = np.flatnonzero((sess == s) & (layer == first_layer))
        return np.stack([label_of[request[m]], tok[m]], axis=1)

    ref = stream(ids[0])
    for s in ids[1:]:
        other = stream(s)
        if other.shape != ref.shape or not np.array_equal(other, ref):
            diff = (min(len(ref), len(other)) if other.shape != ref.shape or not len(ref)
                    else int(np.flatnonzero((other != ref).any(axis=1))[0]))
            raise InputError(f"{where(s)}: logs layers {sorted(layer_sets[list(ids).index(s)])}, "
                             f"{where(ids[0])} logs layers {sorted(layer_sets[0])}, but their token streams differ "
                             f"({len(other)} vs {len(ref)} rows per layer, first difference at row {diff}): "
                             "per-layer logs of separate runs are different tokens and cannot be joined; "
                             "import each run on its own")
    # same stream everywhere: requests of later sessions take the first session's number for that req_id
    first_num = {}
    for (s, _), num in sess_req:
        if s == ids[0]:
            first_num[label_of[num]] = num
    remap = np.array([first_num.get(label_of[num], num) for _, num in sess_req], dtype=np.int64)
    return remap[request], int(ids.size)


def _check_aligned(log: _Log, token_of: np.ndarray, layer: np.ndarray, row: np.ndarray, trace_req: np.ndarray,
                   tok: np.ndarray, dec_layer: np.ndarray) -> None:
    """Every token must have one row at every logged layer: otherwise the layers' streams do not line up
    and rows of different real tokens would be joined (refused, naming the first such token)."""
    layers = np.unique(layer)
    n_tok = int(token_of.max()) + 1
    per = np.zeros((n_tok, layers.size), dtype=np.int64)
    np.add.at(per, (token_of, np.searchsorted(layers, layer)), 1)
    bad = (per != 1).any(axis=1)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        i = int(np.flatnonzero(token_of == t)[0])
        have = sorted(set(dec_layer[token_of == t].tolist()))
        raise InputError(f"{log.where_row(int(row[i]))}: token_idx {int(tok[i])} (batch request {int(trace_req[i])}) "
                         f"has {per[t].tolist()} rows at the logged layers {sorted(set(dec_layer.tolist()))} "
                         f"(rows at {have}): the layers' streams do not line up, so token identity cannot be "
                         "rebuilt from this log")
