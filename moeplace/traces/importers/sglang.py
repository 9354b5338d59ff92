"""SGLang expert-distribution-recorder dumps (``python/sglang/srt/eplb/expert_distribution.py``).

Turn the recorder on with ``--expert-distribution-recorder-mode stat|per_token``, drive traffic between
``POST /start_expert_distribution_record`` and ``POST /stop_expert_distribution_record``, then
``POST /dump_expert_distribution_record``; files land in ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``.

``stat`` mode (``_StatAccumulator.dump``): rank 0 writes ``expert_distribution_recorder_{time}.pt`` =
``{"rank": int, "logical_count": int32 tensor [steps, num_layers, num_logical_experts],
"average_utilization_rate_over_window": float | None}`` (SGLang 0.5.23 writes its dumps only as ``.pt``,
so importing them needs torch); the same dict converted to ``.json`` (lists) is accepted too,
and so is a 2-D ``logical_count`` ``[num_layers, experts]`` (SGLang's ``--init-expert-location`` form).
SGLang's ``num_layers`` is the config's ``num_hidden_layers``: dense layers are included (their rows stay
zero), so the importer keeps the model's MoE layers; a ``logical_count`` that already has exactly
``num_moe_layers`` rows is taken as MoE-only. Steps come from a buffer
(``--expert-distribution-recorder-buffer-size``); a circular buffer that was not filled holds all-zero
steps, which are dropped and counted. Each kept step is one window of the resulting Loads.

``per_token`` mode (``_DetailAccumulator.dump``): every rank writes
``expert_distribution_recorder_{time}_{rank}.pt`` = ``{"records": [...], "last_physical_to_logical_map":
int tensor [num_layers, num_physical]}``, one record per forward pass: ``forward_pass_id``, ``rank``,
``input_ids`` and ``positions`` (lists, one per token), ``extend_seq_lens`` (tokens per sequence in an
extend pass), ``forward_mode`` (``forward_mode.value`` of SGLang's ``ForwardMode``: 1 EXTEND, 2 DECODE,
3 MIXED, 4 IDLE, 5 TARGET_VERIFY, ...; a member name such as ``"extend"`` is read too, anything else refused) and ``topk_ids_of_layer`` (int32 ``[num_layers, num_tokens, 8]``: *physical* expert
ids, ``-1`` where nothing was recorded; SGLang sizes the last axis with a fixed ``_TOP_K_NUM = 8``).
Physical ids are mapped to logical ones with the file's ``last_physical_to_logical_map`` (the map at dump
time: if EPLB rebalanced during recording, earlier passes are mapped with the later map; SGLang keeps no
history). Records of all files are merged in ``(forward_pass_id, rank)`` order; ``step`` is the
forward-pass id. A trace holds every token in each MoE layer it holds (the layers any record recorded):
a forward pass that recorded only some of them is dropped, said on stderr and counted in the summary and
the provenance (``incomplete_tokens_dropped``, ``incomplete_passes_dropped``); when no pass is complete the
import is refused. SGLang records no request ids: ``request_id`` here numbers the sequences of each
(rank, forward pass) (from ``extend_seq_lens``; in a decode pass every token is its own sequence), so it
does not link a request's decode steps. ``phase`` is decode for DECODE/TARGET_VERIFY passes, prefill
otherwise. A model whose top-k exceeds the recorder's 8 columns cannot be imported from ``per_token`` dumps.
"""

from __future__ import annotations

import pickle
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.foundation.progress import track
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import (
    INT32_MAX,
    INT64_MAX,
    check_total,
    exact_ints,
    incomplete_tokens_note,
    nothing_complete,
    write_validated_trace,
)
from moeplace.traces.loads import Loads
from moeplace.traces.phases import PHASES_KNOWN

FORWARD_MODE_DECODE = 2
FORWARD_MODE_TARGET_VERIFY = 5
DECODE_MODES = (FORWARD_MODE_DECODE, FORWARD_MODE_TARGET_VERIFY)


