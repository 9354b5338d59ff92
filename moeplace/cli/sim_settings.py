"""User settings of a simulation -> :class:`sim.config.SimConfig`: the one mapping ``place simulate``
(its flags) and ``place sweep`` (a spec's engine/simulate sections, a workload and a point) share.

:class:`SimSettings` holds the settings as users give them (a pool split or a rebalance as its string,
a context mix as typed); :func:`build_sim_config` parses them and assembles the engine, workload and run
configuration. Each caller keeps only its own naming of the settings and its own error context."""
from __future__ import annotations

from dataclasses import dataclass

from moeplace.foundation.memory.inputs import parse_context_mix, parse_pool_split
from moeplace.sim.config import (
    CostConfig,
    EngineConfig,
    LengthMix,
    SimConfig,
    WorkloadConfig,
    check_resources,
    parse_rebalance,
)


@dataclass(frozen=True)
class SimSettings:
    """The settings of one simulation, named after ``place simulate``'s flags; defaults are its defaults.

    Engine: ``engine`` is the replica-choice rule; ``pool_split`` as ``--pool-split`` takes it
    (``shared``, ``ratio[:R]``, ``slots:N``); ``mtp_draft`` / ``mtp_acceptance`` the two halves of
    ``--mtp``. Workload: ``arrival="closed"`` keeps ``concurrency`` requests in the system, otherwise
    requests arrive at ``rate`` (``rate_end``, ``burstiness`` as the process needs). Prompt lengths:
    fixed ``isl``/``osl`` (with ``random_range_ratio``), else ``context_mix`` (a string such as
    ``8k:0.7,128k:0.3``, outputs of mean ``output_len``), else the trace's own. Run: ``rebalance`` is a
    ``--rebalance`` string or ``None`` for a static placement; ``cost_model`` / ``cost_engine`` as
    ``--cost-model`` / ``--cost-engine`` (measured kernel costs where aiconfigurator's tables cover the run).
    """

    # engine
    attention_tp: int = 8
    engine: str = "vllm"
    kv_dtype: str = "fp8"
    max_batched_tokens: int = 8192
    max_seqs: int = 256
    chunked_prefill: bool = True
    disaggregated: bool = False
    dbo: bool = False
    preemption: str = "recompute"
    pool_split: str = "shared"
    gpu_memory_utilization: float = 0.9
    deepep_mode: str = "auto"
    cuda_graph_max_bs: int = 512
    kernels_per_layer: float | None = None
    kernel_build: str = "unfused"
    mtp_draft: int = 0
    mtp_acceptance: float | tuple[float, ...] = 0.0
    prefix_hit: float = 0.0
    moe_tp: int = 1
    attention_dtype: str = "bf16"
    dp_balance: str = "round_robin"
    admission: str = "on_demand"
    prefill_gpus: int | None = None
    phase: str = "both"
    # workload
    arrival: str = "closed"
    concurrency: int = 256
    rate: float | None = None
    rate_end: float | None = None
    burstiness: float = 2.0
    context_mix: str | None = None
    output_len: int = 512
    isl: int | None = None
    osl: int | None = None
    random_range_ratio: float = 0.0
    max_requests: int | None = None
    # run
    duration: float = 600.0
    mode: str = "stat"
    seed: int = 0
    rebalance: str | None = None
    warmup: float | None = None
    cost_model: str = "roofline"
    cost_engine: str | None = None


def build_sim_config(s: SimSettings, max_context: int | None, *, mix_what: str = "--context-mix") -> SimConfig:
    """The :class:`SimConfig` of ``s`` for a model of ``max_context`` tokens (no mix length may exceed
    it). ``mix_what`` names the context mix in errors (the flag, or the spec field)."""
    split, param = parse_pool_split(s.pool_split)
    engine = EngineConfig(attention_tp=s.attention_tp, max_batched_tokens=s.max_batched_tokens,
                          max_seqs=s.max_seqs, chunked_prefill=s.chunked_prefill, disaggregated=s.disaggregated,
                          dual_batch_overlap=s.dbo, replica_rule=s.engine, kv_dtype=s.kv_dtype,
                          preemption=s.preemption, gpu_memory_utilization=s.gpu_memory_utilization,
                          pool_split=split, pool_param=param, a2a_mode=s.deepep_mode,
                          cuda_graph_max_bs=s.cuda_graph_max_bs, kernels_per_layer=s.kernels_per_layer,
                          kernel_build=s.kernel_build, mtp_draft=s.mtp_draft,
                          mtp_acceptance=s.mtp_acceptance, prefix_hit=s.prefix_hit, moe_tp=s.moe_tp,
                          attention_dtype=s.attention_dtype, dp_balance=s.dp_balance, admission=s.admission,
                          prefill_gpus=s.prefill_gpus, phase=s.phase)
    config = SimConfig(duration=s.duration, mode=s.mode, seed=s.seed, engine=engine, cost=CostConfig(),
                       workload=_workload(s, max_context, mix_what),
                       rebalance=parse_rebalance(s.rebalance) if s.rebalance else None, warmup=s.warmup,
                       cost_model=s.cost_model, cost_engine=s.cost_engine)
    check_resources(config)  # before any work: flags and sweep points meet the same estimate
    return config


def _lengths(s: SimSettings, max_context: int | None, mix_what: str) -> LengthMix | None:
    """Prompt and output lengths: fixed benchmark lengths, a context mix, or ``None`` (the trace's)."""
    if s.isl is not None:
        return LengthMix(components=((s.isl, 1.0),), sigma=0.0, output_mean=s.osl, output_sigma=0.0,
                         max_len=LengthMix.cap_for(max_context), range_ratio=s.random_range_ratio)
    if s.context_mix:
        mix = parse_context_mix(s.context_mix, max_context, mix_what)
        return LengthMix.context_mix(mix, s.output_len, max_context)
    return None


def _workload(s: SimSettings, max_context: int | None, mix_what: str) -> WorkloadConfig:
    """A closed loop carries only its concurrency; an open process its rate, ramp end and burstiness."""
    lengths = _lengths(s, max_context, mix_what)
    if s.arrival == "closed":
        return WorkloadConfig(arrival="closed", concurrency=s.concurrency, lengths=lengths,
                              max_requests=s.max_requests)
    return WorkloadConfig(arrival=s.arrival, rate=1.0 if s.rate is None else s.rate, rate_end=s.rate_end,
                          burstiness=s.burstiness, lengths=lengths, max_requests=s.max_requests)
