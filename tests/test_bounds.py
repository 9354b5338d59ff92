"""Lower bounds (placement/bounds.py): hand-computed values and that nothing beats them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.foundation.errors import InputError
from moeplace.placement.bounds import even_split_bound, minmax_replica_counts, splittable_bound
from moeplace.placement.dispatch import expected_gpu_loads
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule


def test_splittable_and_even_split_hand_computed():
    w = np.array([[60.0, 30.0, 10.0, 20.0]])
    assert splittable_bound(w, 3).tolist() == [40.0]
    # counts (2,2,1,1): units 30,30,15,15,10,20 sorted 10,15,15,20,30,30; S = 2 -> 30 + 10 = 40
    assert even_split_bound(w, np.array([[2, 2, 1, 1]]), 3, 2).tolist() == [40.0]
    # no replication, 2 GPUs x 2 slots: w_max 60 + smallest other 10 = 70 > total/G 60
    assert even_split_bound(w, np.ones((1, 4), int), 2, 2).tolist() == [70.0]


def test_minmax_counts_hand_computed():
    w = np.array([[90.0, 40.0, 10.0]])
    c = minmax_replica_counts(w, 6)
    # add 3 replicas: 90 -> 45 (c=2), 45 -> 40.. expert0 45 vs expert1 40: expert0 c=3 (30); then 40 -> c=2
    assert c.tolist() == [[3, 2, 1]]
    assert get_rule("vllm").budget_bound(w, 3, 6).tolist() == [max(140 / 3, 30.0)]
    assert get_rule("ideal").budget_bound(w, 3, 6).tolist() == [pytest.approx(140 / 3)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(2, 1), (4, 2), (6, 3)]), st.integers(0, 6))
def test_no_placement_beats_its_bounds(k3, seed, grid, extra):
    G, gpn = grid
    E = 12
    R = (-E) % G + G * (extra % 2)
    model = replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=E, top_k=3,
                    attention=("kda",) * 3, mla=None)
    rng = np.random.default_rng(seed)
    p2l = np.concatenate([np.tile(np.arange(E), (2, 1)), rng.integers(0, E, (2, R))], axis=1)
    for row in p2l:
        rng.shuffle(row)
    pl = Placement.from_phy2log(p2l, model, G, gpn)
    w = rng.gamma(0.6, 50.0, (2, E)).round()
    for eng in ("vllm", "sglang", "ideal"):
        mx = expected_gpu_loads(pl, w, eng).max(axis=1)
        assert (mx >= get_rule(eng).placement_bound(pl, w) - 1e-6).all()
        assert (mx >= get_rule(eng).budget_bound(w, G, E + R) - 1e-6).all()
        assert (get_rule(eng).placement_bound(pl, w) >= splittable_bound(w, G) - 1e-6).all()


def _former_bounds_counts(w: np.ndarray, num_slots: int) -> np.ndarray:
    """bounds.minmax_replica_counts before the optimizer shared it (uncapped, all layers at once)."""
    cnt = np.ones(w.shape, dtype=np.int64)
    rows = np.arange(w.shape[0])
    for _ in range(num_slots - w.shape[1]):
        cnt[rows, np.argmax(w / cnt, axis=1)] += 1
    return cnt


def _former_greedy_counts(key: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """optimizer.greedy.replica_counts before it was folded in (one layer, at most num_gpus replicas)."""
    cnt = np.ones(key.shape[0], dtype=np.int64)
    ratio = key.astype(np.float64).copy()
    for _ in range(num_slots - key.shape[0]):
        e = int(np.argmax(np.where(cnt < num_gpus, ratio, -np.inf)))
        cnt[e] += 1
        ratio[e] = key[e] / cnt[e]
    return cnt


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 12), st.integers(1, 8), st.booleans())
def test_water_filling_matches_both_former_copies(seed, E, G, ties):
    """The one water-filling gives what the bounds' and the greedy optimizer's copies gave, ties included."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 4, (3, E)).astype(np.float64) if ties else rng.gamma(0.6, 50.0, (3, E))
    P = E + int(rng.integers(0, E * (G - 1) + 1))  # every budget the cap allows
    assert np.array_equal(minmax_replica_counts(w, P), _former_bounds_counts(w, P))
    capped = minmax_replica_counts(w, P, max_count=G)
    for l in range(3):
        assert np.array_equal(capped[l], _former_greedy_counts(w[l], P, G))
    assert (capped.sum(axis=1) == P).all() and capped.max() <= G


def test_water_filling_cap_is_checked():
    with pytest.raises(InputError, match="at most 2 replicas"):
        minmax_replica_counts(np.ones((1, 3)), 7, max_count=2)
