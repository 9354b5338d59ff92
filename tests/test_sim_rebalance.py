"""Online rebalancing: moved experts, the weight-transfer stall, the move budget, and a drifting trace
re-placed during the run."""
import numpy as np
import pytest
from simkit import build, linear_placement, mini_model, write_trace

from foundation.errors import InputError
from placement.record import Placement
from sim.config import CostConfig, EngineConfig, RebalanceConfig, SimConfig, WorkloadConfig, parse_rebalance
from sim.rebalance import limit_moves, moved_experts, relabel_min_moves, transfer_stall


def test_moved_experts_and_stall_by_hand():
    m = mini_model()
    # 4 GPUs on 2 nodes of 2, 4 slots per GPU, 3 layers
    old = Placement.from_phy2log(np.tile(np.arange(16), (3, 1)), m, 4, 2)
    p2l = old.phy2log.copy()
    p2l[0, [0, 4]] = p2l[0, [4, 0]]  # layer 0: swap expert 0 (GPU 0) and expert 4 (GPU 1): same node
    p2l[1, [0, 8]] = p2l[1, [8, 0]]  # layer 1: swap expert 0 (GPU 0) and expert 8 (GPU 2): across nodes
    new = Placement.from_phy2log(p2l, m, 4, 2)
    mv = moved_experts(old, new)
    assert mv.sum() == 4
    assert mv[0, 0, 4] and mv[0, 1, 0] and mv[1, 0, 8] and mv[1, 2, 0]
    b = 1e6
    stall, moved, n = transfer_stall(old, new, b, nvlink_bw=1e9, nic_bw=1e8, nvlink_latency=1e-6, nic_latency=1e-5)
    # GPU 0 pulls expert 4 over NVLink (1 ms) and expert 8 over its NIC (10 ms): the NIC sets the pace
    assert n == 4 and moved == 4 * b
    assert stall == pytest.approx(1e-5 + b / 1e8)
    assert transfer_stall(old, old, b, 1e9, 1e8, 1e-6, 1e-5) == (0.0, 0.0, 0)


def test_move_budget_takes_whole_layers_best_gain_first():
    m = mini_model()
    old = Placement.from_phy2log(np.tile(np.arange(16), (3, 1)), m, 4, 4)
    rr = np.arange(16).reshape(4, 4).T.ravel()
    new = Placement.from_phy2log(np.tile(rr, (3, 1)), m, 4, 4)
    loads = np.zeros((3, 16))
    loads[:, :4] = [[10, 10, 10, 10], [40, 40, 40, 40], [20, 20, 20, 20]]  # hot experts all on GPU 0 in `old`
    per_layer = moved_experts(old, new).sum(axis=(1, 2))
    assert per_layer.tolist() == [12, 12, 12]
    out = limit_moves(old, new, loads, "vllm", max_moves=24)
    switched = [bool((out.phy2log[l] == new.phy2log[l]).all()) for l in range(3)]
    assert switched == [False, True, True]  # the two layers with the largest gain
    assert out.provenance["moves_used"] == 24


def test_relabeling_keeps_every_gpu_set_and_minimizes_moves():
    m = mini_model()
    rng = np.random.default_rng(0)
    old = Placement.from_phy2log(np.stack([rng.permutation(16) for _ in range(3)]), m, 4, 2)
    # the same layout with GPUs renumbered (nodes swapped, GPUs swapped inside a node): zero real moves
    perm = np.array([3, 2, 0, 1])
    shuffled = old.phy2log.reshape(3, 4, 4)[:, perm].reshape(3, 16)
    new = Placement.from_phy2log(shuffled, m, 4, 2)
    assert moved_experts(old, new).sum() > 0
    fixed = relabel_min_moves(old, new)
    assert moved_experts(old, fixed).sum() == 0
    # a genuinely different layout: GPU sets (as sets) are preserved, moves never increase
    other = Placement.from_phy2log(np.stack([rng.permutation(16) for _ in range(3)]), m, 4, 2)
    rel = relabel_min_moves(old, other)
    key = lambda p: sorted(sorted(map(tuple, np.sort(p.phy2log[l].reshape(4, 4), axis=1).tolist()))
                           for l in range(3))
    assert key(rel) == key(other)
    assert moved_experts(old, rel).sum() <= moved_experts(old, other).sum()


def test_parse_rebalance():
    assert parse_rebalance("every=3000,window=1000,moves=64") == RebalanceConfig(3000, 1000, 64)
    assert parse_rebalance("every=5,policy=moeplace,time=2").time_limit == 2.0
    assert parse_rebalance("every=10").window == 10
    with pytest.raises(InputError, match="unknown keys"):
        parse_rebalance("every=1,often=2")
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_rebalance("every")