def _load_dump(path: Path) -> dict:
    if path.suffix == ".json":
        obj = reading.read_json(path, unreadable="not valid JSON")
    else:
        reading.require_regular(path)  # torch.load would block on a FIFO
        try:
            import torch  # ~5 s to import, and optional (the [capture] extra): only .pt dumps need it
        except ModuleNotFoundError:
            # SGLang (0.5.23) writes its recorder dumps only as .pt: torch is the way to read them
            raise InputError(f"{path}: reading SGLang's .pt dump needs torch, which this install lacks (pip install "
                             "'moeplace[capture]', or torch itself)") from None

        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (
            pickle.UnpicklingError,
            RuntimeError,
            EOFError,
            zipfile.BadZipFile,
            ValueError,
            OSError,
        ) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(
                f"{path}: not a readable torch dump (torch.load weights_only=True: {first})"
            ) from None
    if not isinstance(obj, dict):
        raise InputError(
            f"{path}: expected a dict with 'logical_count' (stat mode) or 'records' "
            f"(per_token mode), got {type(obj).__name__}"
        )
    return obj


def _as_array(value, path: Path, field: str, where: str = "") -> np.ndarray:
    prefix = f"{path}: {where + ': ' if where else ''}field '{field}'"
    torch = sys.modules.get("torch")  # a tensor exists only if torch.load ran, which imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise InputError(f"{prefix}: not a rectangular array of numbers") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.size == 0):
        raise InputError(f"{prefix}: not a rectangular array of numbers")
    return arr


def _token_label(idx: tuple) -> str:
    return f"token {idx[-1]}: " if idx else ""


def _moe_rows(n: int, model: ModelSpec, path: Path, field: str) -> np.ndarray | None:
    """Indices selecting the MoE layers from an SGLang layer axis of length ``n`` (None: axis is MoE-only)."""
    if n == model.num_layers:
        return np.asarray(model.moe_layers)
    if n == model.num_moe_layers:
        return None
    raise InputError(
        f"{path}: field '{field}': layer axis has {n} layers; model '{model.name}' has "
        f"{model.num_layers} layers ({model.num_moe_layers} MoE): expected {model.num_layers} "
        f"(SGLang counts every decoder layer) or {model.num_moe_layers}"
    )


# ------------------------------------------------------------------------------------------- stat mode
def stat_counts(logical_count: np.ndarray, model: ModelSpec, path: Path) -> tuple[np.ndarray, int]:
    """SGLang ``logical_count`` ``[steps, layers, E]`` (or ``[layers, E]``) -> int64
    ``[kept steps, L_moe, E]``
    and the number of all-zero steps dropped."""
    c = logical_count
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise InputError(
            f"{path}: field 'logical_count' has shape {list(c.shape)}, expected "
            "[steps, layers, experts] or [layers, experts]"
        )
    if c.shape[2] != model.num_experts:
        raise InputError(
            f"{path}: field 'logical_count' has {c.shape[2]} experts per layer, but model "
            f"'{model.name}' has {model.num_experts}"
        )
    c = exact_ints(c, f"{path}: field 'logical_count'", 0, INT64_MAX,
                   lambda idx: f"step {idx[0]}, layer {idx[1]}, expert {idx[2]}: ")
    check_total(float(c.sum(dtype=np.float64)), f"{path}: field 'logical_count'")
    rows = _moe_rows(c.shape[1], model, path, "logical_count")
    if rows is not None:
        dense = np.asarray(model.dense_layers, dtype=np.int64)
        if dense.size and c[:, dense].any():
            layer = int(dense[np.flatnonzero(c[:, dense].sum(axis=(0, 2)))[0]])
            raise InputError(
                f"{path}: field 'logical_count': layer {layer} is dense in model '{model.name}' "
                "but has expert counts: the dump is not of this model (check --model)"
            )
        c = c[:, rows]
    busy = c.reshape(c.shape[0], -1).any(axis=1)
    return c[busy], int((~busy).sum())


