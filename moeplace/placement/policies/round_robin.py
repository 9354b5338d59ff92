"""vLLM's ``--expert-placement-strategy round_robin`` (``determine_expert_map``): EP rank ``r`` owns
physical experts ``r, r + G, r + 2G, ...`` of the ``E + R`` physical experts, in that order, each
physical expert holding vLLM's initial EPLB map entry (``p`` for ``p < E``, ``(p - E) % E`` after).
As a phy2log, GPU ``r``'s slots ``r*S .. r*S + S-1`` hold ``init[r], init[r + G], ...``.

Caveat recorded in the provenance: vLLM itself only honours round_robin when the model has expert
groups (``num_expert_group > 1``), there are no redundant experts and EPLB is off
(``determine_expert_placement_strategy``); otherwise it warns and falls back to ``linear``. Kimi K3 has
``n_group = 1``, so a real vLLM K3 deployment would run ``linear``. We still score the round-robin
layout because it is the natural "spread neighbours apart" baseline; with ``R > 0`` and ``E % G == 0``
it puts a redundant replica on the GPU that already holds that expert (``duplicate_on_gpu`` in the
provenance), which is one reason vLLM refuses the combination.
"""
from __future__ import annotations

import numpy as np

from moeplace.placement.policies import PlacementProblem, register_policy
from moeplace.placement.policies.linear import vllm_initial_map
from moeplace.placement.record import Placement


def round_robin_phy2log(num_layers: int, num_experts: int, num_redundant: int, num_gpus: int) -> np.ndarray:
    """int64 ``[L, E + R]``; requires ``(E + R) % G == 0``."""
    init = vllm_initial_map(num_experts, num_redundant)
    P = init.size
    S = P // num_gpus
    order = (np.arange(num_gpus)[:, None] + num_gpus * np.arange(S)[None, :]).ravel()  # rank-major
    return np.tile(init[order], (num_layers, 1))


@register_policy("round_robin", quick=True)
def round_robin(problem: PlacementProblem) -> Placement:
    m, G = problem.model, problem.cluster.num_gpus
    p2l = round_robin_phy2log(m.num_moe_layers, m.num_experts, problem.num_redundant, G)
    fallback = not (m.n_group > 1 and problem.num_redundant == 0)
    per_gpu = np.sort(p2l.reshape(p2l.shape[0], G, -1), axis=2)
    duplicate = bool((np.diff(per_gpu, axis=2) == 0).any())
    return problem.placement(p2l, "round_robin", vllm_falls_back_to_linear=fallback,
                             duplicate_on_gpu=duplicate)
