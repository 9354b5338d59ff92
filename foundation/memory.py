"""The memory model: does a parallel layout of a model fit a cluster, and how many sequences of which
length does it hold?

``plan_memory(model, cluster, config) -> MemoryPlan`` is a pure function of the model spec
(:class:`foundation.model.ModelSpec`), the cluster spec (:class:`foundation.cluster.ClusterSpec`) and a
:class:`PlanConfig`. There is no per-model code path: every number below is arithmetic on spec fields.

Conventions (one engine instance spans all ``W = cluster.num_gpus`` GPUs; SGLang's layout):

* **Attention** runs as ``dp`` data-parallel ranks of ``tp`` GPUs each (``tp * dp == W``; ``dp == 1`` is
  plain TP, ``tp == 1`` is SGLang ``--enable-dp-attention`` / vLLM DP with TP 1). Head-split projections
  are sharded ``/tp``; the low-rank down-projections that run before the head split (MLA ``q_a``,
  ``kv_a``; KDA ``f_a`` and, without a full-rank gate, ``g_a``) are replicated on every GPU, as the engines
  use ``ReplicatedLinear`` for them. GQA K/V projections shard down to one KV head per GPU and replicate
  beyond. So DP attention with TP 1 replicates all attention weights on every GPU.
* **Routed experts**: ``P = E + R`` physical slots per MoE layer, ``P / ep`` per EP rank; when
  ``ep < W`` each slot is further tensor-sharded over ``moe_tp = W / ep`` GPUs (SGLang
  ``moe_tp_size = tp_size / ep_size``). Bytes per GPU = ``P / W`` experts per layer at the expert dtype,
  listed as ``E / ep`` routed + ``R / ep`` redundant (the ``R/G`` extra slots per layer per GPU).
* **Shared experts, LatentMoE projections and the dense MLP layers** are sharded over ``dense_tp``
  (default: the attention TP). SGLang with DeepEP replicates shared experts: that is ``--dense-tp 1``.
  **Routers** are replicated (``ReplicatedLinear``). **Embeddings and LM head** are vocab-parallel over
  the attention TP. The **vision tower** runs data-parallel: replicated on every GPU.
* **Runtime reserve**: activations for ``max_batched_tokens`` tokens per DP rank (see
  :func:`activation_bytes`), all-to-all buffers (see :func:`a2a_buffer_bytes`: DeepEP normal mode for
  prefill plus the DeepEP low-latency layout for decode) and a fixed ``other_reserve_bytes`` for CUDA
  graphs / NCCL / allocator slack. The engine may use ``gpu_memory_utilization * HBM``; the rest is the
  CUDA context's and the fragmentation headroom, as in vLLM and SGLang ``--mem-fraction-static``.
* **Caches**: what is left per GPU holds the MLA KV cache and the per-sequence KDA state. The MLA latent
  is replicated on every attention-TP rank unless decode-context-parallel ``dcp`` shards each
  sequence's tokens over ``dcp`` ranks of the TP group (vLLM ``--decode-context-parallel-size``); KV is
  allocated in pages of ``page_size`` tokens. The KDA state (recurrent + short-conv) is fixed per
  sequence, divided by attention TP (heads split), never sharded by EP/DP/DCP; with prefix caching an
  engine keeps ``state_slots_per_seq`` state copies per request. Pools are per DP rank: every GPU of a
  DP rank holds its share of the same sequences, so concurrency per DP rank is a per-GPU computation and
  the total is ``dp`` times that.
* **Pool split** (``pool_split``): ``"shared"`` (vLLM hybrid allocator: one pool; each sequence takes its
  state and its pages from it, i.e. the state pool is sized for the concurrency the KV pool supports),
  ``"ratio"`` (SGLang ``--mamba-full-memory-ratio r``: the state pool gets ``r / (1 + r)`` of the free
  memory, KV the rest; default ``r = 0.9``) or ``"slots"`` (a fixed number of state slots per DP rank,
  SGLang ``--max-mamba-cache-size``; KV gets the rest).
* **Sizes**: token counts accept ``k = 2**10`` and ``M = 2**20`` suffixes (``1M`` = 1,048,576, K3's
  maximum context). Byte figures are printed in GB (1e9, how HBM is quoted) and per-token / per-sequence
  sizes in KiB / MiB (2**10 / 2**20).

The simulator uses the same model for admission control through :class:`CachePools`
(``cache_pools(model, cluster, config)`` or ``plan.pools``), one per attention-DP rank:
``kv_pool_bytes_per_gpu`` (KV pool bytes per GPU), ``state_slots`` (state slots per DP rank; ``None`` for a
shared pool), ``kv_token_capacity`` (per-GPU token slots of KV that fit), ``kv_tokens(n)`` (slots a
sequence of n tokens takes), ``seq_bytes(n)``, ``fits(used_kv_tokens, used_seqs)`` and
``can_admit(n, used_kv_tokens, used_seqs)`` (can a sequence of length n be admitted given current usage).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from foundation.cluster import ClusterSpec, make_cluster
from foundation.errors import InputError
from foundation.model import DTYPE_BYTES, KV_DTYPE_BYTES, ModelSpec, check_field_types

GiB = 2**30
MiB = 2**20
KiB = 2**10

ACT_BYTES = 2.0  # activations are BF16
LOGIT_BYTES = 4.0  # logits are computed in fp32 for sampling
POOL_SPLITS = ("shared", "ratio", "slots")


# ---------------------------------------------------------------------------- sizes
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str | int, what: str = "size") -> int:
    """``"128k"`` -> 131072, ``"1M"`` -> 1048576, ``"4096"`` -> 4096 (binary suffixes: K3's maximum
    context 1,048,576 is "1M")."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise InputError(f"{what} '{text}': expected a token count such as 4096, 128k or 1M")
        mult = {"": 1, "k": KiB, "m": MiB}[m.group(2).lower()]
        value = round(float(m.group(1)) * mult)
    if value < 1:
        raise InputError(f"{what} '{text}': must be at least 1 token")
    return value


