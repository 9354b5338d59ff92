"""Per-GPU bytes of the fixed components: weights by component (:func:`weight_lines`), activations
(:func:`activation_bytes`) and all-to-all buffers (:func:`a2a_buffer_bytes`). Each returns its bytes
with the formula that produced them, so a printed plan shows its arithmetic."""
from __future__ import annotations

from dataclasses import dataclass

from moeplace.foundation.memory.config import Layout, MemoryConfig
from moeplace.foundation.model import DTYPE_BYTES, ModelSpec

ACT_BYTES = 2.0  # activations are BF16
LOGIT_BYTES = 4.0  # logits are computed in fp32 for sampling


def attention_split(model: ModelSpec, kind: str) -> tuple[int, int]:
    """``(replicated, head_sharded)`` parameters of one attention block of ``kind``; they sum to
    ``model.attention_params(kind)``. The replicated part is what runs before the head split."""
    h = model.hidden_size
    total = model.attention_params(kind)
    if kind == "mla":
        c = model.mla
        replicated = h * (c.q_lora_rank or 0) + h * (c.kv_lora_rank + c.qk_rope_head_dim)
        if not c.q_lora_rank:
            replicated = h * (c.kv_lora_rank + c.qk_rope_head_dim)
    elif kind == "kda":
        c = model.kda
        replicated = h * c.head_dim * (1 if c.full_rank_gate else 2)  # f_a (and g_a) low-rank downs
    else:
        replicated = 0
    return replicated, total - replicated


def attention_params_per_gpu(model: ModelSpec, tp: int) -> float:
    """Attention parameters one GPU of an attention-TP group of ``tp`` holds (all layers)."""
    total = 0.0
    for kind in set(model.attention):
        n = len(model.layers_of(kind))
        if kind == "gqa":
            c, h = model.gqa, model.hidden_size
            q_o = 2 * h * c.num_heads * c.head_dim / tp
            kv = 2 * h * c.head_dim * max(1.0, c.num_kv_heads / tp)  # never below one KV head per GPU
            total += n * (q_o + kv)
        else:
            rep, shard = attention_split(model, kind)
            total += n * (rep + shard / tp)
    return total


@dataclass(frozen=True)
class MemoryLine:
    """One line of the per-GPU breakdown: ``bytes`` on each GPU and how it was computed."""

    section: str  # "weights" | "runtime" | "cache"
    name: str
    bytes: float
    how: str


def weight_lines(model: ModelSpec, lay: Layout) -> list[MemoryLine]:
    """Per-GPU weight bytes by component (see :mod:`foundation.memory` for the sharding conventions)."""
    b = model.param_breakdown()
    wb = DTYPE_BYTES[model.weight_dtype]
    eb = model.bytes_per_routed_expert
    L = len(model.model_moe_layers)  # weights: every MoE layer, held in a trace or not
    E, R = model.num_experts, lay.num_redundant
    out = []
    per_gpu = E / lay.ep / lay.moe_tp
    out.append(MemoryLine("weights", "routed experts", per_gpu * L * eb,
                          f"{E}/EP{lay.ep}" + (f"/MoE-TP{lay.moe_tp}" if lay.moe_tp > 1 else "")
                          + f" = {per_gpu:g} experts/layer x {L} layers x {eb / 1e6:.2f} MB ({model.expert_dtype})"))
    if R:
        per_gpu_r = R / lay.ep / lay.moe_tp
        out.append(MemoryLine("weights", "redundant replicas", per_gpu_r * L * eb,
                              f"{R}/EP{lay.ep}" + (f"/MoE-TP{lay.moe_tp}" if lay.moe_tp > 1 else "")
                              + f" = {per_gpu_r:g} extra slots/layer x {L} layers x {eb / 1e6:.2f} MB"))
    if b["shared_experts"]:
        out.append(MemoryLine("weights", "shared experts", b["shared_experts"] * wb / lay.dense_tp,
                              f"{b['shared_experts'] / 1e9:.2f} B params / dense-TP{lay.dense_tp} ({model.weight_dtype})"))
    if b["latent_projections"]:
        out.append(MemoryLine("weights", "latent projections", b["latent_projections"] * wb / lay.dense_tp,
                              f"{b['latent_projections'] / 1e9:.2f} B params / dense-TP{lay.dense_tp}"))
    out.append(MemoryLine("weights", "routers", b["routers"] * wb,
                          f"{b['routers'] / 1e9:.3f} B params, replicated"))
    att = attention_params_per_gpu(model, lay.tp)
    kinds = "+".join(f"{len(model.layers_of(k))} {k.upper()}" for k in ("mla", "kda", "gqa") if model.layers_of(k))
    out.append(MemoryLine("weights", "attention", att * wb,
                          f"{kinds} layers: {b['attention'] / 1e9:.2f} B params, head-split / TP{lay.tp}, "
                          f"down-projections replicated -> {att / 1e9:.3f} B/GPU"))
    if b["dense_mlp"]:
        out.append(MemoryLine("weights", "dense MLP layers", b["dense_mlp"] * wb / lay.dense_tp,
                              f"{len(model.dense_layers)} layers, {b['dense_mlp'] / 1e9:.2f} B params / "
                              f"dense-TP{lay.dense_tp}"))
    out.append(MemoryLine("weights", "embeddings + LM head", b["embeddings"] * wb / lay.tp,
                          f"{b['embeddings'] / 1e9:.2f} B params, vocab-parallel / TP{lay.tp}"))
    if b["vision"]:
        out.append(MemoryLine("weights", "vision tower", b["vision"] * wb,
                              f"{b['vision'] / 1e9:.2f} B params, data-parallel (replicated)"))
    return out