def test_rebalancing_a_drifting_workload_cuts_imbalance_and_pays_a_stall(tmp_path):
    m = mini_model(num_experts=16)
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=64, output=16, skew=1.5, hot_shift=5)
    pl = linear_placement(m, 4, 4)
    base = {"duration": 0.004, "mode": "replay", "cost": CostConfig.roofline(), "engine": EngineConfig(attention_tp=1, max_batched_tokens=64),
            "workload": WorkloadConfig(arrival="closed", concurrency=8)}
    static = build(path, pl, SimConfig(**base), gpus=4).run()
    # decision time fixed at zero: this run is about the transfer (the measured one is tested below)
    rb = RebalanceConfig(every=10, window=10, policy="eplb", decision_s=0.0)
    sim = build(path, pl, SimConfig(**base, rebalance=rb), gpus=4)
    moving = sim.run()
    assert moving.summary["rebalances"] >= 2 and moving.summary["moved_bytes"] > 0
    assert moving.summary["stall_s"] > 0
    hist = sim.pools_list[0].rebalancer.history
    assert hist[0]["iteration"] == 10 and hist[0]["policy"] == "eplb"
    ts = moving.timeseries
    after = ts.filter(ts["iteration"] > 10)["imbalance"].mean()
    assert after < static.timeseries.filter(static.timeseries["iteration"] > 10)["imbalance"].mean()


@pytest.mark.slow
def test_moeplace_migration_mode_respects_the_move_budget(tmp_path):
    m = mini_model(num_experts=16)
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=64, output=16, skew=1.5, hot_shift=5)
    base = {"duration": 0.002, "mode": "replay", "cost": CostConfig.roofline(), "engine": EngineConfig(attention_tp=1, max_batched_tokens=64),
            "workload": WorkloadConfig(arrival="closed", concurrency=8)}
    rb = RebalanceConfig(every=10, window=10, moves=2, policy="moeplace", time_limit=5.0)
    sim = build(path, linear_placement(m, 4, 4), SimConfig(**base, rebalance=rb), gpus=4)
    res = sim.run()
    hist = sim.pools_list[0].rebalancer.history
    assert res.summary["rebalances"] == len(hist) >= 1
    assert all(h["policy"] == "moeplace" and h["experts_moved"] <= 2 * m.num_moe_layers for h in hist)


def test_decision_time_is_charged_and_async_defers_instead_of_stalling(tmp_path):
    """Blocking: every rank waits for the policy's measured decision time plus the transfer. Async (vLLM's
    default): no stall; the new placement lands once that time has passed in simulated time."""
    m = mini_model(num_experts=16)
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=64, output=16, skew=1.5, hot_shift=5)
    pl = linear_placement(m, 4, 4)
    base = {"duration": 0.004, "mode": "replay", "cost": CostConfig.roofline(),
            "engine": EngineConfig(attention_tp=1, max_batched_tokens=64),
            "workload": WorkloadConfig(arrival="closed", concurrency=8)}
    blocking = build(path, pl, SimConfig(**base, rebalance=RebalanceConfig(every=10, window=10, policy="eplb")),
                     gpus=4)
    res = blocking.run()
    hist = blocking.pools_list[0].rebalancer.history
    assert all(h["decision_s"] > 0 and not h["async"] for h in hist)
    assert res.summary["stall_s"] >= sum(h["decision_s"] + h["transfer_s"] for h in hist[:-1])
    # async with a decision longer than the run: no stall, and the new placement never lands
    rb = RebalanceConfig(every=10, window=10, policy="eplb", asynchronous=True, decision_s=10.0)
    asyn = build(path, pl, SimConfig(**base, rebalance=rb), gpus=4)
    res_a = asyn.run()
    reb = asyn.pools_list[0].rebalancer
    assert res_a.summary["stall_s"] == 0 and reb.count == 1 and reb.history[0]["stall_s"] == 0
    assert reb.pending[0] >= reb.history[0]["time"] + 10.0 and asyn.pools_list[0].placement is pl
    # an instant decision: the placement lands once its transfer time has passed, still without a stall
    rb0 = RebalanceConfig(every=10, window=10, policy="eplb", asynchronous=True, decision_s=0.0)
    fast = build(path, pl, SimConfig(**base, rebalance=rb0), gpus=4)
    res_f = fast.run()
    assert res_f.summary["stall_s"] == 0 and fast.pools_list[0].placement is not pl
    assert parse_rebalance("every=3000,window=1000,policy=eplb,async=1").asynchronous
    assert parse_rebalance("every=5,decision=0.5").decision_s == 0.5
    with pytest.raises(InputError, match="async"):
        parse_rebalance("every=1,async=yes")


def test_simulate_recommend_compares_static_with_the_engines_rebalancers(tmp_path, capsys):
    import json

    from moeplace.cli import main

    m = mini_model(num_experts=16)
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=64, output=16, skew=1.5, hot_shift=5)
    rc = main(["simulate", path, "--placement", "linear", "--gpus", "4", "--gpus-per-node", "2",
               "--attention-tp", "2", "--duration", "0.003", "--concurrency", "8", "--no-progress", "--recommend",
               "--recommend-time", "1", "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)[0]["recommendation"]
    names = [r["config"] for r in rec["rows"]]
    assert names[0] == "static" and any("vLLM EPLB" in n for n in names) and any("SGLang" in n for n in names)
    assert any("moeplace migration" in n for n in names)
    best = max(rec["rows"][1:], key=lambda r: r["output_tok_s"])
    gain = best["output_tok_s"] / rec["rows"][0]["output_tok_s"] - 1
    assert ("static placement suffices" in rec["verdict"]) == (gain < rec["min_gain"])
