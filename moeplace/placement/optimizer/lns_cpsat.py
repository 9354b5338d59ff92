"""OR-Tools CP-SAT for placement: (1) re-solving a neighbourhood (a few GPUs and every replica on them)
of a local-search solution, with a complete hint — large-neighbourhood search; (2) the exact model of a
small layer (replica counts and placement together), used to prove optimality on small instances.

CP-SAT needs integer coefficients: normalized loads are scaled so the heaviest GPU is about ``SCALE``
units (coarse on purpose — runtime grows with the scale); every accepted result is re-scored in floats.
Determinism: one worker, a fixed seed and a *deterministic* time limit, with a wall-clock cap only as a
safety net for the run's hard deadline.
"""
from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

from moeplace.placement.optimizer.local_search import LayerState

SCALE = 20000


def _params(solver: cp_model.CpSolver, seed: int, dtime: float, wall: float) -> None:
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed) % (2 ** 31)
    solver.parameters.max_deterministic_time = float(dtime)
    solver.parameters.max_time_in_seconds = max(0.01, float(wall))
    solver.parameters.log_search_progress = False
    # CP-SAT's own SIGINT handler stops one search and lets the run go on: Ctrl-C would end a neighbourhood,
    # not the command. Python's handler keeps it: the KeyboardInterrupt arrives when this short solve
    # returns, as SIGTERM's does.
    solver.parameters.catch_sigint_signal = False


