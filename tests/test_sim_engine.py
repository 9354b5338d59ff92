"""Fidelity of the simulated engine: hand-summed single request, straggler ratio, queueing, admission by
the plan model, determinism, preemption, disaggregation."""
import numpy as np
import pytest
from simkit import build, linear_placement, mini_model, write_fixed_trace, write_trace

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement
from moeplace.sim.config import CostConfig, EngineConfig, LengthMix, SimConfig, WorkloadConfig
from moeplace.sim.cost import CostModel, RankWork
from moeplace.sim.memory import plan_pools

EXACT = CostConfig.roofline()


def one_rank_work(D=4, **kw):
    w = RankWork.zeros(D)
    for k, v in kw.items():
        getattr(w, k)[0] = v
    return w


def test_single_request_on_an_idle_cluster_equals_the_hand_summed_cost_model(tmp_path):
    m = mini_model()
    path = write_fixed_trace(tmp_path / "t", m, [0, 5, 10, 15], num_requests=1, prompt=20, output=3)
    pl = linear_placement(m, 4, 4)  # experts 0, 5, 10, 15 on GPUs 0, 1, 2, 3
    cfg = SimConfig(duration=10.0, mode="replay", cost=EXACT,
                    engine=EngineConfig(attention_tp=1, max_batched_tokens=64, kv_dtype="fp8"),
                    workload=WorkloadConfig(arrival="closed", concurrency=1, max_requests=1))
    res = build(path, pl, cfg, gpus=4).run()
    cm = CostModel(m, make_cluster(4, "h200"), EXACT, attention_tp=1, kv_dtype="fp8")

    def moe_layer(n, mode):  # n tokens from GPU 0, one expert on each GPU: GPU 0 local, 1-3 over NVLink
        return (cm.expert_time(n, 1) + cm.a2a_time(n, 0, "dispatch", mode) + cm.a2a_time(n, 0, "combine", mode))

    def step(w, n, mode):  # prefill iterations use DeepEP normal kernels, decode-only ones low-latency
        kda_dense = cm.kda_time(w)[0] + cm.trunk_time(w, False)[0]
        kda = cm.kda_time(w)[0] + cm.trunk_time(w, True)[0]
        mla = cm.mla_time(w)[0] + cm.trunk_time(w, True)[0]
        return kda_dense + 2 * kda + mla + 3 * moe_layer(n, mode) + cm.lm_head_time(w)[0]

    prefill = step(one_rank_work(tokens=20, pre_tokens=20, pre_seqs=1, pre_pairs=20 * 21 / 2, pre_ctx=20,
                                 sampled=1), 20, "normal")
    decode1 = step(one_rank_work(tokens=1, dec_seqs=1, dec_ctx=21, sampled=1), 1, "low_latency")
    decode2 = step(one_rank_work(tokens=1, dec_seqs=1, dec_ctx=22, sampled=1), 1, "low_latency")
    r = res.requests.row(0, named=True)
    assert r["first_token_s"] == pytest.approx(prefill, rel=1e-12)
    assert r["finished_s"] == pytest.approx(prefill + decode1 + decode2, rel=1e-12)
    assert r["ttft_s"] == pytest.approx(prefill, rel=1e-12)
    assert r["tpot_s"] == pytest.approx((decode1 + decode2) / 2, rel=1e-12)
    assert res.summary["iterations"] == 3 and res.summary["requests_finished"] == 1


