"""The cost model: a roofline per operation, corrected by a calibration profile when one is given.

Every formula is written once here and tested on hand-computed cases (tests/test_sim_cost.py). Times
are seconds; FLOPs count a multiply-add as 2. A roofline op takes ``max(flops / (peak * eff),
bytes / (hbm_bw * eff))`` at the compute format of its weights (MXFP4 experts run on FP4 tensor cores
where the GPU has them, else at the FP8 rate; GPUSpec.flops decides).

One engine iteration (:func:`CostModel.step_time`) is, layer by layer (every attention-DP rank and every
EP rank meet at each MoE layer's all-to-all, so each layer takes its slowest rank's time)::

    layer l = max_r [attention_r(kind_l) + trunk_r]               (attention + shared experts etc.)
            + max_g dispatch_g + max_g experts_g + max_g combine_g  (MoE layers only)

with dual-batch overlap replacing ``C + M`` (compute, communication) by ``max(C, M) + min(C, M) / 2``
(two micro-batches: one's all-to-all hides under the other's compute, except one pipeline fill).
The *straggler time* of a layer is, summed over its three phases (dispatch, experts, combine),
``max_g t_g - mean_g t_g``: what the slowest EP rank costs every other rank at that layer, against a
perfectly balanced layer with the same total work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from foundation.cluster import ClusterSpec, GPUSpec
from foundation.model import DTYPE_BYTES, KV_DTYPE_BYTES, ModelSpec
from sim.calibration import Profile
from sim.config import CostConfig

KDA_CHUNK = 64  # chunk length of KDA's chunked (WY) prefill algorithm


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


@dataclass
class MoeWork:
    """Per MoE layer and EP rank (GPU), float64 ``[L, G]``: ``tokens`` (token-expert selections served),
    ``touched`` (distinct local experts with >= 1 token: their weights are read), ``nvlink`` / ``nic``
    (token copies received over each link kind; combine sends the same copies back)."""

    tokens: np.ndarray
    touched: np.ndarray
    nvlink: np.ndarray
    nic: np.ndarray


@dataclass
class StepTime:
    total: float
    attention: float  # attention + trunk over all layers (+ LM head)
    experts: float  # sum over MoE layers of the slowest GPU's expert time
    comm: float  # sum over MoE layers of dispatch + combine
    straggler: np.ndarray  # [L] per MoE layer: sum over dispatch/experts/combine of max - mean GPU time
    layer: np.ndarray  # [num_layers] time of each decoder layer


class CostModel:
    """Roofline costs of one model on one GPU kind (shared state: derived constants; no I/O)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cfg: CostConfig | None = None,
                 attention_tp: int = 1, kv_dtype: str = "bf16", profile: Profile | None = None) -> None:
        self.model = model
        self.cluster = cluster
        self.gpu: GPUSpec = cluster.gpu
        self.cfg = cfg or CostConfig()
        self.tp = attention_tp
        self.kv_dtype = kv_dtype
        self.profile = profile
        c = self.cfg
        g = self.gpu
        self.hbm_bw = g.hbm_bw * c.hbm_efficiency
        self.peak_trunk = g.flops(model.weight_dtype) * c.flops_efficiency
        self.peak_expert = g.flops(model.expert_dtype) * c.flops_efficiency
        self.nvlink_bw = g.nvlink_bw * c.link_efficiency
        self.nic_bw = g.nic_bw * c.link_efficiency
        self.wbytes = DTYPE_BYTES[model.weight_dtype]
        self.kind_counts = {k: len(model.layers_of(k)) for k in ("mla", "kda", "gqa")}
        # Per-kind constants, computed once (the formulas below use them per iteration).
        self._att_params = {k: model.attention_params(k) for k, n in self.kind_counts.items() if n}
        self._kda_state_layer = (model.state_bytes_per_sequence(attention_tp) / self.kind_counts["kda"]
                                 if self.kind_counts["kda"] else 0.0)
        # Layer layout for step_time: each layer's (attention kind, MoE?) key and MoE-layer flag.
        moe = set(model.moe_layers)
        self._keys = sorted({(k, i in moe) for i, k in enumerate(model.attention)})
        self._layer_key = np.array([self._keys.index((k, i in moe)) for i, k in enumerate(model.attention)])
        self._is_moe = np.array([i in moe for i in range(model.num_layers)])

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

    def expert_time(self, tokens, touched):
        """Expert GEMM time of a GPU serving ``tokens`` selections spread over ``touched`` local experts
        (arrays of any shape). Roofline: FLOPs of the tokens vs weight bytes of the touched experts plus
        activations. With a profile: ``touched * t(tokens / touched)``, FLOP-scaled to this shape."""
        tokens = np.asarray(tokens, dtype=np.float64)
        touched = np.asarray(touched, dtype=np.float64)
        if self.profile is not None and self.profile.has("expert_gemm"):
            curve = self.profile.ops["expert_gemm"]
            m = self.model
            scale = (m.expert_hidden_size * m.moe_intermediate_size
                     / (curve.meta.get("hidden", m.expert_hidden_size)
                        * curve.meta.get("intermediate", m.moe_intermediate_size)))
            per = np.divide(tokens, touched, out=np.zeros_like(tokens), where=touched > 0)
            return np.where(touched > 0, touched * curve(np.maximum(per, 1e-9)) * scale, 0.0)
        flops = tokens * self.expert_flops_per_token
        bytes_ = touched * self.model.bytes_per_routed_expert + tokens * self.expert_act_bytes_per_token
        return roofline(flops, bytes_, self.peak_expert, self.hbm_bw)

    # ------------------------------------------------------------------ all-to-all
    def copy_bytes(self, op: str) -> float:
        """Bytes of one token copy in ``dispatch`` (FP8 + scales) or ``combine`` (BF16), at the width
        the routed experts run at (LatentMoE projects before dispatch)."""
        per = self.cfg.dispatch_bytes_per_value if op == "dispatch" else self.cfg.combine_bytes_per_value
        return self.model.expert_hidden_size * per

    def a2a_time(self, nvlink_copies, nic_copies, op: str = "dispatch"):
        """One EP rank's share of an all-to-all moving ``nvlink_copies`` / ``nic_copies`` token copies
        (arrays of any shape): the two links work in parallel, each pays its latency when used.
        With a profile for ``op``: the measured time of the bytes (``link`` nvlink / nic / any)."""
        b = self.copy_bytes(op)
        nv = np.asarray(nvlink_copies, dtype=np.float64) * b
        nic = np.asarray(nic_copies, dtype=np.float64) * b
        g = self.gpu
        t_nv = np.where(nv > 0, g.nvlink_latency + nv / self.nvlink_bw, 0.0)
        t_nic = np.where(nic > 0, g.nic_latency + nic / self.nic_bw, 0.0)
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

    # ------------------------------------------------------------------ attention and trunk (per rank)
    def mla_time(self, w: RankWork):
        """One MLA layer on each rank ``[D]``. Projections: 2 x params FLOPs per token, weights read once.
        Decode uses the absorbed form (per key 2H(2 kv_lora + rope) FLOPs, the latent cache read once per
        sequence); prefill the expanded form (per (query, key) pair 2H(qk_nope + rope + v))."""
        c = self.model.mla
        tp = self.tp
        p = self._att_params["mla"]
        kv_tok = (c.kv_lora_rank + c.qk_rope_head_dim) * KV_DTYPE_BYTES[self.kv_dtype]
        dec_pair = 2.0 * c.num_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim) / tp
        pre_pair = 2.0 * c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / tp
        flops = w.tokens * 2.0 * p / tp + w.dec_ctx * dec_pair + w.pre_pairs * pre_pair
        bytes_ = np.where(w.tokens > 0, p * self.wbytes / tp, 0.0) + (w.dec_ctx + w.pre_ctx) * kv_tok
        return roofline(flops, bytes_, self.peak_trunk, self.hbm_bw)

    def kda_time(self, w: RankWork):
        """One KDA layer on each rank ``[D]``. Per token: projections (2 x params) and the recurrent
        update + readout (3 products with the H x d x d state, 2 FLOPs each); prefill adds the intra-chunk
        attention (2 x 2 x H x d x chunk). The fp32 state (and conv state) is read and written once per
        decoding sequence per step, and once per prefill chunk."""
        c = self.model.kda
        tp = self.tp
        p = self._att_params["kda"]
        hdd = c.num_heads * c.head_dim * c.head_dim / tp
        flops = (w.tokens * (2.0 * p / tp + 3 * 2.0 * hdd)
                 + w.pre_tokens * 2 * 2.0 * c.num_heads * c.head_dim * KDA_CHUNK / tp)
        state = self._kda_state_layer
        bytes_ = (np.where(w.tokens > 0, p * self.wbytes / tp, 0.0)
                  + 2 * state * (w.dec_seqs + w.pre_seqs))
        return roofline(flops, bytes_, self.peak_trunk, self.hbm_bw)

    def gqa_time(self, w: RankWork):
        """One GQA layer on each rank ``[D]``: projections plus 4 x heads x head_dim FLOPs per (query, key)
        pair; K and V read once per sequence."""
        c = self.model.gqa
        tp = self.tp
        p = self._att_params["gqa"]
        kv_tok = self.model.kv_bytes_per_token(self.kv_dtype, tp) / max(1, len(self.model.layers_of("gqa")))
        pair = 4.0 * c.num_heads * c.head_dim / tp
        flops = w.tokens * 2.0 * p / tp + (w.dec_ctx + w.pre_pairs) * pair
        bytes_ = np.where(w.tokens > 0, p * self.wbytes / tp, 0.0) + (w.dec_ctx + w.pre_ctx) * kv_tok
        return roofline(flops, bytes_, self.peak_trunk, self.hbm_bw)

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
        return roofline(w.tokens * 2.0 * p / self.tp, np.where(w.tokens > 0, p * self.wbytes / self.tp, 0.0),
                        self.peak_trunk, self.hbm_bw)

    def lm_head_time(self, w: RankWork):
        """Logits for the sampled tokens, per rank ``[D]`` (vocab-parallel across the TP group)."""
        m = self.model
        p = m.vocab_size * m.hidden_size
        return roofline(w.sampled * 2.0 * p / self.tp, np.where(w.sampled > 0, p * self.wbytes / self.tp, 0.0),
                        self.peak_trunk, self.hbm_bw)

    # ------------------------------------------------------------------ one iteration
    def moe_layer_times(self, moe: MoeWork) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per MoE layer ``[L]``: the slowest GPU's expert time, dispatch + combine time (slowest GPU each),
        and the straggler time: for each of the three phases, slowest GPU minus the mean GPU."""
        G = moe.tokens.shape[1]
        t = self.expert_time(moe.tokens, moe.touched)
        d = self.a2a_time(moe.nvlink, moe.nic, "dispatch")
        c = self.a2a_time(moe.nvlink, moe.nic, "combine")
        experts = t.max(axis=1)
        comm = d.max(axis=1) + c.max(axis=1)
        straggler = (experts - t.sum(axis=1) / G) + (comm - (d.sum(axis=1) + c.sum(axis=1)) / G)
        return experts, comm, straggler

    def step_time(self, w: RankWork, moe: MoeWork, dual_batch_overlap: bool = False) -> StepTime:
        """Time of one engine iteration (see the module docstring for the composition)."""
        per_kind = {k: self.attention_time(k, w) for k, n in self.kind_counts.items() if n}
        trunk = {True: self.trunk_time(w, True), False: self.trunk_time(w, False)}
        # the slowest rank of a layer depends only on (attention kind, MoE or dense): once per key
        key_time = np.array([float(np.max(per_kind[k] + trunk[is_moe])) for k, is_moe in self._keys])
        attn = key_time[self._layer_key]  # [num_layers]
        experts, comm, straggler = self.moe_layer_times(moe)
        layer = attn.copy()
        if dual_batch_overlap:
            c = attn[self._is_moe] + experts
            layer[self._is_moe] = np.maximum(c, comm) + np.minimum(c, comm) / 2
        else:
            layer[self._is_moe] += experts + comm
        head = float(np.max(self.lm_head_time(w))) if w.sampled.any() else 0.0
        return StepTime(total=float(layer.sum()) + head, attention=float(attn.sum()) + head,
                        experts=float(experts.sum()), comm=float(comm.sum()), straggler=straggler, layer=layer)

    # ------------------------------------------------------------------ memory movement
    def transfer_time(self, bytes_: float, same_node: bool = False) -> float:
        """Moving ``bytes_`` GPU to GPU (KV/state hand-off, expert weights): latency + bytes / link."""
        if bytes_ <= 0:
            return 0.0
        g = self.gpu
        if same_node:
            return g.nvlink_latency + bytes_ / self.nvlink_bw
        return g.nic_latency + bytes_ / self.nic_bw
