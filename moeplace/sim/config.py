"""Run configuration: frozen dataclasses validated in ``__post_init__`` (no I/O there). The runner writes
the resolved configuration next to its outputs (``config.json``)."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from moeplace.foundation import limits
from moeplace.foundation.errors import InputError
from moeplace.placement.dispatch import ENGINE_RULES

ARRIVALS = ("poisson", "gamma", "ramp", "closed")
MODES = ("replay", "stat")
COST_MODELS = ("auto", "measured", "roofline")
COST_ENGINES = ("trtllm", "sglang", "vllm")
PREEMPTION = ("recompute", "swap")
A2A_MODES = ("auto", "normal", "low_latency", "allgather")
PHASES = ("both", "prefill", "decode")
DP_BALANCE = ("round_robin", "tokens")
ADMISSION = ("on_demand", "reserve")
# how a rank's prefill work shares an iteration with its decoding sequences (EngineConfig.prefill_batches)
PREFILL_BATCHES = ("mixed", "separate")


def prefill_batches_of(engine: str, given: str | None = None) -> str:
    """``given``, else the engine's default: SGLang runs prefill batches alone (``separate``: its scheduler
    runs a prefill batch first whenever one can be formed, and mixes decodes into it only with
    ``--enable-mixed-chunk``, off by default); vLLM V1 and TensorRT-LLM mix prefill chunks into the decode
    iteration (``mixed``)."""
    return given if given is not None else ("separate" if engine == "sglang" else "mixed")


def _bad(what: str, msg: str) -> None:
    raise InputError(f"{what}: {msg}")


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine being modelled.

    ``attention_tp`` GPUs form one attention data-parallel rank (so there are ``G / attention_tp`` ranks);
    every GPU is one expert-parallel rank. Batching limits are per DP rank and per iteration, as in
    vLLM/SGLang's ``--max-num-batched-tokens`` / ``--max-num-seqs`` under DP attention.
    """

    attention_tp: int = 8
    max_batched_tokens: int = 8192
    max_seqs: int = 256
    chunked_prefill: bool = True
    disaggregated: bool = False  # separate prefill and decode pools of the placement's size each
    dual_batch_overlap: bool = False
    replica_rule: str = "vllm"
    kv_dtype: str = "fp8"
    preemption: str = "recompute"
    pool_split: str = "shared"  # place plan --pool-split: shared | ratio | slots
    pool_param: float | None = None
    gpu_memory_utilization: float = 0.9
    swap_bw: float = 55e9  # host link bytes/s per GPU for swap preemption (PCIe 5 x16, achievable)
    # DeepEP mode of the MoE all-to-all: "auto" = normal kernels for iterations with prefill tokens,
    # low-latency kernels for decode-only ones (SGLang --deepep-mode auto); "allgather" = all-gather the
    # tokens and reduce-scatter the outputs (TensorRT-LLM's CUTLASS MoE under attention DP)
    a2a_mode: str = "auto"
    cuda_graph_max_bs: int = 512  # decode-only iterations up to this many sequences per rank replay a graph
    mtp_draft: int = 0  # MTP / speculative draft tokens per step (0 = off)
    # probability each successive draft token is accepted given the ones before it: one value for every
    # draft position, or one per position (later drafts are accepted less often; TensorRT-LLM's MTP table
    # for DeepSeek-R1: 1.92 / 2.58 / 2.82 tokens per step with 1 / 2 / 3 drafts)
    mtp_acceptance: float | tuple[float, ...] = 0.0
    prefix_hit: float = 0.0  # share of every prompt found in the prefix cache (not recomputed)
    moe_tp: int = 1  # TEP: GPUs each routed expert is tensor-sharded across (EP groups of moe_tp GPUs)
    attention_dtype: str = "bf16"  # compute dtype of the attention core (FlashMLA FP8 = "fp8")
    dp_balance: str = "round_robin"  # new requests to DP ranks: round robin or fewest outstanding tokens
    # KV admission: "on_demand" (vLLM/SGLang: a sequence holds what it has so far, the newest is preempted
    # when the pool fills) or "reserve" (TensorRT-LLM GUARANTEED_NO_EVICT, its default: admitted only when
    # the whole prompt + output fits, never preempted)
    admission: str = "on_demand"
    # "mixed": prefill chunks join the decoding sequences' iteration up to max_batched_tokens (vLLM V1,
    # TensorRT-LLM in-flight batching, SGLang with --enable-mixed-chunk); "separate": a rank with a prompt to
    # start runs a prefill-only iteration and its decoding sequences wait for the next one (SGLang's default:
    # Scheduler.get_next_batch_to_run "runs prefill first if possible", enable_mixed_chunk is off by default)
    prefill_batches: str = "mixed"
    prefill_gpus: int | None = None  # disaggregated: GPUs of the prefill pool (None = same as decode)
    phase: str = "both"  # benchmark one phase alone: "prefill" (1-token outputs) or "decode" (KV given)
    # disaggregated pools (--pools): the link the KV cache crosses from prefill to decode, "rdma" (NIXL over
    # the decode GPUs' NICs) or "nvlink" (both pools in one NVLink domain)
    kv_link: str = "rdma"
    # the engine build whose kernels per layer kind pay the per-kernel gap (sim.cost.KERNEL_BUILDS):
    # "unfused" (FP8 block-scale DeepSeek paths of TensorRT-LLM / SGLang / vLLM) or "fused" (TensorRT-LLM's
    # NVFP4 min-latency build: all-reduce + norm + quantize, fused GEMMs, fused MoE)
    kernel_build: str = "unfused"
    # one kernel count for every decoder layer instead (a what-if; None: by build and layer kind)
    kernels_per_layer: float | None = None

    def mtp_position_acceptance(self) -> tuple[float, ...]:
        """Conditional acceptance of each draft position ``[mtp_draft]`` (position j is accepted with this
        probability when positions < j were)."""
        acc = self.mtp_acceptance
        return tuple(acc) if isinstance(acc, tuple) else (float(acc),) * self.mtp_draft

    def mtp_tokens_per_step(self) -> float:
        """Expected tokens a decoding sequence gains per step: ``1 + sum_j prod_{i<=j} a_i`` (the leading
        run of accepted drafts, then the verified token)."""
        total, run = 1.0, 1.0
        for a in self.mtp_position_acceptance():
            run *= a
            total += run
        return total

    def __post_init__(self) -> None:
        w = "engine config"
        if self.a2a_mode not in A2A_MODES:
            _bad(w, f"a2a_mode '{self.a2a_mode}' unknown (expected one of {A2A_MODES})")
        if self.phase not in PHASES:
            _bad(w, f"phase '{self.phase}' unknown (expected one of {PHASES})")
        if self.kv_link not in ("rdma", "nvlink"):
            _bad(w, f"kv_link '{self.kv_link}' unknown (expected rdma or nvlink)")
        if self.admission not in ADMISSION:
            _bad(w, f"admission '{self.admission}' unknown (expected one of {ADMISSION})")
        if self.prefill_batches not in PREFILL_BATCHES:
            _bad(w, f"prefill_batches '{self.prefill_batches}' unknown (expected one of {PREFILL_BATCHES})")
        if self.dp_balance not in DP_BALANCE:
            _bad(w, f"dp_balance '{self.dp_balance}' unknown (expected one of {DP_BALANCE})")
        if self.attention_dtype not in ("bf16", "fp8"):
            _bad(w, f"attention_dtype must be bf16 or fp8, got '{self.attention_dtype}'")
        if self.mtp_draft > MTP_MAX_DRAFT:
            _bad(w, f"--mtp: {self.mtp_draft} draft tokens per step: more than {MTP_MAX_DRAFT} (MTP and EAGLE "
                    "drafts run a few tokens ahead; every draft token is verified in each step, so throughput "
                    "falls towards 0)")
        acc = self.mtp_acceptance
        per_pos = isinstance(acc, tuple)
        if (self.mtp_draft < 0 or not all(0 <= a <= 1 for a in (acc if per_pos else (acc,)))
                or (per_pos and len(acc) != self.mtp_draft)):
            _bad(w, f"--mtp: draft must be >= 0 and acceptance in [0, 1] (one value, or one per draft position), "
                    f"got {self.mtp_draft}, {self.mtp_acceptance}")
        if not 0 <= self.prefix_hit < 1:
            _bad(w, f"--prefix-hit must be in [0, 1), got {self.prefix_hit}")
        if self.kernel_build not in ("unfused", "fused"):
            _bad(w, f"kernel_build '{self.kernel_build}' unknown (expected unfused or fused)")
        if self.kernels_per_layer is not None and not self.kernels_per_layer >= 0:
            _bad(w, f"kernels_per_layer must be >= 0, got {self.kernels_per_layer}")
        if self.moe_tp < 1 or self.cuda_graph_max_bs < 0:
            _bad(w, "moe_tp must be >= 1 and cuda_graph_max_bs >= 0")
        if self.prefill_gpus is not None and (self.prefill_gpus < 1 or not self.disaggregated):
            _bad(w, f"--prefill-gpus {self.prefill_gpus} needs --disaggregated and >= 1 GPU")
        if self.attention_tp < 1:
            _bad(w, f"attention_tp must be >= 1, got {self.attention_tp}")
        if self.max_batched_tokens < 1 or self.max_seqs < 1:
            _bad(w, "max_batched_tokens and max_seqs must be >= 1")
        if self.replica_rule not in ENGINE_RULES:
            _bad(w, f"replica_rule '{self.replica_rule}' unknown (expected one of {ENGINE_RULES})")
        if self.preemption not in PREEMPTION:
            _bad(w, f"preemption '{self.preemption}' unknown (expected one of {PREEMPTION})")
        if not 0 < self.gpu_memory_utilization <= 1:
            _bad(w, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_bw <= 0:
            _bad(w, "swap_bw must be positive")


@dataclass(frozen=True)
class CostConfig:
    """Cost-model constants: achieved-efficiency curves, fixed overheads and collective semantics.

    Defaults marked *fitted* are the reference fit of the shipped ensemble (sim/cost_ensemble.json,
    :mod:`sim.ensemble`): ``bench/fidelity.py`` fits them by least squares on every published case before
    the frozen cut-off (bench/fidelity_frozen.yaml), each within its bounds (the batch-1 step's within
    published ranges), and the ensemble's members are refits on group-bootstrap resamples; a run on these
    defaults is priced by every member (its figures the members' median with an 80 % interval). The others
    are constants from the kernels' own published figures (sources in docs/simulate.md, "Cost model").
    :meth:`roofline` is the pure roofline: peak rates, no overheads, no efficiency curves.

    GEMMs (expert and dense): ``t = max(flops * (1 + gemm_m0 / m) / (peak * gemm_efficiency),
    bytes / (hbm_bw * hbm_efficiency)) + gemm_kernel_s`` per kernel, ``m`` the rows per weight matrix
    (tokens per expert, or tokens of a dense layer): the tile-fill loss of small ``m`` that DeepGEMM's
    grouped-GEMM table shows (932 TFLOPS at 256 rows per expert, 1,297 at 8,192, H800 FP8).
    """

    # fitted: share of the isolated-kernel compute rate sustained while serving (power-capped clocks under
    # sustained load, SMs shared with communication kernels, the elementwise kernels between GEMMs);
    # kernel microbenchmarks (DeepGEMM's tables) run at 1
    sustained_efficiency: float = 0.6159
    flops_efficiency: float = 0.8  # GQA core attention compute: an estimate (no published table priced here)
    # KDA's chunked/recurrent core at its published kernel rate: MoonshotAI FlashKDA's H20 benchmark
    # (BENCHMARK_H20.md, T=8192, D=128, fixed length) runs H=96 in 2.62 ms and H=64 in 1.62 ms, i.e. 39-42
    # TFLOPS by this model's KDA FLOP count (sim.cost.CostModel.kda_time), 0.27-0.29 of H20's 148 BF16
    # TFLOPS (fla's Triton chunk_kda: 4.51 / 2.96 ms, 0.15-0.16); the lower FlashKDA figure
    kda_flops_efficiency: float = 0.27
    hbm_efficiency: float = 0.5314  # fitted: achieved HBM share (DeepGEMM's M=64 rows alone reach ~0.86)
    link_efficiency: float = 0.682  # fitted: NVLink share DeepEP normal kernels reach (153-158 GB/s on H800)
    nic_efficiency: float = 0.8885  # fitted: RDMA share DeepEP normal kernels reach (43-58 GB/s of 50)
    gemm_efficiency: float = 0.6083  # fitted: large-m grouped GEMM FLOP share (DeepGEMM contiguous 1,297/1,979)
    gemm_m0: float = 66.33  # fitted: rows of tile fill per weight matrix (efficiency m / (m + m0))
    gemm_kernel_s: float = 3.802e-06  # fitted: fixed time per GEMM kernel (launch, pipeline fill, tail)
    ll_latency_s: float = 5.022e-05  # fitted: DeepEP low-latency dispatch/combine fixed time (per call)
    ll_efficiency: float = 1.0  # fitted: RDMA share low-latency kernels reach (39-48 GB/s of 50 at EP32+)
    normal_latency_s: float = 40e-6  # DeepEP normal mode: CPU-side layout notify before the copies
    allreduce_latency_s: float = 10e-6  # TP all-reduce fixed time on NVLink (roofline form only)
    # 1: all-reduce / all-gather / reduce-scatter inside an NVLink domain at their measured times by message
    # size (sim.cost.COLLECTIVE_TABLES); 0: the roofline alpha + bytes / NVLink bandwidth
    collective_table: float = 1.0
    # kernels of every decoder layer (0: by layer kind and engine build, sim.cost.KERNEL_BUILDS)
    kernels_per_layer: float = 0.0
    # fitted within 1-2 us: device-side gap per kernel (graph replay or eager; see bench/fidelity.py FIT)
    graph_gap_s: float = 1.945e-6
    launch_s: float = 5e-6  # per-kernel CPU launch time of an eager (non-graph) iteration
    # fitted within 2-9 us: the device time of a latency-bound kernel, so a decode layer takes at least its
    # kernels x this (batch 1 is latency-bound in every kernel); the published range is the measured durations
    # of the small kernels of a DeepSeek-R1 decode step on B200 (FP4 quantize 2.1 us, v_proj 4.1, dense FP4
    # GEMM 8.4, MoE finalize 7.3: SemiAnalysis InferenceX issue 863's trace analysis)
    kernel_floor_s: float = 2.0e-06
    # FP4 (NVFP4 / MXFP4) GEMMs on a GPU with FP4 tensor cores run at this x its FP8 rate, not at its FP4 peak
    # (2x FP8): NVIDIA TransformerEngine issue 2281 measures NVFP4 grouped GEMMs on B200 at most 15 % faster
    # than MXFP8 on DeepSeek-V3 shapes; torchao PR 4798 +13.8 % for NVFP4 over MXFP8 on a 671B MoE at
    # M = 131,072 on GB300; FlashInfer PR 5301's fused NVFP4 MoE reaches 2,318 TFLOPS at 512 tokens per expert
    # on B300 (0.52 of its 4.5 PFLOPS FP8 peak)
    fp4_gemm_speedup: float = 1.15
    # fitted within 0.2-1.5 ms: host scheduling, sampling and synchronisation exposed per iteration; Alibaba
    # RTP-LLM's DeepSeek report measures ~1.5 ms of host time between forward steps, < 200 us its target at
    # batch 128 once made lightweight (the overlap schedulers of SGLang / TensorRT-LLM / vLLM hide most of it)
    iteration_overhead_s: float = 1.5e-3
    comm_sm_share: float = 24 / 132  # SMs DeepEP normal kernels hold while overlapped (set_num_sms(24))
    mla_decode_flops_efficiency: float = 580 / 989  # FlashMLA: 580 TFLOPS BF16 on H800 (compute bound)
    mla_decode_hbm_efficiency: float = 3000 / 3350  # FlashMLA: 3,000 GB/s on H800 (memory bound)
    prefill_attention_efficiency: float = 0.6  # FlashAttention-3 causal forward share of BF16 peak
    dispatch_bytes_per_value: float = 1.0 + 4.0 / 128  # FP8 dispatch with one fp32 scale per 128 values
    combine_bytes_per_value: float = 2.0  # BF16 combine
    activation_bytes: float = 2.0

    ZERO_OK = ("gemm_m0", "gemm_kernel_s", "ll_latency_s", "normal_latency_s", "allreduce_latency_s",
               "collective_table",
               "kernels_per_layer", "graph_gap_s", "launch_s", "kernel_floor_s", "iteration_overhead_s", "comm_sm_share")
    FRACTIONS = ("sustained_efficiency", "flops_efficiency", "kda_flops_efficiency", "hbm_efficiency", "link_efficiency", "nic_efficiency", "gemm_efficiency",
                 "ll_efficiency", "mla_decode_flops_efficiency", "mla_decode_hbm_efficiency",
                 "prefill_attention_efficiency")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.ZERO_OK:
                if not v >= 0:
                    _bad("cost config", f"{f.name} must be >= 0, got {v}")
            elif not v > 0:
                _bad("cost config", f"{f.name} must be positive, got {v}")
        for f in self.FRACTIONS:
            if getattr(self, f) > 1:
                _bad("cost config", f"{f} must be <= 1")
        if self.comm_sm_share >= 1:
            _bad("cost config", "comm_sm_share must be < 1")
        if self.collective_table not in (0, 1):
            _bad("cost config", f"collective_table must be 0 or 1, got {self.collective_table}")

    @classmethod
    def roofline(cls, **kw: float) -> CostConfig:
        """The pure roofline: every efficiency 1, no fixed overheads, no SM sharing (hand-checkable)."""
        base = {f: 1.0 for f in cls.FRACTIONS}
        base.update({f: 0.0 for f in cls.ZERO_OK})
        base["fp4_gemm_speedup"] = 1e9  # FP4 GEMMs at the FP4 peak
        base.update(kw)
        return cls(**base)

    def replace(self, **kw: float) -> CostConfig:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class LengthMix:
    """Prompt lengths: a mixture of ``(length, weight)`` components, each drawn log-normally around its
    length with ``sigma`` (0 = exact), capped at ``max_len``. Outputs: log-normal around ``output_mean``."""

    components: tuple[tuple[int, float], ...] = ((2048, 1.0),)
    sigma: float = 0.5
    output_mean: int = 512
    output_sigma: float = 0.6
    max_len: int = 1 << 20
    # benchmark lengths (vllm bench serve --random-input-len/--random-output-len/--random-range-ratio):
    # when set, prompt and output lengths are uniform in [n (1 - r), n (1 + r)] around the component length
    # and output_mean instead of log-normal; 0 = exact lengths
    range_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.range_ratio is not None and not 0 <= self.range_ratio < 1:
            _bad("length mix", f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if not self.components or any(n < 1 or w <= 0 for n, w in self.components):
            _bad("length mix", "components must be (length >= 1, weight > 0) pairs")
        if self.output_mean < 1 or self.sigma < 0 or self.output_sigma < 0:
            _bad("length mix", "output_mean must be >= 1 and sigmas >= 0")

    @staticmethod
    def cap_for(max_context: int | None) -> int:
        """The longest prompt a model of ``max_context`` tokens serves: one token short, so the prompt
        and at least one output token fit (1 M tokens when the model states no limit)."""
        return (max_context or (1 << 20)) - 1

    @classmethod
    def context_mix(cls, components: tuple[tuple[int, float], ...], output_mean: int,
                    max_context: int | None) -> LengthMix:
        """Prompt lengths from a parsed context mix (``place simulate --context-mix``, a sweep workload's
        ``context_mix``), capped for the model's context."""
        return cls(components=components, output_mean=output_mean, max_len=cls.cap_for(max_context))


@dataclass(frozen=True)
class WorkloadConfig:
    """Where requests come from. ``lengths=None`` takes prompt/output lengths from the trace's requests;
    otherwise from the mix (token routing is still read from the trace). ``arrival="closed"`` keeps
    ``concurrency`` requests in the system; the others are open processes at ``rate`` requests/s
    (``gamma``: inter-arrival coefficient of variation ``burstiness``; ``ramp``: rate from ``rate`` to
    ``rate_end`` over the run)."""

    arrival: str = "closed"
    rate: float = 1.0
    rate_end: float | None = None
    burstiness: float = 2.0
    concurrency: int = 256
    lengths: LengthMix | None = None
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            _bad("workload", f"arrival '{self.arrival}' unknown (expected one of {ARRIVALS})")
        if self.arrival != "closed" and not self.rate > 0:
            _bad("workload", f"--rate must be > 0, got {self.rate}")
        if self.arrival == "closed" and self.concurrency < 1:
            _bad("workload", f"--concurrency must be >= 1, got {self.concurrency}")
        if self.arrival == "gamma" and not self.burstiness > 0:
            _bad("workload", "burstiness must be > 0")
        if self.arrival == "ramp" and not (self.rate_end is not None and self.rate_end > 0):
            _bad("workload", "a ramp needs rate_end > 0")


@dataclass(frozen=True)
class RebalanceConfig:
    """``--rebalance every=N,window=W,moves=K[,policy=P][,time=S][,async=1]``: every N iterations re-place
    from the expert loads of the last W iterations, changing at most K slots per MoE layer (0 = no limit;
    the optimizer's ``--max-moves``); ``time``: the optimizer's time limit per rebalance (seconds);
    ``async``: the decision and the weight transfer overlap serving (vLLM's default) instead of stalling
    every rank; ``decision``: seconds charged per decision instead of the policy's measured time
    (e.g. for a faster host)."""

    every: int
    window: int
    moves: int = 0
    policy: str = "auto"  # auto: the moeplace optimizer's migration mode if registered, else eplb
    time_limit: float | None = None
    asynchronous: bool = False
    decision_s: float | None = None  # None: the policy's measured time; a number: that (what-ifs)
    # float [L, E] expert loads the window holds before the run (what the rebalancer observed earlier); it
    # decides from them at the first iteration. None: the window starts empty (sim.online uses this)
    observed: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.every < 1 or self.window < 1 or self.moves < 0:
            _bad("--rebalance", f"every and window must be >= 1 and moves >= 0, got {self}")
        if self.decision_s is not None and not (self.decision_s >= 0 and math.isfinite(self.decision_s)):
            _bad("--rebalance", f"decision must be a finite number >= 0 seconds, got {self.decision_s}")
        if self.time_limit is not None and not (self.time_limit > 0 and math.isfinite(self.time_limit)):
            _bad("--rebalance", f"time must be a finite number > 0 seconds, got {self.time_limit}")


@dataclass(frozen=True)
class SimConfig:
    duration: float = 600.0
    mode: str = "stat"
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rebalance: RebalanceConfig | None = None
    # Pool overrides (tests, what-ifs); None = from the `place plan` memory model.
    kv_tokens_per_rank: int | None = None
    state_slots_per_rank: int | None = None
    chrome_trace_iterations: int = 2000
    # Throughput and latency are measured after this many simulated seconds (closed-loop start-up and
    # first prefills excluded); None = 20 % of the duration.
    warmup: float | None = None
    # Kernel costs: "roofline" (sim.cost), "measured" (aiconfigurator's silicon tables, sim.measured) or
    # "auto" (measured where the tables cover the run); cost_engine: the serving engine whose tables price
    # it (trtllm | sglang | vllm; None = the replica rule's engine).
    cost_model: str = "roofline"
    cost_engine: str | None = None
    # Throughputs and per-token times priced by the shipped ensemble of constants (sim.ensemble: the
    # members' median with an 80 % interval) when the run uses its reference constants (the defaults) and
    # the roofline cost model; False: by the constants in ``cost`` alone, without an interval.
    ensemble: bool = True

    def __post_init__(self) -> None:
        if self.cost_model not in COST_MODELS:
            _bad("simulate", f"--cost-model '{self.cost_model}' unknown (expected one of {COST_MODELS})")
        if self.cost_engine is not None and self.cost_engine not in COST_ENGINES:
            _bad("simulate", f"--cost-engine '{self.cost_engine}' unknown (expected one of {COST_ENGINES})")
        if not self.duration > 0:
            _bad("simulate", f"--duration must be > 0, got {self.duration}")
        if self.warmup is not None and not 0 <= self.warmup < self.duration:
            _bad("simulate", f"--warmup must be in [0, duration), got {self.warmup}")
        if not 0 <= self.seed <= 2**31 - 1:
            _bad("simulate", f"--seed must be in [0, 2147483647], got {self.seed}")
        if self.mode not in MODES:
            _bad("simulate", f"--mode '{self.mode}' unknown (expected one of {MODES})")
        # ceilings (docs/design.md, Resource bounds); the memory estimate is resource_estimate's (it reads
        # what the machine has, which a config does not)
        limits.check_sim_duration(self.duration)
        wl = self.workload
        limits.check_sim_requests(limits.expected_requests(
            arrival=wl.arrival, concurrency=wl.concurrency, rate=wl.rate, rate_end=wl.rate_end,
            duration=self.duration, max_requests=wl.max_requests), _requests_what(self))

    @property
    def warmup_s(self) -> float:
        return 0.2 * self.duration if self.warmup is None else self.warmup

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _requests_what(config: SimConfig) -> str:
    wl = config.workload
    if wl.arrival == "closed":
        return f"--concurrency {limits.fmt_count(wl.concurrency)}"
    return f"--rate {limits.fmt_count(wl.rate)} x --duration {limits.fmt_count(config.duration)}"


def resource_estimate(config: SimConfig) -> limits.Estimate:
    """What one run of ``config`` needs (:func:`moeplace.foundation.limits.simulation_estimate`)."""
    wl = config.workload
    return limits.simulation_estimate(arrival=wl.arrival, concurrency=wl.concurrency, rate=wl.rate,
                                      rate_end=wl.rate_end, duration=config.duration,
                                      max_requests=wl.max_requests, what=_requests_what(config))


def check_resources(config: SimConfig) -> None:
    """Refuse ``config`` when one run needs more memory than this machine has available."""
    limits.require_memory(resource_estimate(config))


# ---------------------------------------------------------------------------- parsing helpers
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20}


def parse_tokens(text: str, what: str = "length") -> int:
    """``"8k"`` -> 8192, ``"1M"`` -> 1048576, ``"300"`` -> 300."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise InputError(f"{what}: '{text}' is not a token count (e.g. 300, 8k, 1M)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])


MTP_MAX_DRAFT = 16  # draft tokens per step: engines' MTP / EAGLE configurations use 1 to ~8


def parse_mtp(text: str) -> tuple[int, float | tuple[float, ...]]:
    """``"1:0.85"`` -> (1 draft token, acceptance 0.85); ``"3:0.92,0.72,0.36"`` -> (3, per-position
    conditional acceptances)."""
    try:
        d, a = text.split(":", 1)
        parts = [float(x) for x in a.split(",")]
        return int(d), (parts[0] if len(parts) == 1 else tuple(parts))
    except ValueError:
        raise InputError(f"--mtp: '{text}' is not DRAFT:ACCEPTANCE (e.g. 1:0.85, or 3:0.92,0.72,0.36 per draft "
                         "position)") from None


def parse_rebalance(text: str) -> RebalanceConfig:
    """``"every=3000,window=1000,moves=64"`` (policy=... optional)."""
    kv: dict[str, str] = {}
    for part in text.split(","):
        if "=" not in part:
            raise InputError(f"--rebalance: '{part}' is not KEY=VALUE (expected every=N,window=W,moves=K)")
        k, v = part.split("=", 1)
        if k.strip() in kv:  # every=10,every=20: which one was meant is not ours to guess
            raise InputError(f"--rebalance: key '{k.strip()[:60]}' given twice ({kv[k.strip()][:60]} and "
                             f"{v.strip()[:60]})")
        kv[k.strip()] = v.strip()
    unknown = set(kv) - {"every", "window", "moves", "policy", "time", "async", "decision"}
    if unknown:
        raise InputError(f"--rebalance: unknown keys {sorted(unknown)} (expected every, window, moves, policy, time, "
                         "async, decision)")
    if kv.get("async", "0") not in ("0", "1"):
        raise InputError(f"--rebalance: async={kv['async']}: expected 0 or 1")
    if "every" not in kv:
        raise InputError("--rebalance: 'every=N' is required")
    try:
        every = int(kv["every"])
        return RebalanceConfig(every=every, window=int(kv.get("window", every)), moves=int(kv.get("moves", 0)),
                               policy=kv.get("policy", "auto"),
                               time_limit=float(kv["time"]) if "time" in kv else None,
                               asynchronous=kv.get("async", "0") == "1",
                               decision_s=float(kv["decision"]) if "decision" in kv else None)
    except ValueError as exc:
        raise InputError(f"--rebalance: {exc}") from None
