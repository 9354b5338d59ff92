"""The engines' replica-choice rules (placement/rules/, placement/dispatch.py): hand-worked cases and a slow, literal
re-statement of SGLang's loops that the fast map must equal."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from moeplace.foundation.errors import InputError
from moeplace.placement.dispatch import (
    batch_layout,
    choose_slots,
    dp_ranks_round_robin,
    expected_gpu_loads,
    token_gpu_loads,
    token_slots,
)
from moeplace.placement.record import Placement
from moeplace.placement.rules.ideal import ideal_gpu_loads
from moeplace.placement.rules.sglang import _fair_choices, sglang_dispatch_map, sglang_mean_fractions


def make(model, p2l, G, gpn):
    return Placement.from_phy2log(np.asarray(p2l), model, G, gpn)


# ---------------------------------------------------------------------------- vLLM
def test_vllm_hash_rule_hand_computed(tiny):
    # slots: GPU0 = [0, 1, 2], GPU1 = [3, 0, 0]  -> expert 0 has slots 0, 4, 5 (ascending)
    pl = make(tiny, [[0, 1, 2, 3, 0, 0]], 2, 2)
    ids = np.array([[0, 1], [0, 3], [0, 0]])
    # token t hashes to (t * 2654435769) & 0xFFFFFFFF: 0, 2654435769, 1013904242; mod 3 -> 0, 0, 2
    # (all k experts of a token share it): token 0 -> slot 0; token 1 -> slot 0; token 2 -> slot 5, 5
    assert [(t * 2654435769) & 0xFFFFFFFF for t in range(3)] == [0, 2654435769, 1013904242]
    assert choose_slots(pl, 0, ids, "vllm").tolist() == [[0, 1], [0, 3], [5, 5]]


def test_vllm_modulo_on_flattened_index(tiny):
    pl = make(tiny, [[0, 1, 2, 3, 0, 0]], 2, 2)
    ids = np.array([[0, 1], [0, 3], [0, 0]])
    # flattened positions 0..5: (0,0)->0%3=0 slot0; (0,1)->expert1 slot1; (1,0)->2%3=2 slot5;
    # (1,1)->expert3 slot3; (2,0)->4%3=1 slot4; (2,1)->5%3=2 slot5
    assert choose_slots(pl, 0, ids, "vllm", vllm_rule="modulo").tolist() == [[0, 1], [5, 3], [4, 5]]


def test_vllm_index_restarts_per_batch(tiny):
    pl = make(tiny, [[0, 1, 2, 3, 0, 0]], 2, 2)
    ids = np.zeros((4, 1, 2), dtype=np.int64)
    ids[:, 0, 1] = 1
    src = np.zeros(4, dtype=np.int64)
    one = token_slots(pl, ids, "vllm", src_gpu=src, batch_tokens=None, vllm_rule="modulo")[:, 0, 0]
    two = token_slots(pl, ids, "vllm", src_gpu=src, batch_tokens=2, vllm_rule="modulo")[:, 0, 0]
    # one batch: positions 0,2,4,6 -> replicas 0,2,1,0 -> slots 0,5,4,0
    assert one.tolist() == [0, 5, 4, 0]
    # two batches of 2 tokens: positions 0,2 | 0,2 -> slots 0,5 | 0,5
    assert two.tolist() == [0, 5, 0, 5]
    # hash rule: tokens 0,1,2,3 -> hashes mod 3 = 0,0,2,(3*2654435769 & 0xFFFFFFFF) % 3
    h3 = ((3 * 2654435769) & 0xFFFFFFFF) % 3
    hashed = token_slots(pl, ids, "vllm", src_gpu=src)[:, 0, 0]
    assert hashed.tolist() == [0, 0, 5, [0, 4, 5][h3]]
    assert token_slots(pl, ids, "vllm", src_gpu=src, batch_tokens=2)[:, 0, 0].tolist() == [0, 0, 0, 0]


def test_vllm_rules_split_evenly_over_many_tokens(tiny):
    pl = make(tiny, [[0, 1, 2, 3, 0, 0]], 2, 2)
    ids = np.tile([[0, 1]], (30_000, 1))
    for rule in ("hash", "modulo"):
        counts = np.bincount(choose_slots(pl, 0, ids, "vllm", vllm_rule=rule)[:, 0], minlength=6)
        assert np.allclose(counts[[0, 4, 5]], 10_000, rtol=0.01)


# ---------------------------------------------------------------------------- SGLang
def test_fair_choices_is_even_and_seeded():
    r = random.Random(1)
    out = _fair_choices([7, 9], 5, r)
    assert sorted(out).count(7) in (2, 3) and len(out) == 5
    r2 = random.Random(1)
    assert _fair_choices([7, 9], 5, r2) == out


def test_sglang_hand_worked_local_and_node_preference(tiny):
    # 4 GPUs, 2 per node, 2 slots per GPU: GPU0 [0,1] GPU1 [2,3] GPU2 [0,2] GPU3 [1,3]
    pl = make(tiny, [[0, 1, 2, 3, 0, 2, 1, 3]], 4, 2)
    d = sglang_dispatch_map(pl)[:, 0, :]  # [G, E]
    # expert 0: slots 0 (GPU0), 4 (GPU2). GPU0 -> 0, GPU2 -> 4 (own GPU); GPU1 is on node 0 with slot 0
    # only (narrows 2 -> 1) -> 0; GPU3 on node 1 with slot 4 -> 4.
    assert d[:, 0].tolist() == [0, 0, 4, 4]
    # expert 3: slots 3 (GPU1), 7 (GPU3): GPU0 -> node0 -> 3, GPU2 -> node1 -> 7
    assert d[:, 3].tolist() == [3, 3, 7, 7]
    # the legacy rule has no node preference: GPU1's choice for expert 0 is a fair draw over {0, 4}
    leg = sglang_dispatch_map(pl, variant="legacy")[:, 0, :]
    assert leg[0, 0] == 0 and leg[2, 0] == 4 and leg[1, 0] in (0, 4) and leg[3, 0] in (0, 4)


def test_sglang_fair_choice_when_no_local_replica(tiny):
    # 4 GPUs on ONE node: same-node never narrows; expert 0 lives on GPU2 and GPU3 only
    pl = make(tiny, [[1, 2, 3, 1, 0, 2, 0, 3]], 4, 4)
    d = sglang_dispatch_map(pl, seed=42)[:, 0, :]
    assert d[2, 0] == 4 and d[3, 0] == 6  # own GPU
    # GPUs 0 and 1 are the remaining ranks; mainline: each replays its own stream
    for g in (0, 1):
        r = random.Random(42)
        choice = _fair_choices([4, 6], 2, r)[g]
        assert d[g, 0] == choice


def _sglang_reference(pl: Placement, seed: int, variant: str) -> np.ndarray:
    """SGLang's construction, restated loop by loop (slow): per rank, narrow the candidate lists to the
    rank's nearest replica (mainline), then build the whole table and keep the rank's row."""
    G, L, E, S = pl.num_gpus, pl.num_layers, pl.num_experts, pl.slots_per_gpu
    gpn = pl.gpus_per_node
    all_phys = [[[int(p) for p in range(pl.num_slots) if pl.phy2log[l, p] == e] for e in range(E)]
                for l in range(L)]

    def nearest(cands, rank):
        if len(cands) == 1:
            return cands[0]
        same = [p for p in cands if p // S == rank]
        if same:
            return same[0]
        if variant == "mainline":
            node = [p for p in cands if p // (S * gpn) == rank // gpn]
            if 0 < len(node) < len(cands):
                return node[0]
        return -1

    def table(l2p):
        r = random.Random(seed)
        res = [[[-1] * E for _ in range(L)] for _ in range(G)]
        for l in range(L):
            for e in range(E):
                cands = l2p[l][e]
                rem = []
                for g in range(G):
                    v = nearest(cands, g)
                    res[g][l][e] = v
                    if v == -1:
                        rem.append(g)
                if rem:
                    for g, c in zip(rem, _fair_choices(cands, len(rem), r)):
                        res[g][l][e] = c
        return res

    out = np.zeros((G, L, E), dtype=np.int64)
    if variant == "legacy":
        return np.array(table(all_phys))
    for rank in range(G):
        own = [[[nearest(all_phys[l][e], rank)] if nearest(all_phys[l][e], rank) != -1 else all_phys[l][e]
                for e in range(E)] for l in range(L)]
        out[rank] = np.array(table(own)[rank])
    return out


@pytest.mark.parametrize("variant", ["mainline", "legacy"])
@pytest.mark.parametrize("seed", [0, 42])
def test_sglang_map_equals_literal_reference(k3, variant, seed):
    model = replace(k3, name="small", num_layers=4, moe_layers=(1, 2, 3), num_experts=12, top_k=4,
                    attention=("kda",) * 4, mla=None)
    rng = np.random.default_rng(seed)
    G, gpn, R = 6, 2, 12
    p2l = np.concatenate([np.tile(np.arange(12), (3, 1)), rng.integers(0, 12, (3, R))], axis=1)
    for row in p2l:
        rng.shuffle(row)
    pl = make(model, p2l, G, gpn)
    fast = sglang_dispatch_map(pl, seed, variant=variant)
    assert np.array_equal(fast, _sglang_reference(pl, seed, variant))
    # every entry is a replica of the right expert
    assert (pl.phy2log[np.arange(3)[None, :, None], fast] == np.arange(12)[None, None, :]).all()


def test_sglang_mean_fractions_are_distributions(k3):
    model = replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=8, top_k=2,
                    attention=("kda",) * 3, mla=None)
    rng = np.random.default_rng(3)
    p2l = np.concatenate([np.tile(np.arange(8), (2, 1)), rng.integers(0, 8, (2, 8))], axis=1)
    pl = make(model, p2l, 4, 2)
    frac = sglang_mean_fractions(pl)  # [G, L, P]
    per_expert = np.zeros((4, 2, 8))
    for l in range(2):
        np.add.at(per_expert[:, l, :], (slice(None), pl.phy2log[l]), frac[:, l, :])
    assert np.allclose(per_expert, 1.0)


# ---------------------------------------------------------------------------- Loads-level
def test_expected_loads_hand_computed(tiny):
    # GPU0 [0,1] GPU1 [0,2] GPU2 [3,3]... use a valid layout: GPU0 [0,1], GPU1 [2,0], GPU2 [3,1]
    pl = make(tiny, [[0, 1, 2, 0, 3, 1]], 3, 3)
    w = np.array([[60.0, 30.0, 10.0, 20.0]])
    v = expected_gpu_loads(pl, w, "vllm")
    # expert 0 split 30/30 (GPU0, GPU1); expert 1 split 15/15 (GPU0, GPU2)
    assert v.tolist() == [[45.0, 40.0, 35.0]]
    ideal = expected_gpu_loads(pl, w, "ideal")
    # total 120 over 3 GPUs = 40 each is reachable: GPU1 fixed 10 + x0, GPU2 20 + x1, GPU0 the rest
    assert np.allclose(ideal, [[40.0, 40.0, 40.0]], atol=1e-6)
    s = expected_gpu_loads(pl, w, "sglang")
    assert np.isclose(s.sum(), 120.0)
    # GPU0 keeps its own share of 0 and 1, GPU1 its share of 0, GPU2 its share of 1 (20 per rank each)
    d = sglang_dispatch_map(pl)[:, 0, :]
    assert d[0, 0] == 0 and d[1, 0] == 3 and d[0, 1] == 1 and d[2, 1] == 5


def test_ideal_beats_or_ties_every_rule(k3):
    model = replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=16, top_k=4,
                    attention=("kda",) * 3, mla=None)
    rng = np.random.default_rng(5)
    p2l = np.concatenate([np.tile(np.arange(16), (2, 1)), rng.integers(0, 16, (2, 8))], axis=1)
    for row in p2l:
        rng.shuffle(row)
    pl = make(model, p2l, 4, 2)
    w = rng.gamma(0.5, 100.0, (2, 16))
    ideal, span = ideal_gpu_loads(pl, w)
    assert np.allclose(ideal.sum(1), w.sum(1))
    assert np.allclose(span, ideal.max(1))
    for eng in ("vllm", "sglang"):
        assert (expected_gpu_loads(pl, w, eng).max(1) >= span - 1e-6).all()


def test_bad_inputs(tiny):
    pl = make(tiny, [[0, 1, 2, 3]], 2, 2)
    with pytest.raises(InputError, match="unknown replica rule .*did you mean 'trtllm'"):
        expected_gpu_loads(pl, np.ones((1, 4)), "trt")
    with pytest.raises(InputError, match=r"loads must be \[1, 4\]"):
        expected_gpu_loads(pl, np.ones((2, 4)), "vllm")
    with pytest.raises(InputError, match="src_gpu"):
        choose_slots(pl, 0, np.zeros((1, 2)), "sglang")
    with pytest.raises(InputError, match="out of range"):
        choose_slots(pl, 0, np.full((1, 2), 9), "vllm")
    with pytest.raises(InputError, match="fractional"):
        choose_slots(pl, 0, np.zeros((1, 2)), "ideal")


# ---------------------------------------------------------------------------- token-level
def test_dp_ranks_round_robin_by_first_appearance():
    rid = np.array([7, 7, 3, 9, 3, 5, 7])
    assert dp_ranks_round_robin(rid, 2).tolist() == [0, 0, 1, 0, 1, 1, 0]


def test_batch_layout_steps():
    step, pos = batch_layout(np.array([0, 1, 0, 0, 1, 0]), 2, 2)
    assert step.tolist() == [0, 0, 0, 1, 0, 1]
    assert pos.tolist() == [0, 0, 1, 0, 1, 1]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "ideal"])
def test_token_loads_keep_mass(tiny, engine):
    pl = make(tiny, [[0, 1, 2, 0, 3, 1]], 3, 3)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(50)])[:, None, :]
    src = dp_ranks_round_robin(np.arange(50) // 5, 3)
    loads = token_gpu_loads(pl, ids, engine, src_gpu=src, batch_tokens=4)
    assert loads.sum() == pytest.approx(100.0)
    step, _ = batch_layout(src, 3, 4)
    assert loads.shape == (step.max() + 1, 1, 3)
    assert np.allclose(loads.sum(axis=2)[:, 0], np.bincount(step) * 2)
