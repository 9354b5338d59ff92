"""DeepSeek EPLB reimplementation (placement/policies/eplb.py)."""
from __future__ import annotations

import numpy as np
import pytest

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.placement.policies.eplb import balanced_packing, rebalance_experts, replicate_experts

# The published example (README of github.com/deepseek-ai/EPLB)
WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_published_example_exactly():
    p2l, cnt, mode = rebalance_experts(np.array(WEIGHT), 16, 4, 2, 8)
    assert mode == "hierarchical"
    assert p2l.tolist() == PHY2LOG
    assert (cnt == np.stack([np.bincount(r, minlength=12) for r in p2l])).all()


def test_balanced_packing_hand_worked():
    # heaviest first into the lightest pack with room (2 items each): 9 -> pack 0; 7 -> pack 1 (0 < 9);
    # 6 -> pack 1 (7 < 9), now full; 5 -> pack 0
    idx, rank = balanced_packing(np.array([[9.0, 7.0, 6.0, 5.0]]), 2)
    assert idx.tolist() == [[0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1]]


def test_replicate_experts_hand_worked():
    p2l, rank, cnt = replicate_experts(np.array([[90.0, 40.0, 10.0]]), 6)
    assert p2l.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert rank.tolist() == [[0, 0, 0, 1, 2, 1]]
    assert cnt.tolist() == [[3, 2, 1]]


def test_global_mode_when_groups_do_not_divide_nodes():
    w = np.array(WEIGHT)
    p2l, cnt, mode = rebalance_experts(w, 16, 1, 2, 8)
    assert mode == "global"
    assert sorted(set(p2l[0].tolist())) == list(range(12)) and cnt.sum(1).tolist() == [16, 16]
    # 4 redundant slots to the largest load / count: 183 -> 91.5, 165 -> 82.5, 132 -> 66, then 104 > 91.5
    assert cnt[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]


def test_policy_on_k3_shapes(k3):
    rng = np.random.default_rng(0)
    loads = rng.gamma(0.5, 100, (2, k3.num_moe_layers, k3.num_experts))
    pl = get_policy("eplb")(PlacementProblem(loads, k3, make_cluster(32), 32))
    assert pl.provenance["params"]["mode"] == "global"  # K3 has no expert groups
    assert pl.num_slots == 928 and (pl.logcnt >= 1).all()


def test_bad_shapes():
    with pytest.raises(InputError):
        rebalance_experts(np.ones((1, 12)), 15, 1, 1, 4)