def test_moe_expert_time_follows_the_max_over_mean_of_the_placement(tmp_path):
    m = mini_model()
    path = write_fixed_trace(tmp_path / "t", m, [0, 1, 2, 3], num_requests=4, prompt=48, output=8)
    # balanced: expert e on GPU e % 4 -> the token's 4 experts on 4 GPUs, max/mean 1
    balanced = Placement.from_phy2log(np.tile(np.arange(16).reshape(4, 4).T.ravel(), (3, 1)), m, 4, 4)
    # skewed: experts 0, 1 on GPU 0, 2 on GPU 1, 3 on GPU 2, none on GPU 3 -> loads 2:1:1:0, max/mean 2
    skewed = Placement.from_phy2log(np.tile([0, 1, 4, 5, 2, 6, 7, 8, 3, 9, 10, 11, 12, 13, 14, 15], (3, 1)),
                                    m, 4, 4)
    # the pure roofline: expert time proportional to the experts a GPU reads (no tile fill / kernel latency)
    cfg = SimConfig(duration=0.005, mode="replay", cost=EXACT,
                    engine=EngineConfig(attention_tp=1, max_batched_tokens=32),
                    workload=WorkloadConfig(arrival="closed", concurrency=4))
    a = build(path, balanced, cfg, gpus=4).run().timeseries
    b = build(path, skewed, cfg, gpus=4).run().timeseries
    n = min(a.height, b.height)
    assert n >= 5
    assert a["batch_tokens"][:n].to_list() == b["batch_tokens"][:n].to_list()  # same batches
    np.testing.assert_allclose(b["experts_s"][:n] / a["experts_s"][:n], 2.0, rtol=1e-12)
    np.testing.assert_allclose(a["imbalance"][:n], 1.0)
    np.testing.assert_allclose(b["imbalance"][:n], 2.0)
    # balanced and symmetric (one request per rank): no straggler at all; skewed: the expert phase
    # alone costs (max - mean) = half of the slowest GPU's expert time per layer
    assert np.abs(a["straggler_s"][:n].to_numpy()).max() < 1e-15
    assert np.all(b["straggler_s"][:n].to_numpy() >= 0.5 * b["experts_s"][:n].to_numpy() * (1 - 1e-12))


def run_open(path, pl, rate, seconds=0.08, seed=0):
    cfg = SimConfig(cost=EXACT, duration=seconds, mode="stat", seed=seed,
                    engine=EngineConfig(attention_tp=4, max_batched_tokens=256, max_seqs=4),
                    workload=WorkloadConfig(arrival="poisson", rate=rate))
    return build(path, pl, cfg, gpus=4).run()


def test_queueing_delay_is_small_below_saturation_and_grows_sharply_near_it(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=16, output=4)
    pl = linear_placement(m, 4, 4)
    closed = SimConfig(cost=EXACT, duration=0.02, mode="stat", engine=EngineConfig(attention_tp=4, max_batched_tokens=256,
                                                                      max_seqs=4),
                       workload=WorkloadConfig(arrival="closed", concurrency=64))
    sat = build(path, pl, closed, gpus=4).run().summary
    capacity = sat["requests_finished"] / 0.02  # requests/s at saturation
    low, near = run_open(path, pl, 0.3 * capacity), run_open(path, pl, 0.95 * capacity)
    assert low.summary["requests_finished"] > 300
    q_low = low.requests["queue_s"].mean()
    q_near = near.requests["queue_s"].mean()
    service = (low.requests["finished_s"] - low.requests["arrival_s"]).mean() - q_low
    assert q_low < 0.2 * service  # below saturation: waiting is a fraction of the service time
    assert q_near > 5 * q_low and q_near > service  # near capacity: waiting dominates
    assert near.summary["ttft_p99_s"] > 3 * low.summary["ttft_p99_s"]


def test_admission_matches_the_plan_model_for_1m_token_requests(tmp_path, k3):
    """K3 on 32 H200, attention TP8 (4 DP ranks): as many 1M-token sequences start per DP rank as
    `place plan` says fit (CachePools.concurrency), and no more."""
    path = write_trace(tmp_path / "t", k3, num_requests=2, prompt=3, output=1)
    need = (1 << 20)
    mix = LengthMix(components=((need - 1, 1.0),), sigma=0.0, output_mean=8, output_sigma=0.0)
    engine = EngineConfig(attention_tp=8, max_seqs=256, kv_dtype="bf16")
    cfg = SimConfig(cost=EXACT, duration=1e-9, mode="stat", engine=engine,
                    workload=WorkloadConfig(arrival="closed", concurrency=200, lengths=mix))
    pools, _ = plan_pools(k3, make_cluster(32, "h200"), engine, 0)
    per_rank, _ = pools.concurrency(((need, 1.0),))
    assert 0 < per_rank < 50
    res = build(path, linear_placement(k3, 32, 8), cfg, gpus=32).run()
    assert res.timeseries["running"][0] == 4 * per_rank
    assert res.timeseries["waiting"][0] == 200 - 4 * per_rank
    # one more would not fit: the plan's own admission check, at the count the simulator stopped at
    used = per_rank * pools.kv_tokens(need)
    assert not pools.can_admit(need, used, per_rank) and pools.can_admit(need, used - pools.kv_tokens(need),
                                                                           per_rank - 1)


