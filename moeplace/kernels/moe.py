"""Expert-parallel MoE forward: dispatch -> grouped expert GEMMs -> combine, over torch.distributed.

The same code runs on CPU (gloo) and GPU (NCCL); only the device and the grouped-GEMM path differ.
``reference_moe`` is the slow single-process twin every distributed result is checked against.

Shapes: ``n`` local tokens, hidden ``h``, top-``k``, ``E`` logical experts, intermediate ``I``;
``P`` physical slots, ``S = P / world_size`` slots per rank. Expert weights are indexed by LOGICAL id
(replicas of one expert share its weights): ``w_gate_up [E, 2I, h]``, ``w_down [E, h, I]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeplace.placement.dispatch import choose_slots
from moeplace.placement.record import Placement


# ----------------------------------------------------------------------------- math
def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP of one expert: ``x [m, h]``, ``w_gate_up [2I, h]``, ``w_down [h, I]`` -> ``[m, h]``."""
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.T


def reference_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Single-process MoE layer, the pure-torch twin: ``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])``.

    ``hidden [n, h]``, ``topk_ids [n, k]`` int, ``topk_weights [n, k]`` -> ``[n, h]``.
    """
    out = torch.zeros_like(hidden)
    for e in torch.unique(topk_ids).tolist():
        tok, j = torch.nonzero(topk_ids == e, as_tuple=True)
        y = expert_mlp(hidden[tok], w_gate_up[e], w_down[e])
        out.index_add_(0, tok, y * topk_weights[tok, j].unsqueeze(1).to(y.dtype))
    return out


@dataclass(frozen=True)
class Permutation:
    """Where each (token, choice) goes, grouped by destination rank then local slot (a counting sort, the
    job vLLM's ``moe_align_block_size`` does for one rank).

    ``order [n*k]``: flat (token*k + j) indices sorted by physical slot; ``slot_counts [P]``: tokens per
    slot; ``send_counts [world]``: rows sent to each rank; ``slot_offsets [P+1]``: segment starts.
    """

    order: torch.Tensor
    slot_counts: torch.Tensor
    slot_offsets: torch.Tensor
    send_counts: torch.Tensor


def sort_by_destination(slots: torch.Tensor, num_slots: int, world_size: int) -> Permutation:
    """Counting sort of ``slots [n, k]`` (physical slot per choice) by slot; ranks own contiguous slots."""
    flat = slots.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    slot_counts = torch.bincount(flat, minlength=num_slots)
    offsets = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(slot_counts, 0)
    send_counts = slot_counts.view(world_size, num_slots // world_size).sum(1)
    return Permutation(order, slot_counts, offsets, send_counts)


def grouped_expert_forward(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor) -> torch.Tensor:
    """Expert GEMMs over rows grouped by local slot: ``x [m, h]`` sorted so that slot ``s`` owns the next
    ``counts[s]`` rows; ``w_gate_up [S, 2I, h]``, ``w_down [S, h, I]`` -> ``[m, h]``.

    On CUDA with bf16 weights it uses torch's grouped GEMM (``torch._grouped_mm``) where available; else
    one GEMM per non-empty slot.
    """
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and x.shape[0] > 0:
        offs = torch.cumsum(counts.to(torch.int32), 0).to(torch.int32)
        gu = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    out = torch.empty_like(x)
    start = 0
    for s, c in enumerate(counts.tolist()):
        if c:
            out[start:start + c] = expert_mlp(x[start:start + c], w_gate_up[s], w_down[s])
        start += c
    return out


# ----------------------------------------------------------------------------- distributed
@dataclass
class StepTimes:
    """Wall seconds of the three phases of one EP MoE forward on this rank (synchronized per phase)."""

    dispatch: float = 0.0
    experts: float = 0.0
    combine: float = 0.0
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_weights(placement: Placement, layer: int, rank: int, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of ``rank``'s slots in MoE layer ``layer``: ``[S, 2I, h]``, ``[S, h, I]``."""
    experts = torch.as_tensor(np.array(placement.gpu_experts(layer, rank)), dtype=torch.int64)
    return w_gate_up[experts], w_down[experts]


def ep_moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   placement: Placement, layer: int, local_w_gate_up: torch.Tensor, local_w_down: torch.Tensor,
                   *, rule: str = "vllm", dispatch_map: np.ndarray | None = None, group=None,
                   times: StepTimes | None = None) -> torch.Tensor:
    """One expert-parallel MoE layer for this rank's ``n`` local tokens; returns ``[n, h]``.

    1. dispatch: choose the physical replica of each (token, expert) by the engine's replica rule ``rule``
       (:func:`placement.dispatch.choose_slots`), counting-sort by destination, exchange counts, then
       rows and their local slot ids with ``all_to_all_single`` (variable splits);
    2. experts: grouped GEMMs over the received rows, grouped by local slot;
    3. combine: send outputs back to their source ranks and reduce them with the gate weights.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if placement.num_gpus != world:
        raise ValueError(f"placement is for {placement.num_gpus} GPUs but the process group has {world} ranks")
    device = hidden.device
    k = topk_ids.shape[1]
    P, S = placement.num_slots, placement.slots_per_gpu
    t0 = time.perf_counter()

    # --- dispatch
    slots_np = choose_slots(placement, layer, topk_ids.cpu().numpy(), rule, src_gpu=rank,
                            dispatch_map=dispatch_map)
    slots = torch.as_tensor(np.asarray(slots_np), dtype=torch.int64, device=device)
    perm = sort_by_destination(slots, P, world)
    src_token = perm.order // k
    send_x = hidden.index_select(0, src_token)
    send_local_slot = slots.reshape(-1).index_select(0, perm.order) % S
    recv_counts = torch.empty_like(perm.send_counts)
    dist.all_to_all_single(recv_counts, perm.send_counts, group=group)
    send_splits, recv_splits = perm.send_counts.tolist(), recv_counts.tolist()
    recv_x = hidden.new_empty((sum(recv_splits), hidden.shape[1]))
    dist.all_to_all_single(recv_x, send_x, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    recv_slot = torch.empty(sum(recv_splits), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_slot, send_local_slot, output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    _sync(device)
    t1 = time.perf_counter()

    # --- experts (rows from all sources, regrouped by local slot)
    by_slot = torch.argsort(recv_slot, stable=True)
    counts = torch.bincount(recv_slot, minlength=S)
    y_sorted = grouped_expert_forward(recv_x.index_select(0, by_slot), counts, local_w_gate_up, local_w_down)
    y = torch.empty_like(y_sorted)
    y[by_slot] = y_sorted
    _sync(device)
    t2 = time.perf_counter()

    # --- combine
    back = hidden.new_empty((sum(send_splits), hidden.shape[1]))
    dist.all_to_all_single(back, y, output_split_sizes=send_splits, input_split_sizes=recv_splits, group=group)
    w = topk_weights.reshape(-1).index_select(0, perm.order).to(back.dtype)
    out = torch.zeros_like(hidden)
    out.index_add_(0, src_token, back * w.unsqueeze(1))
    _sync(device)
    t3 = time.perf_counter()

    if times is not None:
        times.dispatch += t1 - t0
        times.experts += t2 - t1
        times.combine += t3 - t2
        remote = perm.send_counts.clone()
        remote[rank] = 0
        times.rows_sent += int(remote.sum())
        times.rows_received += int(sum(recv_splits) - recv_splits[rank])
        times.bytes_sent += int(remote.sum()) * hidden.shape[1] * hidden.element_size()
    return out
