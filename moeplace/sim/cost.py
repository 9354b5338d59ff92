"""The cost model: achieved-efficiency rooflines per operation, collectives with the engines' semantics,
fixed overheads; corrected by a measured calibration profile when one is given.

Every formula is written once here and tested on hand-computed cases (tests/test_sim_cost.py). Times
are seconds; FLOPs count a multiply-add as 2. Constants are :class:`sim.config.CostConfig` fields
(``CostConfig.roofline()`` turns every curve and overhead off); docs/simulate.md lists their sources.

- Compute rates are the kernels' isolated rates times ``sustained_efficiency`` (clocks under sustained
  power-capped load, SMs shared with communication, elementwise kernels between GEMMs).
- GEMMs (routed experts, shared experts, projections, LM head) follow DeepGEMM's measured shape
  dependence: ``t = max((m + m0) / m * flops / (peak * e_gemm), bytes / (hbm_bw * e_hbm)) + t_kernel``
  with ``m`` the rows per weight matrix (tokens per expert), so small batches pay tile fill and every
  kernel its launch/pipeline latency. MXFP4 experts run on FP4 tensor cores where the GPU has them,
  else at the FP8 rate (GPUSpec.flops decides).
- Attention cores: MLA decode in the absorbed form at FlashMLA's published rates (580 TFLOPS compute
  bound, 3,000 GB/s memory bound, H800), prefill at a FlashAttention-3 share of peak; KDA's chunked
  prefill and recurrent decode at ``kda_flops_efficiency`` (FlashKDA's published H20 rate) and GQA at
  ``flops_efficiency``, as rooflines.
- Tensor-parallel attention/dense parts (``attention_tp`` > 1): two all-reduces per layer (attention
  output, MLP/MoE output), at the measured time of their message size (:data:`COLLECTIVE_TABLES`:
  TensorRT-LLM's custom all-reduce on 8 x H200 / B200 by message size; the roofline
  ``alpha + 2 (n - 1) / n * bytes / nvlink_bw`` with ``collective_table`` 0).
- ``allgather`` instead (TensorRT-LLM's CUTLASS MoE under attention DP): every rank all-gathers the
  pool's tokens and reduce-scatters the outputs, ``(G-1)/G`` of all tokens per GPU and direction, at
  NCCL's measured all-gather / reduce-scatter times by message size inside one NVLink domain. The
  gathered payload is what TensorRT-LLM's ``CutlassFusedMoE`` gathers (tensorrt_llm/_torch/modules/
  fused_moe, https://github.com/NVIDIA/TensorRT-LLM): NVFP4 experts quantize the tokens to NVFP4 (FP4
  values + one FP8 scale per 16) *before* the gather ("FP4 AllGather", TensorRT-LLM tech blog 3,
  "Optimizing DeepSeek R1 Throughput on NVIDIA Blackwell GPUs"); DeepSeek FP8 block-scale experts gather
  the BF16 tokens and quantize inside the MoE op; other formats gather FP8 + scales; outputs come back BF16.
- MoE all-to-all with DeepEP semantics, chosen by phase as SGLang's ``--deepep-mode auto`` does:
  *normal* kernels (iterations with prefill tokens) send ONE RDMA copy per destination node, which the
  receiving GPU forwards over NVLink (copies per remote GPU x the node-dedup factor below, plus the
  forwarding on NVLink, plus a CPU-side layout notify); *low-latency* kernels (decode-only iterations)
  send every copy straight to its GPU with their own latency and achieved RDMA share.
- Dual-batch overlap (TBO/DBO): the batch splits into two micro-batches whose phases are costed at half
  size (their GEMMs at half the tokens per expert); in steady state a layer takes
  ``max(2 C_half / (1 - s), 2 M_half)`` (compute C, communication M; ``s`` the SM share normal-mode
  kernels hold while overlapped), plus one pipeline fill ``min(C_half, M_half)`` per iteration.
- The step at small batch: every kernel of a layer (counted by layer kind and engine build,
  :data:`KERNEL_BUILDS`) takes at least ``kernel_floor`` on the device (a latency-bound kernel: launch,
  DRAM round trips, tail), so a layer takes ``max(gpu, kernels x kernel_floor)``; each kernel is preceded
  by a device-side gap (``graph_gap``, less what programmatic dependent launch hides in a build that
  enables it, :data:`PDL_GAP_SAVING_S`), graph replay or not; an eager iteration also cannot run a layer
  faster than the CPU launches its kernels (``max(gpu + gaps, kernels x launch)``); per iteration the host
  time the engine leaves exposed (scheduler, sampling, sync). MTP drafts add their layer, LM head and the
  small kernels MTP runs (:data:`MTP_KERNELS`). Decode-only iterations up to the engine's graph batch size
  replay graphs; prefill and mixed ones run eager. Kimi K3 instead runs its engines' own kernel lists, each
  kernel priced at its own roofline and at least the floor (:mod:`sim.k3_kernels`).
- GEMM rates by the weights' format: FP4 on a GPU with FP4 tensor cores at ``fp4_gemm_speedup`` x its
  FP8 rate (published FP4 grouped GEMMs gain ~15 % over FP8, not the 2x of the peaks), INT4 weight-only
  (W4A16) at the BF16 rate; attention cores at the attention dtype's rate.

One engine iteration (:func:`CostModel.step_time`) is, layer by layer (every attention-DP rank and every
EP rank meet at each MoE layer's all-to-all, so each layer takes its slowest rank's time)::

    layer l = max_r [attention_r(kind_l) + trunk_r + 2 all-reduce_r]
            + max_g dispatch_g + max_g experts_g + max_g combine_g  (MoE layers only)

The *straggler time* of a layer is, summed over its three phases (dispatch, experts, combine),
``max_g t_g - mean_g t_g``: what the slowest EP rank costs every other rank at that layer, against a
perfectly balanced layer with the same total work.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np

from moeplace.foundation.cluster import FP4_FORMATS, ClusterSpec, GPUSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import DTYPE_BYTES, KV_DTYPE_BYTES, ModelSpec
from moeplace.sim.calibration import Profile
from moeplace.sim.config import CostConfig, EngineConfig
from moeplace.sim.k3_kernels import K3Kernels, build_of, is_k3

KDA_CHUNK = 64  # chunk length of KDA's chunked (WY) prefill algorithm

# Collectives inside one NVLink domain, measured: (bytes, microseconds) of one collective on 8 GPUs by
# message size (an all-reduce's buffer, an all-gather's output, a reduce-scatter's input), as NVIDIA
# measured them for aiconfigurator-core 0.12 (https://github.com/ai-dynamo/aiconfigurator, its systems
# data for h200_sxm and b200_sxm): all-reduce = TensorRT-LLM 1.3.0rc10's custom all-reduce in BF16
# (what the engines run for their TP all-reduces: one-shot / two-shot kernels for small messages),
# all-gather and reduce-scatter = NCCL 2.29.2 in FP16. Every 4th power of two of the published sweep.
# Their large-message bus bandwidth agrees with nccl-tests' published 8-GPU all-reduce figures: the
# table's 460-469 GB/s at 512 MB-1 GB on H200 vs ~480 GB/s peak on 8 x H100 with NVLink SHARP (NCCL's
# maintainers, NVIDIA/nccl-tests issue 212) and 475 GB/s on 8 x H200 (nccl-tests issue 272); the
# latency term is the small-message rows (3-4 us on H200, 5-6 us on B200). NVLink4 (H100 / H200,
# 450 GB/s per direction) and NVLink5 (B200 / B300 / GB200 / GB300, 900 GB/s); a GPU of another NVLink
# bandwidth (H800, 200 GB/s) takes the NVLink4 table with its bytes scaled by 450 GB/s over its own,
# which keeps the latency rows and scales the bandwidth (nccl issue 1374 measures 215 GB/s all-reduce
# bus bandwidth on 8 x H800, 0.45 x the H100's, as 200 / 450).
COLLECTIVE_TABLES = {
    "nvlink4": {"ref_bw": 450e9,
                "all_reduce": ((256, 2.94), (1024, 3.18), (4096, 3.52), (16384, 3.54), (65536, 4.59),
                               (262144, 10.13), (1048576, 25.93), (4194304, 48.47), (16777216, 121.98),
                               (67108864, 317.25), (268435456, 1054.67), (1073741824, 4007.39)),
                "all_gather": ((512, 12.19), (2048, 12.78), (8192, 12.80), (32768, 14.71), (131072, 14.56),
                               (524288, 13.57), (2097152, 24.28), (8388608, 43.17), (33554432, 123.38),
                               (134217728, 379.88), (536870912, 1394.97)),
                "reduce_scatter": ((512, 12.58), (2048, 10.61), (8192, 12.52), (32768, 11.55), (131072, 11.81),
                                   (524288, 13.72), (2097152, 19.71), (8388608, 44.72), (33554432, 111.62),
                                   (134217728, 375.59), (536870912, 1393.35))},
    "nvlink5": {"ref_bw": 900e9,
                "all_reduce": ((256, 5.22), (1024, 5.37), (4096, 5.78), (16384, 5.91), (65536, 5.90),
                               (262144, 7.61), (1048576, 17.52), (4194304, 38.40), (16777216, 83.43),
                               (67108864, 279.81), (268435456, 723.16), (1073741824, 2592.05)),
                "all_gather": ((512, 16.06), (2048, 18.02), (8192, 16.62), (32768, 19.55), (131072, 18.71),
                               (524288, 19.17), (2097152, 24.38), (8388608, 44.18), (33554432, 113.75),
                               (134217728, 206.75), (536870912, 761.42)),
                "reduce_scatter": ((512, 16.13), (2048, 16.38), (8192, 16.84), (32768, 17.59), (131072, 18.21),
                                   (524288, 18.86), (2097152, 20.99), (8388608, 43.64), (33554432, 107.13),
                                   (134217728, 208.04), (536870912, 766.45))},
}
COLLECTIVE_TABLE_GPUS = 8  # the tables' group size

# Kernels one decoder layer launches in a decode step, by engine build and layer part (attention kind,
# MoE or dense block, and the two residual-add + RMSNorm steps every layer has, fused with the TP
# all-reduce where there is one). Counted from the engines' decode paths, one kernel per launch:
# - "unfused" (DeepSeek FP8 block-scale checkpoints, TensorRT-LLM's PyTorch backend with the CUTLASS MoE
#   -- tensorrt_llm/_torch/models/modeling_deepseekv3.py DeepseekV3DecoderLayer.forward_MoE, modules/
#   attention.py MLA, modules/fused_moe -- and SGLang / vLLM's DeepSeek-V2 decoder layers): MLA = fused
#   q_a/kv_a GEMM, q_a and kv_a RMSNorm, q_b GEMM, the absorbed UK BMM, RoPE + KV-cache write,
#   attention, UV BMM, o_proj, with the FP8 activation quantization of the three dense GEMMs in kernels of
#   their own: 12; MoE block = router GEMM, top-k, shared expert (quantize + gate_up, SiLU-mul,
#   quantize + down: 5), routed experts (permute + quantize, FC1, activation, FC2, finalize: 5): 12;
#   dense MLP = quantize + gate_up, SiLU-mul, quantize + down: 5.
# - "fused" (TensorRT-LLM's NVFP4 min-latency build, tech blog 1 "Pushing Latency Boundaries", its
#   "Everything in One Diagram": Fuse_A GEMM, grouped RMSNorm, UQ_QR GEMM, UK BGEMM, KV concat + RoPE,
#   genAttention, UV GEMM, WO GEMM = 8; router GEMM + top-k, the shared expert on a second stream, the
#   sparse experts with FC1 + activation fused = 3; the all-reduces fused with add + RMSNorm (+ NVFP4
#   quantize) = 2: 13 per MoE layer, the blog's count).
# - KDA (Kimi Linear / K3), both builds: vLLM's KimiDeltaAttention decode path (vllm/model_executor/
#   layers/kda.py): q, k, v, b, f_a, f_b, g_a, g_b, o projections (9 GEMMs), beta sigmoid, fused_kda_gate,
#   the output buffer fill, three causal_conv1d_update, fused_recurrent_kda, the output copy,
#   FusedRMSNormGated: 18 (no fused KDA build is published).
# - GQA: qkv GEMM, RoPE + cache write, attention, o_proj (+ FP8 quantization of the two GEMMs unfused).
KERNEL_BUILDS = {
    "unfused": {"mla": 12, "kda": 18, "gqa": 6, "moe": 12, "mlp": 5, "norm": 2},
    "fused": {"mla": 8, "kda": 18, "gqa": 4, "moe": 3, "mlp": 3, "norm": 2},
}
# Gap per kernel that programmatic dependent launch hides, by build: TensorRT-LLM's fused min-latency build
# runs with PDL (TRTLLM_ENABLE_PDL=1); tech blog 1's optimisation table measures "Enable PDL" at 168 -> 173
# tokens/s per user on DeepSeek-R1 (8 x B200, MTP 3, 2.82 tokens per step): 16.8 -> 16.3 ms per step,
# 0.49 ms over the step's ~900 kernels (61 layers x 13, three MTP drafts), ~0.5 us each
PDL_GAP_SAVING_S = {"fused": 0.5e-6}
# Kernels MTP adds besides its decoder layer and LM head, counted from TensorRT-LLM's one-model MTP (v0.19,
# the build of tech blog 1's MTP table; tensorrt_llm/_torch/speculative/mtp.py MTPEagleWorker and
# models/modeling_deepseekv3.py DeepseekV3MTP, https://github.com/NVIDIA/TensorRT-LLM), one kernel per launch
# at batch 1: per draft step the embedding, enorm, hnorm, concat, eh_proj, a standalone input norm, the
# last-token gather (3), the LM head's all-gather and copy (2), the float cast, argmax + cast (2) and the
# position / hidden-state / KV-length updates (6): 21; once per iteration the acceptance (3-4) and the
# drafts' input set-up and restore (~18): 21. Inside the CUDA graph, like the rest of the step.
MTP_KERNELS = {"draft": 21, "step": 21}
# bus bytes per message byte of a collective over n GPUs (nccl-tests' busbw convention)
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


def _table_name(nvlink_bw: float) -> str:
    """Which :data:`COLLECTIVE_TABLES` table a GPU's NVLink generation takes: NVLink5 from 900 GB/s per
    direction, else NVLink4."""
    return "nvlink5" if nvlink_bw >= 900e9 else "nvlink4"


def collective_table(nvlink_bw: float) -> dict:
    """The measured table of a GPU's NVLink generation (:func:`_table_name`)."""
    return COLLECTIVE_TABLES[_table_name(nvlink_bw)]


