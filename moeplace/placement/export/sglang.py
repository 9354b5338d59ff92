"""SGLang ``--init-expert-location`` files: ``sglang`` (.json), ``sglang-pt`` (.pt), ``sglang-logical-count``.

Confirmed in SGLang's source (release 0.5.23 wheel and github main, ``python/sglang/srt/eplb/expert_location.py``):

- ``compute_initial_expert_location_metadata`` picks the parser by suffix: ``data.endswith(".pt")`` ->
  ``torch.load(data, weights_only=True, map_location="cpu")``; ``.endswith(".json")`` -> ``json.loads(
  Path(data).read_text())``; anything else is parsed as *inline* JSON. A path with another suffix is
  therefore not read as a file at all, so we refuse other suffixes.
- ``"physical_to_logical_map" in data_dict`` -> ``ExpertLocationMetadata.init_by_mapping(model_config,
  **data_dict, moe_ep_rank=...)``: every key of the dict becomes a keyword argument, so a file with any
  extra key (provenance, a version field...) crashes with ``TypeError``. We write exactly one key.
  ``torch.tensor(physical_to_logical_map)`` gives int64 from JSON; we save an int64 tensor in the .pt as
  ``init_trivial`` does (``torch.arange(...) % num_logical``).
- Rows: ``ModelConfigForExpertLocation.num_layers`` = ``config.num_hidden_layers`` (``get_model_config_
  for_expert_location`` of deepseek_v2.py, qwen3_moe.py, kimi_k25.py...), i.e. dense layers included and
  the MoE layer at decoder index ``i`` reads row ``i`` (``ExpertLocationDispatchInfo.init_new(layer_id)``).
  Dense rows are never dispatched, but ``_compute_logical_to_all_physical_map`` walks every row and
  ``compute_logical_to_rank_dispatch_physical_map`` (``--ep-dispatch-algorithm static``, the default when
  ``--init-expert-location`` is set with an a2a backend: ``parallel_hook.handle_eplb_and_dispatch``) calls
  ``_fair_choices(candidates, ...)`` = ``divmod(k, len(candidates))`` for every (row, logical expert):
  a row missing an expert raises ``ZeroDivisionError``. So dense rows must be complete too; we write the
  trivial row ``arange(P) % E`` that ``init_trivial`` uses.
- ``_init_common``: ``num_physical_experts = num_logical_experts + --ep-num-redundant-experts`` and
  ``assert num_physical_experts % ep_size == 0``.
- ``"logical_count" in data_dict`` -> ``init_by_eplb``: a 2-D ``[layers, E]`` tensor is unsqueezed to
  ``[1, layers, E]``; ``eplb_algorithms.rebalance_experts`` sums over dim 0 (steps). We write
  ``[windows, num_hidden_layers, E]`` with zero rows for dense layers (the recorder's shape).

Model support: ``ModelConfigForExpertLocation.from_model_config`` returns ``None`` when the model class has
no ``get_model_config_for_expert_location``; then ``init_by_mapping`` / ``init_by_eplb`` return ``None`` and
SGLang silently serves the trivial layout. In 0.5.23 ``KimiK3ForConditionalGeneration`` /
``KimiK3LinearForCausalLM`` (models/kimi_k3.py) lack it and build their MoE without
``ep_num_redundant_experts`` - the file is ignored for Kimi K3. The exporter warns about that, from the
capability table (``capabilities.py``), which holds the list of architectures SGLang reads the file for.
"""
from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json, write_bytes_atomic, write_text_atomic
from moeplace.foundation.model import ModelSpec
from moeplace.placement.export import ExportFormat, check_matrix, check_rows, register_format, resolve_gpus
from moeplace.placement.export.capabilities import file_warnings
from moeplace.placement.record import Placement
from moeplace.traces.loads import Loads

KEY_MAP = "physical_to_logical_map"
KEY_COUNT = "logical_count"

def support_warnings(model: ModelSpec, num_redundant: int = 1) -> list[str]:
    """Why SGLang would not apply an ``--init-expert-location`` file for ``model`` (the capability table)."""
    return file_warnings("sglang", model, num_redundant)


