"""evaluate() (placement/evaluate.py): hand-computed metrics on tiny cases, properties on random ones,
token-level replay from a real trace file."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.placement.evaluate import TokenRouting, evaluate, read_token_routing
from moeplace.placement.record import Placement
from moeplace.traces.format import TraceWriter
from moeplace.traces.loads import Loads


def make(model, p2l, G, gpn):
    return Placement.from_phy2log(np.asarray(p2l), model, G, gpn)


def test_hand_computed_loads_metrics(tiny):
    # GPU0 [0,1], GPU1 [2,0], GPU2 [3,1]; one node of 3 GPUs
    pl = make(tiny, [[0, 1, 2, 0, 3, 1]], 3, 3)
    w = np.array([[[60.0, 30.0, 10.0, 20.0]], [[0.0, 0.0, 30.0, 30.0]]])  # 2 windows
    m = evaluate(pl, w, "vllm", model=tiny)
    # window 0: GPU loads 45, 40, 35 -> mean 40, max 45; window 1: 0, 30, 30 -> mean 20, max 30
    assert m.gpu_loads[:, 0, :].tolist() == [[45.0, 40.0, 35.0], [0.0, 30.0, 30.0]]
    assert m.window_balancedness == pytest.approx([40 / 45, 20 / 30])
    assert m.balancedness == pytest.approx((40 / 45 + 20 / 30) / 2)
    assert m.worst_window_balancedness == pytest.approx(20 / 30)
    assert m.max_over_mean == pytest.approx((45 / 40 + 30 / 20) / 2)
    # bound for this placement (even split, S=2): window 0 units 30,30,15,15,10,20 -> 30 + 10 = 40;
    # window 1: units 0,0,0,0,30,30 -> 30 + 0 = 30 vs total/G = 20 -> 30
    assert m.bound_placement[:, 0].tolist() == [40.0, 30.0]
    assert m.layer_gap_placement.tolist() == pytest.approx([(45 / 40 - 1 + 0) / 2])
    # budget bound (6 slots for 4 experts, vLLM): window 0 min max unit = 30 (60 split in 2) vs 40 -> 40
    assert m.bound_budget[:, 0].tolist() == pytest.approx([40.0, 20.0])
    # one node: nothing crosses nodes
    assert m.cross_node_share == 0.0 and m.remote_per_token["node"] == 0.0
    # weights: 2 slots x bytes per expert x 1 MoE layer
    assert m.expert_bytes_per_gpu == pytest.approx(2 * tiny.bytes_per_routed_expert)
    d = m.to_dict()
    assert d["layer_balancedness"] == pytest.approx([(40 / 45 + 20 / 30) / 2])
    assert m.ratio_of_sums == pytest.approx(m.balancedness)  # one layer: both forms agree


def test_ratio_of_sums_differs_from_layer_mean(k3):
    two = replace(k3, name="two", num_layers=3, moe_layers=(1, 2), num_experts=2, top_k=1,
                  attention=("kda",) * 3, mla=None)
    pl = make(two, [[0, 1], [0, 1]], 2, 2)
    w = np.array([[10.0, 30.0], [50.0, 50.0]])
    m = evaluate(pl, w, "vllm", model=two)
    # layer 0: mean 20 max 30; layer 1: mean 50 max 50
    assert m.balancedness == pytest.approx((20 / 30 + 1.0) / 2)
    assert m.ratio_of_sums == pytest.approx((20 + 50) / (30 + 50))


def test_token_level_exact_traffic_hand_computed(tiny):
    # 4 GPUs, 2 per node, 1 slot each... need P >= E: 4 slots, GPU g holds expert g
    pl = make(tiny, [[0, 1, 2, 3]], 4, 2)
    ids = np.array([[[0, 1]], [[2, 3]], [[1, 2]], [[3, 0]]])
    tr = TokenRouting(ids, np.array([0, 1, 2, 3]), tiny)  # request r -> DP rank r
    m = evaluate(pl, tr, "vllm")
    # token 0 on GPU0 uses GPUs 0,1: 1 remote GPU, 0 remote nodes
    # token 1 on GPU1 uses 2,3: 2 remote GPUs on node 1 -> 1 remote node, 2 remote selections cross node
    # token 2 on GPU2 uses 1,2: 1 remote GPU (node 0) -> 1 remote node
    # token 3 on GPU3 uses 3,0: 1 remote GPU (node 0) -> 1 remote node
    assert m.traffic_method == "exact"
    assert m.remote_per_token == pytest.approx({"node": 3 / 4, "gpu": 5 / 4, "expert": 5 / 4})
    assert m.cross_node_share == pytest.approx(4 / 8)
    per_send = tiny.expert_hidden_size * 2  # bf16
    assert m.dispatch_bytes_per_token["node"] == pytest.approx(3 / 4 * per_send)
    assert m.gpu_loads[0, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert m.balancedness == 1.0


def test_batch_distribution(tiny):
    pl = make(tiny, [[0, 1, 2, 3]], 2, 2)  # GPU0 {0,1}, GPU1 {2,3}
    # 4 tokens all on rank 0 (one request); batches of 2 tokens: step 0 all on GPU0, step 1 balanced
    ids = np.array([[[0, 1]], [[0, 1]], [[0, 2]], [[1, 3]]])
    m = evaluate(pl, TokenRouting(ids, np.zeros(4, int), tiny), "vllm", batch_tokens=2)
    assert m.batch_balancedness.tolist() == pytest.approx([2 / 4, 1.0])
    st_ = m.batch_stats()
    assert st_["num_batches"] == 2
    assert st_["mean"] == pytest.approx(0.75) and st_["p50"] == pytest.approx(0.75)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["vllm", "sglang", "ideal"]),
       st.sampled_from([(4, 2), (6, 3), (8, 4)]))
def test_properties_mass_range_floor(k3, seed, engine, grid):
    G, gpn = grid
    E = 12
    R = (-E) % G + G
    model = replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=E, top_k=3,
                    attention=("kda",) * 3, mla=None)
    rng = np.random.default_rng(seed)
    p2l = np.concatenate([np.tile(np.arange(E), (2, 1)), rng.integers(0, E, (2, R))], axis=1)
    for row in p2l:
        rng.shuffle(row)
    pl = make(model, p2l, G, gpn)
    w = rng.gamma(0.5, 40.0, (3, 2, E)).round() + (rng.random((3, 2, E)) < 0.1)
    m = evaluate(pl, w, engine, model=model)
    assert np.allclose(m.gpu_loads.sum(axis=2), w.sum(axis=2))  # token mass kept
    b = m.layer_balancedness_wl
    assert ((b <= 1 + 1e-12) & (b >= 1 / G - 1e-12)).all()
    # no better than the bound allows (with a GLOP tolerance)
    assert (m.max_load >= m.bound_placement * (1 - 1e-7) - 1e-9).all()
    assert (m.max_load >= m.bound_budget * (1 - 1e-7) - 1e-9).all()
    assert 0.0 <= m.cross_node_share <= 1.0


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["vllm", "ideal"]))
def test_permuting_gpus_changes_nothing(k3, seed, engine):
    E, G, gpn = 12, 4, 2
    model = replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=E, top_k=3,
                    attention=("kda",) * 3, mla=None)
    rng = np.random.default_rng(seed)
    p2l = np.concatenate([np.tile(np.arange(E), (2, 1)), rng.integers(0, E, (2, 4))], axis=1)
    for row in p2l:
        rng.shuffle(row)
    perm = rng.permutation(G)
    permuted = p2l.reshape(2, G, -1)[:, perm, :].reshape(2, -1)
    w = rng.gamma(0.5, 40.0, (2, E))
    a = evaluate(make(model, p2l, G, gpn), w, engine, model=model)
    b = evaluate(make(model, permuted, G, gpn), w, engine, model=model)
    assert a.balancedness == pytest.approx(b.balancedness, rel=1e-9)
    assert np.allclose(a.max_load, b.max_load)
    if engine == "vllm":  # the LP's optimum is unique only in its makespan
        assert np.allclose(np.sort(a.gpu_loads, axis=2), np.sort(b.gpu_loads, axis=2))
    assert a.gap_placement == pytest.approx(b.gap_placement, abs=1e-9)


def test_loads_traffic_vllm_is_one_minus_node_share(k3):
    rng = np.random.default_rng(0)
    pl = Placement.from_phy2log(np.tile(np.arange(896 + 32) % 896, (92, 1)), k3, 32, 8)
    m = evaluate(pl, rng.gamma(0.5, 10, (92, 896)), "vllm")
    assert m.cross_node_share == pytest.approx(0.75)  # uniform sources, 4 nodes
    assert "independence" in m.traffic_method


def test_trace_roundtrip_equals_token_routing(tmp_path, tiny):
    rng = np.random.default_rng(1)
    n = 40
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(n)])
    req = np.arange(n) // 8
    o = np.argsort(np.arange(n) % 8, kind="stable")  # the file holds rows in step order
    with TraceWriter(tmp_path / "t", tiny, {"kind": "synthetic"}) as w:
        w.write(request_id=req[o], position=(np.arange(n) % 8)[o], phase=np.zeros(n), step=(np.arange(n) % 8)[o],
                layer=np.ones(n), expert_ids=ids[o])
    tr = read_token_routing(tmp_path / "t")
    assert tr.num_tokens == n
    pl = make(tiny, [[0, 1, 2, 3, 0, 1]], 3, 3)
    from_file = evaluate(pl, tmp_path / "t", "sglang", batch_tokens=4)
    assert from_file.gpu_loads.sum() == 2 * n
    assert from_file.batch_balancedness is not None
    # the file's token order is (step, request, position); the loads do not depend on it
    assert np.allclose(from_file.gpu_loads[0, 0].sum(), evaluate(pl, TokenRouting(ids[:, None, :], req, tiny),
                                                                  "sglang").gpu_loads[0, 0].sum())


def test_errors(tiny, k3):
    pl = make(tiny, [[0, 1, 2, 3]], 2, 2)
    with pytest.raises(InputError, match="routing has no tokens"):
        evaluate(pl, np.zeros((1, 4)), model=tiny)
    with pytest.raises(InputError, match="made for model 'tiny'"):
        evaluate(pl, Loads(np.ones((1, 92, 896), dtype=np.int64), k3))
    with pytest.raises(InputError, match="placement is for 2 GPUs"):
        evaluate(pl, np.ones((1, 4)), model=tiny, cluster=make_cluster(8))
    with pytest.raises(InputError, match="not a preset"):
        evaluate(pl, np.ones((1, 4)))
    with pytest.raises(InputError, match="unknown replica rule"):
        evaluate(pl, np.ones((1, 4)), "foo", model=tiny)


# ---------------------------------------------------------------------------- `place evaluate`
def test_evaluate_cli(tiny, tmp_path, capsys):
    import json

    from moeplace.cli.main import main

    pl = make(tiny, [[0, 1, 2, 3, 0, 1]], 3, 3)
    pl.save(tmp_path / "pl.json")
    Loads(np.array([[[60, 30, 10, 20]], [[10, 10, 10, 10]]]), tiny).save(tmp_path / "l.npz")
    assert main(["evaluate", str(tmp_path / "pl.json"), str(tmp_path / "l.npz"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_windows"] == 2 and d["window_balancedness"][0] == pytest.approx(40 / 45)
    assert main(["evaluate", str(tmp_path / "pl.json"), str(tmp_path / "l.npz"), "--engine", "ideal"]) == 0
    assert "balancedness" in capsys.readouterr().out
    Loads(np.ones((1, 92, 896), dtype=np.int64), replace(tiny, name="k3ish", num_layers=93,
          moe_layers=tuple(range(1, 93)), num_experts=896, attention=("kda",) * 93)).save(tmp_path / "k.npz")
    assert main(["evaluate", str(tmp_path / "pl.json"), str(tmp_path / "k.npz")]) == 2
    assert "made for model 'tiny'" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "pl.json"), str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_token_sample_gives_exact_traffic_on_loads(tiny):
    # 4 GPUs, 2 per node; GPU g holds expert g. Sample tokens always pick experts {0, 1} (both on node 0).
    pl = make(tiny, [[0, 1, 2, 3]], 4, 2)
    sample = np.tile(np.array([[[0, 1]]]), (8, 1, 1))
    loads = Loads(np.array([[[8, 8, 0, 0]]]), tiny, samples=sample.astype(np.int32))
    m = evaluate(pl, loads, "vllm")
    assert m.traffic_method.startswith("token sample (8 tokens)")
    # tokens i run on rank i % 4: ranks 0,1 (node 0) send nothing across nodes; ranks 2,3 send both
    # selections to node 0 -> 1 remote node each; remote GPUs: rank0 -> {1}, rank1 -> {0}, ranks 2,3 -> 2
    assert m.cross_node_share == pytest.approx(0.5)
    assert m.remote_per_token == pytest.approx({"node": 0.5, "gpu": 1.5, "expert": 1.5})
    # the independence approximation (no sample) draws the 2 picks independently from (1/2, 1/2): a GPU
    # is touched with probability 1 - (1/2)^2 = 3/4, so rank 0 -> 0.75, rank 2 -> 1.5 remote GPUs
    approx = evaluate(pl, np.array([[8.0, 8.0, 0.0, 0.0]]), "vllm", model=tiny)
    assert approx.remote_per_token["node"] == pytest.approx(0.5)
    assert approx.remote_per_token["gpu"] == pytest.approx((0.75 + 0.75 + 1.5 + 1.5) / 4)
    # rows with -1 (token missing from a layer) are skipped
    holes = sample.astype(np.int32).copy()
    holes[:4] = -1
    m2 = evaluate(pl, Loads(np.array([[[8, 8, 0, 0]]]), tiny, samples=holes), "vllm")
    assert m2.remote_per_token["expert"] == pytest.approx(1.5)
