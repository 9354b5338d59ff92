"""The ideal split: the best any replica rule can do with a placement.

``ideal`` — a splittable split of each expert's tokens over its replicas that minimizes the most
loaded GPU (an LP solved with OR-Tools GLOP; see :func:`ideal_split`). No engine does this; it
is the best any replica-choice rule can do with this placement, so it is also a lower bound for
the other two.
"""
from __future__ import annotations

import numpy as np
from ortools.linear_solver import pywraplp

from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import RuleMemory
from moeplace.placement.bounds import splittable_bound
from moeplace.placement.record import Placement
from moeplace.placement.rules.base import ReplicaRule, register


def check_loads(placement: Placement, loads_LE: np.ndarray) -> np.ndarray:
    """``loads_LE`` as float64 ``[L, E]`` for ``placement``; wrong shapes and negative loads are refused."""
    w = np.asarray(loads_LE, dtype=np.float64)
    if w.shape != (placement.num_layers, placement.num_experts):
        raise InputError(f"loads must be [{placement.num_layers}, {placement.num_experts}] "
                         "(MoE layers x experts) "
                         f"for this placement, got {w.shape}")
    if (w < 0).any():
        raise InputError("loads must be non-negative")
    return w


def ideal_gpu_loads(placement: Placement, loads_LE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The splittable optimum of ``placement`` (:func:`ideal_split`) on expert loads ``loads_LE``
    (float ``[L, E]``): ``(gpu_loads float64 [L, G], makespan float64 [L])``."""
    return ideal_split(placement.phy2log, check_loads(placement, loads_LE), placement.num_gpus)


def ideal_split(phy2log: np.ndarray, loads_LE: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """The splittable optimum: each expert's load may be split in any proportion over the GPUs that
    hold one of its replicas; minimize the most loaded GPU, per layer. ``phy2log``: int ``[L, P]`` (slot
    ``p`` on GPU ``p // (P / num_gpus)``); ``loads_LE``: float ``[L, E]``, non-negative.

    Returns ``(gpu_loads float64 [L, G], makespan float64 [L])``. Experts whose replicas all sit on one
    GPU are fixed; the rest form a small LP per layer (variables: one per (expert, GPU holding it),
    plus the layer's makespan T; constraints: the expert's load is fully assigned, every GPU's load
    <= T). All layers go into one OR-Tools GLOP model minimizing sum_l T_l — the layers share no
    variables, so the sum is minimal exactly when every T_l is. GLOP's answer is then polished: loads
    are recomputed from the split and the makespan is their max, so mass is conserved exactly.
    """
    w = np.asarray(loads_LE, dtype=np.float64)
    L, G, E = w.shape[0], num_gpus, w.shape[1]
    gpu_of = np.asarray(phy2log).reshape(L, G, -1)
    # holds[l, e, g]: expert e has a replica on GPU g
    holds = np.zeros((L, E, G), dtype=bool)
    holds[np.arange(L)[:, None, None], gpu_of, np.arange(G)[None, :, None]] = True
    num_gpus_holding = holds.sum(2)
    fixed = num_gpus_holding == 1
    base = np.zeros((L, G))
    lf, ef = np.nonzero(fixed)
    np.add.at(base, (lf, holds[lf, ef].argmax(1)), w[lf, ef])
    out = base.copy()
    flex_layers = [l for l in range(L) if (~fixed[l] & (w[l] > 0)).any()]
    if flex_layers:
        solver = pywraplp.Solver.CreateSolver("GLOP")
        splits = []  # (layer, expert, gpus, vars)
        T = {}
        scale = {}
        for l in flex_layers:
            # Scale each layer to ~1 so GLOP's absolute tolerances are relative ones.
            scale[l] = max(w[l].sum() / G, 1e-12)
            T[l] = solver.NumVar(0.0, solver.infinity(), f"T_{l}")
            per_gpu: list[list] = [[] for _ in range(G)]
            for e in np.flatnonzero(~fixed[l] & (w[l] > 0)):
                gpus = np.flatnonzero(holds[l, e])
                xs = [solver.NumVar(0.0, solver.infinity(), f"x_{l}_{e}_{g}") for g in gpus]
                # the expert's whole load is served
                solver.Add(solver.Sum(xs) == w[l, e] / scale[l])
                for g, x in zip(gpus, xs):
                    per_gpu[g].append(x)
                splits.append((l, e, gpus, xs))
            # every GPU's load is at most the layer's makespan
            for g in range(G):
                solver.Add(base[l, g] / scale[l] + solver.Sum(per_gpu[g]) <= T[l])
        solver.Minimize(solver.Sum(T.values()))
        status = solver.Solve()
        if status != pywraplp.Solver.OPTIMAL:
            raise RuntimeError(f"GLOP did not solve the ideal split (status {status})")
        for l, e, gpus, xs in splits:
            vals = np.maximum([x.solution_value() for x in xs], 0.0)
            tot = vals.sum()
            vals = vals / tot * w[l, e] if tot > 0 else np.full(len(gpus), w[l, e] / len(gpus))
            out[l, gpus] += vals
    return out, out.max(axis=1)


@register
class IdealRule(ReplicaRule):
    """The LP-optimal fractional split (no engine implements it; a lower bound for every rule)."""

    name = "ideal"
    listing_order = 9
    engine = "ideal split"
    per_token = False
    even_split = False

    def batch_slots(self, placement, layer, expert_ids, *, src_gpu, pos_in_batch, batch_id=None, state=None):
        raise InputError("engine 'ideal' splits tokens fractionally; it has no per-token slot choice "
                         "(use token_gpu_loads / expected_gpu_loads)")

    def expected_gpu_loads(self, placement, loads_LE, state=None, *, seed_averaged=False):
        return ideal_gpu_loads(placement, loads_LE)[0]

    def planning_memory(self, num_layers, num_experts, num_gpus):
        L, E, G = num_layers, num_experts, num_gpus  # the split LP's bool [L, E, G] holder table
        return RuleMemory(once=float(L) * E * G, what=f"; the ideal split's [{L}, {E}, {G:,}] holder table")

    def placement_bound(self, placement, loads_LE):
        return ideal_gpu_loads(placement, loads_LE)[1]

    def budget_bound(self, loads_LE, num_gpus, num_slots):
        return splittable_bound(loads_LE, num_gpus)