def full_phy2log(placement: Placement, model: ModelSpec) -> np.ndarray:
    """SGLang's ``physical_to_logical_map``: int64 ``[num_hidden_layers, P]``.

    MoE decoder layer ``moe_layers[l]`` gets ``placement.phy2log[l]``; dense layers get the trivial row
    ``arange(P) % E`` (complete, as SGLang's static dispatch requires).
    """
    P, E = placement.num_slots, placement.num_experts
    out = np.tile(np.arange(P, dtype=np.int64) % E, (model.num_layers, 1))
    out[list(model.moe_layers)] = placement.phy2log
    return out


def _layer_names(model: ModelSpec) -> list[str]:
    moe = set(model.moe_layers)
    return [f"layer {i} ({'MoE' if i in moe else 'dense'})" for i in range(model.num_layers)]


def _rows_json(key: str, rows: list) -> str:
    body = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in rows)
    return f'{{"{key}": [\n  {body}\n]}}\n'


def _validate(placement: Placement, model: ModelSpec, full: np.ndarray) -> None:
    # The Placement is valid by construction; these are SGLang's own conditions, checked on what we write.
    if full.shape != (model.num_layers, placement.num_slots):
        raise InputError(f"sglang: map has shape {full.shape}, expected ({model.num_layers}, {placement.num_slots})")
    if placement.num_slots % placement.num_gpus:
        raise InputError(f"sglang: {placement.num_slots} physical experts do not divide over ep_size "
                         f"{placement.num_gpus}")
    check_matrix("sglang export", full, model.num_experts, KEY_MAP, _layer_names(model))


def write_json(placement: Placement, model: ModelSpec, out: Path, **_: object) -> list[str]:
    full = full_phy2log(placement, model)
    _validate(placement, model, full)
    write_text_atomic(out, _rows_json(KEY_MAP, full.tolist()))
    return support_warnings(model, placement.num_redundant)


def _torch(path: Path):
    """torch, imported on first use (~5 s; only the .pt forms need it). The core install has no torch: say
    how to get it instead of a traceback."""
    try:
        import torch  # ~5 s, and optional (the [capture] extra): only the .pt forms need it
    except ModuleNotFoundError:
        raise InputError(f"{path}: the .pt form needs torch, which this install lacks (pip install "
                         "'moeplace[capture]', or torch itself); the .json form needs no torch") from None
    return torch


def write_pt(placement: Placement, model: ModelSpec, out: Path, **_: object) -> list[str]:
    torch = _torch(out)

    full = full_phy2log(placement, model)
    _validate(placement, model, full)
    _save_pt(torch, {KEY_MAP: torch.from_numpy(full)}, out)
    return support_warnings(model, placement.num_redundant)


