"""TensorRT-LLM expert-statistic dumps (``EXPERT_STATISTIC_PATH``): counts -> Loads, raw ids -> a trace.

Read in TensorRT-LLM's source (github NVIDIA/TensorRT-LLM, stored copies of 2026):

- ``tensorrt_llm/_torch/expert_statistic.py`` (``ExpertStatistic``): enabled by
  ``EXPERT_STATISTIC_ITER_RANGE=start-stop``; for every iteration in ``[start, stop)`` and MoE layer it adds
  ``torch.bincount(token_selected_experts.flatten(), minlength=num_experts)`` under the key
  ``f"{iter}_{layer}"``; at iteration ``stop`` every rank writes ``{EXPERT_STATISTIC_PATH}/rank{R}.safetensors``
  and rank 0 writes ``meta_info.json`` = ``{"num_experts": E, "num_experts_per_token": k}``. The layer is the
  MoE module's ``layer_idx``, the decoder-layer index (DeepSeek's dumps start at 3).
- ``examples/wide_ep/ep_load_balancer/utils.py`` (``load_expert_statistic``, the reader the offline EPLB
  flow uses): sums the per-rank tensors of each key over ``rank*.safetensors`` (excluding ``*_raw``),
  asserts the iterations are consecutive and every (iteration, layer) is present. A newer commit of that
  file adds ``load_raw_expert_statistic``, which reads ``rank{R}_raw.safetensors``: the same
  ``"{iter}_{layer}"`` keys holding the raw ``token_selected_experts`` ``[tokens, top_k]`` of that rank
  (``report_send_ranks_per_token.py`` concatenates them by row).
- The raw writer (``expert_statistic.py`` at NVIDIA/TensorRT-LLM commit 7ce477f, the commit that added
  that reader): ``_maybe_add_info`` stores ``token_selected_experts.cpu().contiguous()`` (int32
  ``[tokens, top_k]``) under the same key *replacing* what the key held, and still adds the bincount to the
  counts; ``_save`` writes ``rank{R}.safetensors`` (counts) and ``rank{R}_raw.safetensors`` (raw) side by
  side, when the iteration after ``stop`` begins. The range became inclusive there (``start <= iter <=
  stop``). So when one layer is called more than once in an iteration (a chunked MoE forward,
  ``moe_max_num_tokens``), the raw file keeps the last call only while the counts hold all of them: the
  importer compares the two per key and says how many tokens the raw ids lack. With TensorRT-LLM's load
  balancer on, both record *slot* ids and ``num_experts`` is the slot count.

Import (``place trace import --format trtllm-stats DIR``):

- ``--out x.npz``: Loads, one window per iteration, counts summed over ranks as TensorRT-LLM's reader does
  (with attention DP every rank counts its own tokens; under attention TP every rank sees the same tokens
  and the sum multiplies them by the TP size - the summary reports ranks so this can be divided out).
- ``--out DIR``: a trace from the ``*_raw`` files. TensorRT-LLM records no request ids or positions: the
  tokens of one (iteration, rank) batch become one pseudo-request (``request_id = iteration_index * ranks +
  rank``, ``position`` = row within the batch), ``step`` is the iteration and ``phase`` is prefill (unknown).
  Row ``t`` of every layer of one (iteration, rank) is the same token (the layers of one forward pass);
  layer tensors of different lengths are refused. A batch missing a layer that other batches recorded is
  dropped (a trace holds each token in every layer it holds), said on stderr and counted in the summary
  and the provenance (``incomplete_tokens_dropped``, ``incomplete_batches_dropped``); when no batch is
  complete the import is refused.

Layers beyond the model's decoder layers (an MTP draft layer registers after them) are skipped and counted;
a dense decoder layer is an error. Errors name the file and the key.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import track
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import (
    expert_id_matrix,
    incomplete_tokens_note,
    nothing_complete,
    write_validated_trace,
)
from moeplace.traces.loads import Loads
from moeplace.traces.phases import PHASES_KNOWN

_RANK_FILE = re.compile(r"^rank(\d+)(_raw)?\.safetensors$")
_KEY = re.compile(r"^(\d+)_(\d+)$")


def _dump_files(d: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    counts: dict[int, Path] = {}
    raw: dict[int, Path] = {}
    for f in sorted(d.iterdir()):
        m = _RANK_FILE.match(f.name)
        if m:
            (raw if m.group(2) else counts)[int(m.group(1))] = f
    return counts, raw


def _meta(d: Path, model: ModelSpec) -> dict:
    path = d / "meta_info.json"
    meta = reading.read_json(path, "missing (TensorRT-LLM's rank 0 writes it next to rank*.safetensors)")
    if not isinstance(meta, dict):
        raise InputError(f"{path}: expected a JSON object with num_experts and num_experts_per_token")
    for key, want in (("num_experts", model.num_experts), ("num_experts_per_token", model.top_k)):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{path}: field '{key}' is {v!r}, expected an integer")
        if v != want:
            slots = (f" (or of slots: with TensorRT-LLM's load balancer on, the statistic counts {v} slots, "
                     "not experts; record it with the load balancer off)") if key == "num_experts" and v > want else ""
            raise InputError(f"{path}: field '{key}' is {v}, but model '{model.name}' has {want}: the dump is of "
                             f"another model (give --model){slots}")
    return meta


def _load(path: Path) -> dict[str, np.ndarray]:
    reading.require_regular(path)  # never open a FIFO, device or socket named like a dump
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: not a readable safetensors file ({first})") from None


def _key(path: Path, key: str, model: ModelSpec) -> tuple[int, int] | None:
    """``(iteration, decoder layer)`` of a key; ``None`` for a layer past the decoder layers (MTP)."""
    m = _KEY.match(key)
    if not m:
        raise InputError(f"{path}: key '{key}': expected '<iteration>_<layer>' (ExpertStatistic's key format)")
    it, layer = int(m.group(1)), int(m.group(2))
    if layer >= model.num_layers:
        return None
    if layer not in model.moe_layers:
        raise InputError(f"{path}: key '{key}': layer {layer} is a dense layer of '{model.name}' (MoE layers "
                         f"{model.moe_layers[0]}..{model.moe_layers[-1]}; keys use decoder-layer indices)")
    return it, layer


def _iterations(found: set[int], path: Path) -> list[int]:
    its = sorted(found)
    if its and its[-1] - its[0] + 1 != len(its):
        gap = next(i for i in range(its[0], its[-1]) if i not in found)
        raise InputError(f"{path}: iterations {its[0]}..{its[-1]} are not consecutive (iteration {gap} missing; "
                         "EXPERT_STATISTIC_ITER_RANGE records every iteration of its range)")
    return its



def _records(files: dict[int, Path], model: ModelSpec, tally: dict[str, int]):
    """Every (rank, path, key, iteration, layer, array) of the rank files, in file order; keys of layers
    past the decoder layers (an MTP draft layer) are skipped. ``tally`` counts records read and skipped."""
    for rank, path in track(files.items(), "read rank files", "file", total=len(files)):
        for key, arr in _load(path).items():
            tally["records"] += 1
            k = _key(path, key, model)
            if k is None:
                tally["skipped"] += 1
                continue
            yield (rank, path, key, *k, arr)


def import_counts(d: Path, files: dict[int, Path], model: ModelSpec, out: Path | None) -> ImportResult:
    t0 = time.perf_counter()
    E, L = model.num_experts, model.num_moe_layers
    col = {layer: i for i, layer in enumerate(model.moe_layers)}
    acc: dict[int, np.ndarray] = {}
    seen = {rank: set() for rank in files}
    tally = {"records": 0, "skipped": 0}
    for rank, path, key, it, layer, arr in _records(files, model, tally):
        if arr.dtype.kind not in "iu":
            raise InputError(f"{path}: key '{key}': dtype {arr.dtype}, expected integer token counts "
                             "(torch.bincount output)")
        if arr.shape != (E,):
            raise InputError(f"{path}: key '{key}': shape {list(arr.shape)}, expected [{E}] (one count per "
                             "expert)")
        if (arr < 0).any():
            raise InputError(f"{path}: key '{key}': negative count {int(arr.min())}")
        if arr.size and int(arr.max()) > np.iinfo(np.int64).max // 2:
            raise InputError(f"{path}: key '{key}': count {int(arr.max())} overflows the int64 totals")
        if int(arr.sum()) % model.top_k:
            raise InputError(f"{path}: key '{key}': {int(arr.sum())} selections are not a multiple of top-k "
                             f"{model.top_k} (each token selects {model.top_k} experts)")
        acc.setdefault(it, np.zeros((L, E), dtype=np.int64))[col[layer]] += arr.astype(np.int64)
        seen[rank].add((it, layer))
    if not acc:
        raise InputError(f"{d}: the rank*.safetensors files hold no MoE-layer statistics")
    its = _iterations(set(acc), d)
    layers = sorted({layer for s in seen.values() for _, layer in s})
    want = {(it, layer) for it in its for layer in layers}
    for rank, s in seen.items():
        if s != want:
            it, layer = min(want - s)
            raise InputError(f"{files[rank]}: key '{it}_{layer}' missing (every rank records every iteration and "
                             "MoE layer of the range)")
    counts = np.stack([acc[it] for it in its])
    if not counts.any():
        raise InputError(f"{d}: every count in the rank*.safetensors files is zero ({len(its)} iteration(s) x "
                         f"{len(layers)} MoE layer(s), {len(files)} rank(s)): no routing was recorded (was "
                         "EXPERT_STATISTIC_ITER_RANGE over iterations with traffic?); refusing to write empty Loads")
    prov = {"kind": "imported", "format": "trtllm-stats", "sources": [str(p) for p in files.values()],
            "ranks": len(files), "iterations": [its[0], its[-1] + 1], "layers_covered": layers,
            "mtp_layers_skipped": tally["skipped"],
            "phase": "expert counts per iteration: prefill and decode together", PHASES_KNOWN: False}
    loads = Loads(counts, model, 0, tuple(f"iteration {it}" for it in its), prov)
    if out is not None:
        loads.save(out)
    secs = time.perf_counter() - t0
    summary = {"format": "trtllm-stats", "mode": "counts", "records_read": tally["records"], "windows": len(its),
               "selections": int(counts.sum()), "ranks": len(files), "mtp_layers_skipped": tally["skipped"],
               "layers_covered": layers, "seconds": secs,
               "records_per_s": tally["records"] / secs if secs > 0 else 0.0}
    return ImportResult("loads", loads=loads, summary=summary)


def import_raw(d: Path, files: dict[int, Path], model: ModelSpec, out: Path) -> ImportResult:
    t0 = time.perf_counter()
    batches: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (iteration, rank) -> layer -> ids
    tally = {"records": 0, "skipped": 0}
    for rank, path, key, it, layer, arr in _records(files, model, tally):
        ids = expert_id_matrix(arr, path, f"key '{key}'", "token_selected_experts", model.num_experts,
                               model.top_k)
        batches.setdefault((it, rank), {})[layer] = ids
    if not batches:
        raise InputError(f"{d}: the rank*_raw.safetensors files hold no MoE-layer routing")
    its = _iterations({it for it, _ in batches}, d)
    ranks = sorted(files)
    layers = sorted({layer for b in batches.values() for layer in b})
    order = sorted(batches)  # by iteration, then rank
    for it, rank in order:
        n = {v.shape[0] for v in batches[(it, rank)].values()}
        if len(n) > 1:
            raise InputError(f"{files[rank]}: iteration {it}: the layers hold different token counts {sorted(n)}; "
                             "the rows of one forward pass must align across layers")
    order, dropped = _complete_batches(order, batches, layers, files)
    short = _raw_short_of_counts(d, batches, order, model)
    it_index = {it: i for i, it in enumerate(its)}
    tokens = 0

    def write(w):
        nonlocal tokens
        for it, rank in order:
            b = batches[(it, rank)]
            n = next(iter(b.values())).shape[0]
            if n == 0:
                continue
            tokens += n
            nl = len(layers)
            w.write(request_id=np.full(n * nl, it_index[it] * len(ranks) + ranks.index(rank), dtype=np.int64),
                    position=np.repeat(np.arange(n, dtype=np.int32), nl),
                    phase=np.zeros(n * nl, dtype=np.uint8), step=np.full(n * nl, it, dtype=np.int64),
                    layer=np.tile(np.asarray(layers, dtype=np.uint16), n),
                    expert_ids=np.stack([b[layer] for layer in layers], axis=1).reshape(n * nl, model.top_k))

    prov = {"kind": "imported", "format": "trtllm-stats", "mode": "raw", "sources": [str(p) for p in files.values()],
            "ranks": len(ranks), "iterations": [its[0], its[-1] + 1], "layers_covered": layers,
            "mtp_layers_skipped": tally["skipped"], "incomplete_tokens_dropped": dropped["tokens"],
            "incomplete_batches_dropped": dropped["batches"], "raw_tokens_short_of_counts": short["tokens"],
            "request_id": "one pseudo-request per (iteration, rank) batch: TensorRT-LLM records no request ids",
            "phase": "unknown in the dump; all rows marked prefill (0)", PHASES_KNOWN: False}
    rows = write_validated_trace(out, model, prov, write)
    secs = time.perf_counter() - t0
    summary = {"format": "trtllm-stats", "mode": "raw", "records_read": tally["records"], "rows_written": rows,
               "tokens": tokens, "incomplete_tokens_dropped": dropped["tokens"], "ranks": len(ranks),
               "mtp_layers_skipped": tally["skipped"], "layers_covered": layers,
               "seconds": secs, "records_per_s": tally["records"] / secs if secs > 0 else 0.0,
               "raw_tokens_short_of_counts": short["tokens"],
               "notes": [n for n in (dropped["note"], short["note"]) if n]}
    return ImportResult("trace", trace=out, summary=summary)


def _raw_short_of_counts(d: Path, batches: dict, order: list, model: ModelSpec) -> dict:
    """Compare each kept (iteration, rank) batch's raw ids with the counts the same writer saved beside them
    (``rank{R}.safetensors``): TensorRT-LLM's raw record keeps only the last call of a layer in an iteration
    while the counts add every call, so a chunked MoE forward leaves the raw ids short. Returns the tokens
    the raw ids lack (per the counts; per batch the most any of its layers lacks, as a token lacks every
    layer) and a note, or zeros when the counts are absent or agree. A raw id the counts do not hold at all is an error (not the same run)."""
    counts_files, _ = _dump_files(d)
    loaded: dict[int, dict] = {}
    tokens, keys, first = 0, 0, None
    for it, rank in order:
        if rank not in counts_files:
            continue
        if rank not in loaded:
            loaded[rank] = _load(counts_files[rank])
        lack = 0
        for layer, ids in batches[(it, rank)].items():
            key = f"{it}_{layer}"
            c = loaded[rank].get(key)
            if c is None or c.shape != (model.num_experts,):
                continue
            got = np.bincount(ids.ravel().astype(np.int64), minlength=model.num_experts)
            if (got > c).any():
                raise InputError(f"{counts_files[rank]}: key '{key}': the raw ids of {d / f'rank{rank}_raw.safetensors'} "
                                 "select experts these counts do not hold: the two files are not of the same run")
            if (got != c).any():
                lack = max(lack, int((c - got).sum()) // model.top_k)
                keys += 1
                first = first or f"key '{key}' of rank {rank}: {ids.shape[0]} raw tokens, {int(c.sum()) // model.top_k} counted"
        tokens += lack
    if not keys:
        return {"tokens": 0, "note": None}
    return {"tokens": tokens, "note": (f"the raw ids hold {tokens:,} tokens fewer than the counts beside them in "
                                       f"{keys:,} (iteration, layer, rank) keys, the first {first}: TensorRT-LLM's "
                                       "raw record keeps only the last call of a layer per iteration (a chunked "
                                       "MoE forward); the trace holds the recorded tokens, the counts (--out "
                                       "x.npz) hold all")}


def _complete_batches(order: list, batches: dict, layers: list[int], files: dict[int, Path]) -> tuple[list, dict]:
    """The (iteration, rank) batches that recorded every layer the dump holds (``layers``: every token of a
    trace has a row in each); the others are dropped and counted. Refuses when none is complete."""
    keep = [b for b in order if len(batches[b]) == len(layers)]
    gone = [b for b in order if len(batches[b]) != len(layers)]
    if not gone:
        return keep, {"tokens": 0, "batches": 0, "note": None}
    it, rank = gone[0]
    miss = next(layer for layer in layers if layer not in batches[gone[0]])
    first = f"iteration {it} of rank {rank} ({files[rank]}: key '{it}_{miss}' missing)"
    if not keep:
        raise nothing_complete(str(files[rank].parent), layers, "(iteration, rank) batch", first)
    tokens = sum(next(iter(batches[b].values())).shape[0] for b in gone)
    return keep, {"tokens": tokens, "batches": len(gone),
                  "note": incomplete_tokens_note(tokens, layers, len(gone), "(iteration, rank) batch(es)", first)}


def import_(srcs: list[Path], model: ModelSpec, out: Path | None, **_: object) -> ImportResult:
    if len(srcs) != 1 or not srcs[0].is_dir():
        raise InputError(f"{' '.join(map(str, srcs))}: trtllm-stats reads one EXPERT_STATISTIC_PATH directory")
    d = srcs[0]
    _meta(d, model)
    counts, raw = _dump_files(d)
    if out is None or out.suffix == ".npz":
        if not counts:
            raise InputError(f"{d}: no rank<R>.safetensors files (ExpertStatistic writes one per rank)")
        return import_counts(d, counts, model, out)
    if not raw:
        raise InputError(f"{d}: no rank<R>_raw.safetensors files: this dump holds per-expert counts only; "
                         "import it into Loads (--out x.npz)")
    return import_raw(d, raw, model, out)