def test_moe_tp_over_every_gpu_plans_no_all_to_all_buffers(k3):
    """--moe-tp shards each routed expert over that many GPUs, so EP = GPUs / moe_tp: with MoE-TP over
    every GPU (vLLM's TP without --enable-expert-parallel) there is no expert all-to-all and the plan
    reserves no DeepEP buffers, which the KV pool gets instead; the weights per GPU are the same."""
    from moeplace.sim.memory import memory_config  # the planner's view, checked beside the pools

    cluster = make_cluster(32, "h200")
    ep = EngineConfig(attention_tp=8, max_seqs=64, kv_dtype="bf16")
    tp = EngineConfig(attention_tp=8, max_seqs=64, kv_dtype="bf16", moe_tp=32)
    assert memory_config(k3, tp, 32, 0).ep == 1 and memory_config(k3, ep, 32, 0).ep == 32
    pools_ep, plan_ep = plan_pools(k3, cluster, ep, 0)
    pools_tp, plan_tp = plan_pools(k3, cluster, tp, 0)
    lines = {p: {ln.name: ln.bytes for ln in plan.lines} for p, plan in (("ep", plan_ep), ("tp", plan_tp))}
    assert lines["tp"]["all-to-all buffers"] == 0 < lines["ep"]["all-to-all buffers"]
    assert lines["tp"]["routed experts"] == pytest.approx(lines["ep"]["routed experts"])
    assert pools_tp.pool_bytes - pools_ep.pool_bytes == pytest.approx(
        lines["ep"]["all-to-all buffers"] + lines["ep"]["activations"] - lines["tp"]["activations"], rel=1e-9)
    with pytest.raises(InputError, match="--moe-tp 3 does not divide the 32 GPUs"):
        plan_pools(k3, cluster, EngineConfig(attention_tp=8, moe_tp=3), 0)


def test_requests_that_can_never_fit_are_rejected(tmp_path):
    m = mini_model(max_context=1000)
    path = write_trace(tmp_path / "t", m, num_requests=2, prompt=4, output=2)
    mix = LengthMix(components=((2000, 0.5), (100, 0.5)), sigma=0.0, output_mean=4, output_sigma=0.0)
    cfg = SimConfig(cost=EXACT, duration=1.0, mode="stat", engine=EngineConfig(attention_tp=4),
                    workload=WorkloadConfig(arrival="closed", concurrency=8, max_requests=40, lengths=mix))
    res = build(path, linear_placement(m, 4, 4), cfg, gpus=4).run()
    rej = res.requests.filter(res.requests["rejected"])
    assert res.summary["requests_rejected"] == rej.height > 0
    assert (rej["prompt_tokens"] == 2000).all()
    assert res.requests.filter(~res.requests["rejected"])["prompt_tokens"].eq(100).all()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_when_the_kv_pool_fills(tmp_path, preemption):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=4, prompt=50, output=200)
    cfg = SimConfig(cost=EXACT, duration=30.0, mode="stat",
                    engine=EngineConfig(attention_tp=4, max_batched_tokens=512, preemption=preemption),
                    workload=WorkloadConfig(arrival="closed", concurrency=4, max_requests=4),
                    kv_tokens_per_rank=640, state_slots_per_rank=8)
    sim = build(path, linear_placement(m, 4, 4), cfg, gpus=4, kv_tokens=640, state_slots=8)
    res = sim.run()
    assert res.summary["preemptions"] > 0
    assert res.summary["requests_finished"] == 4  # everybody gets through eventually
    assert res.timeseries["kv_occupancy"].max() <= 1.0
    for pool in sim.pools_list:  # the incremental bookkeeping equals a recount
        for rank in pool.ranks:
            assert rank.used == pool._used(rank)
    if preemption == "swap":
        assert res.summary["stall_s"] > 0