@functools.cache
def _collective_rows(op: str, table: str) -> tuple[np.ndarray, ...]:
    """One table's rows as :func:`collective_time` interpolates them: message sizes, seconds (made
    non-decreasing) and both logs (computed once; the tables are constants)."""
    rows = np.asarray(COLLECTIVE_TABLES[table][op], dtype=np.float64)
    size, t = rows[:, 0], np.maximum.accumulate(rows[:, 1]) * 1e-6
    out = (size, t, np.log(size), np.log(t))
    for a in out:
        a.flags.writeable = False
    return out


def collective_time(op: str, bytes_, num_gpus: int, nvlink_bw: float):
    """Seconds of one ``op`` (``all_reduce`` | ``all_gather`` | ``reduce_scatter``) of ``bytes_`` (array or
    scalar; 0 where there is nothing to move) over ``num_gpus`` GPUs of one NVLink domain, from the
    measured 8-GPU tables: the 8-GPU message that moves the same bus bytes (``bytes x bus(n) / bus(8)``),
    scaled by the table's link bandwidth over this GPU's, interpolated log-log between the table's rows
    (made non-decreasing); below the first row its time (the latency), above the last row at the last
    row's bus bandwidth."""
    b = np.asarray(bytes_, dtype=np.float64)
    if num_gpus <= 1:
        return np.zeros_like(b)
    name = _table_name(nvlink_bw)
    size, t, log_size, log_t = _collective_rows(op, name)
    eq = b * _BUS[op](num_gpus) / _BUS[op](COLLECTIVE_TABLE_GPUS) * COLLECTIVE_TABLES[name]["ref_bw"] / nvlink_bw
    x = np.log(np.clip(eq, size[0], size[-1]))
    out = np.exp(np.interp(x, log_size, log_t))
    out = np.where(eq > size[-1], t[-1] * eq / size[-1], out)
    return np.where(b > 0, out, 0.0)


