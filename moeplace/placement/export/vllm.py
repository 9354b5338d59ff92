"""vLLM placement files: ``vllm-expert-map`` (PR #49572) and ``vllm-jsonl`` (PR #41141).

Mainline vLLM loads neither (``vllm/config/parallel.py``: ``EPLBConfig`` has ``window_size``,
``step_interval``, ``num_redundant_experts``, ``log_balancedness``, ``use_async``, ``policy``,
``communicator`` and nothing that names a file). What it does instead: ``--expert-placement-strategy
linear|round_robin`` without EPLB, or ``--enable-eplb``, whose start layout is
``EplbState.build_initial_global_physical_to_logical_map`` = ``list(range(E)) + [i % E for i in range(R)]``
for every MoE layer (``vllm/distributed/eplb/eplb_state.py``), re-planned online every ``step_interval``
steps. Both PR formats index MoE layers only (``model.num_moe_layers``, dense layers excluded) - row ``l`` is
``moe_layers[l]``.

``vllm-expert-map`` (#49572, ``eplb_config.initial_expert_map_path``; PR description): a JSON list of
physical->logical ids, either one list shared by all MoE layers or one list per MoE layer; the loader
validates dimensions (``num_physical_experts = E + num_redundant_experts``), id ranges and that every
logical expert appears, then moves the loaded weights with the EPLB communicator. We always write the
per-layer form; the reader accepts both.

``vllm-jsonl`` (#41141, ``eplb_config.initial_mapping_path``; code in ``EplbState._load_initial_mapping``
and ``tools/eplb/generate_static_mapping.py`` of the PR): one JSON object per line; the loader takes the
*last* ``{"record_type": "eplb_initial_mapping", "version": 1, "num_redundant_experts": R, "num_slots": P,
"initial_global_assignments": {"0": [...], ...}}`` and raises unless ``version == 1``,
``num_redundant_experts`` equals ``eplb_config.num_redundant_experts``, ``num_slots`` equals the model's
physical expert count, ``P == E + R``, keys ``"0".."L-1"`` are all present with exactly ``P`` integer ids
in ``[0, E)`` each, and every logical expert appears in each layer. ``add_model`` caps
``num_redundant_experts <= 1023`` (``MAX_EXPERT_REDUNDANCY``). The same PR writes load records
``{"record_type": "eplb_load_stats", "version": 1, "model", "step", "num_ranks", "num_layers",
"experts_per_rank", "tokens": [L][ranks], "expert_load": [L][P], "p2l_map": [L][P]}``
(``_write_expert_load_stats``); ``generate_static_mapping.py`` reads ``step``, ``num_ranks``,
``expert_load`` and ``p2l_map`` (scatter-adding physical load onto logical experts). We append such records
from ``--loads`` so that tool (or ``place``) can re-plan from them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json, write_text_atomic
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.reading import quote
from moeplace.placement.export import ExportFormat, check_matrix, check_rows, register_format, resolve_gpus
from moeplace.placement.export.capabilities import file_warnings
from moeplace.placement.record import Placement
from moeplace.traces.importers._common import INT64_MAX, exact_ints
from moeplace.traces.loads import Loads

MAX_EXPERT_REDUNDANCY = 1023  # vllm/distributed/eplb/eplb_state.py: EplbState.add_model


def _names(model: ModelSpec) -> list[str]:
    return [f"MoE layer {i} (decoder layer {d})" for i, d in enumerate(model.moe_layers)]


def _validate(placement: Placement, model: ModelSpec) -> None:
    R = placement.num_redundant
    if R > MAX_EXPERT_REDUNDANCY:
        raise InputError(f"vllm: {R} redundant experts exceed vLLM's limit of {MAX_EXPERT_REDUNDANCY} "
                         "(EplbState.add_model asserts num_redundant_experts <= 1023)")
    if placement.num_slots % placement.num_gpus:
        raise InputError(f"vllm: {placement.num_slots} physical experts do not divide over {placement.num_gpus} "
                         "EP ranks")
    check_matrix("vllm export", placement.phy2log.astype(np.int64), model.num_experts, "phy2log", _names(model))


# ---------------------------------------------------------------------------- #49572 expert map
def write_expert_map(placement: Placement, model: ModelSpec, out: Path, **_: object) -> list[str]:
    _validate(placement, model)
    rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in placement.phy2log.tolist())
    write_text_atomic(out, f"[\n  {rows}\n]\n")
    return _mainline_warnings(placement, model, "#49572", "initial_expert_map_path")


def read_expert_map(path: Path, model: ModelSpec, num_gpus: int | None, gpus_per_node: int | None) -> Placement:
    data = read_json(path)
    L = model.num_moe_layers
    if isinstance(data, list) and data and not isinstance(data[0], list):
        data = [data] * L  # one map shared by every MoE layer (#49572 accepts this form)
    p2l = check_rows(path, data, L, model.num_experts, "expert map", _names(model))
    G, gpn = resolve_gpus(path, p2l.shape[1], num_gpus, gpus_per_node)
    return _placement(path, p2l, model, G, gpn, "vllm-expert-map")


# ---------------------------------------------------------------------------- #41141 JSONL
def mapping_record(placement: Placement) -> dict:
    return {
        "record_type": "eplb_initial_mapping",
        "version": 1,
        "num_redundant_experts": placement.num_redundant,
        "num_slots": placement.num_slots,
        "initial_global_assignments": {str(l): row for l, row in enumerate(placement.phy2log.tolist())},
    }


def split_over_replicas(counts: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Per-slot load int64 ``[L, P]`` from logical ``counts [L, E]``: each expert's tokens split evenly
    over its replicas in slot order (the first ``c % n`` replicas take one more), so
    ``scatter_add(slot load -> phy2log)`` gives ``counts`` back exactly."""
    L, P = phy2log.shape
    E = counts.shape[1]
    rows = np.arange(L)[:, None]
    logcnt = np.zeros((L, E), dtype=np.int64)
    np.add.at(logcnt, (rows.repeat(P, 1), phy2log), 1)
    order = np.argsort(phy2log, axis=1, kind="stable")
    ranked = np.empty_like(phy2log)
    sorted_e = np.take_along_axis(phy2log, order, axis=1)
    first = np.zeros((L, E), dtype=np.int64)
    first[:, 1:] = np.cumsum(logcnt, axis=1)[:, :-1]
    ranked[rows, order] = np.arange(P)[None, :] - np.take_along_axis(first, sorted_e, axis=1)
    c = counts[rows, phy2log]
    n = logcnt[rows, phy2log]
    return c // n + (ranked < c % n)


