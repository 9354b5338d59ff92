"""vLLM offline-EPLB load records (vLLM PR #41141, ``tools/eplb/generate_static_mapping.py``) -> Loads.

Each JSONL line is a record; the importer reads those with ``"record_type": "eplb_load_stats"``::

    {"record_type": "eplb_load_stats", "version": 1, "step": 7, "num_ranks": 2,
     "expert_load": [[10, 1, 5, 2], [2, 8, 1, 3]],  # [num_moe_layers][num_slots] tokens per physical slot
     "p2l_map":     [[0, 1, 2, 3], [0, 1, 2, 3]]}   # [num_moe_layers][num_slots] logical expert per slot

and skips other record types (``eplb_load_meta``, ``eplb_initial_mapping``, tool markers), counting them.
The logical load of a record is ``scatter_add(expert_load, index=p2l_map)`` per layer, exactly as the PR's
tool computes it; vLLM numbers only MoE layers (dense layers are not in the arrays), so the layer axis must
equal the model's number of MoE layers. Every record becomes one window of the Loads (label
``"step N"``); records whose load is all zero (idle steps) are dropped and counted.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import check_total, int_matrix, jsonl_records, require
from moeplace.traces.loads import Loads
from moeplace.traces.phases import PHASES_KNOWN

RECORD_TYPE = "eplb_load_stats"
SUPPORTED_VERSIONS = (1,)


def logical_load(expert_load: np.ndarray, p2l: np.ndarray, num_experts: int) -> np.ndarray:
    """Physical-slot loads -> logical-expert loads.

    ``expert_load``: int64 ``[L, P]``; ``p2l``: int64 ``[L, P]`` in ``[0, E)``; returns int64 ``[L, E]``.
    """
    num_layers = expert_load.shape[0]
    flat = (np.arange(num_layers)[:, None] * num_experts + p2l).reshape(-1)
    out = np.zeros(num_layers * num_experts, np.int64)
    np.add.at(out, flat, expert_load.reshape(-1).astype(np.int64))  # exact integers (no float rounding)
    return out.reshape(num_layers, num_experts)


def _check_slots(load: np.ndarray, p2l: np.ndarray, num_ranks: int, path: Path, where: str,
                 model: ModelSpec) -> None:
    """``expert_load`` and ``p2l_map`` (int64 ``[MoE layers, slots]``) fit ``model`` and ``num_ranks``:
    one row per MoE layer, no negative load, logical ids in range, at least one slot per expert, slots
    divisible by the ranks."""
    if load.shape != p2l.shape:
        raise InputError(
            f"{path}: {where}: field 'p2l_map' has shape {list(p2l.shape)}, but 'expert_load' has "
            f"{list(load.shape)}; both are [num_moe_layers][num_slots]"
        )
    num_layers, num_slots = load.shape
    if num_layers != model.num_moe_layers:
        hint = (
            " (vLLM numbers MoE layers only; this count includes dense layers?)"
            if num_layers == model.num_layers
            else ""
        )
        raise InputError(
            f"{path}: {where}: field 'expert_load' has {num_layers} layers, but model "
            f"'{model.name}' has {model.num_moe_layers} MoE layers{hint}"
        )
    if np.any(load < 0):
        raise InputError(f"{path}: {where}: field 'expert_load' holds a negative load")
    bad = (p2l < 0) | (p2l >= model.num_experts)
    if bad.any():
        layer, slot = map(int, np.argwhere(bad)[0])
        raise InputError(
            f"{path}: {where}: field 'p2l_map': layer {layer} slot {slot} maps to logical expert "
            f"{p2l[layer, slot]}, expected 0..{model.num_experts - 1} (model '{model.name}')"
        )
    if num_slots < model.num_experts:
        raise InputError(
            f"{path}: {where}: field 'p2l_map' has {num_slots} slots per layer, fewer than the "
            f"{model.num_experts} experts of model '{model.name}'"
        )
    if num_slots % num_ranks:
        raise InputError(
            f"{path}: {where}: field 'num_ranks' is {num_ranks}, which does not divide the "
            f"{num_slots} physical slots per layer"
        )
    present = np.zeros((num_layers, model.num_experts), dtype=bool)
    present[np.arange(num_layers)[:, None], p2l] = True
    if not present.all():
        layer, expert = map(int, np.argwhere(~present)[0])
        raise InputError(
            f"{path}: {where}: field 'p2l_map': layer {layer} has no slot for logical expert "
            f"{expert}; every logical expert needs at least one replica"
        )


def _record_counts(rec: dict, path: Path, lineno: int, model: ModelSpec) -> tuple[int, np.ndarray]:
    where = f"line {lineno}"
    version = require(rec, "version", path, where, int, "an integer")
    if version not in SUPPORTED_VERSIONS:
        raise InputError(
            f"{path}: {where}: field 'version' is {version}, expected one of {SUPPORTED_VERSIONS}"
        )
    step = require(rec, "step", path, where, int, "an integer step")
    num_ranks = require(rec, "num_ranks", path, where, int, "a positive integer")
    if num_ranks <= 0:
        raise InputError(f"{path}: {where}: field 'num_ranks' is {num_ranks}, expected a positive integer")
    load = int_matrix(
        require(rec, "expert_load", path, where, list, "[[tokens per slot] per MoE layer]"),
        path,
        where,
        "expert_load",
    )
    p2l = int_matrix(
        require(rec, "p2l_map", path, where, list, "[[logical expert per slot] per MoE layer]"),
        path,
        where,
        "p2l_map",
    )
    _check_slots(load, p2l, num_ranks, path, where, model)
    check_total(float(load.sum(dtype=np.float64)), f"{path}: {where}: field 'expert_load'")
    return step, logical_load(load, p2l, model.num_experts)


def import_(srcs: list[Path], model: ModelSpec, out: Path | None) -> ImportResult:
    t0 = time.perf_counter()
    windows, labels = [], []
    num_records = num_other = num_idle = 0
    num_ranks = set()
    total = 0.0
    for path in srcs:
        for lineno, rec in jsonl_records(path):
            rtype = rec.get("record_type")
            if rtype != RECORD_TYPE:
                if not isinstance(rtype, str):
                    raise InputError(
                        f"{path}: line {lineno}: field 'record_type' missing or not a string "
                        f"(expected '{RECORD_TYPE}' records)"
                    )
                num_other += 1
                continue
            num_records += 1
            step, counts = _record_counts(rec, path, lineno, model)
            total += float(counts.sum(dtype=np.float64))
            check_total(total, f"{path}: line {lineno}: field 'expert_load'")
            num_ranks.add(rec["num_ranks"])
            if not counts.any():
                num_idle += 1
                continue
            windows.append(counts)
            labels.append(f"{path.name} step {step}")
    if num_records == 0:
        raise InputError(f"{', '.join(map(str, srcs))}: no '{RECORD_TYPE}' records found")
    if not windows:
        raise InputError(
            f"{', '.join(map(str, srcs))}: all {num_records} '{RECORD_TYPE}' records have zero load"
        )
    counts = np.stack(windows)
    prov = {
        "kind": "imported",
        "format": "vllm-eplb",
        "phase": "expert loads of every step: prefill and decode together", PHASES_KNOWN: False,
        "sources": [str(s) for s in srcs],
        "records": num_records,
        "idle_records_dropped": num_idle,
        "num_ranks": sorted(num_ranks),
    }
    loads = Loads(counts, model, 0, tuple(labels), prov)
    if out is not None:
        loads.save(out)
    secs = time.perf_counter() - t0
    summary = {
        "format": "vllm-eplb",
        "records_read": num_records,
        "other_records_skipped": num_other,
        "idle_records_dropped": num_idle,
        "windows": loads.num_windows,
        "layers_covered": list(model.moe_layers),
        "selections": int(counts.sum()),
        "seconds": secs,
        "records_per_s": num_records / secs if secs > 0 else 0.0,
    }
    return ImportResult("loads", loads=loads, summary=summary)
