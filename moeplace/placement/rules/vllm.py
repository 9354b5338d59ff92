"""vLLM's replica rule.

``vllm`` — a deterministic per-token choice inside the rank-local batch (vLLM
``eplb_map_to_physical_and_record``; ``vllm/model_executor/layers/fused_moe/router/base_router.py``
and ``vllm/distributed/eplb/cuda_platform_backend.py``, read 2026). For the rank-local
``topk_ids [num_tokens, k]`` of one forward pass, element ``(t, j)`` with flat offset ``t*k + j``:

- ``rule="hash"`` (vLLM main since PR #40810, Apr 2026, "Fix replica selection bias"): the Triton
  kernel computes ``token_idx = offset // k`` (= ``t``), ``hashed = (t * 2654435769) & 0xFFFFFFFF``
  (Knuth's multiplicative hash) and ``replica = hashed % logical_replica_count[e]``: all k experts
  of one token use the same hash.
- ``rule="modulo"`` (PR #24573, Sep 2025, until #40810): ``replica = (t*k + j) % count``.

``slot = logical_to_physical_map[e, replica]``; vLLM builds that map by scanning physical slots in
ascending order (``EplbState.build``), so replica ``r`` is the ``r``-th smallest slot of the expert
— exactly :attr:`Placement.log2phy`. The index restarts at 0 in every forward pass on every rank:
with the DeepEP / pplx / FlashInfer all-to-all backends routing runs on the rank's own tokens, so a
"batch" here is one DP rank's tokens of one engine step. Over many tokens both rules are an even
split ``load / replica_count`` per replica.
"""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement
from moeplace.placement.rules.base import ReplicaRule, register

VLLM_RULES = ("hash", "modulo")
KNUTH_MULTIPLIER = 2654435769  # floor(2^32 / golden ratio), the constant in vLLM's kernel


def vllm_replica_index(pos_in_batch: np.ndarray, k: int, replica_count: np.ndarray,
                       rule: str = "hash") -> np.ndarray:
    """vLLM's replica index, int64 ``[n, k]``, of tokens at batch positions ``pos_in_batch`` (int
    ``[n]``) whose selected experts have ``replica_count`` (int ``[n, k]``) replicas."""
    if rule not in VLLM_RULES:
        raise InputError(f"unknown vLLM replica rule '{rule}' (expected one of {VLLM_RULES})")
    t = np.asarray(pos_in_batch, dtype=np.int64)[:, None]
    if rule == "hash":
        return ((t * KNUTH_MULTIPLIER) & 0xFFFFFFFF) % replica_count
    return (t * k + np.arange(k)[None, :]) % replica_count


def vllm_slots(placement: Placement, layer: int, expert_ids: np.ndarray, rule: str = "hash") -> np.ndarray:
    """vLLM's rule for ONE rank-local batch of one MoE layer.

    ``expert_ids``: int ``[n, k]`` logical ids of the batch's tokens, in the batch's token order.
    Returns int64 ``[n, k]`` physical slots ``log2phy[layer, e, replica]``.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    rep = vllm_replica_index(np.arange(ids.shape[0]), ids.shape[1], placement.logcnt[layer][ids], rule)
    return placement.log2phy[layer][ids, rep].astype(np.int64)


@register
class VllmRule(ReplicaRule):
    """vLLM: the hashed (``hash``, default) or flat (``modulo``) batch index modulo the replica count."""

    name = "vllm"
    listing_order = 0
    engine = "vLLM"
    variants = VLLM_RULES
    version_option = "vllm_rule"

    def batch_slots(self, placement, layer, expert_ids, *, src_gpu, pos_in_batch, batch_id=None, state=None):
        e = np.asarray(expert_ids, dtype=np.int64)
        rep = vllm_replica_index(pos_in_batch, e.shape[1], placement.logcnt[layer][e], self.variant)
        return placement.log2phy[layer][e, rep].astype(np.int64)
