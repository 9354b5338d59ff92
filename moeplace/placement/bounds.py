"""Lower bounds on the most loaded GPU (docs/design.md Sources §3), per MoE layer.

Every function takes expert loads ``loads_LE`` (float ``[L, E]``, tokens per logical expert) and
returns float64 ``[L]``: no placement / replica-choice rule can put fewer tokens on its busiest GPU.
Dividing the mean load ``total / G`` by a bound gives the best balancedness that is possible
(a ceiling); ``max_load / bound - 1`` is the gap of an achieved placement.

- :func:`splittable_bound`: ``total / G`` — holds for everything.
- :func:`even_split_bound`: for given replica counts served with an even split (vLLM's modulo rule):
  every replica of ``e`` carries the unit ``w_e / c_e``; the GPU holding the largest unit also holds
  ``S - 1`` other units (``S`` slots per GPU, all filled), at least the ``S - 1`` smallest ones. So
  ``max(total / G, u_max + sum of the S-1 smallest other units)`` (the second term contains
  ``max_e w_e / c_e``; with ``c = 1`` it is the published no-replication bound).
- :func:`minmax_replica_counts`: the counts behind the best bound for a slot budget ``P`` over all
  placements under an even split, ``max(total / G, min_c max_e w_e / c_e)`` over counts ``c_e >= 1``
  with ``sum c = P``.

Which bound holds under which engine is the replica rule's to say
(:meth:`moeplace.placement.rules.ReplicaRule.placement_bound` and ``budget_bound``: the even-split rules
use the two above, the splittable ones ``total / G`` and the LP optimum of the placement's replicas).
"""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError


def _loads(loads_LE) -> np.ndarray:
    w = np.asarray(loads_LE, dtype=np.float64)
    if w.ndim != 2:
        raise InputError(f"loads must be [layers, experts], got shape {w.shape}")
    if (w < 0).any():
        raise InputError("loads must be non-negative")
    return w


def splittable_bound(loads_LE, num_gpus: int) -> np.ndarray:
    """``total / G`` per layer: float64 ``[L]``."""
    return _loads(loads_LE).sum(axis=1) / num_gpus


def even_split_bound(loads_LE, logcnt_LE, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Bound for replica counts ``logcnt_LE`` (int ``[L, E]``, >= 1) under an even split, with
    ``slots_per_gpu`` slots on each GPU: float64 ``[L]`` (see the module docstring)."""
    w = _loads(loads_LE)
    c = np.asarray(logcnt_LE)
    if c.shape != w.shape or (c < 1).any():
        raise InputError("replica counts must be [layers, experts] and >= 1")
    L = w.shape[0]
    S = int(slots_per_gpu)
    out = w.sum(axis=1) / num_gpus
    for l in range(L):
        units = np.sort(np.repeat(w[l] / c[l], c[l]))
        stacked = units[-1] + units[:-1][:S - 1].sum()
        out[l] = max(out[l], stacked)
    return out


def minmax_replica_counts(loads_LE, num_slots: int, max_count: int | None = None) -> np.ndarray:
    """Replica counts int64 ``[L, E]`` (``>= 1``, summing to ``num_slots`` per layer) minimizing the
    largest unit ``max_e w_e / c_e`` (water-filling): give the next replica to the expert with the largest
    current unit (ties: lowest expert id), ``num_slots - E`` times. ``max_count``: no expert gets more
    (the optimizer passes the GPU count, since it never puts two replicas of one expert on one GPU).
    Greedy is optimal here, with or without the cap: the largest unit after ``r`` steps is the
    ``(E + r)``-th largest of the values ``w_e / j`` (``j = 1, 2, ...``, ``j <= max_count``), which no
    other choice beats.
    """
    w = _loads(loads_LE)
    L, E = w.shape
    if num_slots < E:
        raise InputError(f"{num_slots} slots cannot hold {E} experts")
    if max_count is not None and num_slots > E * max_count:
        raise InputError(f"{num_slots} slots cannot hold {E} experts with at most {max_count} replicas each")
    cnt = np.ones((L, E), dtype=np.int64)
    rows = np.arange(L)
    for _ in range(num_slots - E):  # all layers at once, one replica per layer per round
        unit = w / cnt
        if max_count is not None:
            unit = np.where(cnt < max_count, unit, -np.inf)
        best = np.argmax(unit, axis=1)
        cnt[rows, best] += 1
    return cnt
