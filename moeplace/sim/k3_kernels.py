"""Kimi K3's decode step priced through the kernels its engines launch, layer by layer.

The generic step model (sim.cost) floors a small-batch layer at ``kernels x kernel_floor`` with kernel
counts per layer kind (sim.cost.KERNEL_BUILDS); for K3 that is ~2,825 kernels at a fitted floor, and no
hardware term binds. Here each kernel K3's engines run is listed from their code, and priced on its own:
a GEMM at its roofline (its weights read from HBM, its FLOPs; the cost model's GEMM curve), the attention
cores at theirs, the routed experts and their dispatch / combine at the cost model's expert and
all-to-all times, a TP all-reduce at its measured time, and every kernel at least the latency-bound
``kernel_floor``; kernels on a second CUDA stream overlap the main one (the longer branch counts). A
layer then takes at least the sum along its critical path, and the kernels along it pay the device gap.
Nothing here was set from a published K3 serving figure.

Sources (decode step, CUDA graph, no speculative decoding), read in the released wheels:

- vLLM 0.34.0, ``vllm/models/kimi_k3/nvidia/`` (the NVIDIA path; ``decode_backend`` "auto", i.e. not the
  opt-in ``latency_specialized`` CuTe executor):
  - ``model.py`` ``KimiDecoderLayer``: K3's attention residuals (``attn_res_block_size`` 12 in its config)
    replace the two RMSNorms: ``_pre_attn_norm`` / ``_post_attn_norm`` each launch ``ops/attn_res.py``'s
    one Triton kernel.
  - ``kda.py`` ``KimiK3DeltaAttention.forward``: the q/k/v/g projection on the main stream while the aux
    stream runs the f_a/beta projection then f_b (``low_latency_gemm.py`` ``run_kda_projection_overlap``);
    ``_forward``: the native fused KDA decode (``ops.fused_kda_decode``: short conv, gate, beta, recurrence,
    gated RMSNorm in one kernel; SM90 / SM100 / SM120); ``o_proj``.
  - ``mla.py`` ``MultiHeadLatentAttention``: the fused q/kv-a projection on the main stream while the aux
    stream runs the output-gate projection (below 512 tokens); ``fused_q_kv_rmsnorm``; ``q_b_proj``; the
    ``W_UK`` BMM; ``_decode_concat_cache`` (query concat + latent cache insert, one launch);
    ``impl.forward_mqa`` (the decode attention); the ``W_UV`` BMM; ``_gate_sigmoid_mul`` (one compiled
    kernel); ``o_proj``.
  - ``model.py`` ``KimiMoE`` with ``--moe-backend deep_gemm_mega_moe`` (DEP: expert parallel, attention DP):
    the router GEMM then ``fused_grouped_topk`` on the main stream while the aux stream runs the LatentMoE
    down projection (7,168 -> 3,584); ``vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py``:
    ``prepare_megamoe_inputs`` (one Triton kernel) and the MegaMoE kernel (dispatch + grouped GEMMs +
    combine fused); the shared experts (``KimiMLP``: gate_up GEMM, SiTU-and-mul, down GEMM); the routed
    output's RMSNorm (``latent_moe_use_norm``) and the up projection (3,584 -> 7,168) with the shared
    output added in its epilogue (``KimiRoutedOutputTransform``: one ``addmm_``).
  - TP (attention TP > 1, no MegaMoE): ``latent_moe_runner.py`` ``LatentMoERunner``: the router GEMM and the
    down projection overlapped as above; the routed experts through FlashInfer's TRT-LLM-Gen MXFP4 MoE
    (``vllm/model_executor/layers/fused_moe/experts/trtllm_mxfp4_moe.py`` ``TrtLlmMxfp4ExpertsMonolithic``:
    ``flashinfer.trtllm_fp4_block_scale_moe``; routing, FC1, FC2; the finalize deferred into the tail); the shared experts; the small-batch tail
    (``_small_batch_tail``: the CuTe DSL operator that all-reduces, normalises and up-projects in one op);
    the attention's ``o_proj`` all-reduce.
- SGLang 0.5.23, ``sglang/srt/models/kimi_k3.py`` (TP16 / EP16 on H200 is its K3 cookbook deployment):
  ``KimiK3DeltaAttention.forward_qkvbfg_fused`` (the fused q/k/v/g GEMM on the main stream, the b/f_a GEMM
  then f_b on the alt stream), ``layers/attention/linear/kda_backend.py`` ``forward_decode`` (the fused KDA
  decode ``kda_fused_decode``, gated norm folded in), ``o_proj``; ``KimiK3MoE._forward_fused`` (one front
  GEMM for shared gate_up + router + latent down, the routed experts, the shared activation + down GEMM
  + low-SM all-reduce on the alt stream, ``finalize_all_reduce_push_norm``, ``gemm_ag_up_proj``); the
  layer boundaries' attention-residual ops (``attn_boundary`` / ``ffn_boundary``); MLA as
  ``DeepseekV2AttentionMLA`` (the vLLM list above, kernel for kernel).
- FlashKDA / fla: the fused decode is one kernel in both engines; prefill (chunked KDA) is not priced here
  (this floor applies to decode-only iterations; prefill layers are far above it).

Counts per decoder layer along the critical path (main stream, or the longer branch), decode; "+1" is
a TP all-reduce, only with attention TP > 1:

========================  ====  ====  =====  =====
build                     KDA   MLA   MoE    dense
========================  ====  ====  =====  =====
vllm-dep (MegaMoE)          4     9     9      3
vllm-tp (TRT-LLM-Gen)       4     9    8+1    3+1
sglang                      4     9     6     3+1
========================  ====  ====  =====  =====

plus 2 attention-residual kernels per layer and, with attention TP > 1, the all-reduce after attention.
Against the generic counts (KDA 18, MLA 12, MoE 12, dense 5, norms 2): K3's engines run fused kernels
the generic list does not know. Where a fused operator's internal launches are not in the wheel (FlashInfer's
TRT-LLM-Gen MoE, SGLang's routed-expert runner) it counts as the kernels named above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VLLM = "vllm/models/kimi_k3/nvidia/"
SGL = "sglang/srt/models/kimi_k3.py"


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: ``op`` gemm (reads weight ``weight``, :func:`weights`) | small (latency-bound:
    norms, top-k, elementwise, staging) | core (an attention core: ``weight`` names mla or kda) | experts
    (the routed experts; ``share`` of the layer's expert time) | fused_moe (experts + dispatch + combine in
    one kernel) | allreduce (a TP all-reduce of the hidden rows) ; ``when``: ``tp`` (only with attention TP
    > 1) or None; ``source``: where the engine launches it."""

    name: str
    op: str
    source: str
    weight: str | None = None
    share: float = 1.0
    when: str | None = None