def test_identical_seeds_give_identical_results(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=6, prompt=40, output=20)
    pl = linear_placement(m, 4, 4)
    mix = LengthMix(components=((64, 0.8), (512, 0.2)), output_mean=32)
    cfg = lambda seed: SimConfig(cost=EXACT, duration=0.02, mode="stat", seed=seed,
                                 engine=EngineConfig(attention_tp=2, max_batched_tokens=256, max_seqs=16),
                                 workload=WorkloadConfig(arrival="gamma", rate=5000.0, burstiness=2.0, lengths=mix))
    a, b, c = (build(path, pl, cfg(s), gpus=4).run() for s in (7, 7, 8))
    assert a.timeseries.equals(b.timeseries) and a.requests.equals(b.requests)
    sa = {k: v for k, v in a.summary.items() if "wall" not in k}
    sb = {k: v for k, v in b.summary.items() if "wall" not in k}
    assert sa == sb
    assert not a.requests.equals(c.requests)


@pytest.mark.parametrize("mode", ["stat", "replay"])
def test_on_advance_sees_every_event_time_and_changes_nothing(tmp_path, mode):
    """``simulate(on_advance=...)`` (bench/sim.py times the steady state with it) is called with the simulated
    time after every event, in order, within the run; the results are those of a run without it."""
    from moeplace.sim.runner import simulate
    from moeplace.sim.workload import load_trace_tokens

    m = mini_model()
    trace = load_trace_tokens(write_trace(tmp_path / "t", m, num_requests=6, prompt=40, output=20))
    pl = linear_placement(m, 4, 4)
    cfg = SimConfig(cost=EXACT, duration=0.05, mode=mode, engine=EngineConfig(attention_tp=2, max_seqs=8),
                    workload=WorkloadConfig(arrival="closed", concurrency=8,
                                            lengths=LengthMix(components=((64, 1.0),), output_mean=16)))
    cluster = make_cluster(4, "h200")
    seen = []
    a = simulate(trace, [("a", pl)], cluster, cfg, on_advance=seen.append)[0]
    b = simulate(trace, [("a", pl)], cluster, cfg)[0]
    assert a.timeseries.equals(b.timeseries) and a.requests.equals(b.requests)
    assert len(seen) > a.summary["iterations"] and seen == sorted(seen) and 0 <= seen[0] and seen[-1] <= 0.05
    assert set(a.timeseries["time"].to_list()) <= set(seen)


def test_disaggregated_pools_hand_the_kv_cache_over_the_nic(tmp_path):
    m = mini_model()
    path = write_fixed_trace(tmp_path / "t", m, [0, 5, 10, 15], num_requests=1, prompt=20, output=3)
    pl = linear_placement(m, 4, 4)
    wl = WorkloadConfig(arrival="closed", concurrency=1, max_requests=1)
    co = SimConfig(duration=1.0, mode="replay", cost=EXACT, engine=EngineConfig(attention_tp=1), workload=wl)
    dis = SimConfig(duration=1.0, mode="replay", cost=EXACT,
                    engine=EngineConfig(attention_tp=1, disaggregated=True), workload=wl)
    a = build(path, pl, co, gpus=4).run()
    sim = build(path, pl, dis, gpus=4)
    b = sim.run()
    ra, rb = a.requests.row(0, named=True), b.requests.row(0, named=True)
    assert rb["first_token_s"] == pytest.approx(ra["first_token_s"], rel=1e-12)
    p = sim.pools
    handoff = sim.cost.transfer_time(p.kv_tokens(20) * p.kv_bytes_per_token + p.state_bytes_per_seq)
    assert rb["finished_s"] == pytest.approx(ra["finished_s"] + handoff, rel=1e-9)
    assert b.summary["kv_transfer_bytes"] > 0
    assert set(b.timeseries["pool"].unique()) == {"prefill", "decode"}


def test_a_lone_sequence_that_outgrows_the_pool_is_aborted(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=1, prompt=50, output=200)
    cfg = SimConfig(cost=EXACT, duration=1.0, mode="stat", engine=EngineConfig(attention_tp=4),
                    workload=WorkloadConfig(arrival="closed", concurrency=1, max_requests=1))
    sim = build(path, linear_placement(m, 4, 4), cfg, gpus=4, kv_tokens=128, state_slots=4)
    res = sim.run()
    r = res.requests.row(0, named=True)
    assert r["rejected"] and res.summary["requests_rejected"] == 1
    # page-rounded (64 tokens): it ran while 128 slots held it, i.e. until its KV reached 128 tokens
    assert r["generated_tokens"] == 128 - 50 + 1
    assert res.timeseries["kv_occupancy"].max() <= 1.0