def _import_stat(
    dumps: list[tuple[Path, dict]], model: ModelSpec, out: Path | None, t0: float
) -> ImportResult:
    if out is not None and out.suffix != ".npz":
        raise InputError(f"--out {out}: SGLang stat dumps become Loads; give a path ending in .npz")
    windows, labels, dropped, steps_read, util = [], [], 0, 0, []
    total = 0.0
    for path, d in dumps:
        arr = _as_array(d["logical_count"], path, "logical_count")
        counts, n_zero = stat_counts(arr, model, path)
        steps_read += counts.shape[0] + n_zero
        dropped += n_zero
        first = len(labels)
        windows.append(counts)
        total += float(counts.sum(dtype=np.float64))
        check_total(total, f"{path}: field 'logical_count' (with the dumps before it)")
        labels += [f"{path.name} step {i}" for i in range(first, first + counts.shape[0])]
        u = d.get("average_utilization_rate_over_window")
        if isinstance(u, (int, float)) and not isinstance(u, bool):
            util.append(float(u))
    counts = np.concatenate(windows)
    if counts.shape[0] == 0:
        raise InputError(
            f"{', '.join(str(p) for p, _ in dumps)}: field 'logical_count': every step is zero "
            "(was recording started before traffic?)"
        )
    prov = {
        "kind": "imported",
        "format": "sglang",
        "mode": "stat",
        "sources": [str(p) for p, _ in dumps],
        "phase": "per-step expert counts of every pass: prefill and decode together", PHASES_KNOWN: False,
        "steps_read": steps_read,
        "zero_steps_dropped": dropped,
    }
    if util:
        prov["average_utilization_rate_over_window"] = util
    loads = Loads(counts, model, 0, tuple(labels), prov)
    if out is not None:
        loads.save(out)
    secs = time.perf_counter() - t0
    summary = {
        "format": "sglang",
        "mode": "stat",
        "records_read": steps_read,
        "zero_steps_dropped": dropped,
        "windows": loads.num_windows,
        "layers_covered": list(model.moe_layers),
        "selections": int(counts.sum()),
        "seconds": secs,
        "records_per_s": steps_read / secs if secs > 0 else 0.0,
    }
    return ImportResult("loads", loads=loads, summary=summary)


# -------------------------------------------------------------------------------------- per_token mode
def _record_rows(
    rec: dict,
    path: Path,
    ridx: int,
    p2l: np.ndarray,
    model: ModelSpec,
    moe_rows: np.ndarray | None,
    next_request: int,
) -> tuple[dict | None, int, np.ndarray]:
    """Rows of one forward-pass record (token-major, then layer); returns (columns or None, next request id,
    bool [L_moe] of layers this record covers)."""
    where = f"record {ridx}"
    k = model.top_k
    ids, input_ids, positions = _record_arrays(rec, path, where, p2l, model)
    n = input_ids.shape[0]
    covered = np.zeros(model.num_moe_layers, dtype=bool)
    if n == 0:
        return None, next_request, covered
    ids, layer_p2l = _moe_ids(ids, path, where, p2l, model, moe_rows)
    recorded = ids >= 0
    covered = recorded.any(axis=(1, 2))
    partial = covered[:, None] & ~recorded.all(axis=2)
    if partial.any():
        li, ti = map(int, np.argwhere(partial)[0])
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer': MoE layer {model.moe_layers[li]} token {ti} "
            f"has {int(recorded[li, ti].sum())} of {k} experts recorded"
        )
    layers = np.flatnonzero(covered)
    if layers.size == 0:
        return None, next_request, covered
    logical = _logical_ids(ids, layers, layer_p2l, path, where, model)
    mode = _forward_mode(rec, path, where)
    request = next_request + _sequence_of_token(rec, mode, n, path, where)
    lc = layers.size
    cols = {
        "request_id": np.repeat(request, lc),
        "position": np.repeat(positions, lc),
        "phase": np.full(n * lc, 1 if mode in DECODE_MODES else 0, dtype=np.uint8),
        "step": np.full(n * lc, int(rec["forward_pass_id"]), dtype=np.int64),
        "layer": np.tile(np.asarray(model.moe_layers)[layers], n),
        "expert_ids": logical.transpose(1, 0, 2).reshape(n * lc, k),
        "token_id": np.repeat(input_ids, lc),
    }
    return cols, int(request.max()) + 1, covered


