"""Launch flags that must go with an exported placement file, as a ready command line.

The command realizes an attention layout: ``tp`` GPUs of attention tensor parallelism per DP rank times
``dp`` attention data-parallel ranks (``tp * dp`` = the placement's EP size; the MoE layers are expert
parallel over all of them). :func:`check_layout` runs the memory plan (:func:`foundation.memory.planner.plan_memory`)
on that layout and refuses one that does not fit, with the plan's reason.

Flag names are the engines' own (checked in their argument parsers):

- SGLang (0.5.23 wheel, ``srt/arg_groups/fields/{model,parallel,exec_}.py``): ``--model-path``,
  ``--trust-remote-code``, ``--tp-size`` (all GPUs of the instance), ``--attn-dp-size N`` (attention DP;
  ``--tp-size / N`` GPUs per attention TP group; 0.5.23 marks the older ``--dp-size N
  --enable-dp-attention`` deprecated), ``--ep-size``, ``--nnodes``, ``--node-rank``, ``--dist-init-addr``,
  ``--moe-a2a-backend {none,deepep,flashinfer,deepep_v2,...}``, ``--deepep-mode``,
  ``--ep-num-redundant-experts``, ``--ep-dispatch-algorithm {static,dynamic,fake,lp}``,
  ``--init-expert-location``, ``--enable-eplb``, ``--eplb-rebalance-num-iterations`` (default 1000),
  ``--kv-cache-dtype {auto,fp8_e4m3,bf16,...}``, ``--context-length``.
- vLLM (``vllm/config/parallel.py``, ``engine/arg_utils.py``): ``--tensor-parallel-size``,
  ``--data-parallel-size``, ``--data-parallel-size-local``, ``--data-parallel-address``,
  ``--data-parallel-rpc-port``, ``--data-parallel-start-rank``, ``--headless``, ``--enable-expert-parallel``
  (EP size = TP x DP), ``--all2all-backend {allgather_reducescatter,deepep_high_throughput,
  deepep_low_latency,deepep_v2,flashinfer_nvlink_one_sided,...}``, ``--enable-eplb``, ``--eplb-config JSON``
  (``EPLBConfig``: ``window_size`` 1000, ``step_interval`` 3000, ``num_redundant_experts``, ``use_async``;
  :func:`engines.recommended_eplb_config`), ``--expert-placement-strategy {linear,round_robin}``,
  ``--kv-cache-dtype {auto,fp8,...}``, ``--max-model-len``. Released vLLM (0.34.0) loads no placement file:
  the file keys come from the open PRs (``initial_expert_map_path`` #49572; ``initial_mapping_path`` and
  ``disable_online_rebalancing`` #41141) and are printed only with ``--vllm-pr N``.

The vLLM and SGLang commands are checked against the option lists recorded from those releases' own
parsers (``engines.py``, ``engine_options/``): a command naming an option the release lacks is an error.
- vllm-ascend: ``--additional-config '{"eplb_config": {"expert_map_path": ..., "num_redundant_experts": R}}'``.
- TensorRT-LLM (``tensorrt_llm/commands/serve.py``): ``trtllm-serve MODEL --backend pytorch --tp_size
  --ep_size --gpus_per_node --max_seq_len --trust_remote_code --extra_llm_api_options FILE`` (alias
  ``--config``); the YAML carries ``enable_attention_dp``, ``kv_cache_config.dtype`` and ``moe_config``
  (``backend``, ``load_balancer``). TensorRT-LLM's attention is either TP over all ``tp_size`` ranks or DP
  over all of them (``enable_attention_dp``), so only ``tp == 1`` or ``dp == 1`` layouts exist there, and
  its load balancer needs attention DP. Several nodes run under ``mpirun``/``srun`` with
  ``trtllm-llmapi-launch`` (examples/wide_ep).

All-to-all backend by topology (the engines' deployment guides): one NVLink domain (a single node, or an
NVL72 rack) -> vLLM ``flashinfer_nvlink_one_sided`` / SGLang ``flashinfer`` on NVL72, ``deepep`` on 8-GPU
nodes; several nodes over RDMA -> vLLM ``deepep_v2`` / SGLang ``deepep``.

Processes count *hosts*, not NVLink domains (:func:`launch_host_size`): an NVL72 rack is one NVLink domain
of 18 compute trays of 4 GPUs, each tray a machine running its own engine process. vLLM's
``--data-parallel-size-local`` / ``--headless`` workers, SGLang's ``--nnodes`` (0.5.23 gives each node
``--tp-size / --nnodes`` GPUs), TensorRT-LLM's ``--gpus_per_node`` and the Slurm/Kubernetes files of
``deploy`` all count hosts; the all-to-all backend and the cost model count NVLink domains.
"""
from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeplace.foundation.cluster import host_size, load_gpu, make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json
from moeplace.foundation.formats import check
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.planner import plan_memory
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.reading import quote
from moeplace.placement.export import capabilities
from moeplace.placement.export.engines import (
    ENGINE_NAMES,
    VLLM_PRS,
    accepts,
    check_args,
    recommended_eplb_config,
    resolve_version,
)
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule

# Hugging Face ids for the presets; override with --model-path. The K3 id follows Moonshot's naming and
# is not verified here (no network access to the Hub).
MODEL_PATHS = {
    "kimi-k3": "moonshotai/Kimi-K3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
}

# the engine each export format targets (the export *target*, one :class:`ExportTarget` in EXPORT_TARGETS below)
TARGET_OF_FORMAT = {
    "sglang": "sglang", "sglang-pt": "sglang", "sglang-logical-count": "sglang",
    "vllm-expert-map": "vllm", "vllm-jsonl": "vllm", "vllm-ascend": "vllm-ascend",
    "trtllm": "trtllm", "trtllm-lb": "trtllm",
}


