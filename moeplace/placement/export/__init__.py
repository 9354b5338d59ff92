"""Export a :class:`~placement.record.Placement` to the files serving engines load, and read them back.

One module per engine family registers its formats here with :func:`register_format`; adding a format
touches only that module. Every exporter checks the placement against the engine's own constraints
(the checks each engine's loader performs, found in its source and named in each module's docstring)
and raises :class:`~foundation.errors.InputError` instead of writing a file the engine would reject or,
worse, load wrongly. Files are written atomically (``foundation.files``).

Formats (``place export --format NAME``):

================== =========== ==========================================================================
name               engine      file
================== =========== ==========================================================================
sglang             SGLang      ``--init-expert-location x.json``: ``{"physical_to_logical_map": [[...]]}``
sglang-pt          SGLang      the same dict, ``torch.save``-d to ``x.pt`` (int64 tensor)
sglang-logical-count SGLang    ``--init-expert-location x.json|x.pt``: ``{"logical_count": [W][layers][E]}``
vllm-expert-map    vLLM #49572 ``eplb_config.initial_expert_map_path``: ``[[p->l ...] per MoE layer]``
vllm-jsonl         vLLM #41141 ``eplb_config.initial_mapping_path``: ``eplb_initial_mapping`` JSONL record
vllm-ascend        vllm-ascend ``additional_config.eplb_config.expert_map_path`` JSON
trtllm             TRT-LLM     ``trtllm-serve --extra_llm_api_options x.yaml``: ``moe_config.load_balancer``
trtllm-lb          TRT-LLM     bare ``MoeLoadBalancerConfig`` YAML (``moe_config.load_balancer: x.yaml``)
================== =========== ==========================================================================
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.reading import quote
from moeplace.placement.record import Placement
from moeplace.traces.loads import Loads


@dataclass(frozen=True)
class ExportFormat:
    """A file format one engine loads.

    ``write(placement, model, out, **opts) -> warnings`` validates and writes atomically; ``read(path, model,
    num_gpus, gpus_per_node) -> Placement`` parses and validates. ``suffixes``: what the engine's loader
    accepts (SGLang and vllm-ascend choose the parser by file suffix). ``carries_gpus``: whether the file
    records the EP size (otherwise the reader needs ``num_gpus``). ``kind``: ``"placement"`` or ``"loads"``
    (the SGLang ``logical_count`` form carries expert loads and lets the engine run its own EPLB).
    """

    name: str
    engine: str
    suffixes: tuple[str, ...]
    summary: str
    write: Callable[..., list[str]]
    read: Callable[..., Any]
    carries_gpus: bool = False
    kind: str = "placement"


_FORMATS: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> ExportFormat:
    if fmt.name in _FORMATS:
        raise RuntimeError(f"export format '{fmt.name}' registered twice")
    _FORMATS[fmt.name] = fmt
    return fmt


def _load_all() -> None:
    # Imported here (not at module top) so the registry module has no import cycle with its formats.
    from moeplace.placement.export import sglang, trtllm, vllm, vllm_ascend  # noqa: F401


def format_names() -> list[str]:
    _load_all()
    return list(_FORMATS)


def get_format(name: str) -> ExportFormat:
    _load_all()
    if name not in _FORMATS:
        raise InputError(f"--format '{name}' unknown (expected one of {', '.join(_FORMATS)})")
    return _FORMATS[name]


def _check_suffix(fmt: ExportFormat, path: Path) -> None:
    if not any(str(path).endswith(s) for s in fmt.suffixes):
        raise InputError(f"{path}: --format {fmt.name} files must end in {' or '.join(fmt.suffixes)} "
                         f"({fmt.engine} picks its parser by the file suffix)")


def export_placement(placement: Placement, model: ModelSpec, fmt: str, out: str | Path,
                     **opts: Any) -> list[str]:
    """Validate ``placement`` against ``fmt``'s engine and write it to ``out`` atomically.

    ``opts`` are format-specific: ``loads`` (:class:`traces.loads.Loads`) for ``sglang-logical-count``
    (required) and ``vllm-jsonl`` (optional ``eplb_load_stats`` records). Returns warnings (strings) about
    things the file cannot fix, e.g. an engine version that ignores the file for this model.
    """
    f = get_format(fmt)
    out = Path(out)
    _check_suffix(f, out)
    placement.check_model(model, what=f"placement for {f.engine}")
    return f.write(placement, model, out, **opts)


def import_placement(path: str | Path, fmt: str, model: ModelSpec, num_gpus: int | None = None,
                     gpus_per_node: int | None = None) -> Placement:
    """Read an engine file of format ``fmt`` back into a :class:`Placement` of ``model``.

    ``num_gpus`` (the EP size) is needed for formats that do not record it; ``gpus_per_node`` defaults to
    8 when it divides the GPU count, else to the GPU count (one node).
    """
    f = get_format(fmt)
    if f.kind != "placement":
        raise InputError(f"{path}: --format {fmt} holds expert loads, not a placement; read it with "
                         "import_loads (CLI: `place import-placement ... --out loads.npz`)")
    return f.read(Path(path), model, num_gpus, gpus_per_node)


def import_loads(path: str | Path, fmt: str, model: ModelSpec) -> Loads:
    """Read a loads-kind engine file (``sglang-logical-count``) into :class:`traces.loads.Loads`."""
    f = get_format(fmt)
    if f.kind != "loads":
        raise InputError(f"{path}: --format {fmt} holds a placement, not loads")
    return f.read(Path(path), model)


# ---------------------------------------------------------------------------- shared validation helpers
def resolve_gpus(path: Path, num_slots: int, num_gpus: int | None, gpus_per_node: int | None) -> tuple[int, int]:
    """EP size and GPUs per node for a file that holds ``num_slots`` slots per layer."""
    if num_gpus is None:
        raise InputError(f"{path}: this format does not record the EP size; pass --gpus G (number of EP ranks)")
    if num_gpus < 1 or num_slots % num_gpus:
        raise InputError(f"{path}: {num_slots} physical slots per layer do not divide over --gpus {num_gpus} "
                         "EP ranks (the engine asserts num_physical_experts % ep_size == 0)")
    if gpus_per_node is None:
        gpus_per_node = 8 if num_gpus % 8 == 0 else num_gpus
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise InputError(f"--gpus {num_gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    return num_gpus, gpus_per_node


def check_rows(path: Path, rows: Any, num_rows: int, num_experts: int, what: str,
               row_names: list[str] | None = None) -> np.ndarray:
    """Validate a ``[num_rows][P]`` JSON-ish matrix of logical expert ids; return int64 ``[num_rows, P]``.

    Checks what the engines' loaders need: a rectangular integer matrix, ids in ``[0, num_experts)``, and
    every logical expert present in every row (SGLang's static dispatch divides by the replica count, vLLM
    #49572/#41141 reject a missing expert, vllm-ascend indexes its log2phy table by expert id).
    ``row_names[i]`` names row ``i`` in messages (e.g. ``"layer 3"``).
    """
    names = row_names or [f"row {i}" for i in range(num_rows)]
    if not isinstance(rows, list | tuple | np.ndarray) or len(rows) != num_rows:
        got = len(rows) if isinstance(rows, list | tuple | np.ndarray) else type(rows).__name__
        raise InputError(f"{path}: field '{what}' must hold {num_rows} rows, got {got}")
    width = None
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list | tuple | np.ndarray):
            raise InputError(f"{path}: {names[i]}: field '{what}' must be a list of expert ids")
        for s, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or not -2**63 <= v < 2**63:
                raise InputError(f"{path}: {names[i]}: slot {s}: field '{what}': expected an integer expert id, "
                                 f"got {quote(v)}")
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise InputError(f"{path}: {names[i]}: field '{what}' has {len(row)} slots, expected {width} "
                             "(every layer must have the same number of physical slots)")
        out.append(row)
    arr = np.asarray(out, dtype=np.int64).reshape(num_rows, width or 0)
    check_matrix(path, arr, num_experts, what, names)
    return arr


def check_matrix(path: Path | str, arr: np.ndarray, num_experts: int, what: str, row_names: list[str]) -> None:
    """Id range and full coverage of every row of an int ``[rows, P]`` phy->log matrix."""
    if arr.shape[1] < num_experts:
        raise InputError(f"{path}: field '{what}' has {arr.shape[1]} physical slots per layer, fewer than the "
                         f"{num_experts} logical experts")
    bad = (arr < 0) | (arr >= num_experts)
    if bad.any():
        i, s = map(int, np.argwhere(bad)[0])
        raise InputError(f"{path}: {row_names[i]}: slot {s}: field '{what}': expert id {int(arr[i, s])} out of "
                         f"range [0, {num_experts})")
    flat = (np.arange(arr.shape[0])[:, None] * num_experts + arr).ravel()
    cnt = np.bincount(flat, minlength=arr.shape[0] * num_experts).reshape(arr.shape[0], num_experts)
    if (cnt == 0).any():
        i, e = map(int, np.argwhere(cnt == 0)[0])
        raise InputError(f"{path}: {row_names[i]}: field '{what}': logical expert {e} has no physical slot "
                         "(every expert must appear in every layer)")