def _record_arrays(rec: dict, path: Path, where: str, p2l: np.ndarray,
                   model: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A record's ``topk_ids_of_layer`` ``[layers, n, width]``, ``input_ids`` and ``positions`` ``[n]``,
    their fields and shapes checked."""
    for key in ("topk_ids_of_layer", "input_ids", "positions", "forward_pass_id"):
        if key not in rec:
            raise InputError(f"{path}: {where}: field '{key}' missing")
    ids = _as_array(rec["topk_ids_of_layer"], path, "topk_ids_of_layer", where)
    # token ids and positions are int32 in the trace; a value beyond is an error, never wrapped
    input_ids = exact_ints(_as_array(rec["input_ids"], path, "input_ids", where),
                           f"{path}: {where}: field 'input_ids'", 0, INT32_MAX, _token_label).reshape(-1)
    positions = exact_ints(_as_array(rec["positions"], path, "positions", where),
                           f"{path}: {where}: field 'positions'", 0, INT32_MAX, _token_label).reshape(-1)
    n = input_ids.shape[0]
    if ids.ndim != 3 or ids.shape[1] != n:
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer' has shape {list(ids.shape)}, expected "
            f"[layers, {n} tokens (len of input_ids), width]"
        )
    if positions.shape[0] != n:
        raise InputError(f"{path}: {where}: field 'positions' has {positions.shape[0]} entries, expected {n}")
    if ids.shape[0] != p2l.shape[0]:
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer' has {ids.shape[0]} layers, but "
            f"'last_physical_to_logical_map' has {p2l.shape[0]}"
        )
    if ids.shape[2] < model.top_k:
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer' keeps {ids.shape[2]} experts per token, "
            f"fewer than top_k {model.top_k} of model '{model.name}' (SGLang's per_token recorder keeps at "
            "most 8; use stat mode for this model)"
        )
    return ids, input_ids, positions


def _moe_ids(ids: np.ndarray, path: Path, where: str, p2l: np.ndarray, model: ModelSpec,
             moe_rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The MoE layers' physical ids ``[L_moe, n, k]`` (-1: not recorded) and their physical-to-logical
    maps; a dense layer with experts or an expert past column k is an error."""
    k = model.top_k
    ids = exact_ints(ids, f"{path}: {where}: field 'topk_ids_of_layer'", -1, INT32_MAX,
                     lambda idx: f"layer {idx[0]} token {idx[1]}: ")
    if moe_rows is not None:
        dense = np.setdiff1d(np.arange(ids.shape[0]), moe_rows)
        if dense.size and (ids[dense] >= 0).any():
            layer = int(dense[np.flatnonzero((ids[dense] >= 0).any(axis=(1, 2)))[0]])
            raise InputError(
                f"{path}: {where}: field 'topk_ids_of_layer': layer {layer} is dense in model "
                f"'{model.name}' but has recorded experts: the dump is not of this model"
            )
        layer_p2l = p2l[moe_rows]
        ids = ids[moe_rows]
    else:
        layer_p2l = p2l
    if (ids[:, :, k:] >= 0).any():
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer' has experts beyond column {k} "
            f"(top_k of model '{model.name}' is {k}: wrong --model?)"
        )
    return ids[:, :, :k], layer_p2l