def solve_neighbourhood(st: LayerState, gpus: np.ndarray, seed: int, dtime: float, wall: float) -> bool:
    """Re-assign every replica on ``gpus`` among ``gpus`` (counts fixed) to minimize their worst
    scenario load; apply the result if it improves the layer's potential. Returns True if applied."""
    # Data
    S, W = st.S, st.W
    gpus = np.asarray(gpus, dtype=np.int64)
    slots = (gpus[:, None] * S + np.arange(S)[None, :]).ravel()
    experts = st.p2l[slots]
    scale = SCALE / max(st.load[st.cap_rows:, gpus].max(), 1e-12)
    weight = np.rint(st.wr[:, slots] * scale).astype(np.int64)        # [W, items]
    items, bins = range(len(slots)), range(len(gpus))

    # Model
    model = cp_model.CpModel()
    x = {(i, b): model.new_bool_var(f"x_item{i}_gpu{b}") for i in items for b in bins}
    z = model.new_int_var(0, int(weight.max(axis=0).sum()) + 1, "max_load")
    # Each replica sits on exactly one GPU of the neighbourhood.
    for i in items:
        model.add_exactly_one(x[i, b] for b in bins)
    # Each GPU keeps exactly S slots.
    for b in bins:
        model.add(sum(x[i, b] for i in items) == S)
    # Never two replicas of one expert on one GPU.
    for e in np.unique(experts):
        same = np.flatnonzero(experts == e)
        if len(same) > 1:
            for b in bins:
                model.add_at_most_one(x[int(i), b] for i in same)
    # SGLang: replicas of a lightly replicated expert on distinct nodes (counting those outside).
    if st.gpn:
        node = gpus // st.gpn
        for e in np.unique(experts[st.limited(experts)]):
            same = np.flatnonzero(experts == e)
            for n in np.unique(node):
                in_hood = [g for g in gpus if g // st.gpn == n]
                held_outside = int(st.has[n * st.gpn:(n + 1) * st.gpn, e].sum() - st.has[in_hood, e].sum())
                model.add(sum(x[int(i), b] for i in same for b in bins if node[b] == n)
                          <= max(0, 1 - held_outside))
    # Every scenario's load on every GPU is at most the objective (constraint scenarios: at most the cap).
    cap_units = int(np.floor(st.cap * scale)) if np.isfinite(st.cap) else None
    for w in range(W):
        for b in bins:
            load = sum(int(weight[w, i]) * x[i, b] for i in items)
            model.add(load <= (cap_units if w < st.cap_rows else z))
    model.minimize(z)
    # Complete hint: the current assignment.
    for i in items:
        for b in bins:
            model.add_hint(x[i, b], int(i // S == b))

    solver = cp_model.CpSolver()
    _params(solver, seed, dtime, wall)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    new = np.empty(len(slots), dtype=np.int64)
    fill = np.zeros(len(gpus), dtype=np.int64)
    for i in items:
        b = next(b for b in bins if solver.boolean_value(x[i, b]))
        new[b * S + fill[b]] = experts[i]
        fill[b] += 1
    cand = st.p2l.copy()
    cand[slots] = new
    before = (st.value(), st.sumsq(), st.p2l.copy())
    st.set(cand)
    if st.max_moves is not None and st.had0 is not None and st.moves > st.max_moves:
        st.set(before[2])
        return False
    v, sq = st.value(), st.sumsq()
    if st.cap_rows and st.capped_value() > st.cap + 1e-12:  # integer rounding let the cap slip
        st.set(before[2])
        return False
    if v < before[0] - 1e-12 or (v <= before[0] + 1e-12 and sq < before[1] - 1e-9):
        return True
    st.set(before[2])
    return False


def exact_model_size(num_experts: int, num_slots: int, num_gpus: int) -> int:
    """Boolean variables of :func:`solve_exact` (what decides whether a layer is small enough)."""
    return num_experts * num_gpus * min(num_gpus, num_slots - num_experts + 1)


def solve_exact(wn: np.ndarray, num_slots: int, num_gpus: int, seed: int = 0, time_limit: float = 30.0,
                hint: np.ndarray | None = None, dtime: float | None = None):
    """Exact CP-SAT model of one small layer under the even-split rule: replica counts and placement
    together, worst scenario. ``wn``: normalized ``[W, E]``; ``hint``: a feasible ``p2l [P]`` to start
    from. Returns ``(p2l [P], value, bound, optimal)``: ``value`` is the float max/mean of the returned
    placement; ``bound`` is CP-SAT's proven bound rescaled and lowered by the rounding of the integer
    coefficients (at most half a unit per slot of a GPU), so it is a valid bound in float units."""
    # Data
    W, E = wn.shape
    G, S = num_gpus, num_slots // num_gpus
    max_cnt = min(G, num_slots - E + 1)
    scale = SCALE / max(wn.sum(axis=0).max(), 1.0)
    counts = range(1, max_cnt + 1)
    share = {(w, e, c): round(float(wn[w, e]) * scale / c) for w in range(W) for e in range(E) for c in counts}

    # Model
    model = cp_model.CpModel()
    y = {(e, g): model.new_bool_var(f"expert{e}_on_gpu{g}") for e in range(E) for g in range(G)}
    k = {(e, c): model.new_bool_var(f"expert{e}_count{c}") for e in range(E) for c in counts}
    u = {(e, g, c): model.new_bool_var(f"expert{e}_gpu{g}_count{c}")
         for e in range(E) for g in range(G) for c in counts}
    z = model.new_int_var(0, int(sum(share[0, e, 1] for e in range(E)) * W + 1), "max_load")
    # Each expert has exactly one replica count, and that many GPUs hold it (at most one replica per GPU).
    for e in range(E):
        model.add_exactly_one(k[e, c] for c in counts)
        model.add(sum(y[e, g] for g in range(G)) == sum(c * k[e, c] for c in counts))
    # The slot budget: exactly S replicas per GPU.
    for g in range(G):
        model.add(sum(y[e, g] for e in range(E)) == S)
    # u = y AND k (the replica on g carries load / c).
    for (e, g, c), v in u.items():
        model.add_implication(v, y[e, g])
        model.add_implication(v, k[e, c])
        model.add_bool_or([v, ~y[e, g], ~k[e, c]])
    # Every scenario's GPU load is at most the objective.
    for w in range(W):
        for g in range(G):
            model.add(sum(share[w, e, c] * u[e, g, c] for e in range(E) for c in counts) <= z)
    model.minimize(z)
    # Complete hint: the heuristic's placement.
    if hint is not None:
        cnt = np.bincount(hint, minlength=E)
        on = np.zeros((E, G), dtype=bool)
        on[hint, np.arange(num_slots) // S] = True
        for (e, g), v in y.items():
            model.add_hint(v, bool(on[e, g]))
        for (e, c), v in k.items():
            model.add_hint(v, bool(cnt[e] == c))
        for (e, g, c), v in u.items():
            model.add_hint(v, bool(on[e, g] and cnt[e] == c))

    solver = cp_model.CpSolver()
    _params(solver, seed, dtime if dtime is not None else 1e9, time_limit)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None  # out of time before a first solution: the caller keeps its own
    p2l = np.empty(num_slots, dtype=np.int64)
    for g in range(G):
        on = [e for e in range(E) if solver.boolean_value(y[e, g])]
        p2l[g * S:(g + 1) * S] = on
    st = LayerState(wn, p2l, G)
    bound = max(0.0, (solver.best_objective_bound - 0.5 * S) / scale)
    return p2l, st.value(), bound, status == cp_model.OPTIMAL