def _save_pt(torch, obj: dict, out: Path) -> None:
    """``torch.save`` into memory, then the bytes written atomically: a full disk is then Python's
    ``OSError`` (one line naming ``out``, nothing left), not torch's ``inline_container`` RuntimeError.
    The files are small (one int64 tensor of layers x slots)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes_atomic(out, buf.getvalue())


def _load_dict(path: Path) -> dict:
    try:
        if str(path).endswith(".pt"):
            torch = _torch(path)

            if not path.is_file():
                raise FileNotFoundError(path)
            try:
                d = torch.load(path, weights_only=True, map_location="cpu")
            except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
                # a truncated zip can fail anywhere in the reader, down to an OSError from a bad seek
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise InputError(f"{path}: not a readable torch.load(weights_only=True) file: truncated or "
                                 f"corrupt ({first})") from None
        else:
            d = read_json(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a dict with '{KEY_MAP}' or '{KEY_COUNT}', got {type(d).__name__}")
    return d


def _as_list(x):
    return x.tolist() if hasattr(x, "tolist") else x


def read_map(path: Path, model: ModelSpec, num_gpus: int | None, gpus_per_node: int | None) -> Placement:
    d = _load_dict(path)
    if KEY_MAP not in d:
        raise InputError(f"{path}: field '{KEY_MAP}' missing (keys: {sorted(d)})")
    extra = sorted(set(d) - {KEY_MAP})
    if extra:
        raise InputError(f"{path}: unexpected keys {extra}: SGLang passes every key to init_by_mapping(**dict) "
                         "and fails with TypeError; the file may hold only 'physical_to_logical_map'")
    rows = _as_list(d[KEY_MAP])
    full = check_rows(path, rows, model.num_layers, model.num_experts, KEY_MAP, _layer_names(model))
    G, gpn = resolve_gpus(path, full.shape[1], num_gpus, gpus_per_node)
    prov = {"imported_from": str(path), "format": "sglang-pt" if str(path).endswith(".pt") else "sglang"}
    try:
        return Placement.from_phy2log(full[list(model.moe_layers)], model, G, gpn, prov)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------- logical_count (loads)
def full_logical_count(loads: Loads, model: ModelSpec) -> np.ndarray:
    """``[W, num_hidden_layers, E]`` int64: the Loads windows, zeros for dense layers."""
    W = loads.num_windows
    out = np.zeros((W, model.num_layers, model.num_experts), dtype=np.int64)
    out[:, list(model.moe_layers)] = loads.counts
    return out


def write_logical_count(placement: Placement, model: ModelSpec, out: Path, loads: Loads | None = None,
                        **_: object) -> list[str]:
    if loads is None:
        raise InputError("--format sglang-logical-count needs expert loads: pass --loads LOADS.npz or a trace")
    if loads.model.num_experts != model.num_experts or tuple(loads.model.moe_layers) != tuple(model.moe_layers):
        raise InputError(f"--loads: loads are of model '{loads.model.name}', the placement of '{model.name}'")
    counts = full_logical_count(loads, model)
    if str(out).endswith(".pt"):
        torch = _torch(out)
        _save_pt(torch, {KEY_COUNT: torch.from_numpy(counts)}, out)
    else:
        steps = [_rows_json_inner(w) for w in counts.tolist()]
        write_text_atomic(out, f'{{"{KEY_COUNT}": [\n' + ",\n".join(steps) + "\n]}\n")
    warnings = support_warnings(model, placement.num_redundant)
    warnings.append(f"logical_count: SGLang runs its own EPLB on these loads at start-up with "
                    f"--ep-num-redundant-experts {placement.num_redundant} and ep_size {placement.num_gpus}; "
                    "the placement itself is not in this file")
    return warnings


def _rows_json_inner(rows: list) -> str:
    return " [\n  " + ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in rows) + "\n ]"


def read_logical_count(path: Path, model: ModelSpec) -> Loads:
    d = _load_dict(path)
    if KEY_COUNT not in d:
        raise InputError(f"{path}: field '{KEY_COUNT}' missing (keys: {sorted(d)})")
    try:
        arr = np.asarray(_as_list(d[KEY_COUNT]))
    except ValueError as exc:
        raise InputError(f"{path}: field '{KEY_COUNT}' is not a rectangular array ({exc})") from None
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[1:] != (model.num_layers, model.num_experts):
        raise InputError(f"{path}: field '{KEY_COUNT}' has shape {arr.shape}, expected [steps, "
                         f"{model.num_layers} layers (num_hidden_layers), {model.num_experts} experts] or "
                         "[layers, experts]")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: field '{KEY_COUNT}' has dtype {arr.dtype}, expected integer token counts")
    if (arr < 0).any():
        w, l, e = map(int, np.argwhere(arr < 0)[0])
        raise InputError(f"{path}: step {w}: layer {l}: expert {e}: field '{KEY_COUNT}' is negative")
    dense = [i for i in range(model.num_layers) if i not in set(model.moe_layers)]
    if dense and arr[:, dense].any():
        raise InputError(f"{path}: field '{KEY_COUNT}' has tokens in dense layers {dense}: the counts do not "
                         f"match model '{model.name}'")
    return Loads(arr[:, list(model.moe_layers)].astype(np.int64), model, 0,
                 tuple(f"step {i}" for i in range(arr.shape[0])), {"imported_from": str(path),
                                                                    "format": "sglang-logical-count"})


register_format(ExportFormat(
    "sglang", "SGLang", (".json",), "--init-expert-location JSON: physical_to_logical_map [num_hidden_layers][P]",
    write_json, read_map))
register_format(ExportFormat(
    "sglang-pt", "SGLang", (".pt",), "--init-expert-location .pt: the same dict, torch.save, int64 tensor",
    write_pt, read_map))
register_format(ExportFormat(
    "sglang-logical-count", "SGLang", (".json", ".pt"),
    "--init-expert-location logical_count [windows][num_hidden_layers][E]: SGLang runs its own EPLB",
    write_logical_count, read_logical_count, kind="loads"))