def K(name, op, source, weight=None, share=1.0, when=None) -> Kernel:
    return Kernel(name, op, source, weight, share, when)


def par(main: list[Kernel], aux: list[Kernel]) -> tuple[list[Kernel], list[Kernel]]:
    """Two branches on two CUDA streams between a fork and a join."""
    return (main, aux)


_RES = [K("attn_res (pre-attention)", "small", VLLM + "ops/attn_res.py"),
        K("attn_res (post-attention)", "small", VLLM + "ops/attn_res.py")]
_KDA = [par([K("q/k/v/g projection", "gemm", VLLM + "low_latency_gemm.py", "kda_qkvg")],
            [K("f_a/beta projection", "gemm", VLLM + "low_latency_gemm.py", "kda_fab"),
             K("f_b projection", "gemm", VLLM + "low_latency_gemm.py", "kda_fb")]),
        K("fused KDA decode (conv, gate, recurrence, gated norm)", "core", VLLM + "kda.py", "kda"),
        K("o_proj", "gemm", VLLM + "kda.py", "kda_o")]
_MLA = [par([K("fused q/kv-a projection", "gemm", VLLM + "mla.py", "mla_qkv_a")],
            [K("output-gate projection", "gemm", VLLM + "mla.py", "mla_gate")]),
        K("fused q/kv RMSNorm", "small", VLLM + "mla.py"),
        K("q_b_proj", "gemm", VLLM + "mla.py", "mla_q_b"),
        K("W_UK BMM", "gemm", VLLM + "mla.py", "mla_uk"),
        K("query concat + latent cache insert", "small", VLLM + "ops/fused_mla_key_concat_kv_cache.py"),
        K("decode attention (forward_mqa)", "core", VLLM + "mla.py", "mla"),
        K("W_UV BMM", "gemm", VLLM + "mla.py", "mla_uv"),
        K("sigmoid output gate", "small", VLLM + "mla.py"),
        K("o_proj", "gemm", VLLM + "mla.py", "mla_o")]