def roofline(flops, bytes_, peak_flops: float, bandwidth: float):
    """``max(flops / peak_flops, bytes / bandwidth)`` elementwise (arrays or scalars)."""
    return np.maximum(np.asarray(flops, dtype=np.float64) / peak_flops,
                      np.asarray(bytes_, dtype=np.float64) / bandwidth)


@dataclass
class RankWork:
    """What each attention-DP rank does in one iteration; every field float64 ``[D]`` (D ranks).

    ``tokens``: tokens run through the trunk (decode + prefill); ``sampled``: tokens that produce logits;
    ``dec_seqs`` / ``dec_ctx``: decoding sequences and the sum of their context lengths (keys attended,
    the new token included); ``pre_tokens`` / ``pre_seqs``: prefill-chunk tokens and chunks;
    ``pre_pairs``: (query, key) pairs of the causal prefill chunks; ``pre_ctx``: keys read by the chunks
    (sum over chunks of start + length).
    """

    tokens: np.ndarray
    sampled: np.ndarray
    dec_seqs: np.ndarray
    dec_ctx: np.ndarray
    pre_tokens: np.ndarray
    pre_seqs: np.ndarray
    pre_pairs: np.ndarray
    pre_ctx: np.ndarray

    @classmethod
    def zeros(cls, num_ranks: int) -> RankWork:
        return cls(*(np.zeros(num_ranks) for _ in range(8)))

    def half(self) -> RankWork:
        """One of two equal micro-batches (DeepSeek splits prompts so both get half the attention work)."""
        return RankWork(*(getattr(self, f.name) / 2 for f in fields(self)))


@dataclass
class MoeWork:
    """Per MoE layer and EP rank (GPU), float64 ``[L, G]``: ``tokens`` (token-expert selections served),
    ``touched`` (distinct local experts with >= 1 token: their weights are read), ``nvlink`` / ``nic``
    (token copies received over each link kind; combine sends the same copies back)."""

    tokens: np.ndarray
    touched: np.ndarray
    nvlink: np.ndarray
    nic: np.ndarray

    def half(self) -> MoeWork:
        """One of two micro-batches: half the selections and copies; touched experts from a Poisson
        occupancy at the halved mean tokens per touched expert."""
        lam = np.divide(self.tokens, self.touched, out=np.zeros_like(self.tokens), where=self.touched > 0)
        full = -np.expm1(-lam)
        ratio = np.divide(-np.expm1(-lam / 2), full, out=np.full_like(lam, 0.5), where=full > 0)
        return MoeWork(self.tokens / 2, self.touched * ratio, self.nvlink / 2, self.nic / 2)


@dataclass
class StepTime:
    total: float
    attention: float  # attention + trunk over all layers (+ LM head)
    experts: float  # sum over MoE layers of the slowest GPU's expert time
    comm: float  # sum over MoE layers of dispatch + combine
    straggler: np.ndarray  # [L] per MoE layer: sum over dispatch/experts/combine of max - mean GPU time
    layer: np.ndarray  # [num_layers] time of each decoder layer
    mode: str = "low_latency"  # DeepEP kernels of this iteration: normal | low_latency
    graph: bool = False  # replayed as a CUDA graph
    overhead: float = 0.0  # fixed per-iteration and per-layer overheads included in total


