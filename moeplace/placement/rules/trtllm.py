"""TensorRT-LLM's replica rule (its MoE load balancer's routing kernel).

Read from TensorRT-LLM's ``cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceKernels.cu``
(``moeComputeRouteKernel``, launched by ``moeComputeRouteDevice``) and its caller in
``tensorrt_llm/_torch/modules/fused_moe/`` (``route(token_selected_experts, offset_by_ep_rank=use_dp)``),
read 2026. For one rank's ``token_selected_experts [num_tokens, k]`` of one forward pass, flattened to
elements ``f = t*k + j``:

- the kernel runs blocks of ``256 threads x 4 items = 1024`` consecutive elements; block ``b = f // 1024``;
- an expert with one replica goes to its only slot (with no redundant slot at all the kernel is
  ``moeComputeRouteNoRedundantKernel``, the same map);
- for an expert with ``c > 1`` replicas, warp 0 walks the block's elements in order and gives each
  occurrence of the expert its running count inside the block (``atomicAdd_block`` on a per-expert
  counter, lanes ordered by ``__match_any_sync`` rank): ``occ``;
- ``replica = (occ + b + (rank if attention DP else 0)) % c`` and the slot is
  ``globalSlotIds[expertReplicaStartOffset[e] + replica]``; the host lists an expert's replicas in
  ascending global slot order (its rank-major scan), which is :attr:`Placement.log2phy`.

So replicas are taken round-robin in order of appearance within each 1,024-element block, the block and
(under attention DP) the rank shifting the start. Over many tokens every replica carries
``load / replica_count``: an even split, like vLLM's, with a different per-batch pattern.
Variants: ``dp`` (attention DP, the default here since moeplace's ranks are attention-DP ranks: the
offset by EP rank applies) and ``tp`` (attention TP: no offset).
"""
from __future__ import annotations

import numpy as np

from moeplace.placement.rules.base import ReplicaRule, register

BLOCK_ELEMENTS = 256 * 4  # THREAD_COUNT x ITEM_PER_THREAD of moeComputeRouteKernel


def trtllm_replica_index(pos_in_batch: np.ndarray, expert_ids: np.ndarray, replica_count: np.ndarray,
                         src_gpu: np.ndarray, batch_id: np.ndarray | None, offset_by_rank: bool) -> np.ndarray:
    """TensorRT-LLM's replica index, int64 ``[n, k]``, for tokens at batch positions ``pos_in_batch``
    (int ``[n]``) of rank-local batches (``batch_id``, ``src_gpu``), selecting ``expert_ids`` (int
    ``[n, k]``) with ``replica_count`` (int ``[n, k]``) replicas."""
    e = np.asarray(expert_ids, dtype=np.int64)
    n, k = e.shape
    cnt = np.asarray(replica_count, dtype=np.int64)
    if n == 0:
        return np.zeros((0, k), dtype=np.int64)
    src = np.asarray(src_gpu, dtype=np.int64)
    bid = np.zeros(n, dtype=np.int64) if batch_id is None else np.asarray(batch_id, dtype=np.int64)
    f = np.asarray(pos_in_batch, dtype=np.int64)[:, None] * k + np.arange(k)[None, :]  # [n, k]
    block = f // BLOCK_ELEMENTS
    # occurrence of the expert inside its (step, rank, block), in element order
    key = np.stack(np.broadcast_arrays(bid[:, None], src[:, None], block, e), axis=-1).reshape(-1, 4)
    flat_f = f.ravel()
    order = np.lexsort((flat_f, key[:, 3], key[:, 2], key[:, 1], key[:, 0]))
    sk = key[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (sk[1:] != sk[:-1]).any(axis=1)
    starts = np.flatnonzero(new_group)
    run = np.arange(len(order)) - np.repeat(starts, np.diff(np.append(starts, len(order))))
    occ = np.empty(len(order), dtype=np.int64)
    occ[order] = run
    base = block.ravel() + (np.broadcast_to(src[:, None], (n, k)).ravel() if offset_by_rank else 0)
    rep = (occ + base) % cnt.ravel()
    return np.where(cnt.ravel() > 1, rep, 0).reshape(n, k)


@register
class TrtllmRule(ReplicaRule):
    """TensorRT-LLM: round-robin over replicas in order of appearance within 1,024-element blocks."""

    name = "trtllm"
    listing_order = 2
    engine = "TensorRT-LLM"
    variants = ("dp", "tp")
    version_option = "trtllm_variant"

    @property
    def uses_source_rank(self) -> bool:
        return self.variant == "dp"

    def batch_slots(self, placement, layer, expert_ids, *, src_gpu, pos_in_batch, batch_id=None, state=None):
        e = np.asarray(expert_ids, dtype=np.int64)
        rep = trtllm_replica_index(pos_in_batch, e, placement.logcnt[layer][e], src_gpu, batch_id,
                                   offset_by_rank=self.variant == "dp")
        return placement.log2phy[layer][e, rep].astype(np.int64)
