"""The memory model: does a parallel layout of a model fit a cluster, and how many sequences of which
length does it hold?

``plan_memory(model, cluster, config) -> MemoryPlan`` is a pure function of the model spec
(:class:`foundation.model.ModelSpec`), the cluster spec (:class:`foundation.cluster.ClusterSpec`) and a
:class:`MemoryConfig`. There is no per-model code path: every number below is arithmetic on spec fields.

Conventions (one engine instance spans all ``W = cluster.num_gpus`` GPUs; SGLang's layout):

* **Attention** runs as ``dp`` data-parallel ranks of ``tp`` GPUs each (``tp * dp == W``; ``dp == 1`` is
  plain TP, ``tp == 1`` is SGLang ``--attn-dp-size W`` / vLLM DP with TP 1). Head-split projections
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
  graphs / NCCL / allocator slack. The engine may use ``gpu_memory_utilization * M``; the rest is the
  CUDA context's and the fragmentation headroom, as in vLLM and SGLang ``--mem-fraction-static``. ``M`` is
  the memory the device reports to CUDA (``GPUSpec.memory_bytes``: vLLM takes ``torch.cuda.mem_get_info()``'s
  total, SGLang the free memory after start-up), e.g. 139.81 GiB = 150.1 GB on an H200 sold as 141 GB; a
  GPU spec without ``device_memory_bytes`` falls back to its marketing ``hbm_bytes``.
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

Modules, bottom to top: ``inputs`` (token counts, length mixes, pool rules as users type them),
``config`` (:class:`MemoryConfig`, :class:`Layout`), ``components`` (weights, activations, all-to-all
buffers), ``pools`` (:class:`CachePools`), ``plan`` (:class:`MemoryPlan` and its JSON document),
``report`` (the sentences: cache-line formulas, misfit reasons, the printed plan and sweep) and
``planner`` (:func:`plan_memory`, :func:`suggest_changes`, :func:`sweep_plans`). This package re-exports
their public names.
"""
from __future__ import annotations

from moeplace.foundation.memory.components import (
    ACT_BYTES,
    LOGIT_BYTES,
    MemoryLine,
    a2a_buffer_bytes,
    activation_bytes,
    attention_params_per_gpu,
    attention_split,
    deepep_low_latency_bytes,
    weight_lines,
)
from moeplace.foundation.memory.config import (
    Layout,
    MemoryConfig,
    attention_heads,
    next_valid_redundant,
    resolve_layout,
)
from moeplace.foundation.memory.inputs import (
    MEMORY_FLAGS,
    POOL_SPLITS,
    GiB,
    KiB,
    MiB,
    format_tokens,
    parse_context_mix,
    parse_pool_split,
    parse_tokens,
)
from moeplace.foundation.memory.plan import MemoryPlan, Suggestion, SweepRow
from moeplace.foundation.memory.planner import (
    cache_pools,
    default_sweep_gpus,
    plan_memory,
    suggest_changes,
    sweep_plans,
)
from moeplace.foundation.memory.pools import CachePools, make_pools
from moeplace.foundation.memory.report import render_plan, render_sweep

__all__ = [
    "ACT_BYTES", "LOGIT_BYTES", "MEMORY_FLAGS", "POOL_SPLITS", "CachePools", "GiB", "KiB", "Layout",
    "MemoryConfig", "MemoryLine", "MemoryPlan", "MiB", "Suggestion", "SweepRow", "a2a_buffer_bytes",
    "activation_bytes", "attention_heads", "attention_params_per_gpu", "attention_split", "cache_pools",
    "deepep_low_latency_bytes", "default_sweep_gpus", "format_tokens", "make_pools", "next_valid_redundant",
    "parse_context_mix", "parse_pool_split", "parse_tokens", "plan_memory", "render_plan", "render_sweep",
    "resolve_layout", "suggest_changes", "sweep_plans", "weight_lines",
]
