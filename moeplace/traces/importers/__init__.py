"""Importers: engine dumps and public routing logs -> the moeplace trace format or a Loads file.

=============  ==========================================================  =========================
format         input                                                       output
=============  ==========================================================  =========================
``sglang``     SGLang expert-distribution-recorder dumps (``.pt``/``.json``):  Loads (``stat``) or a
               ``stat`` mode ``logical_count``; ``per_token`` mode records    trace directory
               (one file per rank)                                          (``per_token``)
``vllm-jsonl`` per-token routing log (``{"type":"meta",...}`` then            trace directory
               ``{"type":"route",...}`` lines)
``vllm-eplb``  vLLM offline-EPLB load records (``eplb_load_stats`` JSONL)     Loads
``trtllm-stats`` TensorRT-LLM ``EXPERT_STATISTIC_PATH`` dumps (``meta_info.json`` Loads (counts) or a
               + ``rank<R>.safetensors``; ``rank<R>_raw.safetensors``)       trace (raw ids)
``vllm-routed-experts`` vLLM responses with ``routed_experts``                trace directory
               (``--enable-return-routed-experts``; JSON / JSONL)
``flame-moe``  FLAME-MoE traces dataset (``actives/iter_N/layer_NN.parquet``  trace directory
               + ``samples/*.parquet``)
``moe-selection-json`` per-query JSON of the "MoE expert selection trace"     trace directory
               dataset (expert ids per layer per generated token)
=============  ==========================================================  =========================

Every importer checks its input field by field (errors name file, line/record and field), writes
atomically, and validates a trace it writes before it appears under its final name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.loads import Loads

# format name -> module in this package implementing ``import_(srcs, model, out, **options)``
FORMATS: dict[str, str] = {"sglang": "sglang", "vllm-jsonl": "vllm_jsonl", "vllm-eplb": "vllm_eplb",
                           "trtllm-stats": "trtllm_stats", "vllm-routed-experts": "vllm_routed",
                           "flame-moe": "flame", "moe-selection-json": "moe_selection"}
# formats whose input is a directory (a dump directory, a dataset tree)
DIR_FORMATS = {"trtllm-stats", "flame-moe", "moe-selection-json"}


@dataclass
class ImportResult:
    """What an import produced: a :class:`Loads` (``loads``) or a trace directory (``trace``), plus the
    figures of the summary (records read, rows written, warm-up rows dropped, layers covered, ...)."""

    kind: str  # "loads" | "trace"
    loads: Loads | None = None
    trace: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def import_source(
    fmt: str, srcs: list[str | Path], model: ModelSpec, out: str | Path | None = None, **options
) -> ImportResult:
    """Import ``srcs`` of format ``fmt`` for ``model``.

    Loads formats return the Loads and also save it to ``out`` (a ``.npz``) when given; trace formats need
    ``out`` (a directory) and write the trace there. ``options`` are format-specific (see each module).
    """
    if fmt not in FORMATS:
        raise InputError(f"unknown import format '{fmt}' (expected one of {', '.join(FORMATS)})")
    if not srcs:
        raise InputError("no input files given")
    for s in srcs:
        if fmt in DIR_FORMATS and Path(s).is_dir():
            continue
        try:
            reading.require_regular(s)  # a FIFO, device or socket is refused, never opened
        except FileNotFoundError:
            raise InputError(f"{s}: no such file" + (" or directory" if fmt in DIR_FORMATS else "")) from None
    mod = importlib.import_module(f"{__name__}.{FORMATS[fmt]}")
    return mod.import_([Path(s) for s in srcs], model, None if out is None else Path(out), **options)