def parse_context_mix(text: str, max_context: int | None = None,
                      what: str = "--context-mix") -> tuple[tuple[int, float], ...]:
    """``"8k:0.7,128k:0.25,1M:0.05"`` -> ``((8192, 0.7), (131072, 0.25), (1048576, 0.05))``.
    Weights are shares of sequences and must sum to 1 (within 1e-6); with ``max_context`` (the model's)
    no length may exceed it. The one check of a length mix for ``plan``, ``simulate`` and ``sweep``."""
    items = []
    for i, part in enumerate(str(text).split(",")):
        if ":" not in part:
            raise InputError(f"{what} item {i + 1} '{part.strip()}': expected LENGTH:SHARE, e.g. 128k:0.25")
        length, share = part.split(":", 1)
        n = parse_tokens(length, what=f"{what} item {i + 1} length")
        try:
            w = float(share)
        except ValueError:
            raise InputError(f"{what} item {i + 1} share '{share.strip()}': expected a number") from None
        if not (0 < w <= 1):
            raise InputError(f"{what} item {i + 1} share {w}: expected a share in (0, 1]")
        if max_context and n > max_context:
            raise InputError(f"{what} item {i + 1} length {format_tokens(n)} exceeds the model's maximum "
                             f"context {format_tokens(max_context)} ({max_context:,} tokens)")
        items.append((n, w))
    total = sum(w for _, w in items)
    if abs(total - 1.0) > 1e-6:
        raise InputError(f"{what} shares sum to {total:g}, expected 1")
    return tuple(items)


def format_tokens(n: int) -> str:
    """Inverse of :func:`parse_tokens` where exact (1048576 -> "1M", 131072 -> "128k")."""
    if n % MiB == 0:
        return f"{n // MiB}M"
    if n % KiB == 0:
        return f"{n // KiB}k"
    return str(n)


# ---------------------------------------------------------------------------- config
# How `place plan` spells the fields whose flag is not the field name (messages name the flag a user typed;
# fields without a flag, such as ll_max_dispatch_tokens, are named as they are).
PLAN_FLAGS = {"dcp": "--dcp", "max_batched_tokens": "--max-batched-tokens", "max_num_seqs": "--max-num-seqs",
              "state_slots_per_seq": "--state-slots", "page_size": "--page-size", "min_concurrency": "--min-seqs"}