_TP_AR = [K("o_proj all-reduce", "allreduce", "vllm/distributed (tensor_model_parallel_all_reduce)", when="tp")]
_SHARED = [K("shared gate_up", "gemm", VLLM + "model.py", "shared_gate_up"),
           K("SiTU-and-mul", "small", VLLM + "model.py"),
           K("shared down", "gemm", VLLM + "model.py", "shared_down")]
_ROUTER = par([K("router GEMM (fp32 logits)", "gemm", VLLM + "model.py", "router"),
               K("fused_grouped_topk", "small", VLLM + "model.py")],
              [K("LatentMoE down projection", "gemm", VLLM + "model.py", "latent_down")])
_MOE_DEP = [_ROUTER,
            K("prepare_megamoe_inputs", "small", "vllm/model_executor/layers/fused_moe/prepare_megamoe.py"),
            K("MegaMoE (dispatch + grouped GEMMs + combine)", "fused_moe",
              "vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py"),
            *_SHARED,
            K("routed-output RMSNorm", "small", VLLM + "model.py"),
            K("up projection + shared add (addmm_)", "gemm", VLLM + "model.py", "latent_up")]
# K3's MXFP4 experts under TP: TrtLlmMxfp4ExpertsMonolithic, i.e. flashinfer.trtllm_fp4_block_scale_moe, its
# finalize deferred into the latent tail (latent_moe_runner.py)
_TRTLLM_GEN = "vllm/model_executor/layers/fused_moe/experts/trtllm_mxfp4_moe.py"
_MOE_TP = [par([K("router GEMM (fp32 logits)", "gemm", VLLM + "model.py", "router")],
               [K("LatentMoE down projection", "gemm", VLLM + "model.py", "latent_down")]),
           K("TRT-LLM-Gen routing", "small", _TRTLLM_GEN),
           K("TRT-LLM-Gen FC1 (gate/up)", "experts", _TRTLLM_GEN, share=2 / 3),
           K("TRT-LLM-Gen FC2 (down)", "experts", _TRTLLM_GEN, share=1 / 3),
           *_SHARED,
           K("latent tail: all-reduce + RMSNorm + up projection + add", "gemm", VLLM + "latent_moe_runner.py",
             "latent_up"),
           K("latent tail all-reduce", "allreduce", VLLM + "ops/cute_dsl/latent_moe_tail/", when="tp")]
_MOE_SGL = [K("front GEMM (shared gate_up + router + latent down)", "gemm", SGL + " KimiK3MoE._forward_fused",
              "moe_front"),
            par([K("top-k", "small", SGL), K("routed FC1", "experts", SGL, share=2 / 3),
                 K("routed FC2", "experts", SGL, share=1 / 3)],
                [K("shared activation", "small", SGL), K("shared down", "gemm", SGL, "shared_down"),
                 K("shared all-reduce (low SM)", "allreduce", SGL + " k3_ar_fusion", when="tp")]),
            K("finalize + all-reduce + RMSNorm", "allreduce", SGL + " k3_ar_fusion.finalize_all_reduce_push_norm",
              when="tp"),
            K("finalize + RMSNorm", "small", SGL, when="dp"),
            K("up projection with all-gather + add", "gemm", SGL + " k3_ar_fusion.gemm_ag_up_proj", "latent_up")]
_DENSE = [K("dense gate_up", "gemm", VLLM + "model.py", "dense_gate_up"), K("SiTU-and-mul", "small", VLLM + "model.py"),
          K("dense down", "gemm", VLLM + "model.py", "dense_down"),
          K("dense down all-reduce", "allreduce", "vllm/distributed", when="tp")]

BUILDS = {
    "vllm-dep": {"kda": _KDA, "mla": _MLA, "moe": _MOE_DEP, "mlp": _DENSE, "res": _RES, "attn_ar": _TP_AR},
    "vllm-tp": {"kda": _KDA, "mla": _MLA, "moe": _MOE_TP, "mlp": _DENSE, "res": _RES, "attn_ar": _TP_AR},
    "sglang": {"kda": _KDA, "mla": _MLA, "moe": _MOE_SGL, "mlp": _DENSE, "res": _RES, "attn_ar": _TP_AR},
}


def is_k3(model) -> bool:
    """K3's layer structure: KDA + MLA hybrid attention with LatentMoE (routed experts narrower than the
    residual), as its config (``kimi_k3``) and the preset have it."""
    return (model.hf_model_type in ("kimi_k3", "kimi_linear") and model.kda is not None and model.mla is not None
            and model.expert_hidden_size != model.hidden_size)


