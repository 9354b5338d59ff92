"""The moeplace optimizer's modes on crafted layers: robust scenarios, migration budget, traffic,
SGLang's node rule, the hard time limit."""
from __future__ import annotations

import time

import numpy as np
import pytest

from moeplace.placement.optimizer import OptimizerConfig, optimize_layers, solve_layer
from moeplace.placement.optimizer.greedy import greedy_layer, normalize_scenarios
from moeplace.placement.optimizer.local_search import LayerState
from moeplace.placement.optimizer.traffic import TrafficModel
from tests.test_optimizer import check_layer


def worst_balancedness(p2l, loads_we, G):
    st = LayerState(normalize_scenarios(loads_we, G), p2l, G)
    return 1.0 / st.value()


def test_robust_beats_the_single_scenario_plan_on_crafted_case():
    # Scenario A needs experts 0 and 3 apart, B needs 1 and 2 apart; their sum is perfectly balanced by
    # pairing {0, 3} and {1, 2} — which is the worst possible pairing for both scenarios.
    loads = np.array([[10.0, 0.0, 0.0, 10.2], [0.0, 10.1, 10.1, 0.0]])
    G, P = 2, 4
    single = solve_layer(0, loads, P, G, 2, OptimizerConfig(), time.time() + 10)
    robust = solve_layer(0, loads, P, G, 2, OptimizerConfig(robust=True), time.time() + 10)
    assert worst_balancedness(single.p2l, loads, G) == pytest.approx(0.5)
    assert worst_balancedness(robust.p2l, loads, G) > 0.98
    assert 1.0 / robust.value == pytest.approx(worst_balancedness(robust.p2l, loads, G))


def test_robust_worst_scenario_no_worse_than_union_plan():
    rng = np.random.default_rng(11)
    E, G, R = 128, 8, 8
    loads = rng.lognormal(0, 1.0, size=(4, E)) * rng.lognormal(0, 1.0, size=(1, E)) * 50
    single = solve_layer(0, loads, E + R, G, 4, OptimizerConfig(lns_rounds=0), time.time() + 20)
    robust = solve_layer(0, loads, E + R, G, 4, OptimizerConfig(robust=True, lns_rounds=2), time.time() + 20)
    assert worst_balancedness(robust.p2l, loads, G) >= worst_balancedness(single.p2l, loads, G) - 1e-9


@pytest.mark.parametrize("max_moves", [0, 3, 10])
def test_migration_budget_is_respected(max_moves):
    rng = np.random.default_rng(12)
    E, G, R = 64, 8, 8
    loads = rng.lognormal(0, 1.5, size=(1, E)) * 100
    origin = np.concatenate([np.arange(E), np.arange(R)])   # vLLM's initial layout: badly balanced
    res = solve_layer(0, loads, E + R, G, 4, OptimizerConfig(max_moves=max_moves), time.time() + 20,
                      origin=origin)
    check_layer(res.p2l, E, G)
    S = (E + R) // G
    moved = sum(len(set(res.p2l[g * S:(g + 1) * S]) - set(origin[g * S:(g + 1) * S])) for g in range(G))
    assert moved == res.moves <= max_moves
    start = LayerState(normalize_scenarios(loads, G), origin, G).value()
    assert res.value <= start + 1e-12
    if max_moves == 0:
        assert res.value == pytest.approx(start)
    if max_moves == 10:
        assert res.value < start                            # moves were worth making


def _clustered_tokens(rng, n, clusters, k):
    """Tokens that each draw their k experts from one of the expert clusters (co-activation)."""
    out = np.empty((n, k), dtype=np.int64)
    for t in range(n):
        c = clusters[rng.integers(len(clusters))]
        out[t] = rng.choice(c, size=k, replace=False)
    return out


def test_traffic_objective_colocates_coactivated_experts_above_the_floor():
    rng = np.random.default_rng(13)
    E, G, gpn, k = 32, 8, 4, 4                              # 2 nodes of 4 GPUs, 4 slots per GPU
    perm = rng.permutation(E)
    clusters = [perm[:16], perm[16:]]
    samples = _clustered_tokens(rng, 2000, clusters, k)
    loads = np.bincount(samples.ravel(), minlength=E)[None].astype(float)
    cfg = OptimizerConfig(objective="traffic", balance_floor=0.9, pareto=True)
    res = solve_layer(0, loads, E, G, gpn, cfg, time.time() + 30, samples_nk=samples)
    check_layer(res.p2l, E, G)
    assert res.span < res.span0 * 0.8                      # fewer nodes touched per token
    assert 1.0 / res.value >= 0.9 - 1e-9                   # the balancedness floor holds
    tm = TrafficModel(samples, res.p2l, G, gpn)
    assert tm.span() == pytest.approx(res.span)
    spans = [p["span"] for p in res.pareto]
    assert len(spans) >= 2 and spans[-1] <= spans[0] + 1e-9  # looser floors never cost traffic


def test_balance_plus_traffic_keeps_balance_close():
    rng = np.random.default_rng(14)
    E, G, gpn, k = 64, 8, 4, 4
    clusters = np.array_split(rng.permutation(E), 4)
    samples = _clustered_tokens(rng, 3000, clusters, k)
    loads = np.bincount(samples.ravel(), minlength=E)[None].astype(float)
    base = solve_layer(0, loads, E + 8, G, gpn, OptimizerConfig(exact_max_vars=0), time.time() + 20)
    res = solve_layer(0, loads, E + 8, G, gpn, OptimizerConfig(objective="balance+traffic", exact_max_vars=0),
                      time.time() + 30, samples_nk=samples)
    check_layer(res.p2l, E, G)
    assert res.span <= res.span0
    assert 1.0 / res.value >= 1.0 / base.value - 0.01 - 1e-9


def test_sglang_places_replicas_on_distinct_nodes():
    rng = np.random.default_rng(15)
    E, G, gpn, R = 96, 16, 4, 16                            # 4 nodes
    loads = rng.lognormal(0, 1.5, size=(1, E)) * 100
    res = solve_layer(0, loads, E + R, G, gpn, OptimizerConfig(rule="sglang"), time.time() + 20)
    check_layer(res.p2l, E, G)
    S = (E + R) // G
    node_of_slot = np.arange(E + R) // (S * gpn)
    cnt = np.bincount(res.p2l, minlength=E)
    for e in np.flatnonzero((cnt >= 2) & (cnt <= G // gpn)):
        nodes = node_of_slot[res.p2l == e]
        assert len(set(nodes.tolist())) == len(nodes), f"expert {e} has two replicas on one node"


def test_time_limit_is_a_hard_budget():
    rng = np.random.default_rng(16)
    W, L, E, G, R = 6, 6, 896, 32, 32
    loads = rng.lognormal(0, 1.2, size=(W, L, E)) * 100
    cfg = OptimizerConfig(robust=True, time_limit=2.0, workers=1, lns_rounds=50, lns_patience=50)
    t = time.time()
    res = optimize_layers(loads, E + R, G, 8, cfg)
    assert time.time() - t < 2.0 + 1.5
    for r in res:
        check_layer(r.p2l, E, G)
        assert r.bound <= r.value + 1e-12


def test_greedy_start_for_layers_is_deterministic():
    rng = np.random.default_rng(17)
    wn = normalize_scenarios(rng.lognormal(0, 1, size=(2, 200)), 8)
    assert np.array_equal(greedy_layer(wn, 208, 8), greedy_layer(wn, 208, 8))

