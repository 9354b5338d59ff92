"""Admission pools from the ``place plan`` memory model (:mod:`foundation.memory`). The simulator has no memory
model of its own: it builds the same :class:`MemoryConfig` the planner would for this engine and layout,
and asks the resulting :class:`CachePools` (``can_admit``, ``kv_tokens``) every admission question."""
from __future__ import annotations

from dataclasses import replace

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.plan import MemoryPlan
from moeplace.foundation.memory.planner import plan_memory
from moeplace.foundation.memory.pools import CachePools
from moeplace.foundation.model import ModelSpec
from moeplace.sim.config import EngineConfig


def memory_config(model: ModelSpec, engine: EngineConfig, num_gpus: int, num_redundant: int) -> MemoryConfig:
    """The planner's view of this engine: attention TP x DP, the routed experts over EP = GPUs / MoE-TP
    (each expert tensor-sharded over ``moe_tp`` GPUs: MoE-TP over every GPU is EP1, which holds no
    all-to-all buffers), the batching limits."""
    if num_gpus % engine.attention_tp:
        raise InputError(f"--attention-tp {engine.attention_tp} does not divide the {num_gpus} GPUs")
    if num_gpus % engine.moe_tp:
        raise InputError(f"--moe-tp {engine.moe_tp} does not divide the {num_gpus} GPUs")
    return MemoryConfig(tp=engine.attention_tp, dp=num_gpus // engine.attention_tp, ep=num_gpus // engine.moe_tp,
                      num_redundant=num_redundant, kv_dtype=engine.kv_dtype,
                      gpu_memory_utilization=engine.gpu_memory_utilization,
                      max_batched_tokens=engine.max_batched_tokens, max_num_seqs=engine.max_seqs,
                      pool_split=engine.pool_split, pool_param=engine.pool_param,
                      context=min(model.max_context or 2**20, 8192))


def plan_pools(model: ModelSpec, cluster: ClusterSpec, engine: EngineConfig, num_redundant: int
               ) -> tuple[CachePools, MemoryPlan]:
    """The KV / state pools of one DP rank for this deployment. Raises a one-line InputError when the
    weights and runtime reserve do not fit (the plan's own reason)."""
    plan = plan_memory(model, cluster, memory_config(model, engine, cluster.num_gpus, num_redundant), suggest=False)
    if plan.free_bytes <= 0:
        raise InputError(f"the deployment does not fit ({plan.layout.describe()} on {cluster.name}): "
                         + "; ".join(plan.reasons) + " — see `place plan`")
    return plan.pools, plan


def override_pools(pools: CachePools, kv_tokens: int | None, state_slots: int | None) -> CachePools:
    """Pools with explicit per-DP-rank capacities (what-if runs, tests): separate KV and state pools of
    exactly ``kv_tokens`` token slots and ``state_slots`` sequences."""
    if kv_tokens is None and state_slots is None:
        return pools
    kv = pools.kv_token_capacity if kv_tokens is None else kv_tokens
    if kv is None:
        kv = int(pools.pool_bytes // max(pools.kv_bytes_per_token, 1e-9))
    st = state_slots if state_slots is not None else (pools.state_slots or pools.max_num_seqs)
    kvb = pools.kv_bytes_per_token or 1.0
    sb = pools.state_bytes_per_seq or 1.0
    return replace(pools, shared=False, kv_pool_bytes=kv * kvb, state_pool_bytes=st * sb,
                   kv_bytes_per_token=kvb, state_bytes_per_seq=sb, pool_bytes=kv * kvb + st * sb)
