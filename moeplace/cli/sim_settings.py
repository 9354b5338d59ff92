"""User settings of a simulation -> :class:`sim.config.SimConfig`: the one mapping ``place simulate``
(its flags) and ``place sweep`` (a spec's engine/simulate sections, a workload and a point) share.

:class:`SimSettings` holds the settings as users give them (a pool split or a rebalance as its string,
a context mix as typed); :func:`build_sim_config` parses them and assembles the engine, workload and run
configuration. Each caller keeps only its own naming of the settings and its own error context."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.inputs import format_tokens, parse_context_mix, parse_pool_split
from moeplace.foundation.settings import Range
from moeplace.placement.dispatch import ENGINE_RULES
from moeplace.sim.config import (
    A2A_MODES,
    ADMISSION,
    DP_BALANCE,
    MODES,
    PHASES,
    PREEMPTION,
    PREFILL_BATCHES,
    CostConfig,
    EngineConfig,
    LengthMix,
    SimConfig,
    WorkloadConfig,
    check_resources,
    parse_rebalance,
    prefill_batches_of,
)

Count = Annotated[int, Range(1)]  # a whole number >= 1
NonNeg = Annotated[int, Range(0)]
Share = Annotated[float, Range(0, 1)]  # a probability


@dataclass(frozen=True)
class SimSettings:
    """The settings of one simulation, named after ``place simulate``'s flags; defaults are its defaults.
    Each field's type says what a user may give (``Literal`` choices, ``Range`` bounds): a ``place sweep``
    spec's engine, simulate and workload sections are checked against these fields
    (:func:`moeplace.foundation.settings.parse_keys`), the flags by their own parsers.

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
    attention_tp: Count = 8
    engine: Literal[ENGINE_RULES] = "vllm"
    kv_dtype: Literal["bf16", "fp8"] = "fp8"
    max_batched_tokens: Count = 8192
    max_seqs: Count = 256
    chunked_prefill: bool = True
    disaggregated: bool = False
    dual_batch_overlap: bool = False
    preemption: Literal[PREEMPTION] = "recompute"
    pool_split: str = "shared"
    gpu_memory_utilization: Annotated[float, Range(0, 1, lo_open=True)] = 0.9
    deepep_mode: Literal[A2A_MODES] = "auto"
    cuda_graph_max_bs: NonNeg = 512
    kernels_per_layer: Annotated[float, Range(0)] | None = None
    kernel_build: Literal["unfused", "fused"] = "unfused"
    mtp_draft: NonNeg = 0
    mtp_acceptance: Share | tuple[Share, ...] = 0.0
    prefix_hit: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    moe_tp: Count = 1
    attention_dtype: Literal["bf16", "fp8"] = "bf16"
    dp_balance: Literal[DP_BALANCE] = "round_robin"
    admission: Literal[ADMISSION] = "on_demand"
    prefill_batches: Literal[PREFILL_BATCHES] | None = None  # None: the engine's own (prefill_batches_of)
    prefill_gpus: Count | None = None
    phase: Literal[PHASES] = "both"
    # workload
    arrival: Literal["closed", "poisson", "gamma", "ramp"] = "closed"
    concurrency: Count = 256
    rate: Annotated[float, Range(0)] | None = None
    rate_end: Annotated[float, Range(0)] | None = None
    burstiness: Annotated[float, Range(0)] = 2.0
    context_mix: str | None = None
    output_len: Count = 512
    isl: Count | None = None
    osl: Count | None = None
    random_range_ratio: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    max_requests: Count | None = None
    # run
    duration: Annotated[float, Range(0, lo_open=True)] = 600.0
    mode: Literal[MODES] = "stat"
    seed: Annotated[int, Range(0, 2**31 - 1)] = 0
    rebalance: str | None = None
    warmup: Annotated[float, Range(0)] | None = None
    cost_model: str = "roofline"
    cost_engine: str | None = None


def build_sim_config(s: SimSettings, max_context: int | None, *, mix_what: str = "--context-mix") -> SimConfig:
    """The :class:`SimConfig` of ``s`` for a model of ``max_context`` tokens (no mix length may exceed
    it). ``mix_what`` names the context mix in errors (the flag, or the spec field)."""
    split, param = parse_pool_split(s.pool_split)
    engine = EngineConfig(attention_tp=s.attention_tp, max_batched_tokens=s.max_batched_tokens,
                          max_seqs=s.max_seqs, chunked_prefill=s.chunked_prefill, disaggregated=s.disaggregated,
                          dual_batch_overlap=s.dual_batch_overlap, replica_rule=s.engine, kv_dtype=s.kv_dtype,
                          preemption=s.preemption, gpu_memory_utilization=s.gpu_memory_utilization,
                          pool_split=split, pool_param=param, a2a_mode=s.deepep_mode,
                          cuda_graph_max_bs=s.cuda_graph_max_bs, kernels_per_layer=s.kernels_per_layer,
                          kernel_build=s.kernel_build, mtp_draft=s.mtp_draft,
                          mtp_acceptance=s.mtp_acceptance, prefix_hit=s.prefix_hit, moe_tp=s.moe_tp,
                          attention_dtype=s.attention_dtype, dp_balance=s.dp_balance, admission=s.admission,
                          prefill_batches=prefill_batches_of(s.engine, s.prefill_batches),
                          prefill_gpus=s.prefill_gpus, phase=s.phase)
    config = SimConfig(duration=s.duration, mode=s.mode, seed=s.seed, engine=engine, cost=CostConfig(),
                       workload=_workload(s, max_context, mix_what),
                       rebalance=parse_rebalance(s.rebalance) if s.rebalance else None, warmup=s.warmup,
                       cost_model=s.cost_model, cost_engine=s.cost_engine)
    check_resources(config)  # before any work: flags and sweep points meet the same estimate
    return config


def _check_lengths(s: SimSettings, max_context: int | None, mix_what: str) -> None:
    """Fixed lengths and the mean output length within the model's maximum context, as the context mix's
    lengths are (an engine refuses a prompt plus output past ``max_model_len``; a simulation of one would
    report numbers no server produces)."""
    if not max_context:
        return
    limit = f"the model's maximum context {format_tokens(max_context)} ({max_context:,} tokens)"
    if s.isl is not None:
        for name, v in (("isl", s.isl), ("osl", s.osl)):
            if v is not None and v > max_context:
                raise InputError(f"--{name} {v:,}: exceeds {limit}")
        if s.osl is not None and s.isl + s.osl > max_context:
            raise InputError(f"--isl {s.isl:,} + --osl {s.osl:,} = {s.isl + s.osl:,} tokens: exceeds {limit}")
    elif s.context_mix and s.output_len > max_context:
        raise InputError(f"--output-len {s.output_len:,}: exceeds {limit} (with {mix_what})")


def _lengths(s: SimSettings, max_context: int | None, mix_what: str) -> LengthMix | None:
    """Prompt and output lengths: fixed benchmark lengths, a context mix, or ``None`` (the trace's)."""
    _check_lengths(s, max_context, mix_what)
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