def load_records(placement: Placement, loads: Loads, model_name: str) -> list[dict]:
    """One ``eplb_load_stats`` record per Loads window, as the placement would have recorded them."""
    G, s = placement.num_gpus, placement.slots_per_gpu
    p2l = placement.phy2log.astype(np.int64)
    experts_per_rank = [[int(p2l[0, r * s]), int(p2l[0, r * s + s - 1])] for r in range(G)]
    out = []
    for w in range(loads.num_windows):
        slot = split_over_replicas(loads.counts[w], p2l)
        out.append({
            "record_type": "eplb_load_stats", "version": 1, "model": model_name, "step": w,
            "num_ranks": G, "num_layers": placement.num_layers, "experts_per_rank": experts_per_rank,
            "tokens": slot.reshape(placement.num_layers, G, s).sum(axis=2).tolist(),
            "expert_load": slot.tolist(), "p2l_map": p2l.tolist(),
        })
    return out


def write_jsonl(placement: Placement, model: ModelSpec, out: Path, loads: Loads | None = None,
                **_: object) -> list[str]:
    _validate(placement, model)
    lines = []
    if loads is not None:
        if loads.model.num_experts != model.num_experts or tuple(loads.model.moe_layers) != tuple(model.moe_layers):
            raise InputError(f"--loads: loads are of model '{loads.model.name}', the placement of '{model.name}'")
        lines += [json.dumps(r, separators=(",", ":")) for r in load_records(placement, loads, model.name)]
    # vLLM takes the LAST eplb_initial_mapping record of the file, so the mapping goes last.
    lines.append(json.dumps(mapping_record(placement), separators=(",", ":")))
    write_text_atomic(out, "\n".join(lines) + "\n")
    return _mainline_warnings(placement, model, "#41141", "initial_mapping_path")


