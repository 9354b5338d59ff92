"""The partition-first start of the traffic objective: planted groups of co-activated experts are found,
node slots and loads come out exact / balanced, and solve_layer uses it where swaps from a balanced
placement cannot get there."""
from __future__ import annotations

import time

import numpy as np
import pytest

from moeplace.placement.optimizer import OptimizerConfig, solve_layer
from moeplace.placement.optimizer.greedy import normalize_scenarios
from moeplace.placement.optimizer.partition import coactivation, node_partition, pack_nodes, partition_start
from moeplace.placement.optimizer.traffic import TrafficModel
from tests.test_optimizer import check_layer


def themed_tokens(rng, n: int, groups: list[np.ndarray], k: int, in_group: float,
                  weight: np.ndarray) -> np.ndarray:
    """``[n, k]`` distinct experts per token: each slot from the token's group with probability
    ``in_group``, else from all experts; draws follow ``weight`` (hot and cold experts)."""
    E = len(weight)
    out = np.empty((n, k), dtype=np.int64)
    for t in range(n):
        g = groups[rng.integers(len(groups))]
        chosen: list[int] = []
        while len(chosen) < k:
            pool = g if rng.random() < in_group else np.arange(E)
            e = int(rng.choice(pool, p=weight[pool] / weight[pool].sum()))
            if e not in chosen:
                chosen.append(e)
        out[t] = chosen
    return out


def test_coactivation_counts_tokens_using_both():
    C = coactivation(np.array([[0, 1, 2], [1, 2, 3], [2, 2, 0]]), 5)
    assert C[1, 2] == 2 and C[2, 1] == 2 and C[0, 2] == 2 and C[0, 3] == 0
    assert (np.diag(C) == 0).all() and C[4].sum() == 0


def test_planted_groups_are_recovered_with_exact_slots_and_balanced_loads():
    rng = np.random.default_rng(3)
    E, nodes = 64, 4
    groups = np.array_split(rng.permutation(E), nodes)
    weight = np.ones(E)
    samples = themed_tokens(rng, 3000, groups, 6, 0.8, weight)
    w = np.ones(E)  # every group carries exactly a quarter of the load: the planted split is balanced
    cnt = np.ones(E, dtype=np.int64)
    node = node_partition(coactivation(samples, E), w, cnt, nodes, E // nodes)
    found = sorted(sorted(np.flatnonzero(node == n).tolist()) for n in range(nodes))
    assert found == sorted(sorted(g.tolist()) for g in groups)
    # replicas: slot counts per node stay exact, every replica of an expert on its node's GPUs
    cnt[np.concatenate([groups[0][:3], groups[1][:4], groups[2][:1]])] = 2  # 8 redundant slots, unevenly
    node = node_partition(coactivation(samples, E), w, cnt, nodes, (E + 8) // nodes)
    assert (np.bincount(node, weights=cnt, minlength=nodes) == (E + 8) // nodes).all()
    wn = normalize_scenarios((w / cnt.clip(1))[None] * cnt, 8)
    p2l = pack_nodes(node, cnt, wn, nodes, 2, (E + 8) // 8)
    check_layer(p2l, E, 8)
    slot_node = np.arange(len(p2l)) // (2 * ((E + 8) // 8))
    assert (node[p2l] == slot_node).all()


def test_partition_start_refuses_what_it_cannot_build():
    samples = np.array([[0, 1], [2, 3]])
    wn = np.ones((1, 4))
    assert partition_start(samples, wn, np.array([1, 1, 1, 1]), 4, 4) is None     # one node
    assert partition_start(samples, wn, np.array([5, 1, 1, 1]), 8, 4) is None     # 5 replicas > 4 GPUs
    assert partition_start(samples, wn, np.array([2, 1, 1, 1]), 2, 1) is None     # 2 replicas > 1 GPU
    p2l = partition_start(samples, wn, np.array([2, 2, 2, 2]), 4, 2)
    check_layer(p2l, 4, 4)


@pytest.fixture(scope="module")
def themed_layer():
    """128 experts with skewed popularity, tokens of 8 experts drawn 65 % from one of 8 themes of 16
    experts: 16 GPUs = 4 nodes x 4, 16 redundant slots."""
    rng = np.random.default_rng(11)
    E, k = 128, 8
    groups = np.array_split(rng.permutation(E), 8)
    weight = rng.lognormal(0.0, 0.8, E)
    for g in groups:  # equal load per theme, as the synthetic router makes it
        weight[g] /= weight[g].sum()
    samples = themed_tokens(rng, 4000, groups, k, 0.65, weight)
    loads = np.bincount(samples[:2000].ravel(), minlength=E)[None].astype(float)
    return E, loads, samples[:2000], samples[2000:]


def test_traffic_objective_finds_the_themes_a_balanced_start_cannot(themed_layer):
    E, loads, plan_tokens, held = themed_layer
    G, gpn, P = 16, 4, E + 16
    base = solve_layer(0, loads, P, G, gpn, OptimizerConfig(), time.time() + 30)
    floor = 1.0 / base.value - 0.01
    res = solve_layer(0, loads, P, G, gpn, OptimizerConfig(objective="traffic", balance_floor=floor),
                      time.time() + 60, samples_nk=plan_tokens)
    check_layer(res.p2l, E, G)
    assert 1.0 / res.value >= floor - 1e-9
    assert res.traffic_start == "partition"
    assert res.span == pytest.approx(TrafficModel(plan_tokens, res.p2l, G, gpn).span())
    held_base = TrafficModel(held, base.p2l, G, gpn).span()
    held_res = TrafficModel(held, res.p2l, G, gpn).span()
    assert held_res < 0.85 * held_base  # on tokens it was not planned on
    # SGLang's node rule rules the partition start out; the swap search alone gets much less
    sg = solve_layer(0, loads, P, G, gpn, OptimizerConfig(objective="traffic", rule="sglang",
                                                          balance_floor=floor - 0.05),
                     time.time() + 60, samples_nk=plan_tokens)
    assert sg.traffic_start == "balance"


def test_traffic_on_unstructured_tokens_never_costs_span_or_the_floor():
    rng = np.random.default_rng(5)
    E, G, gpn, k = 96, 16, 4, 6
    samples = np.array([rng.choice(E, k, replace=False) for _ in range(1500)])
    loads = np.bincount(samples.ravel(), minlength=E)[None].astype(float) * rng.uniform(0.5, 2.0, E)
    base = solve_layer(0, loads, E + 16, G, gpn, OptimizerConfig(), time.time() + 30)
    for obj in ("traffic", "balance+traffic"):
        res = solve_layer(0, loads, E + 16, G, gpn, OptimizerConfig(objective=obj, balance_floor=0.97),
                          time.time() + 60, samples_nk=samples)
        check_layer(res.p2l, E, G)
        assert res.span <= res.span0 + 1e-12
        assert 1.0 / res.value >= min(0.97, 1.0 / base.value) - 1e-9
