"""TensorRT-LLM MoE load-balancer files: ``trtllm`` (extra LLM-API options YAML) and ``trtllm-lb`` (bare).

Read in TensorRT-LLM's own source (github NVIDIA/TensorRT-LLM, stored copies of 2026):

- ``tensorrt_llm/llmapi/llm_args.py``: ``MoeLoadBalancerConfig`` has ``num_slots: int``,
  ``initial_global_assignments: Dict[int, List[int]]`` and ``layer_updates_per_iter: int = 0`` (a strict
  pydantic model: unknown keys are rejected). ``setup(ep_rank, ep_size)`` raises unless ``num_slots %
  ep_size == 0``; ``num_local_slots = num_slots // ep_size`` and rank ``r`` owns global slots
  ``[r * num_local_slots, (r + 1) * num_local_slots)`` - consecutive slots per rank, the same convention as
  our ``phy2log``. ``get_layer_initial_global_assignments(layer_idx)`` raises ``KeyError`` for a missing
  layer and ``ValueError`` when a list is not ``num_slots`` long. ``MoeConfig.load_balancer`` is typed
  ``MoeLoadBalancerConfig | dict | str``; ``TorchLlmArgs.validate_load_balancer`` turns a *path string* into
  the config with ``yaml.safe_load`` + ``MoeLoadBalancerConfig(**d)``.
- ``tensorrt_llm/_torch/modules/fused_moe/interface.py`` (``MoE._init_load_balancer``): the layer's key is
  ``self.layer_idx``, the *decoder-layer* index (DeepSeek's keys start at 3, its first MoE layer; the wide-EP
  example's YAML shows keys 3..60). A loaded list must satisfy ``len == num_slots``, ``num_slots >=
  num_experts`` and ``set(list) == set(range(num_experts))`` (every expert placed). It also asserts ``use_dp
  and parallel_size > 1``: "Load Balancer should be only used with ADP and EP > 1" (attention DP on).
- ``tensorrt_llm/_torch/modules/fused_moe/moe_load_balancer.py`` (``maybe_create_moe_load_balancer``): the
  balancer is created only if ``architectures[0]`` is in ``moe_model_arch_list`` (``DeepseekV3ForCausalLM``,
  ``MixtralForCausalLM``, ``Llama4ForConditionalGeneration``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``
  in the stored copies), ``moe_ep_size > 1`` and no MoE cluster parallelism; otherwise the section is
  *silently ignored* and every layer keeps ``num_slots = num_experts`` with the trivial layout.
  ``layer_updates_per_iter == 0`` is static routing: the file's layout is served as written.
- ``tensorrt_llm/_torch/modules/fused_moe/create_moe.py``: with a balancer, the MoE backend must be one of
  WIDEEP, CUTLASS, TRTLLM, CUTEDSL, DEEPGEMM, DENSEGEMM (an assertion otherwise).
- ``examples/wide_ep/ep_load_balancer/{README.md,generate_eplb_config.py}``: the offline flow writes the bare
  mapping (``num_slots``, ``initial_global_assignments``, ``layer_updates_per_iter``) with inline lists and
  points ``moe_config.load_balancer`` at it from the extra-options YAML, next to ``enable_attention_dp: true``
  and ``moe_config.backend: WideEP``.

Formats:

``trtllm``: the extra-options YAML itself (``trtllm-serve --extra_llm_api_options lb.yaml``) with the
mapping inline: ``yaml.safe_load(f)["moe_config"]["load_balancer"]`` is the ``MoeLoadBalancerConfig``.
When the launch layout is known (``--flags``), the same file also carries ``enable_attention_dp`` and
``moe_config.backend`` so the printed command works as is.

``trtllm-lb``: the bare mapping, as ``generate_eplb_config.py`` writes it; reference it by path
(``moe_config.load_balancer: /path/lb.yaml``), the route TensorRT-LLM's validator converts explicitly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import write_text_atomic
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.reading import quote
from moeplace.placement.export import ExportFormat, check_matrix, register_format, resolve_gpus
from moeplace.placement.export.capabilities import (  # the architecture facts live in the capability table
    ARCHITECTURE_OF_MODEL_TYPE,
    cell,
    file_warnings,
)
from moeplace.placement.record import Placement

# create_moe.py: backends that accept a load balancer
LB_BACKENDS = ("WIDEEP", "CUTLASS", "TRTLLM", "CUTEDSL", "DEEPGEMM", "DENSEGEMM")
LB_KEYS = {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}


def architecture(model: ModelSpec) -> str | None:
    return ARCHITECTURE_OF_MODEL_TYPE.get(model.hf_model_type)


def support_warnings(model: ModelSpec, *, attention_dp: bool | None = None, ep_size: int | None = None,
                     num_redundant: int = 1) -> list[str]:
    """Why TensorRT-LLM would not apply the load-balancer section (empty when it would): the architecture
    (the capability table), attention DP off, or EP size 1."""
    out = file_warnings("trtllm", model, num_redundant)
    if not cell("trtllm", "placement_file", model).supported:
        return out  # no balancer is built for this architecture: its layout conditions do not arise
    if attention_dp is False:
        out.append("TensorRT-LLM applies the load balancer only with attention DP (enable_attention_dp: true): "
                   "MoE._init_load_balancer asserts 'Load Balancer should be only used with ADP and EP > 1' "
                   "(releases without the assertion skip the section); use --dp equal to the GPU count")
    if ep_size is not None and ep_size <= 1:
        out.append("TensorRT-LLM ignores the load balancer with EP size 1 (moe_ep_size > 1 is required)")
    return out


def balancer_dict(placement: Placement, model: ModelSpec) -> dict[str, Any]:
    """``MoeLoadBalancerConfig`` as a plain dict: decoder-layer index -> ``num_slots`` expert ids."""
    check_matrix("trtllm export", placement.phy2log.astype(np.int64), model.num_experts, "initial_global_assignments",
                 [f"MoE layer {i} (decoder layer {d})" for i, d in enumerate(model.moe_layers)])
    return {
        "num_slots": int(placement.num_slots),
        "layer_updates_per_iter": 0,
        "initial_global_assignments": {int(d): [int(x) for x in row]
                                       for d, row in zip(model.moe_layers, placement.phy2log.tolist(), strict=True)},
    }


class _InlineLists(yaml.SafeDumper):
    """Lists inline (one line per layer, as generate_eplb_config.py writes them), mappings in block style."""


_InlineLists.add_representer(list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                          flow_style=True))


def dump_yaml(obj: dict[str, Any], header: str) -> str:
    body = yaml.dump(obj, Dumper=_InlineLists, sort_keys=False, width=1 << 30, default_flow_style=False)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


def extra_options(placement: Placement, model: ModelSpec, *, attention_dp: bool | None = None,
                  moe_backend: str | None = None, kv_cache_dtype: str | None = None,
                  max_num_tokens: int | None = None) -> dict[str, Any]:
    """The extra LLM-API options dict: layout keys (when known) and ``moe_config.load_balancer``."""
    out: dict[str, Any] = {}
    if attention_dp is not None:  # the launch layout is known: the EP size goes in too (LLM-API key)
        out["enable_attention_dp"] = bool(attention_dp)
        out["moe_expert_parallel_size"] = int(placement.num_gpus)
    if kv_cache_dtype is not None:
        out["kv_cache_config"] = {"dtype": "fp8" if kv_cache_dtype == "fp8" else "auto"}
    moe: dict[str, Any] = {}
    if moe_backend is not None:
        if moe_backend.upper() not in LB_BACKENDS:
            raise InputError(f"--moe-backend {moe_backend}: TensorRT-LLM's load balancer needs one of "
                             f"{', '.join(LB_BACKENDS)} (create_moe.py asserts it)")
        moe["backend"] = moe_backend.upper()
    if max_num_tokens is not None:
        moe["max_num_tokens"] = int(max_num_tokens)
    moe["load_balancer"] = balancer_dict(placement, model)
    out["moe_config"] = moe
    return out


def _header(placement: Placement, model: ModelSpec, what: str) -> str:
    return (f"moeplace placement for TensorRT-LLM ({what}): {model.name}, {placement.num_layers} MoE layers, "
            f"{placement.num_slots} slots on EP {placement.num_gpus} ({placement.slots_per_gpu} consecutive slots "
            f"per rank)\nkeys of initial_global_assignments are decoder-layer indices (TensorRT-LLM's layer_idx)\n"
            f"served with --ep_size {placement.num_gpus} and enable_attention_dp: true (the load balancer needs "
            "attention DP)")


def write_extra_options(placement: Placement, model: ModelSpec, out: Path, *, attention_dp: bool | None = None,
                        moe_backend: str | None = None, kv_cache_dtype: str | None = None,
                        **_: object) -> list[str]:
    doc = extra_options(placement, model, attention_dp=attention_dp, moe_backend=moe_backend,
                        kv_cache_dtype=kv_cache_dtype)
    write_text_atomic(out, dump_yaml(doc, _header(placement, model, "trtllm-serve --extra_llm_api_options")))
    return support_warnings(model, attention_dp=attention_dp, ep_size=placement.num_gpus,
                            num_redundant=placement.num_redundant)


def write_bare(placement: Placement, model: ModelSpec, out: Path, **_: object) -> list[str]:
    write_text_atomic(out, dump_yaml(balancer_dict(placement, model),
                                     _header(placement, model, "moe_config.load_balancer: <this file>")))
    return support_warnings(model, ep_size=placement.num_gpus, num_redundant=placement.num_redundant)


def _load_yaml(path: Path) -> Any:
    """The safe loader through :func:`moeplace.foundation.reading.read_yaml`: duplicate keys, nesting and
    huge integers are refused (PyYAML alone keeps the last of two keys)."""
    return reading.read_yaml(path)


def _int(v: Any, path: Path, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise InputError(f"{path}: {where}: expected an integer, got {quote(v)}")
    return int(v)


def read_balancer(path: Path, model: ModelSpec, num_gpus: int | None, gpus_per_node: int | None) -> Placement:
    """Either form back into a :class:`Placement` (with the same checks TensorRT-LLM's loader makes)."""
    doc = _load_yaml(path)
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a YAML mapping, got {type(doc).__name__}")
    lb = doc
    field = ""
    if "moe_config" in doc:
        moe = doc["moe_config"]
        if not isinstance(moe, dict) or "load_balancer" not in moe:
            raise InputError(f"{path}: field 'moe_config.load_balancer' missing (expected the MoeLoadBalancerConfig)")
        lb = moe["load_balancer"]
        field = "moe_config.load_balancer."
        if isinstance(lb, str):
            raise InputError(f"{path}: field 'moe_config.load_balancer' is a path ({lb}); import that file instead")
        if not isinstance(lb, dict):
            raise InputError(f"{path}: field 'moe_config.load_balancer' must be a mapping, got {type(lb).__name__}")
        if "moe_expert_parallel_size" in doc:
            # TensorRT-LLM runs the file with this EP size: a --gpus that disagrees, or a value that is not an
            # integer (a quoted '8'), is an error, never silently overridden
            ep = _int(doc["moe_expert_parallel_size"], path, "field 'moe_expert_parallel_size'")
            if ep < 1:
                raise InputError(f"{path}: field 'moe_expert_parallel_size' is {ep}, expected >= 1")
            if num_gpus is not None and num_gpus != ep:
                raise InputError(f"{path}: field 'moe_expert_parallel_size' is {ep}, but --gpus is {num_gpus}: "
                                 "the engine runs this file on its own EP size (drop --gpus or fix the file)")
            num_gpus = ep
    unknown = set(lb) - LB_KEYS
    if unknown:
        raise InputError(f"{path}: field '{field}{min(unknown)}' is not a MoeLoadBalancerConfig field "
                         f"(expected {', '.join(sorted(LB_KEYS))}; TensorRT-LLM rejects unknown keys)")
    for key in ("num_slots", "initial_global_assignments"):
        if key not in lb:
            raise InputError(f"{path}: field '{field}{key}' missing")
    P = _int(lb["num_slots"], path, f"field '{field}num_slots'")
    upd = _int(lb.get("layer_updates_per_iter", 0), path, f"field '{field}layer_updates_per_iter'")
    if upd < 0:
        raise InputError(f"{path}: field '{field}layer_updates_per_iter' must be >= 0, got {upd}")
    E = model.num_experts
    if P < E:
        raise InputError(f"{path}: field '{field}num_slots' is {P}, fewer than the {E} experts of {model.name}")
    iga = lb["initial_global_assignments"]
    if not isinstance(iga, dict):
        raise InputError(f"{path}: field '{field}initial_global_assignments' must map layer index -> list of expert ids")
    rows: dict[int, list] = {}
    for k, v in iga.items():
        try:
            layer = int(k)
        except (TypeError, ValueError):
            raise InputError(f"{path}: field '{field}initial_global_assignments': key {quote(k)} is not a layer index") from None
        if isinstance(k, bool) or str(layer) != str(k).strip():
            raise InputError(f"{path}: field '{field}initial_global_assignments': key {quote(k)} is not a layer index")
        if layer not in model.moe_layers:
            raise InputError(f"{path}: field '{field}initial_global_assignments': layer {layer} is not an MoE layer of "
                             f"{model.name} (keys are decoder-layer indices {model.moe_layers[0]}..{model.moe_layers[-1]})")
        if not isinstance(v, list):
            raise InputError(f"{path}: layer {layer}: field '{field}initial_global_assignments' must be a list")
        if len(v) != P:
            raise InputError(f"{path}: layer {layer}: field '{field}initial_global_assignments' has {len(v)} slots, "
                             f"num_slots is {P} (TensorRT-LLM raises 'Assignment length ... does not match')")
        for s, x in enumerate(v):
            _int(x, path, f"layer {layer}: slot {s}: field '{field}initial_global_assignments'")
        rows[layer] = v
    missing = [d for d in model.moe_layers if d not in rows]
    if missing:
        raise InputError(f"{path}: field '{field}initial_global_assignments' lacks MoE layer {missing[0]} "
                         "(TensorRT-LLM raises KeyError for a missing layer)")
    p2l = np.asarray([rows[d] for d in model.moe_layers], dtype=np.int64).reshape(len(model.moe_layers), P)
    check_matrix(path, p2l, E, f"{field}initial_global_assignments",
                 [f"layer {d}" for d in model.moe_layers])
    G, gpn = resolve_gpus(path, P, num_gpus, gpus_per_node)
    return Placement.from_phy2log(p2l, model, G, gpn, provenance={"imported_from": str(path), "format": "trtllm",
                                                                    "layer_updates_per_iter": upd})


register_format(ExportFormat(
    name="trtllm", engine="TensorRT-LLM", suffixes=(".yaml", ".yml"),
    summary="trtllm-serve --extra_llm_api_options x.yaml with moe_config.load_balancer inline",
    write=write_extra_options, read=read_balancer))
register_format(ExportFormat(
    name="trtllm-lb", engine="TensorRT-LLM", suffixes=(".yaml", ".yml"),
    summary="bare MoeLoadBalancerConfig YAML (moe_config.load_balancer: x.yaml)",
    write=write_bare, read=read_balancer))
