"""vLLM's ``--expert-placement-strategy linear`` (``determine_expert_map`` in
``vllm/model_executor/layers/fused_moe/layer.py``): EP rank ``r`` owns a contiguous block of the
``E + R`` physical experts, ``[r * base + min(r, rem), ... + local)`` with the remainder going to the
lowest ranks. Physical expert ``p`` holds logical ``p`` for ``p < E`` and ``(p - E) % E`` for the
redundant ones — vLLM's initial EPLB map ``[0..E-1] + [i % E for i in range(R)]``
(``EplbState.build_initial_global_physical_to_logical_map``). With EPLB vLLM requires ``(E + R) % G
== 0`` (``rem = 0``), which our Placement requires too, so the blocks are the slot ranges
``p // (P / G)`` and phy2log is the initial map itself, the same for every MoE layer. Loads are not
used.
"""
from __future__ import annotations

import numpy as np

from moeplace.placement.policies import PlacementProblem, register_policy
from moeplace.placement.record import Placement


def vllm_initial_map(num_experts: int, num_redundant: int) -> np.ndarray:
    """vLLM's initial physical -> logical map, int64 ``[E + R]``."""
    return np.concatenate([np.arange(num_experts), np.arange(num_redundant) % num_experts])


def linear_phy2log(num_layers: int, num_experts: int, num_redundant: int) -> np.ndarray:
    """int64 ``[L, E + R]``."""
    return np.tile(vllm_initial_map(num_experts, num_redundant), (num_layers, 1))


@register_policy("linear", quick=True)
def linear(problem: PlacementProblem) -> Placement:
    m = problem.model
    return problem.placement(linear_phy2log(m.num_moe_layers, m.num_experts, problem.num_redundant), "linear")