def _logical_ids(ids: np.ndarray, layers: np.ndarray, layer_p2l: np.ndarray, path: Path, where: str,
                 model: ModelSpec) -> np.ndarray:
    """Logical expert ids ``[len(layers), n, k]`` of the recorded ``layers``: every physical id within the
    map, no logical expert twice in one token's top-k."""
    num_phys = layer_p2l.shape[1]
    if (ids >= num_phys).any():
        li, ti, _ = map(int, np.argwhere(ids >= num_phys)[0])
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer': MoE layer {model.moe_layers[li]} token {ti} "
            f"has physical expert {int(ids[li, ti].max())} >= {num_phys} physical slots"
        )
    sel = ids[layers]  # [Lc, n, k] physical
    logical = layer_p2l[layers][np.arange(layers.size)[:, None, None], sel]  # [Lc, n, k] logical
    srt = np.sort(logical, axis=2)
    dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)
    if dup.any():
        li, ti = map(int, np.argwhere(dup)[0])
        raise InputError(
            f"{path}: {where}: field 'topk_ids_of_layer': MoE layer {model.moe_layers[layers[li]]} "
            f"token {ti}: physical experts {sel[li, ti].tolist()} map to logical "
            f"{logical[li, ti].tolist()} with a repeat; "
            "'last_physical_to_logical_map' does not fit this record (EPLB rebalanced during recording?)"
        )
    return logical


# SGLang's ForwardMode (python/sglang/srt/model_executor/forward_batch_info.py, an IntEnum of auto() values):
# the recorder stores ``forward_batch.forward_mode.value``; a dump converted to JSON by hand may carry the
# member's name instead ("EXTEND", "extend", "ForwardMode.DECODE"), read here by the same table.
FORWARD_MODE_NAMES = {"EXTEND": 1, "DECODE": 2, "MIXED": 3, "IDLE": 4, "TARGET_VERIFY": 5, "DRAFT_EXTEND": 6}


def _forward_mode(rec: dict, path: Path, where: str) -> int:
    """A record's ``forward_mode`` as SGLang's integer value (absent or null: 0, read as a prefill pass); a
    member name is accepted, anything else is an error naming the record and the field."""
    v = rec.get("forward_mode")
    if v is None:
        return 0
    if isinstance(v, str):
        name = v.strip().upper().removeprefix("FORWARDMODE.")
        if name in FORWARD_MODE_NAMES:
            return FORWARD_MODE_NAMES[name]
        raise InputError(f"{path}: {where}: field 'forward_mode' is {v[:40]!r}, expected SGLang's ForwardMode value "
                         f"(an integer) or name ({', '.join(n.lower() for n in FORWARD_MODE_NAMES)})")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= int(v) <= INT32_MAX:
        raise InputError(f"{path}: {where}: field 'forward_mode' is {str(v)[:40]!r}, expected SGLang's ForwardMode "
                         "value (a non-negative integer) or name")
    return int(v)


def _sequence_of_token(rec: dict, mode: int, n: int, path: Path, where: str) -> np.ndarray:
    """The sequence (0-based, within the pass) of each of the ``n`` tokens: extend passes list tokens per
    sequence, decode passes have one token each."""
    seq_lens = rec.get("extend_seq_lens")
    if mode in DECODE_MODES or not seq_lens:
        return np.arange(n)
    lens = exact_ints(seq_lens, f"{path}: {where}: field 'extend_seq_lens'", 0, INT32_MAX).reshape(-1)
    if lens.sum() != n or np.any(lens < 0):
        raise InputError(
            f"{path}: {where}: field 'extend_seq_lens' sums to {int(lens.sum())}, expected {n} tokens"
        )
    return np.repeat(np.arange(lens.size), lens)


def _record_coverage(rec: dict, path: Path, p2l: np.ndarray, moe_rows: np.ndarray | None,
                     k: int) -> tuple[np.ndarray | None, int]:
    """The MoE layers one record recorded (bool ``[L_moe]``, as :func:`_record_rows` finds them once its
    checks pass) and its token count, read before any row is written; None for a record whose
    ``topk_ids_of_layer`` is not a usable array (:func:`_record_rows` words that error)."""
    try:
        ids = _as_array(rec.get("topk_ids_of_layer"), path, "topk_ids_of_layer")
    except InputError:
        return None, 0
    if ids.ndim != 3 or ids.shape[0] != p2l.shape[0]:
        return None, 0
    if moe_rows is not None:
        ids = ids[moe_rows]
    return (ids[:, :, :k] >= 0).any(axis=(1, 2)), int(ids.shape[1])