def rule_mismatch(placement: Placement, fmt: str) -> str | None:
    """A warning when ``placement`` was optimized for another replica rule than the one the engine of
    export format ``fmt`` routes tokens with (the balance it was planned for is not what that engine gives)."""
    planned = placement.provenance.get("engine")  # the file's key for the rule it was optimized for
    target = EXPORT_TARGETS[TARGET_OF_FORMAT[fmt]].replica_rule if fmt in TARGET_OF_FORMAT else None
    if not planned or target is None:
        return None
    try:
        planned_rule, target_rule = get_rule(planned), get_rule(target)
    except InputError:
        return None  # an unknown name in an imported placement's provenance: nothing to compare
    if planned_rule.name == target_rule.name:
        return None
    return (f"this placement was optimized for the {planned_rule.engine} replica rule (--engine {planned_rule.name}); "
            f"{target_rule.engine} routes tokens with its own, so the balance it was planned for is not what "
            f"{target_rule.engine} gives: re-run place optimize with --engine {target_rule.name}")


@dataclass(frozen=True)
class FlagOptions:
    """What the command line needs beyond the placement. ``tp``/``dp``: the attention layout (``None``:
    the memory plan's default for the GPU count, as ``place plan`` resolves it). ``online_eplb``: keep the
    engine's online rebalancing on (window/interval below) rather than serving the file's layout
    statically. ``moe_backend``: TensorRT-LLM's ``moe_config.backend``."""

    model_path: str | None = None
    kv_cache_dtype: str = "fp8"  # bf16 | fp8
    max_model_len: int | None = None  # default: the model's max context
    gpu: str | None = None  # GPU kind, for the Hopper caveat and the memory plan; default from the placement
    online_eplb: bool = False
    eplb_window: int = 1000
    eplb_interval: int = 3000
    tp: int | None = None
    dp: int | None = None
    moe_backend: str = "WIDEEP"
    master_addr: str = "$MASTER_ADDR"
    engine_version: str | None = None  # vLLM / SGLang release to print for (default: the newest checked)
    vllm_pr: int | None = None  # opt in to an open vLLM PR's placement-file keys (49572 or 41141)
    vllm_static: str | None = None  # vLLM without EPLB: --expert-placement-strategy linear | round_robin
    placement_path: str | None = None  # the placement JSON itself: what the vLLM plugin reads (MOEPLACE_PLACEMENT)
    # a pool of a disaggregated deployment (place export --pools): "prefill" | "decode" (None: co-located), its
    # running-sequence and per-forward token limits per DP rank (None: the engine's defaults)
    pool: str | None = None
    max_seqs: int | None = None
    max_batched_tokens: int | None = None
    serve: str | None = None  # "checkpoint": a relabelled checkpoint (no file); "plugin": the vLLM plugin on SRC
    # GPUs per host (one engine process each); None: from the GPU spec (launch_host_size). check_layout sets it
    gpus_per_host: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("bf16", "fp8"):
            raise InputError(f"--kv-cache-dtype must be bf16 or fp8, got '{self.kv_cache_dtype}'")
        if self.eplb_window < 1 or self.eplb_interval < 1:
            raise InputError("--eplb-window and --eplb-interval must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InputError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"--{name} must be >= 1, got {v}")
        if self.vllm_pr is not None and self.vllm_pr not in VLLM_PRS:
            raise InputError(f"--vllm-pr {self.vllm_pr}: expected one of {', '.join(map(str, VLLM_PRS))} (the open "
                             "vLLM PRs that load a placement file)")
        if self.vllm_static not in (None, "linear", "round_robin"):
            raise InputError(f"--vllm-static must be linear or round_robin, got '{self.vllm_static}'")
        if self.pool not in (None, "prefill", "decode"):
            raise InputError(f"pool must be prefill or decode, got '{self.pool}'")
        for name in ("max_seqs", "max_batched_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"{name} must be >= 1, got {v}")
        if self.vllm_static is not None and (self.vllm_pr is not None or self.online_eplb):
            raise InputError("--vllm-static serves vLLM without EPLB: it does not go with --vllm-pr or --online-eplb")
        if self.serve not in (None, "checkpoint", "plugin"):
            raise InputError(f"serve must be checkpoint or plugin, got '{self.serve}'")
        if self.gpus_per_host is not None and self.gpus_per_host < 1:
            raise InputError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        if self.serve is not None and (self.vllm_pr is not None or self.vllm_static is not None or self.online_eplb):
            raise InputError("a relabelled checkpoint (or the plugin) is served in the engine's own layout: "
                             "--vllm-pr / --vllm-static / --online-eplb do not go with it")


def _gpu_kind(placement: Placement, opts: FlagOptions) -> str:
    if opts.gpu:
        return opts.gpu
    cluster = placement.provenance.get("cluster") if isinstance(placement.provenance, dict) else None
    return str(cluster.get("gpu", "")) if isinstance(cluster, dict) else ""


def launch_host_size(placement: Placement, opts: FlagOptions) -> int:
    """GPUs per host of the launch (one engine process each), from the same GPU spec as the memory plan:
    ``opts.gpus_per_host`` (what :func:`check_layout` resolved), else the spec of ``--gpu`` (a preset or a
    JSON file), else the placement's recorded cluster (its ``gpus_per_host``, or its GPU preset's). A
    placement with no GPU kind runs one host per node, as before hosts were counted. Always divides the
    placement's ``gpus_per_node`` (an NVL72 NVLink domain of 72 GPUs is 18 hosts of 4)."""
    gpn = placement.gpus_per_node
    if opts.gpus_per_host is not None:
        host = opts.gpus_per_host
    elif opts.gpu:
        host = host_size(load_gpu(opts.gpu), gpn)
    else:
        cluster = placement.provenance.get("cluster") if isinstance(placement.provenance, dict) else None
        cluster = cluster if isinstance(cluster, dict) else {}
        recorded = cluster.get("gpus_per_host")
        if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
            host = recorded
        else:
            try:
                host = host_size(load_gpu(str(cluster["gpu"])), gpn) if cluster.get("gpu") else gpn
            except InputError:  # a user spec recorded by name only: its node is the host (pass --gpu SPEC.json)
                host = gpn
    if gpn % host:
        raise InputError(f"{host} GPUs per host do not divide the placement's {gpn} GPUs per node (NVLink domain)")
    return host


def memory_config_from_report(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """The :class:`~foundation.memory.config.MemoryConfig` and cluster dict of a ``place plan --report`` JSON."""
    d = read_json(path)
    check(d, "memory-plan", str(path), hint="written by `place plan --report`")
    for key in ("config", "cluster"):
        if not isinstance(d.get(key), dict):
            raise InputError(f"{path}: field '{key}' missing or not an object (expected a `place plan --report` file)")
    cfg = dict(d["config"])
    if cfg.get("context_mix") is not None:
        try:
            cfg["context_mix"] = tuple((int(n), float(s)) for n, s in cfg["context_mix"])
        except (TypeError, ValueError):
            raise InputError(f"{path}: field 'config.context_mix' must be [[tokens, share], ...]") from None
    layout = d.get("layout") if isinstance(d.get("layout"), dict) else {}
    for key in ("tp", "dp", "ep", "dense_tp"):  # the resolved sizes, so the plan is re-run on exactly them
        if layout.get(key) is not None:
            cfg[key] = layout[key]
    try:
        return MemoryConfig(**cfg), d["cluster"]
    except TypeError as exc:
        raise InputError(f"{path}: field 'config' does not match this version's plan settings ({exc})") from None
    except InputError as exc:  # a value the plan refuses: say which file it came from
        raise InputError(f"{path}: field 'config': {exc}") from None


def check_layout(placement: Placement, model: ModelSpec, opts: FlagOptions, plan_report: str | Path | None = None):
    """Run the memory plan on the launch layout; return ``(opts with tp/dp resolved, MemoryPlan)``.

    The layout comes from ``opts.tp``/``opts.dp`` or from a ``place plan --report`` file (whose GPU count,
    GPU kind and redundancy must be the placement's). A layout the plan rejects raises :class:`InputError`
    carrying the plan's first reason.
    """
    G, R = placement.num_gpus, placement.num_redundant
    if plan_report is not None:
        if opts.tp is not None or opts.dp is not None:
            raise InputError("give the attention layout either as --tp/--dp or as --plan, not both")
        config, cluster_d = memory_config_from_report(plan_report)
        n = cluster_d.get("num_gpus")
        if n != G:
            raise InputError(f"--plan {plan_report}: the plan is for {n} GPUs, the placement for {G}")
        if config.num_redundant != R:
            raise InputError(f"--plan {plan_report}: the plan has {config.num_redundant} redundant experts per layer, "
                             f"the placement {R}; re-plan with --redundant {R}")
        if config.ep not in (None, G):
            raise InputError(f"--plan {plan_report}: the plan has EP {config.ep}, the placement spreads over {G} GPUs")
        gpu = str(cluster_d.get("gpu", {}).get("name") if isinstance(cluster_d.get("gpu"), dict)
                  else cluster_d.get("gpu") or _gpu_kind(placement, opts) or "h200")
        if opts.gpu and load_gpu(opts.gpu).name == gpu:  # the plan names the spec --gpu gives (a JSON file: by name)
            gpu = opts.gpu
        gpn = cluster_d.get("gpus_per_node")
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int)):
            raise InputError(f"--plan {plan_report}: field 'cluster.gpus_per_node' must be a whole number, got {quote(gpn)}")
        try:
            cluster = make_cluster(G, gpu, gpn or placement.gpus_per_node)
        except InputError as exc:
            raise InputError(f"--plan {plan_report}: field 'cluster': {exc}") from None
    else:
        gpu = _gpu_kind(placement, opts) or "h200"
        cluster = make_cluster(G, gpu, placement.gpus_per_node)
        config = MemoryConfig(tp=opts.tp, dp=opts.dp, ep=G, num_redundant=R,
                            kv_dtype="fp8" if opts.kv_cache_dtype == "fp8" else "bf16",
                            context=opts.max_model_len)
    plan = plan_memory(model, cluster, config, suggest=False)
    lay = plan.layout
    if not plan.fits:
        raise InputError(f"layout attention TP{lay.tp} x DP{lay.dp} on {G} x {cluster.gpu.name} does not fit: "
                         f"{plan.reasons[0]} (`place plan --gpus {G} --gpu {cluster.gpu.name} --tp {lay.tp} "
                         f"--dp {lay.dp} --redundant {R}` shows the breakdown)")
    if plan_report is not None:  # the flags serve what the plan certified: its KV dtype and context
        if config.kv_dtype in ("fp8", "bf16"):
            opts = replace(opts, kv_cache_dtype=config.kv_dtype)
        if opts.max_model_len is None and config.context is not None:
            opts = replace(opts, max_model_len=config.context)
    return replace(opts, tp=lay.tp, dp=lay.dp, gpu=opts.gpu or cluster.gpu.name,
                   gpus_per_host=cluster.gpus_per_host), plan


def matching_plan(placement: Placement, plan_reports: list[str | Path]) -> tuple[Path | None, list[str]]:
    """The first ``place plan --report`` file of ``plan_reports`` made for ``placement`` (its GPU count and
    redundant slots), and why each one before it was passed over. ``(None, reasons)`` when none is."""
    reasons = []
    for path in plan_reports:
        try:
            config, cluster_d = memory_config_from_report(path)
        except InputError as exc:
            reasons.append(str(exc))
            continue
        if cluster_d.get("num_gpus") != placement.num_gpus:
            reasons.append(f"{path}: a plan for {cluster_d.get('num_gpus')} GPUs, the placement spreads over "
                           f"{placement.num_gpus}")
        elif config.num_redundant != placement.num_redundant:
            reasons.append(f"{path}: a plan with {config.num_redundant} redundant experts per layer, the placement "
                           f"has {placement.num_redundant}")
        else:
            return Path(path), reasons
    return None, reasons


@dataclass(frozen=True)
class LaunchPlan:
    """What ``place export --flags`` prints and the dashboard shows for one format: the options with the
    layout resolved, the memory plan that certified it, the export options that layout implies
    (TensorRT-LLM's YAML keys) and the :class:`Launch`."""

    opts: FlagOptions
    plan: Any  # foundation.memory.plan.MemoryPlan
    extra: dict[str, Any]
    launch: Launch

    def memory_line(self) -> str:
        p = self.plan
        return (f"memory plan: {p.layout.describe()} on {p.cluster.num_gpus} x {p.cluster.gpu.name} fits; "
                f"{p.concurrency} sequences of {p.context:,} tokens")


def build_launch(placement: Placement, model: ModelSpec, fmt: str, file_path: str | Path, opts: FlagOptions,
                 plan_report: str | Path | None = None) -> LaunchPlan:
    """The launch of ``placement`` exported in ``fmt`` to ``file_path``: the memory plan on the layout of
    ``opts`` or of ``plan_report`` (:func:`check_layout`), the layout's export options
    (:func:`format_options`) and the command (:func:`launch_spec`, checked against the engine release's
    recorded parser and the capability table). Raises :class:`InputError` when the plan, the engine or
    the parser refuses. The one function behind ``place export --flags`` and the dashboard's launch tabs."""
    opts, plan = check_layout(placement, model, opts, plan_report)
    extra = format_options(placement, fmt, opts)  # refuses a layout the target cannot express
    return LaunchPlan(opts, plan, extra, launch_spec(placement, model, fmt, file_path, opts))


def _join(lines: list[str]) -> str:
    return " \\\n  ".join(lines)


def _layout(placement: Placement, opts: FlagOptions) -> tuple[int, int]:
    G = placement.num_gpus
    tp, dp = opts.tp, opts.dp
    if tp is None and dp is None:
        raise InputError("the launch command needs the attention layout: pass --tp/--dp or --plan "
                         "(check_layout resolves it)")
    tp = tp or G // dp
    dp = dp or G // tp
    if tp * dp != G:
        raise InputError(f"--tp {tp} x --dp {dp} = {tp * dp}, but the placement spreads over {G} GPUs "
                         "(attention TP x DP must equal the EP size)")
    return tp, dp


@dataclass
class Launch:
    """A launch, structured: what :func:`launch_command` prints and the deployment writers
    (``placement.export.deploy``) turn into a script or a manifest.

    ``head``: the node-0 command as shell words grouped per option (``"--tp-size 32"``), with ``$NODE_RANK``
    / ``$MASTER_ADDR`` where nodes differ; ``worker_extra``: what nodes 1.. add (vLLM's ``--headless``;
    ``None`` when every node runs ``head``). ``version``: the checked engine release it was checked
    against (``None``: not checked). ``trailer``: text printed after the command (TensorRT-LLM's YAML)."""

    engine: str
    version: str | None
    notes: list[str]
    layout: str
    where: str
    head: list[str]
    nodes: int
    gpus_per_node: int
    file_path: str
    model_path: str
    worker_extra: list[str] | None = None
    trailer: str = ""
    allow_eplb_keys: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # set for the engine process (the vLLM plugin's switch)
    applies_placement: bool = True  # False: the command serves the engine's own layout (the notes say why)

    def env_prefix(self) -> str:
        """``K=V `` words that go before the command (empty without ``env``)."""
        return "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())

    def argv(self, worker: bool = False) -> list[str]:
        """The command as shell words (node 0, or with ``worker`` another node)."""
        return shlex.split(" ".join(self.head + (self.worker_extra or [] if worker else [])))

    def worker_line(self) -> str:
        return " ".join(self.head + (self.worker_extra or []))

    def problems(self) -> list[str]:
        """What the checked release's recorded parser options say about the command(s)."""
        if self.version is None:
            return []
        out = check_args(self.engine, self.version, self.argv(), self.allow_eplb_keys)
        if self.worker_extra:
            out += [p for p in check_args(self.engine, self.version, self.argv(True), self.allow_eplb_keys)
                    if p not in out]
        return out

    def text(self) -> str:
        lines = self.notes + [self.layout, self.where, self.env_prefix() + _join(self.head)]
        if self.worker_extra:
            lines.append(f"# nodes 1..{self.nodes - 1}: the same command plus {' '.join(self.worker_extra)}")
        out = "\n".join(lines) + "\n"
        return out + ("\n" + self.trailer.rstrip("\n") + "\n" if self.trailer else "")


def launch_spec(placement: Placement, model: ModelSpec, fmt: str, file_path: str | Path,
                opts: FlagOptions) -> Launch:
    """The :class:`Launch` that serves ``model`` with ``placement`` loaded from ``file_path`` (exported in
    ``fmt``) on ``placement.num_gpus`` GPUs with attention TP ``opts.tp`` x DP ``opts.dp``. For vLLM and
    SGLang the command is checked against the recorded options of ``opts.engine_version`` (default: the
    newest checked release) and an option it lacks is an error. Run :func:`check_layout` first: this
    function checks the arithmetic, not the memory."""
    target = EXPORT_TARGETS[target_of(fmt)]
    if (opts.vllm_pr is not None or opts.vllm_static is not None) and not target.vllm_options:
        raise InputError(f"--vllm-pr/--vllm-static choose how vLLM serves the placement; --format {fmt} is "
                         f"for {target.name}")
    if opts.engine_version is not None and target.name not in ENGINE_NAMES:
        raise InputError(f"--engine-version: the {target.name} command is not checked against a recorded release "
                         f"(checked engines: {', '.join(ENGINE_NAMES.values())})")
    path = str(Path(file_path).resolve())
    tp, dp = _layout(placement, opts)
    model_path = opts.model_path or MODEL_PATHS.get(model.name, model.source or model.name)
    max_len = opts.max_model_len or model.max_context
    launch = target.launch(placement, model, fmt, path, opts, model_path, max_len, tp, dp)
    problems = launch.problems()
    if problems:
        raise InputError(f"the {ENGINE_NAMES[launch.engine]} command would not parse: {'; '.join(problems)}")
    return launch


def target_of(fmt: str) -> str:
    """The export target (engine) of format ``fmt``."""
    if fmt not in TARGET_OF_FORMAT:
        raise InputError(f"--format '{fmt}' unknown (expected one of {', '.join(TARGET_OF_FORMAT)})")
    return TARGET_OF_FORMAT[fmt]


def format_options(placement: Placement, fmt: str, opts: FlagOptions) -> dict[str, Any]:
    """The export options the launch layout ``opts`` implies for format ``fmt`` (TensorRT-LLM's YAML
    layout keys for ``trtllm``); raises :class:`InputError` for a layout the target cannot express.
    Empty for the other formats."""
    target = EXPORT_TARGETS[target_of(fmt)]
    if target.layout_options is None:
        return {}
    keys = target.layout_options(placement, opts)
    return keys if fmt in target.layout_formats else {}


def recommended_format(rule: str) -> tuple[str, str] | None:
    """``(format, file name)`` a placement optimized for replica rule ``rule`` is served from (the engine
    whose rule it is, its preferred format); ``None`` when no export target routes with that rule."""
    return next((t.recommended for t in EXPORT_TARGETS.values() if t.replica_rule == rule and t.recommended), None)


def launch_command(placement: Placement, model: ModelSpec, fmt: str, file_path: str | Path,
                   opts: FlagOptions) -> str:
    """:func:`launch_spec` as the text ``place export --flags`` prints: ``#`` comment lines, then the
    command (``\\``-continued)."""
    return launch_spec(placement, model, fmt, file_path, opts).text()


def plugin_env(placement_path: str, dp: int, nodes: int) -> dict[str, str]:
    """The environment of a vLLM launched with the moeplace plugin: ``MOEPLACE_PLACEMENT``, and where several
    DP engine cores may run (DP > 1 or several nodes: ``--data-parallel-backend ray`` is one flag away)
    ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=MOEPLACE_PLACEMENT``: vLLM's Ray actors get only ``VLLM_*`` / ``HF_*``
    ... variables (vllm/ray/ray_env.py), so without it some ranks would load the original layout."""
    env = {capabilities.PLUGIN_ENV: str(Path(placement_path).resolve())}
    if dp > 1 or nodes > 1:
        env[capabilities.RAY_ENV_COPY] = capabilities.PLUGIN_ENV
    return env




def relabelled_launches(placement: Placement, model: ModelSpec, src: str | Path, dst: str | Path,
                        opts: FlagOptions, plan_report: str | Path | None = None) -> tuple[Any, list[Launch]]:
    """The memory plan and the launches that serve a relabelled checkpoint: vLLM and SGLang on ``dst`` (their
    own layout is the placement) and, where the capability table has the plugin, vLLM on the original ``src``
    through it. Refuses (:class:`InputError`) a layout the plan or an engine's parser refuses."""
    opts, plan = check_layout(placement, model, opts, plan_report)
    out = []
    for engine, fmt, serve, path in (("vllm", "vllm-expert-map", "checkpoint", dst), ("sglang", "sglang", "checkpoint", dst),
                                     ("vllm", "vllm-expert-map", "plugin", src)):
        if capabilities.cell(engine, serve, model).supported is not True:
            continue
        out.append(launch_spec(placement, model, fmt, path, replace(opts, serve=serve, model_path=str(Path(path).resolve()))))
    return plan, out


def _table_notes(engine: str, model: ModelSpec, features: tuple[str, ...]) -> list[str]:
    """``# WARNING`` lines for the ``features`` the capability table says ``engine`` lacks for ``model``."""
    return [f"# WARNING: {c.reason}" for c in capabilities.lacks(engine, model, features)]


def _vllm_nodes(tp: int, dp: int, gpn: int, nodes: int, master_addr: str) -> tuple[list[str], list[str] | None, int]:
    """vLLM's multi-node flags for attention TP ``tp`` x DP ``dp`` on ``nodes`` hosts of ``gpn`` GPUs (one
    engine process each: an NVL72 rack is 18 hosts of 4): the head's extra flags, what hosts 1.. add, and
    the DP ranks per host. DP ranks that fit in a host: ``--data-parallel-size-local`` ranks per host, host
    ``n`` starting at DP rank ``n * local`` (``--headless`` workers). A TP group spanning hosts
    (``tp > gpn``) runs under vLLM's multi-node launcher (``--nnodes``/``--node-rank``/``--master-addr``,
    ParallelConfig of 0.34.0), one DP rank; with more DP ranks the host-to-rank mapping is not checked
    here and the layout is refused."""
    if gpn % tp and tp % gpn:
        raise InputError(f"--tp {tp} and the {gpn} GPUs per host: one must divide the other (a TP group fills "
                         "whole hosts or packs into one)")
    if tp <= gpn:
        local = gpn // tp
        head = [f"--data-parallel-size {dp}", f"--data-parallel-size-local {local}"]
        if nodes == 1:
            return head, None, local
        return (head + [f"--data-parallel-address {master_addr}", "--data-parallel-rpc-port 13345"],
                ["--headless", f"--data-parallel-start-rank $((NODE_RANK*{local}))"], local)
    if dp > 1:
        raise InputError(f"attention TP{tp} x DP{dp}: each DP rank's TP group spans {tp // gpn} hosts of {gpn} GPUs; "
                         "vLLM's multi-host TP under data parallelism is not printed here: use --tp "
                         f"{gpn} or less (e.g. --tp {gpn} --dp {tp * dp // gpn}), or DP 1")
    return ([f"--nnodes {nodes}", "--node-rank $NODE_RANK", f"--master-addr {master_addr}"], ["--headless"], 0)


def _host_notes(G: int, gpn: int, gph: int) -> list[str]:
    """The comment saying how the launch counts hosts where an NVLink domain spans several (NVL72)."""
    if gph >= gpn:
        return []
    domains = G // gpn
    where = "all in one NVLink domain" if domains == 1 else f"in {domains} NVLink domains of {gpn}"
    line = f"# {G // gph} hosts of {gph} GPUs (compute trays), one engine process each, {where}: a 'node' below is a host"
    return [line]


def _vllm(placement: Placement, model: ModelSpec, fmt: str, path: str, opts: FlagOptions, model_path: str,
          max_len: int, tp: int, dp: int, ascend: bool = False) -> Launch:
    G, gpn, R = placement.num_gpus, placement.gpus_per_node, placement.num_redundant
    gph = launch_host_size(placement, opts)
    nodes = G // gph  # hosts: one engine process each
    notes = _host_notes(G, gpn, gph)
    version = None if ascend else resolve_version("vllm", opts.engine_version)
    node_flags, worker, _ = _vllm_nodes(tp, dp, gph, nodes, opts.master_addr)
    gpu = _gpu_kind(placement, opts)
    if not ascend and gpu in ("h100", "h200") and model.name == "kimi-k3":
        notes.append("# vLLM's K3 recipe marks DEP unsupported on Hopper (H100/H200): it runs TP with "
                     "--moe-backend marlin --max-model-len 32768 there")
    a2a = "flashinfer_nvlink_one_sided" if G <= gpn else "deepep_v2"  # the EP group within one NVLink domain
    kv = "fp8" if opts.kv_cache_dtype == "fp8" else "auto"
    # --enable-expert-parallel: EP over all TP x DP ranks (EPLB requires it; vLLM's ParallelConfig asserts)
    head = [f"vllm serve {shlex.quote(model_path)}", "--trust-remote-code",
            f"--tensor-parallel-size {tp}", *node_flags, "--enable-expert-parallel", f"--all2all-backend {a2a}"]
    allow: tuple[str, ...] = ()
    env: dict[str, str] = {}
    applies = True
    name = Path(path).name
    eplb_ok = ascend or capabilities.cell("vllm", "online_eplb", model).supported is not False
    plugin = not ascend and capabilities.cell("vllm", "plugin", model).supported
    if opts.serve == "checkpoint":
        if R:
            raise InputError(f"a relabelled checkpoint holds each expert once; the placement has {R} redundant slots")
        notes.append(f"# the relabelled checkpoint: vLLM's own layout (--expert-placement-strategy linear, the "
                     f"default) is the placement; no plugin, no placement file, no {capabilities.PLUGIN_ENV}")
    elif ascend:
        eplb = {"expert_map_path": path, "num_redundant_experts": R}
        head += [f"--additional-config {shlex.quote(json.dumps({'eplb_config': eplb}))}"]
        head = [h for h in head if not h.startswith("--all2all-backend")]  # Ascend picks its own (HCCL MC2)
        notes.append("# vllm-ascend: static expert_map_path is Model Runner V1 only; scheduled for removal in "
                     "v0.25.1")
    elif opts.vllm_static is not None:
        notes.append(f"# vLLM {version} cannot load {name}; without EPLB it places the experts itself "
                     f"(--expert-placement-strategy {opts.vllm_static}, no replicas)")
        if R:
            notes.append(f"# the placement's {R} redundant slots per layer are not realized without EPLB")
        head += [f"--expert-placement-strategy {opts.vllm_static}"]
        applies = False
    elif opts.vllm_pr is not None:
        pr_fmt, allow = VLLM_PRS[opts.vllm_pr]
        if fmt != pr_fmt:
            raise InputError(f"--vllm-pr {opts.vllm_pr} loads --format {pr_fmt} files, not {fmt}")
        cfg: dict = {"num_redundant_experts": R, "window_size": opts.eplb_window, "step_interval": opts.eplb_interval}
        if fmt == "vllm-expert-map":
            cfg["initial_expert_map_path"] = path
            if not opts.online_eplb:
                notes.append("# #49572 (per its description) adds no switch to stop online EPLB: it re-plans every "
                             "step_interval steps; raise --eplb-interval to keep this layout longer")
        else:
            cfg["initial_mapping_path"] = path
            if not opts.online_eplb:
                cfg["disable_online_rebalancing"] = True
        if opts.online_eplb:
            cfg["log_balancedness"] = True
        notes.append(f"# needs a vLLM build with the open PR #{opts.vllm_pr} (eplb_config.{', '.join(allow)}): "
                     f"vLLM {version}'s parser rejects {'these keys' if len(allow) > 1 else 'this key'}")
        notes += _table_notes("vllm", model, ("online_eplb",))  # the PR loads the map through EPLB
        head += ["--enable-eplb", f"--eplb-config {shlex.quote(json.dumps(cfg, separators=(',', ':')))}"]
    elif R == 0 and plugin or opts.serve == "plugin":
        if opts.placement_path is None:
            raise InputError("the vLLM command loads the placement through the moeplace plugin, which reads the "
                             "placement JSON: its path is needed (place export passes PLACEMENT)")
        env.update(plugin_env(opts.placement_path, dp, nodes))
        if opts.serve == "plugin":
            notes.append(f"# the original checkpoint, relabelled while vLLM loads it: {capabilities.PLUGIN_INSTALL} "
                         f"(the moeplace vllm.general_plugins entry point); {capabilities.PLUGIN_ENV} names the "
                         "placement JSON; every rank logs the placement hash it applied (place export --check-logs)")
        else:
            notes.append(f"# {name} is for an open PR: {capabilities.cell('vllm', 'placement_file', model).reason}. "
                         f"This replica-free placement is applied while vLLM loads the weights instead: "
                         f"{capabilities.PLUGIN_INSTALL} (the moeplace vllm.general_plugins entry point); "
                         f"{capabilities.PLUGIN_ENV} names the placement JSON")
        if opts.online_eplb:
            if eplb_ok:
                cfg = recommended_eplb_config(0, version, window_size=opts.eplb_window, step_interval=opts.eplb_interval)
                head += ["--enable-eplb", f"--eplb-config {shlex.quote(json.dumps(cfg, separators=(',', ':')))}"]
                notes.append(f"# online EPLB starts from this layout and re-plans every {cfg['step_interval']} steps")
            else:
                notes += _table_notes("vllm", model, ("online_eplb",))
    elif eplb_ok:
        cfg = recommended_eplb_config(R, version, window_size=opts.eplb_window, step_interval=opts.eplb_interval)
        pr = next(n for n, (f, _) in VLLM_PRS.items() if f == fmt)
        notes.append(f"# vLLM {version} cannot load {name} (the open PR #{pr} adds that: --vllm-pr {pr} prints "
                     "its keys); this command runs vLLM's own online EPLB, which starts from its default layout "
                     f"with {R} redundant experts per layer and re-plans every {cfg['step_interval']} steps")
        alt = capabilities.offer("vllm", model, opts.placement_path or "PLACEMENT")
        if alt:
            notes.append(f"# to serve a moeplace placement on vLLM {version}: {alt}")
        head += ["--enable-eplb", f"--eplb-config {shlex.quote(json.dumps(cfg, separators=(',', ':')))}"]
        applies = False
    else:  # neither a map nor EPLB reaches this model's experts: serve the default layout, and say so
        notes += _table_notes("vllm", model, ("placement_file", "online_eplb"))
        alt = capabilities.offer("vllm", model, opts.placement_path or "PLACEMENT")
        notes.append(f"# this command serves vLLM's default layout, not this placement with {R} redundant slots per "
                     f"layer" + (f"; instead {alt}" if alt else ""))
        applies = False
    if opts.pool is not None and not ascend:
        head += _vllm_pool_flags(opts)
        notes.append(_POOL_NOTES["vllm"][opts.pool])
    if ascend and kv == "fp8":
        notes.append("# vllm-ascend: KV-cache dtype left at the model default (fp8 KV support differs on NPUs)")
        head += [f"--max-model-len {max_len}"]
    else:
        head += [f"--kv-cache-dtype {kv}", f"--max-model-len {max_len}"]
    where = f"# head node (node 0 of {nodes})" if nodes > 1 else f"# one node, {G} GPUs"
    return Launch("vllm", version, notes, f"# attention TP{tp} x DP{dp}, EP{G}", where, head, nodes, gph, path,
                  model_path, worker, allow_eplb_keys=allow, env=env, applies_placement=applies)


def _sglang(placement: Placement, model: ModelSpec, fmt: str, path: str, opts: FlagOptions, model_path: str,
            max_len: int, tp: int, dp: int) -> Launch:
    G, gpn, R = placement.num_gpus, placement.gpus_per_node, placement.num_redundant
    gph = launch_host_size(placement, opts)
    nodes = G // gph  # hosts: SGLang gives each of the --nnodes processes --tp-size / --nnodes GPUs
    from moeplace.placement.export.sglang import support_warnings  # the format modules import this one

    version = resolve_version("sglang", opts.engine_version)
    if opts.serve == "plugin":
        raise InputError("moeplace has no SGLang load-time plugin: serve the relabelled checkpoint")
    relabelled = opts.serve == "checkpoint"
    own = ("# the relabelled checkpoint: SGLang's own layout (physical expert p on EP rank p // (E/G)) is the "
           "placement; no --init-expert-location")
    notes = _host_notes(G, gpn, gph) + ([own] if relabelled else [f"# WARNING: {w}" for w in support_warnings(model, R)])
    if opts.online_eplb:
        notes += _table_notes("sglang", model, ("online_eplb",))
    a2a = "flashinfer" if gpn >= 72 else "deepep"  # by the NVLink domain, not the host
    kv = "fp8_e4m3" if opts.kv_cache_dtype == "fp8" else "bf16"
    # SGLang's --tp-size is the instance's GPU count; with DP attention each of the attention-DP ranks
    # runs attention TP over tp-size / dp GPUs. 0.5.23 spells that --attn-dp-size D (its parser marks the
    # older --dp-size D --enable-dp-attention deprecated: --dp-size now means whole-model replicas).
    cmd = [f"python -m sglang.launch_server --model-path {shlex.quote(model_path)}", "--trust-remote-code",
           f"--tp-size {tp * dp}"]
    if dp > 1:
        cmd += ([f"--attn-dp-size {dp}"] if accepts("sglang", version, "--attn-dp-size")
                else [f"--dp-size {dp}", "--enable-dp-attention"])
    cmd.append(f"--ep-size {G}")
    if nodes > 1:
        cmd += [f"--nnodes {nodes}", "--node-rank $NODE_RANK", f"--dist-init-addr {opts.master_addr}:5000"]
    cmd += [f"--moe-a2a-backend {a2a}"]
    if a2a == "deepep":
        cmd.append("--deepep-mode auto")
    if not relabelled:
        cmd += [f"--ep-num-redundant-experts {R}", "--ep-dispatch-algorithm static",
                f"--init-expert-location {shlex.quote(path)}"]
    if fmt == "sglang-logical-count":
        notes.append("# SGLang runs its EPLB on the logical_count at start-up (--eplb-algorithm auto)")
    if opts.online_eplb:
        cmd += ["--enable-eplb", f"--eplb-rebalance-num-iterations {opts.eplb_interval}"]
    if opts.pool is not None:
        cmd += [f"--disaggregation-mode {opts.pool}", f"--disaggregation-transfer-backend {SGLANG_TRANSFER}"]
        # both are the instance's totals, which SGLang divides over its attention-DP ranks (0.5.23:
        # kv_cache_configurator max_running_requests // attn_dp_size, parallel_hook chunked_prefill_size //
        # attn_dp_size); the pool's limits are per DP rank, as vLLM's --max-num-seqs is
        cmd += [f"--max-running-requests {opts.max_seqs * dp}"] if opts.max_seqs else []
        cmd += [f"--chunked-prefill-size {opts.max_batched_tokens * dp}"] if opts.max_batched_tokens else []
        notes.append(_POOL_NOTES["sglang"][opts.pool])
    cmd += [f"--kv-cache-dtype {kv}", f"--context-length {max_len}"]
    where = f"# run on each of the {nodes} nodes with NODE_RANK=0..{nodes - 1}" if nodes > 1 else f"# one node, {G} GPUs"
    return Launch("sglang", version, notes, f"# attention TP{tp} x DP{dp}, EP{G}", where, cmd, nodes, gph, path,
                  model_path, applies_placement=relabelled or capabilities.cell("sglang", "placement_file",
                                                                                 model).supported is not False)


# Disaggregated pools. vLLM (0.34.0, vllm/config/kv_transfer.py KVTransferConfig): the NIXL connector moves the
# KV cache; both instances run it as "kv_both" (its usage guide) and a proxy sends each request to the prefill
# instance first and then to the decode instance, which pulls the cache. SGLang (0.5.23): --disaggregation-mode
# prefill|decode with --disaggregation-transfer-backend nixl (its choices: mooncake, nixl, ...), and its router
# in PD mode in front.
VLLM_KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
SGLANG_TRANSFER = "nixl"
_POOL_NOTES = {
    "vllm": {"prefill": "# prefill pool: a disaggregation proxy sends each request here first (max_tokens 1), then to "
                        "the decode pool, which pulls the KV cache over NIXL (vLLM's disaggregated-serving proxy "
                        "example, llm-d or Dynamo route it)",
             "decode": "# decode pool: requests arrive through the disaggregation proxy with the prefill instance's "
                       "KV handle; NIXL pulls the cache (UCX over the NICs, or NVLink within one domain)"},
    "sglang": {"prefill": "# prefill pool: route with SGLang's router in PD mode (sglang-router package: "
                          "--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL; not checked here)",
               "decode": "# decode pool: the router in PD mode pairs each request with a prefill instance; the KV "
                         "cache arrives over NIXL"},
}


def _vllm_pool_flags(opts: FlagOptions) -> list[str]:
    """The flags that make a vLLM instance one pool of a disaggregated deployment."""
    cfg = json.dumps(VLLM_KV_TRANSFER, separators=(",", ":"))
    out = [f"--kv-transfer-config {shlex.quote(cfg)}"]
    if opts.max_seqs:
        out.append(f"--max-num-seqs {opts.max_seqs}")
    if opts.max_batched_tokens:
        out.append(f"--max-num-batched-tokens {opts.max_batched_tokens}")
    return out


def trtllm_attention_dp(tp: int, dp: int) -> bool:
    """TensorRT-LLM's ``enable_attention_dp`` for attention TP ``tp`` x DP ``dp`` (one of them must be 1)."""
    if tp > 1 and dp > 1:
        raise InputError(f"TensorRT-LLM runs attention either as TP over all ranks or as DP over all ranks "
                         f"(enable_attention_dp); attention TP{tp} x DP{dp} cannot be expressed: use --tp 1 "
                         f"--dp {tp * dp} (its load balancer needs attention DP anyway)")
    return dp > 1 or tp == 1


def trtllm_options(placement: Placement, opts: FlagOptions) -> dict[str, Any]:
    """The launch part of the extra-options YAML (what ``--flags`` adds to an exported ``trtllm`` file)."""
    tp, dp = _layout(placement, opts)
    return {"attention_dp": trtllm_attention_dp(tp, dp), "moe_backend": opts.moe_backend,
            "kv_cache_dtype": opts.kv_cache_dtype}


def _trtllm(placement: Placement, model: ModelSpec, fmt: str, path: str, opts: FlagOptions, model_path: str,
            max_len: int, tp: int, dp: int) -> Launch:
    from moeplace.placement.export.trtllm import (  # the format modules import this one
        dump_yaml,
        support_warnings,
    )

    G, gpn = placement.num_gpus, launch_host_size(placement, opts)  # TensorRT-LLM's --gpus_per_node: GPUs per host
    nodes = G // gpn
    adp = trtllm_attention_dp(tp, dp)
    if capabilities.cell("trtllm", "placement_file", model).supported is not False and not adp:
        # the file is applied for this architecture, and then MoE._init_load_balancer asserts attention DP
        raise InputError(f"TensorRT-LLM's load balancer needs attention DP over all {G} ranks (MoE._init_load_balancer "
                         f"asserts 'Load Balancer should be only used with ADP and EP > 1'); attention TP{tp} x DP{dp} "
                         f"has it off: use --tp 1 --dp {G}")
    notes = _host_notes(G, placement.gpus_per_node, gpn)
    notes += [f"# WARNING: {w}" for w in support_warnings(model, attention_dp=adp, ep_size=G,
                                                          num_redundant=placement.num_redundant)]
    options: dict[str, Any] = {"enable_attention_dp": adp,
                               "kv_cache_config": {"dtype": "fp8" if opts.kv_cache_dtype == "fp8" else "auto"},
                               "moe_config": {"backend": opts.moe_backend.upper(),
                                              "load_balancer": "<inline in the file: num_slots "
                                                               f"{placement.num_slots}, layer_updates_per_iter 0>"}}
    if fmt == "trtllm-lb":
        options["moe_config"]["load_balancer"] = path
        extra = "extra_llm_api_options.yaml"
        notes.append(f"# write the YAML below to {extra}; moe_config.load_balancer points at the exported file")
    else:
        extra = path
        notes.append(f"# {Path(path).name} holds the YAML below, with the load balancer inline")
    if opts.online_eplb:
        notes.append("# online rebalancing: set moe_config.load_balancer.layer_updates_per_iter > 0 (layers "
                     "re-placed per iteration); the exported layout is then only the start")
    cmd = [f"trtllm-serve {shlex.quote(model_path)}", "--backend pytorch", "--trust_remote_code",
           f"--tp_size {G}", f"--ep_size {G}", f"--gpus_per_node {gpn}", f"--max_seq_len {max_len}",
           f"--extra_llm_api_options {shlex.quote(extra)}"]
    if nodes > 1:
        cmd[0] = f"trtllm-llmapi-launch {cmd[0]}"
        where = (f"# {nodes} nodes: start under mpirun/srun with one rank per GPU ({G} ranks), e.g. "
                 f"srun -N {nodes} --ntasks-per-node {gpn}")
    else:
        where = f"# one node, {G} GPUs"
    yaml_text = dump_yaml(options, f"extra LLM-API options: attention {'DP' if adp else 'TP'} over {G} ranks")
    return Launch("trtllm", None, notes, f"# attention TP{tp} x DP{dp}, EP{G}", where, cmd, nodes, gpn, path,
                  model_path, trailer=yaml_text,
                  applies_placement=capabilities.cell("trtllm", "placement_file", model).supported is not False)


def _vllm_ascend(*args: Any) -> Launch:
    return _vllm(*args, ascend=True)


@dataclass(frozen=True)
class ExportTarget:
    """An engine that loads exported placements: ``launch`` builds its command (``(placement, model, fmt,
    path, opts, model_path, max_len, tp, dp) -> Launch``); ``replica_rule`` is the :mod:`placement.rules`
    rule it routes tokens with (``None``: not modelled); ``vllm_options``: it takes ``--vllm-pr`` /
    ``--vllm-static``; ``layout_options(placement, opts)``: the export options the launch layout implies,
    for ``layout_formats``; ``recommended``: the ``(format, file name)`` ``place sweep`` exports its
    recommended placement as."""

    name: str
    launch: Callable[..., Launch]
    replica_rule: str | None = None
    vllm_options: bool = False
    layout_options: Callable[[Placement, FlagOptions], dict[str, Any]] | None = None
    layout_formats: tuple[str, ...] = ()
    recommended: tuple[str, str] | None = None


EXPORT_TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    ExportTarget("vllm", _vllm, "vllm", vllm_options=True, recommended=("vllm-jsonl", "expert-map.jsonl")),
    ExportTarget("vllm-ascend", _vllm_ascend),  # its own dispatch is not modelled
    ExportTarget("sglang", _sglang, "sglang", recommended=("sglang", "expert-location.json")),
    ExportTarget("trtllm", _trtllm, "trtllm", layout_options=trtllm_options, layout_formats=("trtllm",),
                 recommended=("trtllm", "extra-llm-api-options.yaml")),
)}
