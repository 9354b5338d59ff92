"""The replica-rule interface (placement/rules/): the registry, and TensorRT-LLM's rule against a literal
re-statement of its routing kernel (moeComputeRouteKernel: 1,024-element blocks, warp 0 counting each
multi-replica expert's occurrences in element order, replica = (count + block + rank) % replicas)."""
from __future__ import annotations

import numpy as np
import pytest

from moeplace.foundation.errors import InputError
from moeplace.placement.dispatch import ENGINE_RULES, ENGINES, expected_gpu_loads, token_gpu_loads
from moeplace.placement.record import Placement
from moeplace.placement.rules import ReplicaRule, get_rule, rule_names
from moeplace.placement.rules.trtllm import BLOCK_ELEMENTS


def _kernel_reference(topk_ids: np.ndarray, replica_count: np.ndarray, replica_slots: list[list[int]],
                      ep_rank: int, offset_by_ep_rank: bool) -> np.ndarray:
    """One rank's call of the kernel, written as its loops run: elements in blocks of 1,024; per block a
    fresh per-expert counter; each element of a multi-replica expert takes the counter's value and bumps it."""
    flat = topk_ids.ravel()
    out = np.empty_like(flat)
    for start in range(0, flat.size, BLOCK_ELEMENTS):
        block = start // BLOCK_ELEMENTS
        base = block + (ep_rank if offset_by_ep_rank else 0)
        counter: dict[int, int] = {}
        for f in range(start, min(start + BLOCK_ELEMENTS, flat.size)):
            e = int(flat[f])
            c = int(replica_count[e])
            if c > 1:
                occ = counter.get(e, 0)
                counter[e] = occ + 1
                out[f] = replica_slots[e][(occ + base) % c]
            else:
                out[f] = replica_slots[e][0]
    return out.reshape(topk_ids.shape)


@pytest.fixture()
def placement(tiny):
    # 4 experts, 8 slots on 4 GPUs: expert 0 three times, expert 1 twice, experts 2, 3 once... plus one more 1
    p2l = np.array([[0, 1, 0, 2, 1, 3, 0, 1]])
    return Placement.from_phy2log(p2l, tiny, 4, 2)


def test_registry_names_every_rule_once_and_suggests_the_nearest():
    assert set(rule_names()) == {"vllm", "sglang", "trtllm", "ideal"} == set(ENGINES)
    assert set(ENGINE_RULES) == {"vllm", "sglang", "trtllm"}  # the ideal split is no engine's per-token rule
    for name in rule_names():
        rule = get_rule(name)
        assert isinstance(rule, ReplicaRule) and rule.name == name
    with pytest.raises(InputError, match="did you mean 'sglang'"):
        get_rule("sglng")
    with pytest.raises(InputError, match="rule version 'hashed'"):
        get_rule("vllm", vllm_rule="hashed")
    # each rule takes only its own version option
    assert get_rule("vllm", vllm_rule="modulo", sglang_variant="legacy").variant == "modulo"
    assert get_rule("sglang", vllm_rule="modulo", sglang_variant="legacy").variant == "legacy"


@pytest.mark.parametrize("variant", ["dp", "tp"])
@pytest.mark.parametrize("num_tokens", [3, 700, 2100])  # one block, and several blocks of 1,024 elements
def test_trtllm_slots_equal_the_kernel(placement, variant, num_tokens):
    rng = np.random.default_rng(num_tokens)
    G = placement.num_gpus
    rule = get_rule("trtllm", trtllm_variant=variant)
    k = 2
    ids = np.stack([rng.choice(4, size=k, replace=False) for _ in range(num_tokens * G)])  # [n, k]
    src = np.repeat(np.arange(G), num_tokens)  # each rank's batch of num_tokens
    pos = np.tile(np.arange(num_tokens), G)
    got = rule.batch_slots(placement, 0, ids, src_gpu=src, pos_in_batch=pos)
    cnt = placement.logcnt[0]
    reps = [list(placement.log2phy[0, e, :cnt[e]]) for e in range(4)]
    for g in range(G):
        mine = src == g
        want = _kernel_reference(ids[mine], cnt, reps, g, offset_by_ep_rank=variant == "dp")
        assert (got[mine] == want).all()
    # tokens of two engine steps are two batches: the second restarts the counters
    two = rule.batch_slots(placement, 0, np.vstack([ids[:3], ids[:3]]), src_gpu=np.zeros(6, dtype=int),
                           pos_in_batch=np.array([0, 1, 2, 0, 1, 2]), batch_id=np.array([0, 0, 0, 1, 1, 1]))
    assert (two[:3] == two[3:]).all()


def test_trtllm_is_an_even_split_over_many_tokens(placement):
    rng = np.random.default_rng(0)
    n = 40_000
    ids = np.stack([rng.choice(4, size=2, replace=False, p=[0.4, 0.3, 0.2, 0.1]) for _ in range(n)])[:, None, :]
    src = np.arange(n) % placement.num_gpus
    got = token_gpu_loads(placement, ids, "trtllm", src_gpu=src).sum(axis=0)  # [L, G]
    loads = np.bincount(ids[:, 0, :].ravel(), minlength=4)[None].astype(float)
    want = expected_gpu_loads(placement, loads, "trtllm")
    assert np.allclose(got, want, rtol=0.02)
    assert get_rule("trtllm").even_split and not get_rule("sglang").even_split


def test_each_rule_owns_its_planning_memory():
    """placement_estimate adds what the rule says: SGLang's per-placement dispatch map, the ideal split's
    holder table once; the even-split rules nothing."""
    from moeplace.foundation.limits import placement_estimate

    L, E, G, R, n = 4, 64, 16, 16, 3
    base = placement_estimate(L, E, G, R, num_placements=n).bytes
    for name in rule_names():
        est = placement_estimate(L, E, G, R, num_placements=n, rule=get_rule(name).planning_memory(L, E, G))
        extra = {"sglang": n * 4.0 * G * L * E + 4 * 8.0 * L * G * G, "ideal": float(L * E * G)}.get(name, 0.0)
        assert est.bytes == base + extra, name
        assert ("SGLang dispatch map" in est.detail) == (name == "sglang")


def test_every_engine_rule_has_an_export_target_the_sweep_recommends():
    from moeplace.placement.export import get_format
    from moeplace.placement.export.flags import EXPORT_TARGETS, TARGET_OF_FORMAT, recommended_format

    for rule in ENGINE_RULES:  # what a sweep's engine axis takes
        fmt, fname = recommended_format(rule)
        assert EXPORT_TARGETS[TARGET_OF_FORMAT[fmt]].replica_rule == rule
        assert any(fname.endswith(s) for s in get_format(fmt).suffixes)
    assert recommended_format("ideal") is None  # no engine routes with the LP optimum
    assert {t.replica_rule for t in EXPORT_TARGETS.values()} - {None} <= set(rule_names())