# ---------------------------------------------------------------------------- runtime reserve
def activation_bytes(model: ModelSpec, lay: Layout, config: MemoryConfig) -> tuple[float, str]:
    """Peak activation bytes per GPU for a forward of ``T = max_batched_tokens`` tokens per DP rank.

    ``residual (3 T h) + max(attention, dense MLP, MoE block) + logits``, BF16, where
      attention = T x heads/TP x widths of q, k, v, out (MLA: 2 (nope+rope) + 2 v; KDA: 6 head_dim for
                  q, k, v, gate, decay, out; GQA: (q + out) + 2 KV heads) plus MLA's low-rank latents;
      dense MLP = 3 T i_dense / dense-TP (gate, up, activated);
      MoE block = shared 3 T n_shared i_shared / dense-TP + latent 2 T h_e
                  + routed C (2 h_e + 3 i_moe / MoE-TP), with C = peak x dp T top_k / EP token copies
                  arriving on the hottest GPU;
      logits    = min(max_num_seqs, T) x vocab / TP, fp32.
    Returns ``(bytes, formula text)``.
    """
    T, h, A = config.max_batched_tokens, model.hidden_size, ACT_BYTES
    residual = 3 * T * h * A
    attn = 0.0
    if model.mla is not None and model.layers_of("mla"):
        c = model.mla
        heads = c.num_heads / lay.tp
        attn = max(attn, T * (heads * (2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim)
                              + (c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim) * A)
    if model.kda is not None and model.layers_of("kda"):
        c = model.kda
        attn = max(attn, T * c.num_heads / lay.tp * c.head_dim * 6 * A)
    if model.gqa is not None and model.layers_of("gqa"):
        c = model.gqa
        attn = max(attn, T * (2 * c.num_heads / lay.tp + 2 * max(1.0, c.num_kv_heads / lay.tp)) * c.head_dim * A)
    dense = 3 * T * model.dense_intermediate_size / lay.dense_tp * A if model.dense_layers else 0.0
    he = model.expert_hidden_size
    copies = config.moe_peak_factor * lay.dp * T * model.top_k / lay.ep
    routed = copies * (2 * he + 3 * model.moe_intermediate_size / lay.moe_tp) * A
    shared = 3 * T * model.num_shared_experts * model.shared_intermediate_size / lay.dense_tp * A
    latent = 2 * T * he * A if he != h else 0.0
    moe = routed + shared + latent
    logits = min(config.max_num_seqs, T) * model.vocab_size / lay.tp * LOGIT_BYTES
    total = residual + max(attn, dense, moe) + logits
    how = (f"T={T}/DP rank: residual {residual / 1e9:.2f} + max(attention {attn / 1e9:.2f}, dense MLP "
           f"{dense / 1e9:.2f}, MoE {moe / 1e9:.2f} [{copies:.0f} routed copies]) + logits {logits / 1e9:.2f} GB")
    return total, how


def deepep_low_latency_bytes(num_slots: int, hidden: int, max_tokens: int) -> float:
    """DeepEP's low-latency buffer (``LowLatencyLayout``): odd/even send, receive and signalling buffers.

    dispatch message = 16 + max(2 h, h + 4 h/128) bytes (BF16 or FP8 + scales, plus an int4 header),
    combine message = 2 h; send = max(T msg_d, P T msg_c), receive = P T max(msg_d, msg_c), both double
    buffered, signalling 4 P bytes each. ``P`` = physical experts, ``T`` = max dispatch tokens per rank.
    """
    msg_d = 16 + max(2 * hidden, hidden + 4 * (hidden // 128))
    msg_c = 2 * hidden
    send = max(max_tokens * msg_d, num_slots * max_tokens * msg_c)
    recv = num_slots * max_tokens * max(msg_d, msg_c)
    signal = 4 * num_slots
    return 2 * (send + recv + signal)


def a2a_buffer_bytes(model: ModelSpec, lay: Layout, config: MemoryConfig) -> tuple[float, str]:
    """All-to-all buffers per GPU (zero when EP is 1).

    normal mode (prefill): peak x dp T min(top_k, EP) / EP tokens received per GPU (a token is sent once
    per destination rank), each h_e wide, BF16 dispatch + BF16 combine: ``x 4 h_e`` bytes;
    low-latency mode (decode): :func:`deepep_low_latency_bytes` with ``P = E + R`` and
    ``T = ll_max_dispatch_tokens``. h_e is the width tokens travel at (LatentMoE: the expert width).
    """
    if lay.ep == 1:
        return 0.0, "EP1: no expert all-to-all"
    he = model.expert_hidden_size
    recv = config.moe_peak_factor * lay.dp * config.max_batched_tokens * min(model.top_k, lay.ep) / lay.ep
    normal = recv * he * 2 * ACT_BYTES
    ll = deepep_low_latency_bytes(lay.num_slots, he, config.ll_max_dispatch_tokens)
    how = (f"normal {recv:.0f} tok x {he} x 4 B = {normal / 1e9:.2f} GB + DeepEP low-latency "
           f"{lay.num_slots} experts x {config.ll_max_dispatch_tokens} tok = {ll / 1e9:.2f} GB")
    return normal + ll, how