def _complete_records(order: list, coverage: dict, dumps: list, model: ModelSpec) -> tuple[set, list[int], dict]:
    """Which records to write: a trace holds each token in every MoE layer it holds, so a forward pass that
    recorded only some of the layers the dumps hold (the union over all records) is dropped and counted.
    Returns ``(keys of the dropped records, the layers held, a tally)``; refuses when nothing is complete."""
    held = np.zeros(model.num_moe_layers, dtype=bool)
    for cov, _ in coverage.values():
        if cov is not None:
            held |= cov
    dropped, tokens, first, complete = set(), 0, None, False
    for fp, rank, di, ri in order:
        cov, n = coverage[(di, ri)]
        if cov is None or not cov.any():
            continue  # nothing recorded (an idle pass), or malformed: the write pass says which
        if (cov == held).all():
            complete = True
            continue
        dropped.add((di, ri))
        tokens += n
        if first is None:
            have = [model.moe_layers[i] for i in np.flatnonzero(cov)]
            first = (f"forward pass {fp} of rank {rank} ({dumps[di][0]}, record {ri}) records layers "
                     f"{format_ranges(have)}")
    layers = [model.moe_layers[i] for i in np.flatnonzero(held)]
    if dropped and not complete:
        raise nothing_complete(", ".join(str(p) for p, _ in dumps), layers, "forward pass", first)
    tally = {"tokens": tokens, "passes": len(dropped),
             "note": incomplete_tokens_note(tokens, layers, len(dropped), "forward pass(es)", first) if dropped else None}
    return dropped, layers, tally