def build_of(engine: str, attention_tp: int) -> str:
    """The kernel list of an engine and layout: SGLang's, or vLLM's MegaMoE (attention DP) / TP path."""
    if engine == "sglang":
        return "sglang"
    return "vllm-dep" if attention_tp == 1 else "vllm-tp"


def weights(model) -> dict[str, tuple[float, bool]]:
    """Parameters each GEMM reads, full size, and whether the attention TP group splits them."""
    h = model.hidden_size
    k, m = model.kda, model.mla
    hd = k.num_heads * k.head_dim
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    lat = model.expert_hidden_size
    sh = model.num_shared_experts * model.shared_intermediate_size
    return {
        "kda_qkvg": (4.0 * h * hd, True), "kda_fab": (h * (k.head_dim + k.num_heads), True),
        "kda_fb": (float(k.head_dim * hd), True), "kda_o": (float(hd * h), True),
        "mla_qkv_a": (h * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim), False),
        "mla_gate": (float(h * m.num_heads * m.v_head_dim), True),
        "mla_q_b": (float(m.q_lora_rank * m.num_heads * qk), True),
        "mla_uk": (float(m.num_heads * m.qk_nope_head_dim * m.kv_lora_rank), True),
        "mla_uv": (float(m.num_heads * m.kv_lora_rank * m.v_head_dim), True),
        "mla_o": (float(m.num_heads * m.v_head_dim * h), True),
        "router": (float(h * model.num_experts), False), "latent_down": (float(h * lat), False),
        "latent_up": (float(lat * h), False),
        "shared_gate_up": (2.0 * h * sh, True), "shared_down": (float(sh * h), True),
        "moe_front": (2.0 * h * sh + h * model.num_experts + h * lat, True),
        "dense_gate_up": (2.0 * h * model.dense_intermediate_size, True),
        "dense_down": (float(model.dense_intermediate_size * h), True),
    }