def test_generation_stops_at_the_models_context(tmp_path):
    m = mini_model(max_context=100)
    path = write_trace(tmp_path / "t", m, num_requests=1, prompt=90, output=50)
    cfg = SimConfig(cost=EXACT, duration=1.0, mode="stat", engine=EngineConfig(attention_tp=4),
                    workload=WorkloadConfig(arrival="closed", concurrency=1, max_requests=1))
    res = build(path, linear_placement(m, 4, 4), cfg, gpus=4).run()
    r = res.requests.row(0, named=True)
    assert not r["rejected"] and r["finished_s"] is not None
    assert r["generated_tokens"] == 100 - 90  # KV of 99 tokens + the last one made = the 100-token context


def test_prefix_hits_skip_cached_prompt_tokens_and_tokens_balancer_spreads_prompts(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=32, output=4)
    pl4 = linear_placement(m, 4, 4)
    mix = LengthMix(components=((400, 1.0),), output_mean=4, range_ratio=0.0)

    def run(**eng):
        cfg = SimConfig(cost=EXACT, duration=0.05, mode="stat", warmup=0.0,
                        engine=EngineConfig(attention_tp=1, max_batched_tokens=4096, **eng),
                        workload=WorkloadConfig(arrival="closed", concurrency=8, lengths=mix, max_requests=8))
        return build(path, pl4, cfg, gpus=4).run()

    full, half = run(), run(prefix_hit=0.5)
    assert full.summary["requests_finished"] == half.summary["requests_finished"] == 8
    # every prompt computes 400 tokens without hits, 200 with half of each prompt cached
    assert full.requests["prompt_tokens"].sum() == 8 * 400
    assert full.summary["prefill_tok_s"] == pytest.approx(2 * half.summary["prefill_tok_s"])
    assert half.summary["input_tok_s"] == pytest.approx(full.summary["input_tok_s"])  # cache hits count as input
    # the tokens balancer gives each of the 4 ranks 2 of the 8 equal prompts, like round robin
    bal = run(dp_balance="tokens")
    assert sorted(bal.requests["dp_rank"].value_counts()["count"].to_list()) == [2, 2, 2, 2]


def test_mtp_acceptance_per_draft_position_compounds(tmp_path):
    from moeplace.sim.config import parse_mtp

    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=8, prompt=32, output=4)
    mix = LengthMix(components=((32, 1.0),), output_mean=5000, range_ratio=0.0)
    acc = (0.92, 0.717, 0.364)  # conditional acceptance of drafts 1, 2, 3

    def gain(a):
        cfg = SimConfig(cost=EXACT, duration=0.3, mode="stat", warmup=0.0,
                        engine=EngineConfig(attention_tp=1, max_batched_tokens=4096, phase="decode", mtp_draft=3,
                                            mtp_acceptance=a),
                        workload=WorkloadConfig(arrival="closed", concurrency=64, lengths=mix))
        res = build(path, linear_placement(m, 4, 4), cfg, gpus=4).run()
        return res.requests["generated_tokens"].sum() / res.timeseries["decode_seqs"].sum(), res

    per_pos, res = gain(acc)
    steps = int(res.timeseries["decode_seqs"].sum())
    assert steps > 5000
    # a sequence keeps the leading run of accepted drafts: 1 + a1 + a1 a2 + a1 a2 a3 tokens per step
    want = 1 + 0.92 + 0.92 * 0.717 + 0.92 * 0.717 * 0.364
    assert EngineConfig(mtp_draft=3, mtp_acceptance=acc).mtp_tokens_per_step() == pytest.approx(want)
    assert per_pos == pytest.approx(want, abs=4 * 0.9 / steps ** 0.5)
    # one value for every position: 1 + a + a^2 + a^3
    flat, _ = gain(0.5)
    assert flat == pytest.approx(1.875, abs=4 * 0.9 / steps ** 0.5)
    assert parse_mtp("3:0.92,0.717,0.364") == (3, acc) and parse_mtp("1:0.85") == (1, 0.85)
    with pytest.raises(InputError, match="one per draft position"):
        EngineConfig(mtp_draft=2, mtp_acceptance=acc)


