"""The ``ideal`` engine: tokens of an expert may be split among its replicas in any proportion. The best
split of a fixed placement is a linear program (OR-Tools GLOP): minimize the max GPU load."""
from __future__ import annotations

import numpy as np
from ortools.linear_solver import pywraplp


def ideal_max_load(load_e: np.ndarray, p2l: np.ndarray, num_gpus: int) -> tuple[float, np.ndarray]:
    """LP-optimal split of one layer. ``load_e``: float ``[E]``; ``p2l``: ``[P]``. Returns
    ``(max GPU load, per-slot tokens [P])``; the max equals ``sum / G`` whenever the replicas allow it."""
    # Data
    P = p2l.shape[0]
    S = P // num_gpus
    slot_gpu = np.arange(P) // S
    E = load_e.shape[0]

    # Model
    solver = pywraplp.Solver.CreateSolver("GLOP")
    f = [solver.NumVar(0.0, solver.infinity(), f"tokens_slot{p}") for p in range(P)]
    z = solver.NumVar(0.0, solver.infinity(), "max_load")
    # Each expert's tokens are split over its replicas.
    for e in range(E):
        solver.Add(sum(f[p] for p in np.flatnonzero(p2l == e)) == float(load_e[e]))
    # Each GPU carries at most the objective.
    for g in range(num_gpus):
        solver.Add(sum(f[p] for p in np.flatnonzero(slot_gpu == g)) <= z)
    solver.Minimize(z)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise RuntimeError("GLOP did not solve the split LP")
    return z.solution_value(), np.array([v.solution_value() for v in f])