def selections_per_copy(num_gpus: int, top_k: int) -> float:
    """Expected selections per distinct destination GPU of a token whose ``top_k`` experts spread uniformly
    over ``num_gpus`` GPUs: ``k / (G (1 - (1 - 1/G)^k))``. DeepEP's low-latency kernels send one message
    per selected expert (their receive buffers are laid out per local expert), so they move this many
    times the bytes a per-GPU-deduplicated all-to-all would."""
    G, k = num_gpus, top_k
    return float(k / (G * (1 - (1 - 1 / G) ** k))) if G > 1 else 1.0


def node_dedup_factor(num_gpus: int, gpus_per_node: int, top_k: int) -> float:
    """Expected distinct remote NODES over distinct remote GPUs a token's ``top_k`` experts land on, for
    uniformly spread experts: how many RDMA copies DeepEP's normal kernels send (one per node) per copy
    a per-GPU all-to-all would send. ``(N-1)(1-(1-1/N)^k) / ((G-n)(1-(1-1/G)^k))``, 1 on one node."""
    G, n = num_gpus, gpus_per_node
    N = G // n
    if N <= 1:
        return 1.0
    gpus = (G - n) * (1 - (1 - 1 / G) ** top_k)
    nodes = (N - 1) * (1 - (1 - 1 / N) ** top_k)
    return float(nodes / gpus)


_LAYOUTS: dict = {}  # CostModel's layout by (model, cluster, settings) object: see _layout


def _layout(model: ModelSpec, cluster: ClusterSpec, attention_tp: int, kernels_per_layer: float, kernel_build: str,
            engine: str) -> dict:
    """The part of a :class:`CostModel` that no constant changes (the layer layout, kernels per layer, the
    dedup factors), computed once per model and cluster object and settings and shared by every cost model
    built on them: a fit prices one pool under thousands of constant sets. Keyed on the objects' identity
    (the cache holds them, so an id is never reused while it is cached); their dataclasses are frozen."""
    key = (id(model), id(cluster), attention_tp, kernels_per_layer, kernel_build, engine)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is model and hit[1] is cluster:
        return hit[2]
    out = {"node_dedup": node_dedup_factor(cluster.num_gpus, cluster.gpus_per_node, model.top_k),
           "ll_per_copy": selections_per_copy(cluster.num_gpus, model.top_k),
           "pure_tp": attention_tp >= cluster.num_gpus,  # every GPU holds every token: no all-to-all
           "wbytes": DTYPE_BYTES[model.weight_dtype],
           "kind_counts": {k: len(model.layers_of(k)) for k in ("mla", "kda", "gqa")}}
    # Per-kind constants, computed once (the formulas below use them per iteration).
    out["_att_params"] = {k: model.attention_params(k) for k, n in out["kind_counts"].items() if n}
    out["_kda_state_layer"] = (model.state_bytes_per_sequence(attention_tp) / out["kind_counts"]["kda"]
                               if out["kind_counts"]["kda"] else 0.0)
    # Layer layout for step_time: each layer's (attention kind, MoE?) key and MoE-layer flag.
    moe = set(model.moe_layers)
    keys = sorted({(k, i in moe) for i, k in enumerate(model.attention)})
    out["_keys"] = keys
    out["_layer_key"] = np.array([keys.index((k, i in moe)) for i, k in enumerate(model.attention)])
    is_moe = np.array([i in moe for i in range(model.num_layers)])
    out["_is_moe"] = is_moe
    # Kimi K3: its engines' own kernels, each priced (sim.k3_kernels), unless a count is imposed
    k3 = K3Kernels(model, build_of(engine, attention_tp), attention_tp) if is_k3(model) and kernels_per_layer == 0 \
        else None
    out["_k3"] = k3
    if kernels_per_layer > 0:
        out["_layer_kernels"] = np.full(model.num_layers, kernels_per_layer)
    elif k3 is not None:
        out["_layer_kernels"] = k3.counts(model.attention, is_moe)
    else:
        b = KERNEL_BUILDS[kernel_build]
        out["_layer_kernels"] = np.array([b[kind] + b["moe" if m else "mlp"] + b["norm"]
                                          for kind, m in zip(model.attention, is_moe)], dtype=np.float64)
    for v in out.values():  # shared: nothing may write into them
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    if len(_LAYOUTS) >= 256:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (model, cluster, out)
    return out