def test_reserve_admission_never_preempts_and_admits_only_whole_sequences(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=4, prompt=50, output=200)
    cfg = SimConfig(cost=EXACT, duration=30.0, mode="stat",
                    engine=EngineConfig(attention_tp=4, max_batched_tokens=512, admission="reserve"),
                    workload=WorkloadConfig(arrival="closed", concurrency=4, max_requests=4))
    sim = build(path, linear_placement(m, 4, 4), cfg, gpus=4, kv_tokens=640, state_slots=8)
    res = sim.run()
    # the same pool preempts on demand (test above); reserving 50 + 200 tokens a request, two fit in 640
    full = sim.pools_list[0].pools.kv_tokens(250)
    assert 2 * full <= 640 < 3 * full
    assert res.summary["preemptions"] == 0 and res.summary["requests_finished"] == 4
    assert res.timeseries["running"].max() == 2
    assert res.requests["generated_tokens"].to_list() == [200] * 4
    for pool in sim.pools_list:
        for rank in pool.ranks:
            assert rank.used == pool._used(rank) == 0
    with pytest.raises(InputError, match="admission 'lazy' unknown"):
        EngineConfig(admission="lazy")


def _iterations_work(monkeypatch, path, m, prefill_batches):
    """Per iteration of a 2-request run on one attention-DP rank: (prefill tokens, decoding sequences) of
    rank 0, and the result. Prompts of 20 tokens against a 16-token budget, so the second prompt's last
    chunk is left to run while the first request decodes."""
    from moeplace.sim import engine as sim_engine

    seen = []
    form = sim_engine.Pool._form_batch

    def spy(self, now):
        b = form(self, now)
        if b is not None:
            seen.append((int(b.work.pre_tokens[0]), int(b.work.dec_seqs[0])))
        return b

    monkeypatch.setattr(sim_engine.Pool, "_form_batch", spy)
    cfg = SimConfig(duration=10.0, mode="replay", cost=EXACT,
                    engine=EngineConfig(attention_tp=4, max_batched_tokens=16, prefill_batches=prefill_batches),
                    workload=WorkloadConfig(arrival="closed", concurrency=2, max_requests=2))
    res = build(path, linear_placement(m, 4, 4), cfg, gpus=4).run()
    monkeypatch.undo()
    return seen, res


def test_separate_prefill_batches_make_a_ranks_decodes_wait_for_its_prefill(tmp_path, monkeypatch):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=2, prompt=20, output=6)
    mixed, res_mixed = _iterations_work(monkeypatch, path, m, "mixed")
    sep, res_sep = _iterations_work(monkeypatch, path, m, "separate")
    # mixed (vLLM, TensorRT-LLM): the second prompt's last 8 tokens join the first request's decode step;
    # separate (SGLang's default): they run alone and the first request's decode waits one iteration
    assert (8, 1) in mixed and all(not (p and d) for p, d in sep)
    assert [p for p, _ in sep if p] == [16, 16, 8] == [p for p, _ in mixed if p]
    a_mixed, a_sep = res_mixed.requests.row(0, named=True), res_sep.requests.row(0, named=True)
    assert a_sep["ttft_s"] == pytest.approx(a_mixed["ttft_s"], rel=1e-12)  # its own prefill is not delayed
    assert a_sep["finished_s"] > a_mixed["finished_s"] and a_sep["tpot_s"] > a_mixed["tpot_s"]
    assert res_sep.requests["generated_tokens"].to_list() == [6, 6] == res_mixed.requests["generated_tokens"].to_list()
    with pytest.raises(InputError, match="prefill_batches 'interleaved' unknown"):
        EngineConfig(prefill_batches="interleaved")


def test_sglang_runs_prefill_batches_alone_unless_told_otherwise():
    from moeplace.sim.config import prefill_batches_of

    assert prefill_batches_of("sglang") == "separate"
    assert prefill_batches_of("vllm") == prefill_batches_of("trtllm") == "mixed"
    assert prefill_batches_of("sglang", "mixed") == "mixed"  # --enable-mixed-chunk