def read_jsonl(path: Path, model: ModelSpec, num_gpus: int | None, gpus_per_node: int | None) -> Placement:
    record, num_ranks = None, None
    for no, line in _lines(path):
        rec = reading.parse_json(line, f"{path}: line {no}")
        if not isinstance(rec, dict):
            raise InputError(f"{path}: line {no}: expected a JSON object, got {type(rec).__name__}")
        if rec.get("record_type") == "eplb_initial_mapping":
            record, rec_line = rec, no
        elif rec.get("record_type") == "eplb_load_stats" and isinstance(rec.get("num_ranks"), int):
            num_ranks = rec["num_ranks"]
    if record is None:
        raise InputError(f"{path}: no eplb_initial_mapping record (field 'record_type')")
    at = f"{path}: line {rec_line}"
    if record.get("version") != 1:
        raise InputError(f"{at}: field 'version' is {quote(record.get('version'))}, expected 1")
    P, R = record.get("num_slots"), record.get("num_redundant_experts")
    E = model.num_experts
    if not isinstance(P, int) or not isinstance(R, int) or P != E + R or R < 0:
        raise InputError(f"{at}: fields 'num_slots' {quote(P)} and 'num_redundant_experts' {quote(R)} must satisfy "
                         f"num_slots = {E} logical experts + num_redundant_experts")
    assign = record.get("initial_global_assignments")
    if not isinstance(assign, dict):
        raise InputError(f"{at}: field 'initial_global_assignments' must be an object keyed by MoE layer")
    L = model.num_moe_layers
    missing = [str(i) for i in range(L) if str(i) not in assign]
    if missing:
        raise InputError(f"{at}: field 'initial_global_assignments' lacks MoE layers {missing[:5]} "
                         f"(model '{model.name}' has {L} MoE layers, keyed \"0\"..\"{L - 1}\")")
    extra = sorted(set(assign) - {str(i) for i in range(L)})
    if extra:
        raise InputError(f"{at}: field 'initial_global_assignments' has keys {extra[:5]} beyond the model's "
                         f"{L} MoE layers")
    p2l = check_rows(path, [assign[str(i)] for i in range(L)], L, E, "initial_global_assignments", _names(model))
    if p2l.shape[1] != P:
        raise InputError(f"{at}: layers hold {p2l.shape[1]} ids but field 'num_slots' is {P}")
    G, gpn = resolve_gpus(path, P, num_gpus if num_gpus is not None else num_ranks, gpus_per_node)
    return _placement(path, p2l, model, G, gpn, "vllm-jsonl")


def read_load_stats(path: Path, model: ModelSpec) -> Loads:
    """``eplb_load_stats`` records -> Loads (one window per record; physical load scatter-added onto
    logical experts as ``generate_static_mapping.py`` does)."""
    counts, labels = [], []
    L, E = model.num_moe_layers, model.num_experts
    for no, line in _lines(path):
        rec = reading.parse_json(line, f"{path}: line {no}")
        if not isinstance(rec, dict) or rec.get("record_type") != "eplb_load_stats":
            continue
        missing = next((k for k in ("expert_load", "p2l_map") if k not in rec), None)
        if missing is not None:
            raise InputError(f"{path}: line {no}: field '{missing}' missing")
        # exact: a load of 1.5 or NaN, or an id of 2.7, is refused (numpy's int64 cast would truncate it)
        load = exact_ints(rec["expert_load"], f"{path}: line {no}: field 'expert_load'", 0, INT64_MAX)
        p2l = exact_ints(rec["p2l_map"], f"{path}: line {no}: field 'p2l_map'", 0, INT64_MAX)
        step = rec.get("step", len(labels))
        if not reading.is_int(step):
            raise InputError(f"{path}: line {no}: field 'step' must be a whole number, got {reading.quote(step)}")
        if load.shape != p2l.shape or load.ndim != 2 or load.shape[0] != L:
            raise InputError(f"{path}: line {no}: fields 'expert_load' {load.shape} and 'p2l_map' {p2l.shape} must "
                             f"both be [{L} MoE layers, slots]")
        check_matrix(f"{path}: line {no}", p2l, E, "p2l_map", _names(model))
        c = np.zeros((L, E), dtype=np.int64)
        np.add.at(c, (np.arange(L)[:, None].repeat(p2l.shape[1], 1), p2l), load)
        counts.append(c)
        labels.append(f"step {step}")
    if not counts:
        raise InputError(f"{path}: no eplb_load_stats records")
    return Loads(np.stack(counts), model, 0, tuple(labels), {"imported_from": str(path), "format": "vllm-jsonl"})


# ---------------------------------------------------------------------------- helpers
def _mainline_warnings(placement: Placement, model: ModelSpec, pr: str, key: str) -> list[str]:
    """The capability table's word on a vLLM placement file (released vLLM loads none), naming the PR this
    file is for and the route that does serve the placement (plugin, checkpoint or vLLM's own EPLB)."""
    return [f"{w} (this file is for the open PR {pr}: eplb_config.{key})"
            for w in file_warnings("vllm", model, placement.num_redundant)]


def _lines(path: Path):
    try:
        text = reading.read_text(path)  # a regular file only; not UTF-8 is an error naming the line
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    for no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield no, line


def _placement(path: Path, p2l: np.ndarray, model: ModelSpec, G: int, gpn: int, fmt: str) -> Placement:
    try:
        return Placement.from_phy2log(p2l, model, G, gpn, {"imported_from": str(path), "format": fmt})
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


register_format(ExportFormat(
    "vllm-expert-map", "vLLM (PR #49572)", (".json",),
    "eplb_config.initial_expert_map_path JSON: [[p->l ...] per MoE layer]", write_expert_map, read_expert_map))
register_format(ExportFormat(
    "vllm-jsonl", "vLLM (PR #41141)", (".jsonl",),
    "eplb_config.initial_mapping_path JSONL: eplb_initial_mapping record (+ eplb_load_stats from --loads)",
    write_jsonl, read_jsonl))
