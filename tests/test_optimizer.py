"""The moeplace optimizer's building blocks on single layers: greedy construction, replica counts,
lower bounds, local search and CP-SAT. Invariants and bounds, not exact assignments."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from moeplace.placement.bounds import minmax_replica_counts
from moeplace.placement.optimizer import OptimizerConfig, solve_layer
from moeplace.placement.optimizer.greedy import count_bound, greedy_layer, normalize_scenarios
from moeplace.placement.optimizer.lns_cpsat import solve_exact, solve_neighbourhood
from moeplace.placement.optimizer.local_search import LayerState, aggregate, local_search
from moeplace.placement.rules.ideal import ideal_split


def check_layer(p2l: np.ndarray, num_experts: int, num_gpus: int) -> None:
    """Valid phy2log row: every expert present, exactly P/G slots per GPU, no duplicate on a GPU."""
    P = p2l.shape[0]
    S = P // num_gpus
    assert P % num_gpus == 0
    assert set(np.unique(p2l)) == set(range(num_experts))
    per_gpu = p2l.reshape(num_gpus, S)
    for g in range(num_gpus):
        assert len(set(per_gpu[g].tolist())) == S, f"GPU {g} holds a duplicate replica"


def skewed(rng, W, E, sigma=1.2):
    return rng.lognormal(0.0, sigma, size=(W, E)) * 100.0


def test_normalize_rows_sum_to_gpu_count():
    wn = normalize_scenarios(np.array([[1.0, 3.0], [0.0, 0.0], [2.0, 2.0]]), 4)
    assert wn.shape == (2, 2)  # the empty scenario is dropped
    np.testing.assert_allclose(wn.sum(axis=1), 4.0)


def test_replica_counts_minimize_the_largest_unit():
    rng = np.random.default_rng(1)
    for _ in range(20):
        key = rng.uniform(0.1, 10.0, size=4)
        cnt = minmax_replica_counts(key[None], 7, max_count=3)[0]
        assert cnt.sum() == 7 and cnt.min() >= 1 and cnt.max() <= 3
        best = min(max(key / np.array(c)) for c in itertools.product(range(1, 4), repeat=4) if sum(c) == 7)
        assert max(key / cnt) == pytest.approx(best)


def test_greedy_is_valid_and_never_stacks_an_expert():
    rng = np.random.default_rng(2)
    for E, G, R in ((64, 8, 8), (896, 32, 32), (30, 6, 6), (12, 4, 0)):
        wn = normalize_scenarios(skewed(rng, 2, E, 2.0), G)
        p2l = greedy_layer(wn, E + R, G)
        check_layer(p2l, E, G)


@pytest.mark.parametrize("robust", [False, True])
def test_solve_layer_invariants_bound_and_greedy_start(robust):
    rng = np.random.default_rng(3)
    cfg = OptimizerConfig(robust=robust, lns_rounds=2)
    for E, G, R in ((128, 8, 8), (96, 16, 16), (40, 8, 0)):
        loads = skewed(rng, 3, E)
        res = solve_layer(0, loads, E + R, G, 4, cfg, time.time() + 30)
        check_layer(res.p2l, E, G)
        assert res.bound <= res.value + 1e-12           # a proven bound never exceeds what is achieved
        assert res.value <= res.greedy_value + 1e-12    # never worse than the greedy start
        # the reported value is the layer's real max/mean
        wn = normalize_scenarios(loads if robust else loads.sum(0, keepdims=True), G)
        assert LayerState(wn, res.p2l, G).value() == pytest.approx(res.value)


def test_no_replication_bound_is_hot_expert_plus_lightest():
    # E=4, G=2, S=2, no redundancy: the GPU with the 10 also holds at least the lightest (1).
    wn = normalize_scenarios(np.array([[10.0, 1.0, 2.0, 3.0]]), 2)
    assert count_bound(wn, 4, 2) == pytest.approx(11.0 / 8.0)
    res = solve_layer(0, np.array([[10.0, 1.0, 2.0, 3.0]]), 4, 2, 2, OptimizerConfig(), time.time() + 10)
    assert res.value == pytest.approx(11.0 / 8.0)       # and the search reaches it


def test_local_search_reaches_near_bound_on_k3_sized_layer():
    rng = np.random.default_rng(4)
    E, G, R = 896, 32, 32
    wn = normalize_scenarios(skewed(rng, 1, E), G)
    st = LayerState(wn, greedy_layer(wn, E + R, G), G)
    local_search(st, time.monotonic() + 20)
    assert st.value() <= count_bound(wn, E + R, G) * 1.001
    check_layer(st.p2l, E, G)


def test_cvar_aggregate():
    m = np.array([1.0, 3.0, 2.0, 4.0])
    assert aggregate(m, 0.0) == 4.0
    assert aggregate(m, 0.5) == pytest.approx(3.5)


def test_neighbourhood_solve_never_worsens_and_keeps_rules():
    rng = np.random.default_rng(5)
    E, G, R = 60, 6, 6
    wn = normalize_scenarios(skewed(rng, 2, E), G)
    st = LayerState(wn, greedy_layer(wn, E + R, G), G)
    before = st.value()
    for r in range(3):
        solve_neighbourhood(st, np.array([0, 2, 4]), seed=r, dtime=0.1, wall=5.0)
        assert st.value() <= before + 1e-12
        check_layer(st.p2l, E, G)


def test_cpsat_proves_small_optimum_and_heuristic_reaches_it():
    rng = np.random.default_rng(6)
    for trial in range(3):
        E, G, R = 7, 3, 2                                 # P = 9, S = 3
        loads = rng.integers(1, 40, size=(1, E)).astype(float)
        wn = normalize_scenarios(loads, G)
        p2l, value, bound, optimal = solve_exact(wn, E + R, G, seed=0, time_limit=20)
        assert optimal
        check_layer(p2l, E, G)
        res = solve_layer(trial, loads, E + R, G, 3, OptimizerConfig(), time.time() + 20)
        # coefficients are rounded to 1/20000 of the total: compare with that slack
        assert res.value <= value + 1e-3
        assert bound <= res.value + 1e-3
        assert res.bound <= value + 1e-9


def _former_split_lp(load_e: np.ndarray, p2l: np.ndarray, num_gpus: int) -> float:
    """The optimizer's own split LP before it used placement.rules.ideal.ideal_split (one GLOP variable per
    slot, unscaled): the max GPU load of one layer."""
    from ortools.linear_solver import pywraplp

    P = p2l.shape[0]
    slot_gpu = np.arange(P) // (P // num_gpus)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    f = [solver.NumVar(0.0, solver.infinity(), f"f{p}") for p in range(P)]
    z = solver.NumVar(0.0, solver.infinity(), "z")
    for e in range(load_e.shape[0]):
        solver.Add(sum(f[p] for p in np.flatnonzero(p2l == e)) == float(load_e[e]))
    for g in range(num_gpus):
        solver.Add(sum(f[p] for p in np.flatnonzero(slot_gpu == g)) <= z)
    solver.Minimize(z)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    return z.solution_value()


def test_ideal_split_is_no_worse_than_even_split():
    rng = np.random.default_rng(7)
    E, G, R = 32, 4, 4
    load = skewed(rng, 1, E)[0]
    p2l = greedy_layer(normalize_scenarios(load[None], G), E + R, G)
    gpu_loads, span = ideal_split(p2l[None], load[None], G)
    z = span[0]
    even = LayerState(normalize_scenarios(load[None], G), p2l, G).value() * load.sum() / G
    assert z <= even + 1e-6
    assert z >= load.sum() / G - 1e-6
    np.testing.assert_allclose(gpu_loads.sum(), load.sum(), rtol=1e-9)


def test_ideal_split_matches_the_former_optimizer_lp():
    """The optimizer's ``ideal`` value now comes from the evaluator's LP; it is the same optimum."""
    rng = np.random.default_rng(11)
    for _ in range(6):
        E, G = 16, int(rng.choice([2, 4]))
        R = G * int(rng.integers(0, 3))
        load = skewed(rng, 1, E)[0]
        p2l = greedy_layer(normalize_scenarios(load[None], G), E + R, G)
        z = ideal_split(p2l[None], load[None], G)[1][0]
        assert z == pytest.approx(_former_split_lp(load, p2l, G), rel=1e-7)
