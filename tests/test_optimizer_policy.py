"""The ``moeplace`` policy through the registry: valid placements, evaluate() agreement, determinism,
migration from a placement file, errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import PlacementProblem, get_policy


@pytest.fixture(scope="module")
def qwen():
    """Qwen3-30B-A3B's experts (128, top-8) on 4 MoE layers: the real shape, a fast test."""
    q = load_model("qwen3-30b-a3b")
    return dataclasses.replace(q, name="qwen3-4-layers", num_layers=4, moe_layers=(0, 1, 2, 3),
                               attention=q.attention[:4])


def problem(model, W=3, G=8, R=8, seed=0, **options):
    rng = np.random.default_rng(seed)
    loads = rng.lognormal(0, 1.2, size=(W, model.num_moe_layers, model.num_experts)) * 100
    return PlacementProblem(loads, model, make_cluster(G, gpus_per_node=4), R, seed=seed,
                            options={"workers": 2, **options})


def test_policy_is_registered_valid_and_agrees_with_evaluate(qwen):
    prob = problem(qwen)
    pl = get_policy("moeplace")(prob)
    assert pl.num_slots == qwen.num_experts + 8 and pl.num_gpus == 8
    assert not pl.duplicate_on_gpu().any()
    layers = pl.provenance["params"]["layers"]
    assert len(layers) == qwen.num_moe_layers
    m = evaluate(pl, prob.loads.sum(0), "vllm", model=qwen)
    for lay, b in zip(layers, m.layer_balancedness):
        assert lay["bound"] <= lay["value"] + 1e-12
        assert lay["value"] <= lay["greedy_value"] + 1e-12
        assert b == pytest.approx(lay["balancedness"], rel=1e-9)   # same score as evaluate()
    eplb = get_policy("eplb")(prob)
    assert m.balancedness >= evaluate(eplb, prob.loads.sum(0), "vllm", model=qwen).balancedness - 1e-9


def test_same_seed_same_output(qwen):
    a = get_policy("moeplace")(problem(qwen, robust=True))
    b = get_policy("moeplace")(problem(qwen, robust=True))
    assert np.array_equal(a.phy2log, b.phy2log)


def test_migration_from_file(qwen, tmp_path):
    prob = problem(qwen)
    cur = get_policy("linear")(prob)
    path = tmp_path / "current.json"
    cur.save(path)
    pl = get_policy("moeplace")(problem(qwen, **{"from": str(path), "max_moves": 4}))
    S = pl.slots_per_gpu
    for l in range(pl.num_layers):
        moved = sum(len(set(pl.phy2log[l, g * S:(g + 1) * S]) - set(cur.phy2log[l, g * S:(g + 1) * S]))
                    for g in range(pl.num_gpus))
        assert moved <= 4
        # experts that stay on a GPU keep their slot
        same = [p for p in range(pl.num_slots) if cur.phy2log[l, p] in pl.gpu_experts(l, p // S)]
        assert all(pl.phy2log[l, p] == cur.phy2log[l, p] for p in same)
    assert pl.provenance["params"]["summary"]["max_moves_used"] <= 4


def test_errors_are_input_errors(qwen, tmp_path):
    with pytest.raises(InputError, match="--from"):
        get_policy("moeplace")(problem(qwen, max_moves=3))
    other = get_policy("linear")(problem(qwen, G=16, R=16))
    path = tmp_path / "other.json"
    other.save(path)
    with pytest.raises(InputError, match="placement is for 16 GPUs"):
        get_policy("moeplace")(problem(qwen, **{"from": str(path), "max_moves": 3}))
    with pytest.raises(InputError, match="objective"):
        get_policy("moeplace")(problem(qwen, objective="speed"))


def test_canonical_slots_with_an_origin_holding_an_expert_twice_on_one_gpu():
    """EPLB can put two replicas of one expert on one GPU; the new placement keeps one: the other slot
    must take the new placement's expert, not repeat the old one (every expert keeps a slot)."""
    from moeplace.placement.policies.moeplace import canonical_slots

    origin = np.array([0, 0, 1, 2, 3, 4])  # GPU 0 holds expert 0 twice
    new = np.array([0, 5, 1, 2, 3, 4])
    out = canonical_slots(new, 2, origin)
    assert sorted(out[:3].tolist()) == [0, 1, 5] and out[:3].tolist() == [0, 5, 1]
    assert sorted(out.tolist()) == sorted(new.tolist())