class K3Kernels:
    """K3's per-layer kernel lists under one build, priced by a cost model (module docstring)."""

    def __init__(self, model, build: str, attention_tp: int) -> None:
        self.model, self.build, self.tp = model, build, attention_tp
        self.lists = BUILDS[build]
        self.params = weights(model)
        self._att = np.array(model.attention)
        # every GEMM's parameters per GPU (split by the attention TP group where the engine splits them),
        # priced in one call per iteration
        self._weight_names = sorted(self.params)
        self._gemm_params = np.array([self.params[n][0] / (attention_tp if self.params[n][1] else 1)
                                      for n in self._weight_names])
        moe = set(model.moe_layers)
        keys = dict.fromkeys((kind, i in moe) for i, kind in enumerate(model.attention))
        self._plans = {key: self._plan(*key) for key in keys}
        # per key: its layers, and (MoE keys) their index among the MoE layers
        is_moe = np.array([i in moe for i in range(model.num_layers)])
        moe_i = np.cumsum(is_moe) - 1
        self._layers = {key: np.flatnonzero((self._att == key[0]) & (is_moe == key[1])) for key in keys}
        self._moe_rows = {key: moe_i[idx] for key, idx in self._layers.items()}

    def _active(self, k: Kernel) -> bool:
        return k.when is None or (k.when == "tp") == (self.tp > 1)

    def layer_list(self, kind: str, moe: bool) -> list:
        b = self.lists
        return [*b["res"], *b[kind], *b["attn_ar"], *b["moe" if moe else "mlp"]]

    def _count(self, steps) -> int:
        n = 0
        for s in steps:
            if isinstance(s, tuple):
                n += max(self._count(s[0]), self._count(s[1]))
            elif self._active(s):
                n += 1
        return n

    def counts(self, attention: list[str], is_moe: np.ndarray) -> np.ndarray:
        """Kernels along each decoder layer's critical path ``[num_layers]``."""
        memo = {}
        out = []
        for kind, moe in zip(attention, is_moe):
            key = (kind, bool(moe))
            if key not in memo:
                memo[key] = self._count(self.layer_list(kind, bool(moe)))
            out.append(memo[key])
        return np.array(out, dtype=np.float64)

    def _plan(self, kind: str, moe: bool) -> dict:
        """A layer's active kernels in one flat order with what prices each, and the critical path as
        masks over them: ``seq`` (kernels on the one stream) and ``par`` (per fork, the main and the aux
        branch)."""
        kernels, seq, par = [], [], []
        for step in self.layer_list(kind, moe):
            if isinstance(step, tuple):
                branches = []
                for branch in step:
                    if any(isinstance(k, tuple) for k in branch):
                        raise ValueError("nested forks are not supported")
                    idx = []
                    for k in branch:
                        if self._active(k):
                            idx.append(len(kernels))
                            kernels.append(k)
                    branches.append(idx)
                par.append(branches)
            elif self._active(step):
                seq.append(len(kernels))
                kernels.append(step)
        n = len(kernels)

        def mask(idx):
            m = np.zeros(n)
            m[idx] = 1.0
            return m

        gemm = [i for i, k in enumerate(kernels) if k.op == "gemm"]
        # the critical path as one matrix over the kernels: row 0 the sequential ones, then per fork its
        # main and its aux branch
        path = np.array([mask(seq), *[mask(b) for m_a in par for b in m_a]])
        return {"n": n, "path": path, "forks": len(par),
                "gemm": np.array(gemm, dtype=int),
                "gemm_src": np.array([self._weight_names.index(kernels[i].weight) for i in gemm], dtype=int),
                "core": [(i, k.weight) for i, k in enumerate(kernels) if k.op == "core"],
                "allreduce": np.array([i for i, k in enumerate(kernels) if k.op == "allreduce"], dtype=int),
                "experts": np.array([i for i, k in enumerate(kernels) if k.op == "experts"], dtype=int),
                "shares": np.array([k.share for k in kernels if k.op == "experts"], dtype=np.float64),
                "fused": np.array([i for i, k in enumerate(kernels) if k.op == "fused_moe"], dtype=int)}

    def layer_floor(self, cost, w, experts: np.ndarray, comm: np.ndarray, parts: dict | None = None) -> np.ndarray:
        """Each decoder layer's time priced kernel by kernel along its critical path, the slowest rank's
        ``[num_layers]``; ``experts`` / ``comm``: the cost model's routed-expert and dispatch + combine times
        per MoE layer (slowest GPU). Per (attention kind, MoE or dense): every kernel's time ``[kernels,
        layers, ranks]`` at once, at least the floor, then the sequential kernels summed and each fork's
        longer branch added. ``parts``: the attention cores and all-reduce the step already priced
        (``cost._attention_layers``), else priced here."""
        tok = np.asarray(w.tokens, dtype=np.float64)
        active = tok > 0
        floor = cost.cfg.kernel_floor_s
        if parts is None:
            parts = {}
            cost._attention_layers(w, parts)
        core, ar = parts["core"], parts["allreduce"]
        p = self._gemm_params[:, None]
        gemms = cost.gemm_time(2.0 * p, tok[None, :], 1.0, np.where(active, p * cost.wbytes, 0.0), cost.peak_trunk, 1)
        out = np.zeros(self.model.num_layers)
        for (kind, moe), plan in self._plans.items():
            idx = self._layers[(kind, moe)]
            n, D = idx.size, tok.size
            t = np.zeros((plan["n"], n, D))
            if plan["gemm"].size:
                t[plan["gemm"]] = gemms[plan["gemm_src"]][:, None, :]
            for i, name in plan["core"]:
                t[i] = core[name]
            if plan["allreduce"].size:
                t[plan["allreduce"]] = ar
            if moe:
                rows_moe = self._moe_rows[(kind, moe)]
                e = np.asarray(experts, dtype=np.float64)[rows_moe][:, None]
                c = np.asarray(comm, dtype=np.float64)[rows_moe][:, None]
                if plan["experts"].size:
                    t[plan["experts"]] = plan["shares"][:, None, None] * e[None]
                if plan["fused"].size:
                    t[plan["fused"]] = (e + c)[None]
            t = np.where(active, np.maximum(t, floor), 0.0)
            rows = (plan["path"] @ t.reshape(plan["n"], -1)).reshape(-1, n, D)
            total = rows[0] + np.maximum(rows[1::2], rows[2::2]).sum(axis=0) if plan["forks"] else rows[0]
            out[idx] = total.max(axis=1)
        return out

    def table(self) -> list[dict]:
        """Every kernel of the build's layer kinds, for docs and ``--json`` (name, op, source, stream)."""
        rows = []
        for part in ("res", "kda", "mla", "attn_ar", "moe", "mlp"):
            for s in self.lists[part]:
                branches = [("main", s[0]), ("aux", s[1])] if isinstance(s, tuple) else [("main", [s])]
                for stream, ks in branches:
                    for k in ks:
                        rows.append({"part": part, "name": k.name, "op": k.op, "stream": stream, "when": k.when,
                                     "source": k.source})
        return rows
