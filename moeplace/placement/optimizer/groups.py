"""Planning under routing groups kept whole (``--keep-groups``): placements a relabelled checkpoint can serve
exactly for a model with group-limited top-k (DeepSeek-V3: 256 experts in ``n_group = 8`` groups of 32
consecutive ids, the router keeps the best ``topk_group = 4`` groups per token).

A renaming of expert ids preserves that routing only if it maps every group onto one group as a whole
(``placement.relabel.check_groups``). Under the engines' contiguous layout the slots of a layer form
``n_group`` blocks of ``S = E / n_group`` consecutive ids; a replica-free placement is servable iff each
block holds exactly one original group. The smallest honest constraint on the search is therefore:

- ``S`` a multiple of the slots per GPU (a group spans ``b = S / (E/G)`` whole GPUs): the only freedom is how
  each group's experts spread over its own ``b`` GPUs. Every block is the same set of GPUs for balance, so
  group ``g`` keeps block ``g`` and each group is one independent sub-problem, solved by the ordinary layer
  search (:func:`..layer.solve_layer`) on ``b`` GPUs. The layer's max/mean is the worst group's, and each
  sub-problem minimizes its own max, so solving them apart loses nothing on the summed windows.
- the slots per GPU a multiple of ``S`` (whole groups per GPU): the only freedom is which groups share a
  GPU: the layer search on the group level (group loads, ``n_group`` items on ``G`` GPUs).
- otherwise no replica-free placement keeps groups whole on the GPUs' blocks: refused.

The traffic objective and a migration budget are not applied under the constraint (refused by the config).
"""
from __future__ import annotations

import math
import time

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.optimizer.config import OptimizerConfig
from moeplace.placement.optimizer.greedy import count_bound
from moeplace.placement.optimizer.layer import LayerResult, scenario_loads, solve_layer
from moeplace.placement.optimizer.local_search import LayerState


def group_shape(num_experts: int, num_slots: int, num_gpus: int, n_group: int) -> tuple[str, int]:
    """``("split", b)`` (each group over ``b`` GPUs) or ``("pack", m)`` (``m`` groups per GPU); refuses
    replicas and shapes where groups cannot stay whole."""
    if num_slots != num_experts:
        raise InputError(f"--keep-groups plans a replica-free placement (a relabelled checkpoint): use --redundant 0, "
                         f"not {num_slots - num_experts}")
    if num_experts % n_group:
        raise InputError(f"--keep-groups: {num_experts} experts do not split into {n_group} routing groups")
    S, spg = num_experts // n_group, num_slots // num_gpus
    if S % spg == 0:
        return "split", S // spg
    if spg % S == 0:
        return "pack", spg // S
    raise InputError(f"--keep-groups: routing groups of {S} experts and {spg} experts per GPU: neither divides the "
                     "other, so no placement keeps each group whole on a contiguous block of GPUs; choose --gpus so "
                     f"that {S} is a multiple of E/G or E/G a multiple of {S}")


def solve_grouped_layer(layer: int, loads_we: np.ndarray, num_slots: int, num_gpus: int, gpus_per_node: int,
                        cfg: OptimizerConfig, deadline: float) -> LayerResult:
    """One MoE layer's replica-free placement with every routing group on its own contiguous block of slots
    (``loads_we``: ``[W, E]``; ``cfg.keep_groups`` groups). The result's ``p2l`` is ``[P]``."""
    t0 = time.time()
    E = loads_we.shape[1]
    n = cfg.keep_groups
    how, k = group_shape(E, num_slots, num_gpus, n)
    S = E // n
    if how == "split":
        p2l = np.empty(num_slots, dtype=np.int64)
        share = max(0.0, deadline - t0) / n
        gpn = math.gcd(k, gpus_per_node)
        for g in range(n):
            sub = solve_layer(layer, loads_we[:, g * S:(g + 1) * S], S, k, gpn, cfg,
                              min(deadline, time.time() + share))
            p2l[g * S:(g + 1) * S] = g * S + sub.p2l
    else:  # whole groups per GPU: which groups share one
        group_loads = loads_we.reshape(loads_we.shape[0], n, S).sum(axis=2)
        sub = solve_layer(layer, group_loads, n, num_gpus, gpus_per_node, cfg, deadline)
        p2l = (sub.p2l[:, None] * S + np.arange(S)[None, :]).reshape(-1)
    wn = scenario_loads(loads_we, cfg, num_gpus)
    value = LayerState(wn, p2l, num_gpus, cfg.cvar).value()
    start = LayerState(wn, np.arange(num_slots), num_gpus, cfg.cvar).value()  # the unrelabelled layout
    # the bound of the unconstrained problem still bounds the constrained one from below
    return LayerResult(layer, p2l, value, count_bound(wn, num_slots, num_gpus), start, time.time() - t0)