@dataclass(frozen=True)
class PlanConfig:
    """A parallel layout and a serving configuration.

    ``tp``/``dp``/``ep``/``dense_tp`` left ``None`` are derived from the GPU count by
    :func:`resolve_layout` (``tp = W / dp``, or with neither given the largest divisor of ``W`` that
    divides the attention heads; ``dp = W / tp``; ``ep = W``; ``dense_tp = tp``).
    ``context``: the target length of one sequence (``None``: the model's maximum context).
    ``context_mix``: ``((length, share), ...)`` for the mixed-length concurrency figure.
    ``max_batched_tokens``: tokens per forward per DP rank (chunked-prefill size).
    ``max_num_seqs``: running-sequence cap per DP rank. ``state_slots_per_seq``: KDA state copies a
    request keeps (prefix caching keeps 3-5). ``pool_split``/``pool_param``: see the module docstring
    (``ratio``: r; ``slots``: slots per DP rank). ``ll_max_dispatch_tokens``: DeepEP low-latency tokens per
    rank. ``moe_peak_factor``: max/mean tokens per GPU the MoE buffers are sized for.
    ``min_concurrency``: total concurrent sequences at ``context`` needed to call it a fit.
    """

    tp: int | None = None
    dp: int | None = None
    ep: int | None = None
    dense_tp: int | None = None
    num_redundant: int = 0
    dcp: int = 1
    context: int | None = None
    context_mix: tuple[tuple[int, float], ...] | None = None
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    max_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    state_slots_per_seq: int = 1
    pool_split: str = "shared"
    pool_param: float | None = None
    page_size: int = 64
    ll_max_dispatch_tokens: int = 128
    moe_peak_factor: float = 2.0
    other_reserve_bytes: float = 1.0 * GiB
    min_concurrency: int = 1

    def __post_init__(self) -> None:
        check_field_types(self, "plan config", ranges=False)  # a plan report read back: no "1.5" GPUs
        for name in ("tp", "dp", "ep", "dense_tp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("dcp", "max_batched_tokens", "max_num_seqs", "state_slots_per_seq", "page_size",
                     "ll_max_dispatch_tokens", "min_concurrency"):
            if getattr(self, name) < 1:
                raise InputError(f"{PLAN_FLAGS.get(name, name)} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant < 0:
            raise InputError(f"--redundant must be >= 0, got {self.num_redundant}")
        if self.context is not None and self.context < 1:
            raise InputError(f"--context must be >= 1 token, got {self.context}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise InputError(f"--kv-dtype '{self.kv_dtype}' unknown (expected one of {sorted(KV_DTYPE_BYTES)})")
        if not (0 < self.gpu_memory_utilization <= 1):
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.pool_split not in POOL_SPLITS:
            raise InputError(f"--pool-split '{self.pool_split}' unknown (expected one of {POOL_SPLITS})")
        if self.pool_split == "ratio" and self.pool_param is not None and not self.pool_param > 0:
            raise InputError(f"--pool-split ratio:{self.pool_param}: the ratio must be > 0")
        if self.pool_split == "slots" and (self.pool_param is None or self.pool_param < 1
                                           or self.pool_param != int(self.pool_param)):
            raise InputError(f"--pool-split slots:N needs a whole number of slots >= 1, got {self.pool_param}")
        if self.moe_peak_factor < 1:
            raise InputError(f"moe_peak_factor must be >= 1 (max/mean), got {self.moe_peak_factor}")
        if self.other_reserve_bytes < 0:
            raise InputError(f"--other-reserve must be >= 0 GiB, got {self.other_reserve_bytes / GiB:g} GiB")


def parse_pool_split(text: str) -> tuple[str, float | None]:
    """``"shared"`` | ``"ratio"`` | ``"ratio:0.9"`` | ``"slots:64"`` -> ``(rule, param)``."""
    rule, _, param = str(text).partition(":")
    if rule not in POOL_SPLITS:
        raise InputError(f"--pool-split '{text}': expected shared, ratio[:R] or slots:N")
    if not param:
        return rule, None
    try:
        return rule, float(param)
    except ValueError:
        raise InputError(f"--pool-split '{text}': '{param}' is not a number") from None


@dataclass(frozen=True)
class Layout:
    """A resolved parallel layout on ``world`` GPUs: attention ``tp x dp``, MoE ``ep x moe_tp``."""

    world: int
    tp: int
    dp: int
    ep: int
    moe_tp: int
    dense_tp: int
    dcp: int
    num_redundant: int
    num_slots: int  # physical expert slots per MoE layer (E + R)

    def describe(self) -> str:
        moe = f"EP{self.ep}" + (f" x MoE-TP{self.moe_tp}" if self.moe_tp > 1 else "")
        dcp = f", DCP{self.dcp}" if self.dcp > 1 else ""
        return f"attention TP{self.tp} x DP{self.dp}{dcp}, MoE {moe}, dense TP{self.dense_tp}, R={self.num_redundant}"


def next_valid_redundant(num_experts: int, ep: int, at_least: int = 0) -> int:
    """Smallest ``R >= at_least`` with ``(num_experts + R) % ep == 0``."""
    return at_least + (-(num_experts + at_least)) % ep


def attention_heads(model: ModelSpec) -> set[int]:
    """Head counts attention TP must divide (query heads of every attention kind the model uses)."""
    return {getattr(model, kind).num_heads for kind in set(model.attention)}


def resolve_layout(model: ModelSpec, num_gpus: int, config: PlanConfig) -> Layout:
    """Fill in the derived parallel sizes and validate the layout (clear errors, exit code 2)."""
    W = num_gpus
    tp, dp = config.tp, config.dp
    heads = attention_heads(model)
    if tp is None and dp is None:
        # Plain TP over as many GPUs as the heads allow; DP attention over the rest.
        tp = max(t for t in range(1, W + 1) if W % t == 0 and all(h % t == 0 for h in heads))
        dp = W // tp
    elif tp is None:
        if W % dp:
            raise InputError(f"--dp {dp} does not divide {W} GPUs")
        tp = W // dp
    elif dp is None:
        if W % tp:
            raise InputError(f"--tp {tp} does not divide {W} GPUs")
        dp = W // tp
    if tp * dp != W:
        raise InputError(f"--tp {tp} x --dp {dp} = {tp * dp}, but attention TP x DP must equal the {W} GPUs")
    for h in heads:
        if h % tp:
            raise InputError(f"attention TP {tp} does not divide the {h} attention heads of '{model.name}' "
                             f"(choose --tp from {[t for t in range(1, h + 1) if h % t == 0 and W % t == 0]})")
    ep = config.ep or W
    if ep > W or W % ep:
        raise InputError(f"--ep {ep} must divide the {W} GPUs (EP x MoE-TP = GPUs)")
    E, R = model.num_experts, config.num_redundant
    if (E + R) % ep:
        raise InputError(f"{E} experts + {R} redundant = {E + R} slots per layer are not divisible by --ep {ep}; "
                         f"use --redundant {next_valid_redundant(E, ep, R)} (or another R with E+R a multiple "
                         f"of {ep})")
    dense_tp = config.dense_tp or tp
    if W % dense_tp:
        raise InputError(f"--dense-tp {dense_tp} must divide the {W} GPUs")
    if tp % config.dcp:
        raise InputError(f"--dcp {config.dcp} must divide the attention TP size {tp}")
    return Layout(world=W, tp=tp, dp=dp, ep=ep, moe_tp=W // ep, dense_tp=dense_tp, dcp=config.dcp,
                  num_redundant=R, num_slots=E + R)


# ---------------------------------------------------------------------------- weights
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
    """Per-GPU weight bytes by component (see the module docstring for the sharding conventions)."""
    b = model.param_breakdown()
    wb = DTYPE_BYTES[model.weight_dtype]
    eb = model.bytes_per_routed_expert
    L = model.num_moe_layers
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
def activation_bytes(model: ModelSpec, lay: Layout, config: PlanConfig) -> tuple[float, str]:
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


def a2a_buffer_bytes(model: ModelSpec, lay: Layout, config: PlanConfig) -> tuple[float, str]:
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


# ---------------------------------------------------------------------------- cache pools
@dataclass(frozen=True)
class CachePools:
    """The KV and state pools of one attention-DP rank, as seen on each of its GPUs.

    This is the admission-control model the simulator shares with the planner. Units: bytes per GPU;
    token counts are per-GPU page-rounded token slots (``kv_tokens(n)``).

    ``kv_bytes_per_token``: bytes one cached token takes on a GPU (MLA latent, replicated across TP);
    ``state_bytes_per_seq``: per-GPU state of one sequence (KDA state / TP x state slots per request);
    ``shared``: one pool of ``pool_bytes`` for both (vLLM) or two fixed pools (``kv_pool_bytes``,
    ``state_slots``; SGLang).
    """

    pool_bytes: float
    kv_pool_bytes: float
    state_pool_bytes: float
    kv_bytes_per_token: float
    state_bytes_per_seq: float
    shared: bool
    dcp: int
    page_size: int
    max_num_seqs: int
    max_model_len: int

    # -- the functions the simulator calls
    def kv_tokens(self, num_tokens: int) -> int:
        """Per-GPU token slots a sequence of ``num_tokens`` occupies: its tokens spread over ``dcp``
        ranks, rounded up to whole pages."""
        per_rank = -(-num_tokens // self.dcp)
        return -(-per_rank // self.page_size) * self.page_size

    @property
    def kv_pool_bytes_per_gpu(self) -> float:
        return self.kv_pool_bytes

    @property
    def state_slots(self) -> int | None:
        """Sequences the state pool holds per DP rank; ``None`` when the pool is shared."""
        if self.shared:
            return None
        if self.state_bytes_per_seq == 0:
            return self.max_num_seqs
        return int(self.state_pool_bytes // self.state_bytes_per_seq)

    @property
    def kv_token_capacity(self) -> int | None:
        """Per-GPU token slots the KV pool holds (``None`` when the pool is shared)."""
        if self.shared:
            return None
        if self.kv_bytes_per_token == 0:
            return 2**62
        return int(self.kv_pool_bytes // self.kv_bytes_per_token)

    def seq_bytes(self, num_tokens: int) -> float:
        """Per-GPU bytes one sequence of ``num_tokens`` takes (state + its KV pages)."""
        return self.state_bytes_per_seq + self.kv_tokens(num_tokens) * self.kv_bytes_per_token

    def fits(self, used_kv_tokens: int, used_seqs: int) -> bool:
        """Do ``used_seqs`` sequences holding ``used_kv_tokens`` per-GPU token slots (the sum of their
        ``kv_tokens``) fit the pools of one DP rank? (A simulator calls this as sequences grow, to decide
        on preemption.)"""
        if used_seqs > self.max_num_seqs:
            return False
        if self.shared:
            return used_seqs * self.state_bytes_per_seq + used_kv_tokens * self.kv_bytes_per_token <= self.pool_bytes
        return used_seqs <= self.state_slots and used_kv_tokens <= self.kv_token_capacity

    def can_admit(self, num_tokens: int, used_kv_tokens: int = 0, used_seqs: int = 0) -> bool:
        """Can one more sequence growing to ``num_tokens`` be admitted on a DP rank that already holds
        ``used_seqs`` sequences occupying ``used_kv_tokens`` per-GPU token slots (sum of ``kv_tokens``)?"""
        if num_tokens > self.max_model_len:
            return False
        return self.fits(used_kv_tokens + self.kv_tokens(num_tokens), used_seqs + 1)

    # -- concurrency
    def concurrency(self, mix: tuple[tuple[int, float], ...]) -> tuple[int, str]:
        """Sequences per DP rank at a length mix (shares of sequences; one length = ``((n, 1.0),)``), in
        steady state with every length present at its share. Returns ``(count, ceiling)`` with the
        ceiling ``"kv"``, ``"state"`` or ``"max_num_seqs"``."""
        longest = max(n for n, _ in mix)
        if longest > self.max_model_len:
            return 0, "max_model_len"
        if not self.fits(self.kv_tokens(longest), 1):  # the longest sequence must fit on its own
            alone_state = self.state_bytes_per_seq > (self.pool_bytes if self.shared else self.state_pool_bytes)
            return 0, "state" if alone_state else "kv"
        kv_tok = sum(w * self.kv_tokens(n) for n, w in mix)
        kv = kv_tok * self.kv_bytes_per_token
        if self.shared:
            per_seq = self.state_bytes_per_seq + kv
            count = int(self.pool_bytes // per_seq) if per_seq else self.max_num_seqs
            ceiling = "kv" if kv >= self.state_bytes_per_seq else "state"
        else:
            by_kv = int(self.kv_token_capacity // kv_tok) if kv_tok else 2**62
            by_state = self.state_slots
            count, ceiling = (by_kv, "kv") if by_kv <= by_state else (by_state, "state")
        if count > self.max_num_seqs:
            return self.max_num_seqs, "max_num_seqs"
        return count, ceiling

    def max_context(self) -> int:
        """The longest sequence one DP rank can hold alone (tokens; ignores the model's limit)."""
        room = (self.pool_bytes - self.state_bytes_per_seq) if self.shared else self.kv_pool_bytes
        if self.state_bytes_per_seq > (self.pool_bytes if self.shared else self.state_pool_bytes):
            return 0
        if self.kv_bytes_per_token == 0:
            return 2**62
        pages = int(max(room, 0) // (self.kv_bytes_per_token * self.page_size))
        return pages * self.page_size * self.dcp


def make_pools(model: ModelSpec, lay: Layout, config: PlanConfig, free_bytes: float) -> CachePools:
    """Split ``free_bytes`` per GPU between the KV pool and the state pool by ``config.pool_split``."""
    kvb = model.kv_bytes_per_token(config.kv_dtype, attention_tp=lay.tp)
    state = model.state_bytes_per_sequence(attention_tp=lay.tp) * config.state_slots_per_seq
    free = max(free_bytes, 0.0)
    if config.pool_split == "shared" or state == 0 or kvb == 0:
        # A model without state (or without KV) has one pool whatever the rule says.
        kv_part, state_part, shared = free, 0.0, True
    elif config.pool_split == "ratio":
        r = 0.9 if config.pool_param is None else config.pool_param
        state_part = free * r / (1 + r)
        kv_part, shared = free - state_part, False
    else:
        state_part = min(free, int(config.pool_param) * state)
        kv_part, shared = free - state_part, False
    return CachePools(pool_bytes=free, kv_pool_bytes=kv_part, state_pool_bytes=state_part, kv_bytes_per_token=kvb,
                      state_bytes_per_seq=state, shared=shared, dcp=lay.dcp, page_size=config.page_size,
                      max_num_seqs=config.max_num_seqs, max_model_len=model.max_context or 2**62)


def cache_pools(model: ModelSpec, cluster: ClusterSpec, config: PlanConfig) -> CachePools:
    """The cache pools of one DP rank under ``config`` (what a simulator admits sequences against)."""
    return plan_memory(model, cluster, config, suggest=False).pools


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Suggestion:
    """A change that makes a non-fitting plan fit, found by re-planning with the same model."""

    kind: str  # "fp8 KV" | "fewer redundant" | "larger EP" | "larger attention TP" | "more GPUs"
    change: str
    gpus: int
    config: PlanConfig
    concurrency: int


@dataclass(frozen=True)
class MemoryPlan:
    """The answer of :func:`plan_memory`: per-GPU lines, pools, concurrency and the verdict.

    Concurrency figures are totals over the ``dp`` DP ranks (``*_per_rank`` per DP rank)."""

    model_name: str
    cluster: ClusterSpec
    config: PlanConfig
    layout: Layout
    lines: tuple[MemoryLine, ...]
    hbm_bytes: float
    budget_bytes: float
    pools: CachePools
    context: int
    concurrency_per_rank: int
    concurrency_ceiling: str
    mix_concurrency_per_rank: int | None
    mix_ceiling: str | None
    max_context: int  # longest single sequence: the pool's limit capped at the model's maximum context
    pool_max_context: int  # what the pool alone would hold
    fits: bool
    reasons: tuple[str, ...]
    suggestions: tuple[Suggestion, ...] = ()

    def section_bytes(self, section: str) -> float:
        return sum(x.bytes for x in self.lines if x.section == section)

    @property
    def weight_bytes(self) -> float:
        return self.section_bytes("weights")

    @property
    def reserve_bytes(self) -> float:
        return self.section_bytes("runtime")

    @property
    def free_bytes(self) -> float:
        """Per-GPU bytes left for the caches (negative when weights and reserve do not fit)."""
        return self.budget_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def concurrency(self) -> int:
        return self.concurrency_per_rank * self.layout.dp

    @property
    def mix_concurrency(self) -> int | None:
        return None if self.mix_concurrency_per_rank is None else self.mix_concurrency_per_rank * self.layout.dp

    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg["context_mix"] = [list(x) for x in self.config.context_mix] if self.config.context_mix else None
        p = self.pools
        return {
            "model": self.model_name,
            "cluster": {**self.cluster.to_dict(), "num_gpus": self.cluster.num_gpus},
            "config": cfg,
            "layout": asdict(self.layout),
            "per_gpu": {
                "hbm_bytes": self.hbm_bytes,
                "budget_bytes": self.budget_bytes,
                "lines": [asdict(x) for x in self.lines],
                "weight_bytes": self.weight_bytes,
                "reserve_bytes": self.reserve_bytes,
                "free_bytes": self.free_bytes,
            },
            "pools": {**asdict(p), "state_slots": p.state_slots, "kv_token_capacity": p.kv_token_capacity},
            "context": self.context,
            "concurrency": self.concurrency,
            "concurrency_per_dp_rank": self.concurrency_per_rank,
            "concurrency_ceiling": self.concurrency_ceiling,
            "mix_concurrency": self.mix_concurrency,
            "mix_ceiling": self.mix_ceiling,
            "max_context": self.max_context,
            "pool_max_context": self.pool_max_context,
            "model_max_context": p.max_model_len,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "suggestions": [{"kind": s.kind, "change": s.change, "gpus": s.gpus, "concurrency": s.concurrency,
                             "tp": s.config.tp, "dp": s.config.dp, "ep": s.config.ep,
                             "num_redundant": s.config.num_redundant, "kv_dtype": s.config.kv_dtype}
                            for s in self.suggestions],
        }


def plan_memory(model: ModelSpec, cluster: ClusterSpec, config: PlanConfig, *, suggest: bool = True) -> MemoryPlan:
    """Plan the memory of ``model`` served on ``cluster`` with ``config``; see the module docstring.

    A plan fits when the weights and runtime reserve fit the usable memory of every GPU and at least
    ``config.min_concurrency`` sequences of ``context`` tokens (and, if given, of the mix) fit the
    pools. When it does not fit and ``suggest`` is set, :func:`suggest_changes` searches the smallest
    change that makes it fit.
    """
    lay = resolve_layout(model, cluster.num_gpus, config)
    context = config.context or model.max_context
    if not context:
        raise InputError(f"model '{model.name}'{' (' + model.source + ')' if model.source else ''} has no maximum context in its spec: give --context")
    hbm = cluster.gpu.hbm_bytes
    budget = config.gpu_memory_utilization * hbm
    lines = weight_lines(model, lay)
    act, act_how = activation_bytes(model, lay, config)
    a2a, a2a_how = a2a_buffer_bytes(model, lay, config)
    lines += [MemoryLine("runtime", "activations", act, act_how),
              MemoryLine("runtime", "all-to-all buffers", a2a, a2a_how),
              MemoryLine("runtime", "CUDA graphs / NCCL / slack", config.other_reserve_bytes,
                         "fixed reserve (--other-reserve)")]
    used = sum(x.bytes for x in lines)
    pools = make_pools(model, lay, config, budget - used)
    kvb, st = pools.kv_bytes_per_token, pools.state_bytes_per_seq
    if lay.dcp > 1:
        dcp_note = f", tokens sharded over DCP{lay.dcp}"
    elif lay.tp > 1:
        dcp_note = f", KV heads split over TP{lay.tp}" if model.gqa else f", replicated on TP{lay.tp}"
    else:
        dcp_note = ""
    split = {"shared": "one shared pool (vLLM hybrid allocator)" if st and kvb else "one pool",
             "ratio": f"SGLang ratio {0.9 if config.pool_param is None else config.pool_param:g}",
             "slots": f"{int(config.pool_param or 0)} state slots/DP rank"}["shared" if pools.shared else config.pool_split]
    # The "dcp" note: MLA latents are replicated on every attention-TP rank unless DCP shards the tokens.
    kv_name = "MLA KV" if model.mla else "KV"
    state_name = "KDA state" if model.kda else "state"
    kv_how = f"{kvb / KiB:.2f} KiB/token ({config.kv_dtype}{dcp_note})"
    slots = f"{config.state_slots_per_seq} slot{'s' if config.state_slots_per_seq > 1 else ''}"
    st_how = f"{st / MiB:.1f} MiB/sequence (state / TP{lay.tp} x {slots})"
    if pools.shared and not st:
        lines.append(MemoryLine("cache", f"{kv_name} pool", pools.pool_bytes, f"{kv_how}; no per-sequence state"))
    elif pools.shared and not kvb:
        lines.append(MemoryLine("cache", f"{state_name} pool", pools.pool_bytes, f"{st_how}; no per-token KV"))
    elif pools.shared:
        lines.append(MemoryLine("cache", f"{kv_name} + {state_name} pool", pools.pool_bytes,
                                f"{split}: {kv_how} + {st_how}"))
    else:
        lines += [MemoryLine("cache", f"{kv_name} pool", pools.kv_pool_bytes, f"{kv_how}; {split}"),
                  MemoryLine("cache", f"{state_name} pool", pools.state_pool_bytes, st_how)]
    n_ctx, ceiling = pools.concurrency(((context, 1.0),))
    n_mix = mix_ceiling = None
    if config.context_mix:
        n_mix, mix_ceiling = pools.concurrency(config.context_mix)
    if used > budget:  # nothing is left for the caches: the weights are the ceiling
        ceiling = mix_ceiling = "weights"
        if not config.context_mix:
            mix_ceiling = None
    pool_ctx = pools.max_context()
    max_ctx = min(pool_ctx, pools.max_model_len)

    reasons = []
    total_weights = model.checkpoint_bytes + (lay.num_redundant * model.num_moe_layers * model.bytes_per_routed_expert)
    if total_weights > cluster.num_gpus * hbm:
        reasons.append(f"the model's weights ({total_weights / 1e12:.2f} TB) exceed the HBM of {cluster.num_gpus} x "
                       f"{hbm / 1e9:.0f} GB = {cluster.num_gpus * hbm / 1e12:.2f} TB")
    weights = sum(x.bytes for x in lines if x.section == "weights")
    if used > budget:
        reasons.append(f"weights {weights / 1e9:.1f} GB + runtime reserve {(used - weights) / 1e9:.1f} GB per GPU "
                       f"exceed the usable {budget / 1e9:.1f} GB ({config.gpu_memory_utilization:g} x "
                       f"{hbm / 1e9:.0f} GB)")
    elif context > pools.max_model_len:
        reasons.append(f"--context {context:,} exceeds the model's maximum context {pools.max_model_len:,}")
    elif n_ctx * lay.dp < config.min_concurrency:
        if n_ctx == 0:
            reasons.append(f"one {format_tokens(context)}-token sequence needs {pools.seq_bytes(context) / 1e9:.1f} GB "
                           f"per GPU of KV + state, but only {pools.pool_bytes / 1e9:.1f} GB is free for caches "
                           f"(largest context: {max_ctx:,} tokens)")
        else:
            reasons.append(f"only {n_ctx * lay.dp} sequences of {format_tokens(context)} tokens fit, "
                           f"{config.min_concurrency} required")
    if config.context_mix and used <= budget and (n_mix or 0) * lay.dp < config.min_concurrency:
        longest = max(n for n, _ in config.context_mix)
        if longest > max_ctx:
            reasons.append(f"the mix's longest length {format_tokens(longest)} does not fit one DP rank (largest "
                           f"context: {max_ctx:,} tokens)")
        else:
            reasons.append(f"the context mix admits {(n_mix or 0) * lay.dp} sequences, "
                           f"{config.min_concurrency} required")
    plan = MemoryPlan(model_name=model.name, cluster=cluster, config=config, layout=lay, lines=tuple(lines),
                      hbm_bytes=hbm, budget_bytes=budget, pools=pools, context=context,
                      concurrency_per_rank=n_ctx, concurrency_ceiling=ceiling,
                      mix_concurrency_per_rank=n_mix, mix_ceiling=mix_ceiling, max_context=max_ctx, pool_max_context=pool_ctx,
                      fits=not reasons, reasons=tuple(reasons))
    if not plan.fits and suggest:
        plan = replace(plan, suggestions=tuple(suggest_changes(model, cluster, config)))
    return plan


# ---------------------------------------------------------------------------- search for a fix
def _try(model: ModelSpec, cluster: ClusterSpec, config: PlanConfig) -> MemoryPlan | None:
    try:
        plan = plan_memory(model, cluster, config, suggest=False)
    except InputError:
        return None
    return plan if plan.fits else None


def _with_layout(config: PlanConfig, lay: Layout, **changes: Any) -> PlanConfig:
    """``config`` with the resolved layout made explicit, then ``changes`` applied."""
    base = {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "dense_tp": lay.dense_tp, "num_redundant": lay.num_redundant}
    base.update(changes)
    return replace(config, **base)


def suggest_changes(model: ModelSpec, cluster: ClusterSpec, config: PlanConfig,
                    *, max_gpus_factor: int = 8) -> list[Suggestion]:
    """Single changes that make the plan fit, cheapest kind first; within a kind the smallest.

    A ``--context`` beyond the model's maximum is answered with the maximum only. Otherwise kinds, in
    this order: FP8 KV cache; fewer redundant experts; a larger EP; a larger attention TP
    (fewer DP ranks); more GPUs (whole nodes, up to ``max_gpus_factor`` x, keeping the attention TP and
    scaling DP and EP with the world size, redundant count rounded up to a valid one). Every candidate
    is re-planned with :func:`plan_memory` on the same model and cluster kind.
    """
    lay = resolve_layout(model, cluster.num_gpus, config)
    W, E = cluster.num_gpus, model.num_experts
    found: list[Suggestion] = []
    context = config.context or model.max_context
    if model.max_context and context > model.max_context:
        # Nothing about the topology can help a sequence longer than the model reads.
        cfg = replace(config, context=model.max_context)
        plan = _try(model, cluster, cfg)
        if plan is not None:
            found.append(Suggestion("model max context", f"--context {format_tokens(model.max_context)}", W, cfg,
                                    plan.concurrency))
        return found

    def add(kind: str, change: str, cl: ClusterSpec, cfg: PlanConfig) -> bool:
        plan = _try(model, cl, cfg)
        if plan is None:
            return False
        found.append(Suggestion(kind, change, cl.num_gpus, cfg, plan.concurrency))
        return True

    if KV_DTYPE_BYTES[config.kv_dtype] > KV_DTYPE_BYTES["fp8"] and model.kv_bytes_per_token("bf16") > 0:
        add("fp8 KV", "--kv-dtype fp8", cluster, _with_layout(config, lay, kv_dtype="fp8"))
    if lay.num_redundant:
        for r in range(lay.num_redundant - 1, -1, -1):
            if (E + r) % lay.ep == 0 and add("fewer redundant", f"--redundant {r}", cluster,
                                             _with_layout(config, lay, num_redundant=r)):
                break
    for ep in range(lay.ep + 1, W + 1):
        if W % ep == 0:
            r = next_valid_redundant(E, ep, lay.num_redundant)
            note = f" --redundant {r}" if r != lay.num_redundant else ""
            if add("larger EP", f"--ep {ep}{note}", cluster, _with_layout(config, lay, ep=ep, num_redundant=r)):
                break
    for tp in range(lay.tp + 1, W + 1):
        if W % tp == 0 and tp % lay.dcp == 0:
            dense_tp = tp if config.dense_tp is None else lay.dense_tp
            if add("larger attention TP", f"--tp {tp} --dp {W // tp}", cluster,
                   _with_layout(config, lay, tp=tp, dp=W // tp, dense_tp=dense_tp)):
                break
    step = min(cluster.gpus_per_node, W)
    for W2 in range(W + step, max_gpus_factor * W + 1, step):
        if W2 % lay.tp:
            continue
        ep2 = lay.ep * W2 // W if (lay.ep * W2) % W == 0 else W2
        r = next_valid_redundant(E, ep2, lay.num_redundant)
        if W2 > cluster.gpus_per_node and W2 % cluster.gpus_per_node:
            continue  # whole nodes only
        per_node = min(cluster.gpus_per_node, W2)
        cl = ClusterSpec(gpu=cluster.gpu, num_nodes=W2 // per_node, gpus_per_node=per_node)
        dense_tp = lay.dense_tp if W2 % lay.dense_tp == 0 else lay.tp
        note = f" --redundant {r}" if r != lay.num_redundant else ""
        if add("more GPUs", f"--gpus {W2} --tp {lay.tp} --dp {W2 // lay.tp} --ep {ep2}{note}", cl,
               _with_layout(config, lay, dp=W2 // lay.tp, ep=ep2, num_redundant=r, dense_tp=dense_tp)):
            break
    return found


# ---------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class SweepRow:
    gpus: int
    tp: int | None
    dp: int | None
    ep: int
    num_redundant: int
    plan: MemoryPlan | None
    error: str | None = None


def sweep_plans(model: ModelSpec, config: PlanConfig, *, gpu: str, gpus_per_node: int | None,
                gpu_counts: list[int], ep_sizes: list[int] | None = None,
                redundant: list[int] | None = None) -> list[SweepRow]:
    """Plan every (GPU count, EP size, redundant count) combination.

    ``ep_sizes`` ``None``: EP = the GPU count and half of it. EP sizes that do not divide a GPU count are
    skipped; a redundant count that does not make ``E + R`` divisible by EP is rounded up to the next valid
    one (rows are deduplicated). The attention TP/DP the user gave are kept where they divide the GPU
    count; rows whose layout is invalid carry the error instead of a plan.
    """
    rows: list[SweepRow] = []
    seen = set()
    E = model.num_experts
    for W in gpu_counts:
        try:
            cluster = make_cluster(W, gpu, gpus_per_node if gpus_per_node and W >= gpus_per_node else None)
        except InputError as exc:
            rows.append(SweepRow(W, config.tp, config.dp, 0, 0, None, str(exc)))
            continue
        eps = ep_sizes or sorted({W, W // 2} - {0})
        tp, dp = config.tp, config.dp
        if tp is not None and dp is not None and tp * dp != W:
            dp = None  # keep the attention TP, let DP follow the GPU count
        for ep in eps:
            if ep > W or W % ep:
                continue
            for r in (redundant or [config.num_redundant]):
                r2 = next_valid_redundant(E, ep, r)
                key = (W, ep, r2)
                if key in seen:
                    continue
                seen.add(key)
                cfg = replace(config, tp=tp, dp=dp, ep=ep, num_redundant=r2)
                try:
                    rows.append(SweepRow(W, tp, dp, ep, r2, plan_memory(model, cluster, cfg, suggest=False)))
                except InputError as exc:
                    rows.append(SweepRow(W, tp, dp, ep, r2, None, str(exc)))
    return rows


def default_sweep_gpus(num_gpus: int, gpus_per_node: int) -> list[int]:
    """Quarter, half, the same, double and quadruple the GPU count, in whole nodes where possible."""
    out = []
    for f in (0.25, 0.5, 1, 2, 4):
        w = int(num_gpus * f)
        if w >= 1 and (w < gpus_per_node or w % gpus_per_node == 0) and w not in out:
            out.append(w)
    return out


__all__ = [
    "CachePools", "Layout", "MemoryLine", "MemoryPlan", "PlanConfig", "Suggestion", "SweepRow",
    "a2a_buffer_bytes", "activation_bytes", "attention_params_per_gpu", "attention_split", "cache_pools",
    "deepep_low_latency_bytes", "default_sweep_gpus", "format_tokens", "make_pools", "next_valid_redundant",
    "parse_context_mix", "parse_pool_split", "parse_tokens", "plan_memory", "resolve_layout",
    "suggest_changes", "sweep_plans", "weight_lines",
]