class CostModel:
    """Costs of one model on one GPU kind and pool (shared state: derived constants; no I/O).

    ``attention_tp``: GPUs per attention-DP rank; ``moe_tp``: GPUs each routed expert is sharded across
    (TEP); ``a2a_mode``: ``auto`` | ``normal`` | ``low_latency``; ``cuda_graph_max_bs``: decode-only
    iterations with at most this many sequences per rank replay a CUDA graph (0 = never);
    ``kernel_build``: the engine build whose kernel counts per layer kind (:data:`KERNEL_BUILDS`) pay the
    per-kernel gap; ``kernels_per_layer``: one count for every layer instead (None: the CostConfig's, whose
    0 means by build)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cfg: CostConfig | None = None,
                 attention_tp: int = 1, kv_dtype: str = "bf16", profile: Profile | None = None,
                 attention_dtype: str = "bf16", moe_tp: int = 1, a2a_mode: str = "auto",
                 cuda_graph_max_bs: int = 512, kernels_per_layer: float | None = None,
                 kernel_build: str = "unfused", engine: str = "vllm") -> None:
        self.model = model
        self.cluster = cluster
        self.gpu: GPUSpec = cluster.gpu
        self.cfg = cfg or CostConfig()
        self.tp = attention_tp
        self.moe_tp = moe_tp
        self.kv_dtype = kv_dtype
        self.profile = profile
        self.a2a_mode = a2a_mode
        self.cuda_graph_max_bs = cuda_graph_max_bs
        # kernels one decoder layer runs back to back in this engine build (fusions change it); the
        # per-kernel gap and launch constants stay global
        self.kernels_per_layer = self.cfg.kernels_per_layer if kernels_per_layer is None else float(kernels_per_layer)
        if self.kernels_per_layer < 0:
            raise InputError(f"kernels per layer must be >= 0, got {kernels_per_layer}")
        if kernel_build not in KERNEL_BUILDS:
            raise InputError(f"kernel build '{kernel_build}' unknown (expected one of {sorted(KERNEL_BUILDS)})")
        self.kernel_build = kernel_build
        if cluster.num_gpus % moe_tp:
            raise InputError(f"--moe-tp {moe_tp} does not divide the pool's {cluster.num_gpus} GPUs")
        c = self.cfg
        g = self.gpu
        self.hbm_bw = g.hbm_bw * c.hbm_efficiency
        s = c.sustained_efficiency
        self.peak_trunk = self.gemm_flops(model.weight_dtype) * c.gemm_efficiency * s
        self.peak_expert = self.gemm_flops(model.expert_dtype) * c.gemm_efficiency * s
        # attention cores compute in the attention dtype (BF16 or FP8), whatever format the weights are in
        self.peak_other = g.flops(attention_dtype) * c.flops_efficiency * s
        self.peak_kda = g.flops(attention_dtype) * c.kda_flops_efficiency * s
        self.peak_attn_dec = g.flops(attention_dtype) * c.mla_decode_flops_efficiency * s
        self.hbm_attn_dec = g.hbm_bw * c.mla_decode_hbm_efficiency
        self.peak_attn_pre = g.flops(attention_dtype) * c.prefill_attention_efficiency * s
        self.nvlink_bw = g.nvlink_bw * c.link_efficiency
        self.nic_bw = g.nic_bw * c.nic_efficiency
        self.ll_nic_bw = g.nic_bw * c.ll_efficiency
        self.__dict__.update(_layout(model, cluster, attention_tp, self.kernels_per_layer, kernel_build, engine))

    # ------------------------------------------------------------------ GEMMs
    @classmethod
    def for_engine(cls, model: ModelSpec, cluster: ClusterSpec, cfg: CostConfig | None, engine: EngineConfig,
                   profile: Profile | None = None) -> CostModel:
        """The cost model of one engine configuration (its parallelism, dtypes, kernels and graphs)."""
        return cls(model, cluster, cfg, profile=profile, **cls.engine_kwargs(engine))

    @staticmethod
    def engine_kwargs(e: EngineConfig) -> dict:
        """The constructor's keywords an engine configuration sets (one list for every cost model)."""
        return {"attention_tp": e.attention_tp, "kv_dtype": e.kv_dtype, "attention_dtype": e.attention_dtype,
                "moe_tp": e.moe_tp, "a2a_mode": e.a2a_mode, "cuda_graph_max_bs": e.cuda_graph_max_bs,
                "kernels_per_layer": e.kernels_per_layer, "kernel_build": e.kernel_build, "engine": e.replica_rule}

    def gemm_time(self, flops_per_row, rows, groups, bytes_, peak: float, kernels: int = 1):
        """``kernels`` GEMM kernels over ``rows`` rows split into ``groups`` weight matrices (arrays of any
        shape): ``max((rows + m0 groups) * flops_per_row / peak, bytes / hbm_bw) + kernels * t_kernel``
        when there is work, else 0. ``peak`` already carries the GEMM efficiency."""
        c = self.cfg
        rows = np.asarray(rows, dtype=np.float64)
        groups = np.asarray(groups, dtype=np.float64)
        compute = (rows + c.gemm_m0 * groups) * flops_per_row / peak
        t = np.maximum(compute, np.asarray(bytes_, dtype=np.float64) / self.hbm_bw)
        return np.where(rows > 0, t + kernels * c.gemm_kernel_s, 0.0)

    # ------------------------------------------------------------------ routed experts
    @property
    def expert_flops_per_token(self) -> float:
        """Gated MLP of one expert for one token: gate+up (2 x h x i) and down (i x h), 2 FLOPs each."""
        m = self.model
        return 2.0 * 3 * m.expert_hidden_size * m.moe_intermediate_size

    @property
    def expert_act_bytes_per_token(self) -> float:
        """Activations one token moves through one expert: input and output rows (h) plus the gate/up
        outputs written and read back (3 x i), at the activation dtype."""
        m = self.model
        return self.cfg.activation_bytes * (2 * m.expert_hidden_size + 3 * m.moe_intermediate_size)

    def expert_time(self, tokens, touched, shard: int = 1):
        """Expert GEMM time of a GPU serving ``tokens`` selections spread over ``touched`` local experts
        (arrays of any shape), each expert's weights split ``shard`` ways (TEP). Two grouped GEMMs
        (gate+up, down) on the GEMM curve: FLOPs of the tokens vs weight bytes of the touched experts
        plus activations. With a profile: ``touched * t(tokens / touched)``, FLOP-scaled to this shape."""
        tokens = np.asarray(tokens, dtype=np.float64)
        touched = np.asarray(touched, dtype=np.float64)
        if self.profile is not None and self.profile.has("expert_gemm"):
            curve = self.profile.ops["expert_gemm"]
            m = self.model
            scale = (m.expert_hidden_size * m.moe_intermediate_size
                     / (curve.meta.get("hidden", m.expert_hidden_size)
                        * curve.meta.get("intermediate", m.moe_intermediate_size))) / shard
            per = np.divide(tokens, touched, out=np.zeros_like(tokens), where=touched > 0)
            return np.where(touched > 0, touched * curve(np.maximum(per, 1e-9)) * scale, 0.0)
        bytes_ = (touched * self.model.bytes_per_routed_expert + tokens * self.expert_act_bytes_per_token) / shard
        return self.gemm_time(self.expert_flops_per_token / shard, tokens, touched, bytes_, self.peak_expert,
                              kernels=2)

    # ------------------------------------------------------------------ all-to-all
    def allgather_bytes(self) -> float:
        """Bytes of one token in TensorRT-LLM's MoE all-gather under attention DP: NVFP4-quantized
        before the gather for NVFP4 experts (``h x 4.5 / 8``), BF16 for DeepSeek FP8 block-scale experts
        (``2 h``: the MoE op quantizes after the gather), else FP8 + scales as a dispatch copy."""
        dt = self.model.expert_dtype
        if dt == "nvfp4":
            return self.model.expert_hidden_size * DTYPE_BYTES["nvfp4"]
        if dt == "fp8_block128":
            return self.model.expert_hidden_size * 2.0
        return self.copy_bytes("dispatch")

    def copy_bytes(self, op: str) -> float:
        """Bytes of one token copy in ``dispatch`` (FP8 + scales) or ``combine`` (BF16), at the width
        the routed experts run at (LatentMoE projects before dispatch)."""
        per = self.cfg.dispatch_bytes_per_value if op == "dispatch" else self.cfg.combine_bytes_per_value
        return self.model.expert_hidden_size * per

    def a2a_time(self, nvlink_copies, nic_copies, op: str = "dispatch", mode: str = "low_latency",
                 link_share=None):
        """One EP rank's share of an all-to-all moving ``nvlink_copies`` / ``nic_copies`` token copies
        (arrays of any shape); the two links work in parallel, each pays its latency when used.

        ``low_latency``: one message per selected expert straight to its GPU (``ll_per_copy`` messages per
        copy; DeepEP low-latency kernels: own fixed time and achieved RDMA share). ``normal``: one RDMA copy per destination node (``nic x node_dedup``)
        which the receiver forwards over NVLink, after a CPU-side layout notify.
        With a profile for ``op``: the measured time of the bytes (``link`` nvlink / nic / any).

        ``link_share``: ``(nvlink, nic)`` factors ``>= 1`` broadcastable to the copies (per GPU ``[G]``):
        how much longer each link takes to move the same bytes because other traffic (an asynchronous
        weight transfer, :class:`sim.rebalance.Transfer`) shares it; the latency terms are not stretched."""
        c = self.cfg
        g = self.gpu
        b = self.copy_bytes(op)
        nv = np.asarray(nvlink_copies, dtype=np.float64) * b
        nic = np.asarray(nic_copies, dtype=np.float64) * b
        # normal mode: the receiver forwards what arrived over its NIC to its node's GPUs on NVLink
        fwd = nic * (1 - 1 / self.cluster.gpus_per_node)
        if link_share is not None:
            # bytes at a share of a link's bandwidth take as long as proportionally more bytes at all of it
            f_nv, f_nic = (np.asarray(f, dtype=np.float64) for f in link_share)
            nv, fwd, nic = nv * f_nv, fwd * f_nv, nic * f_nic
        if mode == "normal":
            t_nv = np.where(nv + fwd > 0, g.nvlink_latency + c.normal_latency_s + (nv + fwd) / self.nvlink_bw, 0.0)
            t_nic = np.where(nic > 0, g.nic_latency + c.normal_latency_s + nic * self.node_dedup / self.nic_bw, 0.0)
        else:
            f = self.ll_per_copy
            t_nv = np.where(nv > 0, g.nvlink_latency + c.ll_latency_s + nv * f / self.nvlink_bw, 0.0)
            t_nic = np.where(nic > 0, g.nic_latency + c.ll_latency_s + nic * f / self.ll_nic_bw, 0.0)
        if self.profile is not None and self.profile.has(op):
            curve = self.profile.ops[op]
            link = curve.meta.get("link", "any")
            if link == "any":
                tot = nv + nic
                return np.where(tot > 0, curve(np.maximum(tot, 1.0)), 0.0)
            if link == "nvlink":
                t_nv = np.where(nv > 0, curve(np.maximum(nv, 1.0)), 0.0)
            else:
                t_nic = np.where(nic > 0, curve(np.maximum(nic, 1.0)), 0.0)
        return np.maximum(t_nv, t_nic)

    def allreduce_time(self, tokens):
        """One TP all-reduce of ``tokens`` BF16 hidden rows per rank ``[D]`` across the ``attention_tp``
        GPUs of a rank: the measured time of that message (:func:`collective_time`; with
        ``collective_table`` 0, the roofline ``alpha + 2 (n - 1) / n * bytes / nvlink_bw``); 0 without TP."""
        if self.tp <= 1:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        bytes_ = np.asarray(tokens, dtype=np.float64) * self.model.hidden_size * 2.0
        n = self.tp
        if self.cfg.collective_table:
            return collective_time("all_reduce", bytes_, n, self.gpu.nvlink_bw)
        return np.where(bytes_ > 0, self.cfg.allreduce_latency_s + 2 * (n - 1) / n * bytes_ / self.nvlink_bw, 0.0)

    # ------------------------------------------------------------------ attention and trunk (per rank)
    def _projections(self, kind: str, w: RankWork, kernels: int):
        p = self._att_params[kind]
        return self.gemm_time(2.0 * p / self.tp, w.tokens, 1.0, np.where(w.tokens > 0, p * self.wbytes / self.tp, 0.0),
                              self.peak_trunk, kernels)

    def mla_time(self, w: RankWork):
        """One MLA layer on each rank ``[D]``. Projections: 2 x params FLOPs per token, weights read once
        (GEMM curve). Decode core in the absorbed form (per key 2H(2 kv_lora + rope) FLOPs, the latent
        cache read once per sequence) at FlashMLA's rates; prefill core in the expanded form (per (query,
        key) pair 2H(qk_nope + rope + v)) at the prefill-attention share of peak."""
        return self._projections("mla", w, 4) + self.mla_core(w)

    def mla_core(self, w: RankWork):
        """:meth:`mla_time` without its projections: the attention core alone ``[D]``."""
        c = self.model.mla
        tp = self.tp
        kv_tok = (c.kv_lora_rank + c.qk_rope_head_dim) * KV_DTYPE_BYTES[self.kv_dtype]
        dec_pair = 2.0 * c.num_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim) / tp
        pre_pair = 2.0 * c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / tp
        dec = roofline(w.dec_ctx * dec_pair, w.dec_ctx * kv_tok, self.peak_attn_dec, self.hbm_attn_dec)
        pre = roofline(w.pre_pairs * pre_pair, w.pre_ctx * kv_tok, self.peak_attn_pre, self.hbm_bw)
        return dec + pre

    def kda_time(self, w: RankWork):
        """One KDA layer on each rank ``[D]``. Projections on the GEMM curve; per token the recurrent
        update + readout (3 products with the H x d x d state, 2 FLOPs each); prefill adds the intra-chunk
        attention (2 x 2 x H x d x chunk). The fp32 state (and conv state) is read and written once per
        decoding sequence per step, and once per prefill chunk."""
        return self._projections("kda", w, 4) + self.kda_core(w)

    def kda_core(self, w: RankWork):
        """:meth:`kda_time` without its projections: the recurrent core alone ``[D]``."""
        c = self.model.kda
        tp = self.tp
        hdd = c.num_heads * c.head_dim * c.head_dim / tp
        flops = (w.tokens * 3 * 2.0 * hdd + w.pre_tokens * 2 * 2.0 * c.num_heads * c.head_dim * KDA_CHUNK / tp)
        bytes_ = 2 * self._kda_state_layer * (w.dec_seqs + w.pre_seqs)
        return roofline(flops, bytes_, self.peak_kda, self.hbm_bw)

    def gqa_time(self, w: RankWork):
        """One GQA layer on each rank ``[D]``: projections plus 4 x heads x head_dim FLOPs per (query, key)
        pair; K and V read once per sequence."""
        c = self.model.gqa
        tp = self.tp
        kv_tok = self.model.kv_bytes_per_token(self.kv_dtype, tp) / max(1, len(self.model.layers_of("gqa")))
        pair = 4.0 * c.num_heads * c.head_dim / tp
        core = roofline((w.dec_ctx + w.pre_pairs) * pair, (w.dec_ctx + w.pre_ctx) * kv_tok, self.peak_other,
                        self.hbm_bw)
        return self._projections("gqa", w, 3) + core

    def attention_time(self, kind: str, w: RankWork):
        return {"mla": self.mla_time, "kda": self.kda_time, "gqa": self.gqa_time}[kind](w)

    @property
    def moe_trunk_params(self) -> float:
        """Dense parameters of one MoE layer besides attention: shared experts, router, latent
        down/up projections (LatentMoE)."""
        m = self.model
        latent = 2 * m.hidden_size * m.expert_hidden_size if m.expert_hidden_size != m.hidden_size else 0
        return (m.num_shared_experts * 3 * m.hidden_size * m.shared_intermediate_size
                + m.hidden_size * m.num_experts + latent)

    def trunk_time(self, w: RankWork, moe: bool):
        """The dense work of one layer besides attention, per rank ``[D]``: an MoE layer's shared
        experts + router + latent projections, or a dense layer's MLP; TP-split like attention."""
        m = self.model
        p = self.moe_trunk_params if moe else 3 * m.hidden_size * m.dense_intermediate_size
        return self.gemm_time(2.0 * p / self.tp, w.tokens, 1.0, np.where(w.tokens > 0, p * self.wbytes / self.tp, 0.0),
                              self.peak_trunk, 2)

    def lm_head_time(self, w: RankWork):
        """Logits for the sampled tokens, per rank ``[D]`` (vocab-parallel across the TP group)."""
        m = self.model
        p = m.vocab_size * m.hidden_size
        return self.gemm_time(2.0 * p / self.tp, w.sampled, 1.0, np.where(w.sampled > 0, p * self.wbytes / self.tp, 0.0),
                              self.peak_trunk, 1)

    # ------------------------------------------------------------------ one iteration
    def mode_of(self, w: RankWork) -> str:
        """DeepEP kernels of an iteration: the configured mode, or by phase (normal with prefill tokens)."""
        if self.a2a_mode in ("normal", "low_latency", "allgather"):
            return self.a2a_mode
        return "normal" if w.pre_tokens.any() else "low_latency"

    def expert_times(self, moe: MoeWork) -> np.ndarray:
        """Each GPU's routed-expert time per MoE layer ``[L, G]``. With TEP (``moe_tp`` t > 1) every GPU of
        a group of t serves the group's selections on 1/t of each expert."""
        if self.moe_tp == 1:
            return self.expert_time(moe.tokens, moe.touched)
        L, G = moe.tokens.shape
        t_ = self.moe_tp
        grp = (moe.tokens.reshape(L, G // t_, t_).sum(axis=2), moe.touched.reshape(L, G // t_, t_).sum(axis=2))
        return np.repeat(self.expert_time(*grp, shard=t_), t_, axis=1)

    def gemm_flops(self, dtype: str) -> float:
        """Tensor-core FLOP/s of a GEMM on ``dtype`` weights (``GPUSpec.flops``), except that FP4 formats on
        a GPU with FP4 tensor cores run at ``fp4_gemm_speedup`` times its FP8 rate, not at its FP4 peak (the
        published FP4 MoE and grouped GEMMs gain 12-15 % over FP8, :class:`CostConfig`)."""
        g = self.gpu
        f = g.flops(dtype)
        if dtype in FP4_FORMATS and g.flops_fp4:
            return min(f, g.flops_fp8 * self.cfg.fp4_gemm_speedup)
        return f

    def tep_copies(self, moe: MoeWork) -> tuple[np.ndarray, np.ndarray]:
        """Token copies each GPU receives (and sends back) in the all-to-all ``[L, G]`` by link: with TEP
        (``moe_tp`` t > 1) a copy bound for an expert goes to every GPU of its group of t (each holds 1/t
        of the expert and returns a partial output the combine sums), so each GPU of a group receives the
        group's copies, over the link kind of the placement's destination GPU."""
        if self.moe_tp == 1:
            return moe.nvlink, moe.nic
        L, G = moe.nvlink.shape
        t = self.moe_tp
        return tuple(np.repeat(x.reshape(L, G // t, t).sum(axis=2), t, axis=1) for x in (moe.nvlink, moe.nic))

    def layer_kernels(self, dual_batch_overlap: bool = False) -> np.ndarray:
        """Kernels each decoder layer runs ``[num_layers]``: its attention kind's, its MoE or dense
        block's and the two norms' in this build (:data:`KERNEL_BUILDS`; a KDA layer runs KDA's, not
        MLA's), or ``kernels_per_layer`` for every layer when set; two micro-batches run every kernel
        twice."""
        return self._layer_kernels * (2 if dual_batch_overlap else 1)

    def kernel_gap_s(self) -> float:
        """The device-side gap before each kernel: ``graph_gap_s``, less what programmatic dependent launch
        hides in a build that enables it (:data:`PDL_GAP_SAVING_S`)."""
        return max(self.cfg.graph_gap_s - PDL_GAP_SAVING_S.get(self.kernel_build, 0.0), 0.0)

    def kernel_gaps_s(self, dual_batch_overlap: bool = False) -> float:
        """Device-side gaps between the kernels of one decoder layer."""
        return self.layer_kernels(dual_batch_overlap) * self.kernel_gap_s()

    def moe_layer_times(self, moe: MoeWork, mode: str = "low_latency",
                        link_share=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per MoE layer ``[L]``: the slowest GPU's expert time, dispatch + combine time (slowest GPU each),
        and the straggler time: for each of the three phases, slowest GPU minus the mean GPU. With TEP
        (``moe_tp`` t > 1) every GPU of a group of t serves the group's selections on 1/t of each expert.
        ``link_share``: per-GPU link slow-down factors of the all-to-all (:meth:`a2a_time`)."""
        L, G = moe.tokens.shape
        t = self.expert_times(moe)
        experts = t.max(axis=1)
        strag = experts - t.sum(axis=1) / G
        if self.pure_tp:  # tokens are on every GPU already; the MoE output joins the TP all-reduce
            return experts, np.zeros(L), strag
        if mode == "allgather":
            # every EP rank gathers all ranks' tokens (FP8) and reduce-scatters the outputs (BF16): each GPU
            # receives the other ranks' share, (G - 1) / G of the pool's tokens, per direction
            pool = moe.tokens.sum(axis=1) / self.model.top_k  # [L] tokens of all ranks
            tok = pool * (G - 1) / G
            multi = self.cluster.num_nodes > 1
            slow = 1.0 if link_share is None else float(np.max(link_share[1 if multi else 0]))
            if self.cfg.collective_table and not multi:
                # one NVLink domain: the measured all-gather of the pool's tokens and reduce-scatter of the
                # outputs; the most slowed-down GPU sets the pace of a collective
                comm = (collective_time("all_gather", pool * self.allgather_bytes() * slow, G, self.gpu.nvlink_bw)
                        + collective_time("reduce_scatter", pool * self.copy_bytes("combine") * slow, G,
                                          self.gpu.nvlink_bw))
                return experts, comm, strag
            bw, lat = (self.nic_bw, self.gpu.nic_latency) if multi else (self.nvlink_bw, self.gpu.nvlink_latency)
            bw /= slow
            comm = np.where(tok > 0, 2 * lat + tok * (self.allgather_bytes() + self.copy_bytes("combine")) / bw, 0.0)
            return experts, comm, strag
        nv, nic = self.tep_copies(moe)
        d = self.a2a_time(nv, nic, "dispatch", mode, link_share)
        c = self.a2a_time(nv, nic, "combine", mode, link_share)
        comm = d.max(axis=1) + c.max(axis=1)
        straggler = strag + (comm - (d.sum(axis=1) + c.sum(axis=1)) / G)
        return experts, comm, straggler

    def _attention_layers(self, w: RankWork, parts: dict | None = None) -> np.ndarray:
        """Slowest rank's attention + trunk + TP all-reduces, per decoder layer ``[num_layers]``. ``parts``
        (a dict) receives the MLA/KDA cores (``"core"``) and one all-reduce (``"allreduce"``) per rank,
        which K3's kernel pricing reuses."""
        cores = {k: core(w) for k, core in (("mla", self.mla_core), ("kda", self.kda_core)) if self.kind_counts.get(k)}
        per_kind = {k: (self._projections(k, w, 4) + cores[k] if k in cores else self.attention_time(k, w))
                    for k, n in self.kind_counts.items() if n}
        one = self.allreduce_time(w.tokens)
        if parts is not None:
            parts.update(core=cores, allreduce=one)
        ar = 2 * one
        trunk = {True: self.trunk_time(w, True) + ar, False: self.trunk_time(w, False) + ar}
        # the slowest rank of a layer depends only on (attention kind, MoE or dense): once per key
        key_time = np.array([float(np.max(per_kind[k] + trunk[is_moe])) for k, is_moe in self._keys])
        return key_time[self._layer_key]

    def step_time(self, w: RankWork, moe: MoeWork, dual_batch_overlap: bool = False,
                  link_share=None) -> StepTime:
        """Time of one engine iteration (see the module docstring for the composition). ``link_share``:
        ``(nvlink, nic)`` per-GPU factors by which other traffic on the links stretches the all-to-all
        (:meth:`a2a_time`; ``None``: the links are the all-to-all's alone)."""
        c = self.cfg
        mode = self.mode_of(w)
        graph = bool(self.cuda_graph_max_bs and not w.pre_tokens.any()
                     and float(w.dec_seqs.max(initial=0.0)) <= self.cuda_graph_max_bs)
        parts: dict = {}
        attn = self._attention_layers(w, parts)  # [num_layers]
        experts, comm, straggler = self.moe_layer_times(moe, mode, link_share)
        layer = attn.copy()
        fill = 0.0
        if dual_batch_overlap:
            w2, moe2 = w.half(), moe.half()
            attn2 = self._attention_layers(w2)
            exp2, comm2, _ = self.moe_layer_times(moe2, mode, link_share)
            share = c.comm_sm_share if mode == "normal" else 0.0
            comp = 2 * (attn2[self._is_moe] + exp2) / (1 - share)
            com = 2 * comm2
            layer[self._is_moe] = np.maximum(comp, com)
            if self._is_moe.any():
                fill = float(np.mean(np.minimum(comp, com))) / 2
        else:
            layer[self._is_moe] += experts + comm
        kernels = self.layer_kernels(dual_batch_overlap)
        # a latency-bound layer (batch 1) takes at least its kernels x the kernel floor; K3's kernels are
        # priced one by one (each at least the floor)
        if self._k3 is not None and not dual_batch_overlap:
            layer = np.maximum(layer, self._k3.layer_floor(self, w, experts, comm, parts))
        else:
            layer = np.maximum(layer, kernels * c.kernel_floor_s)
        gpu_layer = layer
        # the device-side gap between dependent kernels is paid with or without a graph (a graph removes
        # the CPU launches, not the GPU's own kernel-to-kernel latency: RTP-LLM's DeepSeek report measures
        # ~2 ms of device launch overhead per step with C++ launches far ahead of the GPU); an eager layer
        # also cannot run faster than the CPU launches its kernels
        layer = layer + kernels * self.kernel_gap_s()
        if not graph:
            layer = np.maximum(layer, kernels * c.launch_s)
        head = float(np.max(self.lm_head_time(w))) if w.sampled.any() else 0.0
        overhead = float((layer - gpu_layer).sum()) + c.iteration_overhead_s
        total = float(layer.sum()) + head + fill + c.iteration_overhead_s
        return StepTime(total=total, attention=float(attn.sum()) + head, experts=float(experts.sum()),
                        comm=float(comm.sum()), straggler=straggler, layer=layer, mode=mode, graph=graph,
                        overhead=overhead)

    def draft_time(self, st: StepTime, w: RankWork, draft: int) -> float:
        """MTP / speculative drafting of ``draft`` tokens per sequence: each draft step runs one MTP module
        (one decoder layer with its MoE, DeepSeek-V3's MTP depth 1 chained) and the LM head at one token
        per sequence; costed as the iteration's mean MoE-layer time plus its head, per draft step (decode
        layers are weight- and latency-bound, so one token per sequence costs about what 1 + draft do)."""
        if draft <= 0 or not w.dec_seqs.any():
            return 0.0
        moe_layers = st.layer[self._is_moe] if self._is_moe.any() else st.layer
        head = float(np.max(self.lm_head_time(w)))
        # the small kernels MTP adds (:data:`MTP_KERNELS`) are latency-bound: each takes the kernel floor
        # plus its gap
        per_kernel = self.cfg.kernel_floor_s + self.kernel_gap_s()
        return (draft * (float(np.mean(moe_layers)) + head + MTP_KERNELS["draft"] * per_kernel)
                + MTP_KERNELS["step"] * per_kernel)

    # ------------------------------------------------------------------ memory movement
    def transfer_time(self, bytes_: float, same_node: bool = False) -> float:
        """Moving ``bytes_`` GPU to GPU (KV/state hand-off, expert weights): latency + bytes / link."""
        if bytes_ <= 0:
            return 0.0
        g = self.gpu
        if same_node:
            return g.nvlink_latency + bytes_ / self.nvlink_bw
        return g.nic_latency + bytes_ / self.nic_bw