def _dump_map(path: Path, d: dict, model: ModelSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """A per_token dump's ``last_physical_to_logical_map`` ``[layers, physical]`` (checked) and the rows of
    its layer axis that are MoE layers (None: the axis is MoE-only)."""
    if "last_physical_to_logical_map" not in d:
        raise InputError(
            f"{path}: field 'last_physical_to_logical_map' missing (needed to map physical "
            "expert ids to logical ones)"
        )
    p2l = exact_ints(_as_array(d["last_physical_to_logical_map"], path, "last_physical_to_logical_map"),
                     f"{path}: field 'last_physical_to_logical_map'", -INT32_MAX, INT32_MAX)
    if p2l.ndim != 2:
        raise InputError(
            f"{path}: field 'last_physical_to_logical_map' has shape {list(p2l.shape)}, "
            "expected [layers, physical experts]"
        )
    if np.any((p2l < 0) | (p2l >= model.num_experts)):
        raise InputError(
            f"{path}: field 'last_physical_to_logical_map' maps to logical ids outside "
            f"0..{model.num_experts - 1} (model '{model.name}')"
        )
    return p2l, _moe_rows(p2l.shape[0], model, path, "last_physical_to_logical_map")


def _record_order(dumps: list[tuple[Path, dict]], model: ModelSpec) -> tuple[list, dict, list]:
    """Every record of every dump as ``(forward_pass_id, rank, dump index, record index)``, sorted; each
    record's coverage (:func:`_record_coverage`) by ``(dump index, record index)``; each dump's map
    (:func:`_dump_map`). Checked dump by dump: its map, then its records."""
    order, coverage, maps = [], {}, []
    for di, (path, d) in enumerate(dumps):
        maps.append(_dump_map(path, d, model))
        recs = d["records"]
        if not isinstance(recs, list):
            raise InputError(f"{path}: field 'records' is {type(recs).__name__}, expected a list of dicts")
        for ri, rec in enumerate(recs):
            if not isinstance(rec, dict):
                raise InputError(f"{path}: record {ri}: expected a dict, got {type(rec).__name__}")
            fp = rec.get("forward_pass_id")
            if isinstance(fp, bool) or not isinstance(fp, int) or not -INT64_MAX - 1 <= fp <= INT64_MAX:
                raise InputError(f"{path}: record {ri}: field 'forward_pass_id' missing or not an int64 integer")
            rank = rec.get("rank", 0)
            order.append((fp, int(rank) if isinstance(rank, int) else 0, di, ri))
            coverage[(di, ri)] = _record_coverage(rec, path, *maps[di], model.top_k)
    order.sort()
    return order, coverage, maps


def _import_per_token(
    dumps: list[tuple[Path, dict]], model: ModelSpec, out: Path | None, t0: float
) -> ImportResult:
    if out is None:
        raise InputError("per_token dumps become a trace: give --out DIR")
    if out.suffix == ".npz":
        raise InputError(f"--out {out}: SGLang per_token dumps become a trace directory, not a .npz")
    order, coverage, maps = _record_order(dumps, model)
    dropped, held, tally = _complete_records(order, coverage, dumps, model)
    state = {"next_request": 0, "covered": np.zeros(model.num_moe_layers, dtype=bool), "tokens": 0}

    def write(w):
        for _, _, di, ri in order:
            path, d = dumps[di]
            p2l, moe_rows = maps[di]
            # a dropped record is still checked: a malformed one is an error, not a reason to drop it
            cols, next_request, cov = _record_rows(
                d["records"][ri], path, ri, p2l, model, moe_rows, state["next_request"]
            )
            if (di, ri) in dropped:
                continue
            state["next_request"] = next_request
            state["covered"] |= cov
            if cols is not None:
                state["tokens"] += len(cols["request_id"]) // max(int(cov.sum()), 1)
                w.write(**cols)

    prov = {
        "kind": "imported",
        "format": "sglang",
        "mode": "per_token",
        "sources": [str(p) for p, _ in dumps],
        "request_id": "per (rank, forward pass, sequence); SGLang records no request ids",
        "phase": "each pass's forward mode: DECODE / TARGET_VERIFY passes decode (1), the others prefill (0)",
        PHASES_KNOWN: True,
        "layers_covered": held,
        "incomplete_tokens_dropped": tally["tokens"],
        "incomplete_passes_dropped": tally["passes"],
    }
    rows = write_validated_trace(out, model, prov, write, token_id=True)
    secs = time.perf_counter() - t0
    covered = [model.moe_layers[i] for i in np.flatnonzero(state["covered"])]
    summary = {
        "format": "sglang",
        "mode": "per_token",
        "records_read": len(order),
        "rows_written": rows,
        "tokens": state["tokens"],
        "incomplete_tokens_dropped": tally["tokens"],
        "layers_covered": covered,
        "seconds": secs,
        "records_per_s": len(order) / secs if secs > 0 else 0.0,
        "rows_per_s": rows / secs if secs else 0.0,
        "notes": [tally["note"]] if tally["note"] else [],
    }
    return ImportResult("trace", trace=out, summary=summary)


def import_(srcs: list[Path], model: ModelSpec, out: Path | None) -> ImportResult:
    t0 = time.perf_counter()
    dumps = [(p, _load_dump(p)) for p in track(srcs, "read dumps", "file")]
    modes = []
    for path, d in dumps:
        if "logical_count" in d:
            modes.append("stat")
        elif "records" in d:
            modes.append("per_token")
        else:
            raise InputError(
                f"{path}: field 'logical_count' (stat mode) or 'records' (per_token mode) missing; "
                f"keys present: {sorted(map(str, d))[:8]}"
            )
    if len(set(modes)) > 1:
        raise InputError(
            f"{srcs[modes.index('per_token')]}: a per_token dump mixed with stat dumps "
            f"({srcs[modes.index('stat')]}); import each mode separately"
        )
    if modes[0] == "stat":
        return _import_stat(dumps, model, out, t0)
    return _import_per_token(dumps, model, out, t0)
