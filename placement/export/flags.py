"""Launch flags that must go with an exported placement file, as a ready command line.

Flag names are the engines' own (checked in their argument parsers):

- SGLang (0.5.23 wheel, ``srt/arg_groups/fields/{model,parallel,exec_}.py``): ``--model-path``,
  ``--trust-remote-code``, ``--tp-size``, ``--ep-size``, ``--attn-dp-size`` (replaces the deprecated
  ``--dp-size N --enable-dp-attention``), ``--nnodes``, ``--node-rank``, ``--dist-init-addr``,
  ``--moe-a2a-backend {none,deepep,flashinfer,deepep_v2,...}``, ``--deepep-mode``,
  ``--ep-num-redundant-experts``, ``--ep-dispatch-algorithm {static,dynamic,fake,lp}``,
  ``--init-expert-location``, ``--enable-eplb``, ``--eplb-rebalance-num-iterations`` (default 1000),
  ``--kv-cache-dtype {auto,fp8_e4m3,bf16,...}``, ``--context-length``.
- vLLM (``vllm/config/parallel.py``, ``engine/arg_utils.py``): ``--tensor-parallel-size``,
  ``--data-parallel-size``, ``--data-parallel-size-local``, ``--data-parallel-address``,
  ``--data-parallel-rpc-port``, ``--data-parallel-start-rank``, ``--headless``, ``--enable-expert-parallel``,
  ``--all2all-backend {allgather_reducescatter,deepep_high_throughput,deepep_low_latency,deepep_v2,
  flashinfer_nvlink_one_sided,...}``, ``--enable-eplb``, ``--eplb-config JSON`` (``window_size`` 1000,
  ``step_interval`` 3000, ``num_redundant_experts``), ``--expert-placement-strategy``,
  ``--kv-cache-dtype {auto,fp8,...}``, ``--max-model-len``; the file keys come from the open PRs
  (``initial_expert_map_path`` #49572; ``initial_mapping_path`` and ``disable_online_rebalancing`` #41141).
- vllm-ascend: ``--additional-config '{"eplb_config": {"expert_map_path": ..., "num_redundant_experts": R}}'``.

All-to-all backend by topology (REFERENCE.md "Deployments seen"): one NVLink domain (a single node, or an
NVL72 rack) -> vLLM ``flashinfer_nvlink_one_sided`` / SGLang ``flashinfer`` on NVL72, ``deepep`` on 8-GPU
nodes; several nodes over RDMA -> vLLM ``deepep_v2`` / SGLang ``deepep``.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from placement.record import Placement
from traces.errors import InputError
from traces.model import ModelSpec

# Hugging Face ids for the presets; override with --model-path. The K3 id follows Moonshot's naming and
# is not verified here (no network access to the Hub).
MODEL_PATHS = {
    "kimi-k3": "moonshotai/Kimi-K3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
}

ENGINE_OF_FORMAT = {
    "sglang": "sglang", "sglang-pt": "sglang", "sglang-logical-count": "sglang",
    "vllm-expert-map": "vllm", "vllm-jsonl": "vllm", "vllm-ascend": "vllm-ascend",
}


@dataclass(frozen=True)
class FlagOptions:
    """What the command line needs beyond the placement. ``online_eplb``: keep the engine's online
    rebalancing on (window/interval below) rather than serving the file's layout statically."""

    model_path: str | None = None
    kv_cache_dtype: str = "fp8"  # bf16 | fp8
    max_model_len: int | None = None  # default: the model's max context
    gpu: str | None = None  # GPU kind, for the Hopper caveat; default from the placement's provenance
    online_eplb: bool = False
    eplb_window: int = 1000
    eplb_interval: int = 3000
    dp_attention: bool = False  # SGLang: --attn-dp-size G (DP attention) instead of TP attention
    master_addr: str = "$MASTER_ADDR"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("bf16", "fp8"):
            raise InputError(f"--kv-cache-dtype must be bf16 or fp8, got '{self.kv_cache_dtype}'")
        if self.eplb_window < 1 or self.eplb_interval < 1:
            raise InputError("--eplb-window and --eplb-interval must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InputError(f"--max-model-len must be >= 1, got {self.max_model_len}")


def _gpu_kind(placement: Placement, opts: FlagOptions) -> str:
    if opts.gpu:
        return opts.gpu
    cluster = placement.provenance.get("cluster") if isinstance(placement.provenance, dict) else None
    return str(cluster.get("gpu", "")) if isinstance(cluster, dict) else ""


def _join(lines: list[str]) -> str:
    return " \\\n  ".join(lines)


def launch_command(placement: Placement, model: ModelSpec, fmt: str, file_path: str | Path,
                   opts: FlagOptions | None = None) -> str:
    """A shell command (with ``#`` comment lines) that serves ``model`` with ``placement`` loaded from
    ``file_path`` (exported in ``fmt``) on ``placement.num_gpus`` GPUs."""
    opts = opts or FlagOptions()
    if fmt not in ENGINE_OF_FORMAT:
        raise InputError(f"--format '{fmt}' unknown (expected one of {', '.join(ENGINE_OF_FORMAT)})")
    engine = ENGINE_OF_FORMAT[fmt]
    path = str(Path(file_path).resolve())
    G, gpn, R = placement.num_gpus, placement.gpus_per_node, placement.num_redundant
    nodes = G // gpn
    model_path = opts.model_path or MODEL_PATHS.get(model.name, model.source or model.name)
    max_len = opts.max_model_len or model.max_context
    notes: list[str] = []
    if engine == "sglang":
        return _sglang(placement, model, fmt, path, opts, model_path, max_len, nodes, notes)
    gpu = _gpu_kind(placement, opts)
    if engine == "vllm" and gpu in ("h100", "h200") and model.name == "kimi-k3":
        notes.append("# vLLM's K3 recipe marks DEP unsupported on Hopper (H100/H200): it runs TP with "
                     "--moe-backend marlin --max-model-len 32768 there")
    if engine == "vllm" and model.name == "kimi-k3":
        notes.append("# vLLM EPLB for Kimi K3 needs PR #50647 (open at the time of writing)")
    a2a = "flashinfer_nvlink_one_sided" if nodes == 1 else "deepep_v2"
    kv = "fp8" if opts.kv_cache_dtype == "fp8" else "auto"
    head = [f"vllm serve {shlex.quote(model_path)}", "--trust-remote-code",
            "--tensor-parallel-size 1", f"--data-parallel-size {G}", f"--data-parallel-size-local {gpn}"]
    if nodes > 1:
        head += [f"--data-parallel-address {opts.master_addr}", "--data-parallel-rpc-port 13345"]
    head += ["--enable-expert-parallel", f"--all2all-backend {a2a}"]
    if engine == "vllm-ascend":
        eplb = {"expert_map_path": path, "num_redundant_experts": R}
        head += [f"--additional-config {shlex.quote(json.dumps({'eplb_config': eplb}))}"]
        head = [h for h in head if not h.startswith("--all2all-backend")]  # Ascend picks its own (HCCL MC2)
        notes.append("# vllm-ascend: static expert_map_path is Model Runner V1 only; scheduled for removal in "
                     "v0.25.1")
    else:
        cfg: dict = {"num_redundant_experts": R, "window_size": opts.eplb_window,
                     "step_interval": opts.eplb_interval}
        if fmt == "vllm-expert-map":
            cfg["initial_expert_map_path"] = path
            notes.append("# needs vLLM PR #49572 (eplb_config.initial_expert_map_path); mainline vLLM has no such "
                         "key")
            if not opts.online_eplb:
                notes.append("# #49572 (per its description) adds no switch to stop online EPLB: it re-plans every "
                             "step_interval steps; raise --eplb-interval to keep this layout longer")
        else:
            cfg["initial_mapping_path"] = path
            if not opts.online_eplb:
                cfg["disable_online_rebalancing"] = True
            notes.append("# needs vLLM PR #41141 (eplb_config.initial_mapping_path, disable_online_rebalancing); "
                         "mainline vLLM has no such keys")
        if opts.online_eplb:
            cfg["log_balancedness"] = True
        head += ["--enable-eplb", f"--eplb-config {shlex.quote(json.dumps(cfg, separators=(',', ':')))}"]
    if engine == "vllm-ascend" and kv == "fp8":
        notes.append("# vllm-ascend: KV-cache dtype left at the model default (fp8 KV support differs on NPUs)")
        head += [f"--max-model-len {max_len}"]
    else:
        head += [f"--kv-cache-dtype {kv}", f"--max-model-len {max_len}"]
    lines = notes + [f"# head node (node 0 of {nodes})" if nodes > 1 else f"# one node, {G} GPUs", _join(head)]
    if nodes > 1:
        lines.append(f"# nodes 1..{nodes - 1}: the same command plus --headless --data-parallel-start-rank "
                     f"$((NODE_RANK * {gpn}))")
    return "\n".join(lines) + "\n"


def _sglang(placement: Placement, model: ModelSpec, fmt: str, path: str, opts: FlagOptions, model_path: str,
            max_len: int, nodes: int, notes: list[str]) -> str:
    G, gpn, R = placement.num_gpus, placement.gpus_per_node, placement.num_redundant
    from placement.export.sglang import support_warnings

    notes += [f"# WARNING: {w}" for w in support_warnings(model)]
    a2a = "flashinfer" if gpn >= 72 else "deepep"
    kv = "fp8_e4m3" if opts.kv_cache_dtype == "fp8" else "bf16"
    cmd = [f"python -m sglang.launch_server --model-path {shlex.quote(model_path)}", "--trust-remote-code",
           f"--tp-size {G}", f"--ep-size {G}"]
    if opts.dp_attention:
        cmd.append(f"--attn-dp-size {G}")
    if nodes > 1:
        cmd += [f"--nnodes {nodes}", "--node-rank $NODE_RANK", f"--dist-init-addr {opts.master_addr}:5000"]
    cmd += [f"--moe-a2a-backend {a2a}"]
    if a2a == "deepep":
        cmd.append("--deepep-mode auto")
    cmd += [f"--ep-num-redundant-experts {R}", "--ep-dispatch-algorithm static",
            f"--init-expert-location {shlex.quote(path)}"]
    if fmt == "sglang-logical-count":
        notes.append("# SGLang runs its EPLB on the logical_count at start-up (--eplb-algorithm auto)")
    if opts.online_eplb:
        cmd += ["--enable-eplb", f"--eplb-rebalance-num-iterations {opts.eplb_interval}"]
    cmd += [f"--kv-cache-dtype {kv}", f"--context-length {max_len}"]
    head = f"# run on each of the {nodes} nodes with NODE_RANK=0..{nodes - 1}" if nodes > 1 else f"# one node, {G} GPUs"
    return "\n".join(notes + [head, _join(cmd)]) + "\n"
