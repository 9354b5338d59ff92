"""The cost model: every formula on a hand-computed case (H200 preset, efficiencies set to 1 so the
peak numbers of foundation/presets/gpus.json apply as they are)."""
import numpy as np
import pytest
from simkit import mini_model

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.sim.calibration import profile_from_dict
from moeplace.sim.config import CostConfig
from moeplace.sim.cost import CostModel, MoeWork, RankWork, roofline

EXACT = CostConfig.roofline()
H200_BW = 4.8e12
H200_BF16 = 989e12
H200_FP8 = 1979e12


def work(**kw):
    w = RankWork.zeros(1)
    for k, v in kw.items():
        setattr(w, k, np.array([float(v)]))
    return w


def test_roofline_is_the_slower_of_compute_and_memory():
    assert roofline(2e12, 1e9, 1e12, 1e12) == pytest.approx(2.0)
    assert roofline(1e9, 3e12, 1e12, 1e12) == pytest.approx(3.0)


def test_k3_expert_gemm_mxfp4_on_h200(k3):
    cm = CostModel(k3, make_cluster(32, "h200"), EXACT)
    # one expert: 3 x 3584 x 3072 params, 2 FLOPs each per token
    assert cm.expert_flops_per_token == 6 * 3584 * 3072
    # decode-like: 1000 selections over 29 experts -> weight-read bound
    # bytes = 29 x 33,030,144 params x 4.25/8 B + 1000 x 2 B x (2 x 3584 + 3 x 3072)
    want_mem = (29 * 3 * 3584 * 3072 * 4.25 / 8 + 1000 * 2 * (2 * 3584 + 3 * 3072)) / H200_BW
    assert cm.expert_time(1000, 29) == pytest.approx(want_mem, rel=1e-12)
    # prefill-like: 100k selections over 29 experts -> compute bound at the FP8 rate (H200 has no FP4)
    want_flops = 100_000 * 6 * 3584 * 3072 / H200_FP8
    assert cm.expert_time(100_000, 29) == pytest.approx(want_flops, rel=1e-12)
    # no tokens, nothing touched: free
    assert cm.expert_time(0, 0) == 0.0


def test_all_to_all_nvlink_and_nic_in_parallel_with_latency(k3):
    cm = CostModel(k3, make_cluster(32, "h200"), EXACT)
    copy = 3584 * (1 + 4 / 128)  # FP8 values + one fp32 scale per 128
    assert cm.copy_bytes("dispatch") == pytest.approx(copy)
    # low-latency kernels send one message per selected expert: 16 / (32 (1 - (31/32)^16)) per GPU copy
    f = 16 / (32 * (1 - (31 / 32) ** 16))
    assert k3.top_k == 16 and cm.ll_per_copy == pytest.approx(f)
    t_nv = 3e-6 + 100 * f * copy / 450e9
    t_nic = 8e-6 + 50 * f * copy / 50e9
    assert cm.a2a_time(100, 50, "dispatch") == pytest.approx(max(t_nv, t_nic))
    assert cm.a2a_time(100, 0, "dispatch") == pytest.approx(t_nv)
    assert cm.a2a_time(0, 0, "combine") == 0.0
    assert cm.a2a_time(0, 10, "combine") == pytest.approx(8e-6 + 10 * f * 3584 * 2 / 50e9)


def test_mla_decode_is_a_cache_read_and_prefill_is_compute():
    m = mini_model()
    cm = CostModel(m, make_cluster(8, "h200"), EXACT, kv_dtype="fp8")
    p = 393216  # q 512x64 + 64x8x48, kv 512x80 + 64x8x64, o 8x32x512, gate 512x8x32
    assert m.attention_params("mla") == p
    # two decoding sequences with contexts 100 and 300 (400 keys): weights + 400 x 80 B of fp8 latent
    w = work(tokens=2, dec_seqs=2, dec_ctx=400, sampled=2)
    assert cm.mla_time(w)[0] == pytest.approx((2 * p + 400 * 80) / H200_BW)
    # a 4096-token chunk from position 0: 4096 x 4097 / 2 causal pairs at 2 x 8 x (32 + 16 + 32) FLOPs
    pairs = 4096 * 4097 / 2
    w = work(tokens=4096, pre_tokens=4096, pre_seqs=1, pre_pairs=pairs, pre_ctx=4096, sampled=1)
    assert cm.mla_time(w)[0] == pytest.approx((4096 * 2 * p + pairs * 1280) / H200_BF16)


def test_kda_decode_reads_and_writes_the_state_once_per_sequence():
    m = mini_model()
    cm = CostModel(m, make_cluster(8, "h200"), EXACT)
    p = m.attention_params("kda")
    state = 8 * 32 * 32 * 4 + 3 * 8 * 32 * 3 * 2  # fp32 recurrent + bf16 conv state, one layer
    assert m.state_bytes_per_sequence() == 3 * state
    w = work(tokens=3, dec_seqs=3, sampled=3)
    assert cm.kda_time(w)[0] == pytest.approx((2 * p + 2 * state * 3) / H200_BW)
    # attention TP 2 halves heads, weights and state
    cm2 = CostModel(m, make_cluster(8, "h200"), EXACT, attention_tp=2)
    assert cm2.kda_time(w)[0] == pytest.approx((p + state * 3) / H200_BW)


def test_kda_prefill_core_runs_at_the_published_kda_rate_not_the_gqa_estimate():
    """KDA's chunked core is priced at ``kda_flops_efficiency`` (FlashKDA's published H20 rate), GQA's at
    ``flops_efficiency``: changing one moves only its own layer kind."""
    m = mini_model()
    w = work(tokens=65536, pre_tokens=65536, pre_seqs=1, sampled=1, pre_pairs=65536 * 65537 / 2, pre_ctx=65536)
    c = m.kda
    core = 65536 * (3 * 2.0 * c.num_heads * c.head_dim ** 2 + 2 * 2.0 * c.num_heads * c.head_dim * 64)
    base = CostModel(m, make_cluster(8, "h200"), EXACT.replace(kda_flops_efficiency=0.5))
    slow = CostModel(m, make_cluster(8, "h200"), EXACT.replace(kda_flops_efficiency=0.25))
    assert slow.kda_time(w)[0] - base.kda_time(w)[0] == pytest.approx(core / (0.25 * H200_BF16) - core / (0.5 * H200_BF16))
    other = CostModel(m, make_cluster(8, "h200"), EXACT.replace(kda_flops_efficiency=0.5, flops_efficiency=0.25))
    assert other.kda_time(w)[0] == pytest.approx(base.kda_time(w)[0])
    assert CostConfig().kda_flops_efficiency == 0.27


def test_step_time_composition_and_dual_batch_overlap():
    m = mini_model()
    cm = CostModel(m, make_cluster(4, "h200"), EXACT)
    w = RankWork.zeros(2)
    w.tokens[:] = [64, 32]
    w.pre_tokens[:] = [64, 32]
    w.pre_seqs[:] = [1, 1]
    w.pre_pairs[:] = [64 * 65 / 2, 32 * 33 / 2]
    w.pre_ctx[:] = [64, 32]
    w.sampled[:] = [1, 1]
    L, G = 3, 4
    moe = MoeWork(tokens=np.array([[100, 60, 20, 20]] * L, float), touched=np.array([[4, 4, 2, 2]] * L, float),
                  nvlink=np.array([[30, 20, 10, 10]] * L, float), nic=np.zeros((L, G)))
    st = cm.step_time(w, moe)
    kda = np.max(cm.kda_time(w) + cm.trunk_time(w, True))
    kda_dense = np.max(cm.kda_time(w) + cm.trunk_time(w, False))
    mla = np.max(cm.mla_time(w) + cm.trunk_time(w, True))
    t = cm.expert_time(moe.tokens[0], moe.touched[0])
    assert st.mode == "normal"  # prefill tokens: DeepEP normal kernels
    d = cm.a2a_time(moe.nvlink[0], moe.nic[0], "dispatch", "normal")
    c = cm.a2a_time(moe.nvlink[0], moe.nic[0], "combine", "normal")
    moe_t = t.max() + d.max() + c.max()
    head = np.max(cm.lm_head_time(w))
    assert st.layer == pytest.approx([kda_dense, kda + moe_t, kda + moe_t, mla + moe_t])
    assert st.total == pytest.approx(kda_dense + 2 * kda + mla + 3 * moe_t + head)
    assert st.straggler == pytest.approx([t.max() - t.mean() + d.max() - d.mean() + c.max() - c.mean()] * 3)
    # dual-batch overlap: two half micro-batches; a layer takes max(2 x half compute, 2 x half comm) and the
    # iteration one pipeline fill (min of the two halves, averaged over MoE layers)
    dbo = cm.step_time(w, moe, dual_batch_overlap=True)
    w2, moe2 = w.half(), moe.half()
    kda2 = np.max(cm.kda_time(w2) + cm.trunk_time(w2, True))
    t2 = cm.expert_time(moe2.tokens[0], moe2.touched[0])
    comm2 = cm.a2a_time(moe2.nvlink[0], moe2.nic[0], "dispatch", "normal").max() + cm.a2a_time(
        moe2.nvlink[0], moe2.nic[0], "combine", "normal").max()
    comp, com = 2 * (kda2 + t2.max()), 2 * comm2
    assert dbo.layer[1] == pytest.approx(max(comp, com))
    assert dbo.layer[0] == pytest.approx(kda_dense)  # dense layers do not overlap
    # half the batch touches fewer experts (Poisson occupancy), never more than the whole batch
    assert np.all(moe2.touched <= moe.touched) and np.all(moe2.touched >= moe.touched / 2)
    # with little work the two micro-batches pay every latency twice: overlap does not pay off ...
    assert dbo.total > st.total
    # ... with a large batch it hides the communication
    big = MoeWork(tokens=moe.tokens * 400, touched=moe.touched, nvlink=moe.nvlink * 400, nic=moe.nic)
    wb = RankWork(*(getattr(w, f) * (400 if f != "sampled" else 1) for f in
                    ("tokens", "sampled", "dec_seqs", "dec_ctx", "pre_tokens", "pre_seqs", "pre_pairs", "pre_ctx")))
    assert cm.step_time(wb, big, dual_batch_overlap=True).total < cm.step_time(wb, big).total


def test_deepep_normal_sends_one_rdma_copy_per_node_low_latency_one_per_gpu(k3):
    from moeplace.sim.cost import node_dedup_factor
    # 4 nodes of 8, top-8 uniform: remote GPUs hit 24 (1 - (31/32)^8), remote nodes 3 (1 - (3/4)^8)
    f = node_dedup_factor(32, 8, 8)
    assert f == pytest.approx(3 * (1 - 0.75 ** 8) / (24 * (1 - (31 / 32) ** 8)))
    assert node_dedup_factor(8, 8, 8) == 1.0
    cm = CostModel(k3, make_cluster(32, "h200"), EXACT)
    f = node_dedup_factor(32, 8, k3.top_k)
    assert cm.node_dedup == pytest.approx(f)
    copy = cm.copy_bytes("dispatch")
    ll = cm.a2a_time(0, 100, "dispatch", "low_latency")
    normal = cm.a2a_time(0, 100, "dispatch", "normal")
    assert ll == pytest.approx(8e-6 + 100 * cm.ll_per_copy * copy / 50e9)
    # normal: the NIC carries f x the copies; the receiver forwards 7/8 of them over NVLink in parallel
    assert normal == pytest.approx(max(8e-6 + 100 * f * copy / 50e9, 3e-6 + 100 * 7 / 8 * copy / 450e9))
    assert normal < ll


def test_allgather_moe_moves_every_other_ranks_tokens(k3):
    cm = CostModel(k3, make_cluster(8, "h200"), EXACT, a2a_mode="allgather")
    L, G = k3.num_moe_layers, 8
    tokens = np.full((L, G), 100.0 * k3.top_k)  # 100 tokens per GPU, top-k selections each
    moe = MoeWork(tokens, np.full((L, G), 4.0), np.zeros((L, G)), np.zeros((L, G)))
    _, comm, _ = cm.moe_layer_times(moe, "allgather")
    per = cm.copy_bytes("dispatch") + cm.copy_bytes("combine")
    assert comm == pytest.approx(np.full(L, 2 * 3e-6 + 800 * 7 / 8 * per / 450e9))


def test_allgather_payload_follows_the_expert_format(k3):
    """TensorRT-LLM's CUTLASS MoE gathers NVFP4 tokens for NVFP4 experts (quantized before the gather) and
    BF16 tokens for DeepSeek FP8 block-scale experts (quantized inside the MoE op); outputs return BF16."""
    from dataclasses import replace
    L, G, h = k3.num_moe_layers, 8, k3.expert_hidden_size
    tokens = np.full((L, G), 100.0 * k3.top_k)
    moe = MoeWork(tokens, np.full((L, G), 4.0), np.zeros((L, G)), np.zeros((L, G)))
    for dtype, gathered in (("nvfp4", h * 4.5 / 8), ("fp8_block128", h * 2.0)):
        cm = CostModel(replace(k3, expert_dtype=dtype), make_cluster(8, "h200"), EXACT, a2a_mode="allgather")
        assert cm.allgather_bytes() == pytest.approx(gathered)
        _, comm, _ = cm.moe_layer_times(moe, "allgather")
        # 800 tokens in the pool, 7/8 of them from other GPUs, NVLink 450 GB/s per direction, 3 us per collective
        assert comm == pytest.approx(np.full(L, 2 * 3e-6 + 800 * 7 / 8 * (gathered + 2.0 * h) / 450e9))


def _small_decode(m, gpus: int = 4):
    """One rank decoding 4 sequences at context 400, and no MoE work on any of ``gpus`` GPUs: an iteration
    whose cost is the attention side plus the fixed overheads."""
    zero = MoeWork(*(np.zeros((m.num_moe_layers, gpus)) for _ in range(4)))
    dec = RankWork.zeros(1)
    dec.tokens[:] = dec.dec_seqs[:] = dec.sampled[:] = 4
    dec.dec_ctx[:] = 400
    return zero, dec


def test_kernels_per_layer_of_an_engine_build_sets_the_gap_overhead():
    """A fused build (fewer kernels per layer) pays the per-kernel gap fewer times; nothing else changes."""
    m = mini_model()
    cfg = CostConfig.roofline(kernels_per_layer=20, graph_gap_s=1e-5, iteration_overhead_s=1e-3)
    zero, dec = _small_decode(m)
    bare = CostModel(m, make_cluster(4, "h200"), EXACT).step_time(dec, zero)
    default = CostModel(m, make_cluster(4, "h200"), cfg).step_time(dec, zero)
    fused = CostModel(m, make_cluster(4, "h200"), cfg, kernels_per_layer=13).step_time(dec, zero)
    assert default.total == pytest.approx(bare.total + m.num_layers * 20 * 1e-5 + 1e-3)
    assert fused.total == pytest.approx(bare.total + m.num_layers * 13 * 1e-5 + 1e-3)
    assert fused.overhead == pytest.approx(m.num_layers * 13 * 1e-5 + 1e-3)
    with pytest.raises(InputError):
        CostModel(m, make_cluster(4, "h200"), cfg, kernels_per_layer=-1)


def test_gemm_curve_tile_fill_kernel_latency_and_tp_allreduce(k3):
    cfg = CostConfig.roofline(gemm_efficiency=0.5, gemm_m0=100.0, gemm_kernel_s=5e-6)
    cm = CostModel(k3, make_cluster(32, "h200"), cfg)
    f = cm.expert_flops_per_token
    # compute bound: 29 experts x 3000 tokens each; tile fill adds 100 rows per expert, 2 kernels
    want = (29 * 3000 + 29 * 100) * f / (H200_FP8 * 0.5) + 2 * 5e-6
    assert cm.expert_time(29 * 3000, 29) == pytest.approx(want)
    # TEP: each GPU holds 1/4 of every expert of its group: a quarter of the FLOPs, same kernels
    assert cm.expert_time(29 * 3000, 29, shard=4) == pytest.approx((want - 1e-5) / 4 + 1e-5)
    # TP8 all-reduce of 10 tokens of hidden 7168 BF16: alpha + 2 x 7/8 x bytes / NVLink
    tp = CostModel(k3, make_cluster(8, "h200"), CostConfig.roofline(allreduce_latency_s=1e-5), attention_tp=8)
    assert tp.allreduce_time(np.array([10.0]))[0] == pytest.approx(1e-5 + 2 * 7 / 8 * 10 * k3.hidden_size * 2 / 450e9)
    assert cm.allreduce_time(np.array([10.0]))[0] == 0.0  # attention TP1: nothing to reduce


def test_fixed_overheads_graph_replay_vs_eager():
    m = mini_model()
    cfg = CostConfig.roofline(kernels_per_layer=10, graph_gap_s=1e-6, launch_s=1e-4, iteration_overhead_s=2e-3)
    cm = CostModel(m, make_cluster(4, "h200"), cfg, cuda_graph_max_bs=8)
    zero, dec = _small_decode(m)
    gpu = CostModel(m, make_cluster(4, "h200"), EXACT).step_time(dec, zero)
    st = cm.step_time(dec, zero)
    assert st.graph and st.mode == "low_latency"
    assert st.total == pytest.approx(gpu.total + m.num_layers * 10 * 1e-6 + 2e-3)
    # 16 sequences exceed the captured graphs: eager, each (tiny) layer waits for its 10 launches
    dec16 = RankWork(*(getattr(dec, f) * 4 for f in ("tokens", "sampled", "dec_seqs", "dec_ctx", "pre_tokens",
                                                      "pre_seqs", "pre_pairs", "pre_ctx")))
    eager = cm.step_time(dec16, zero)
    assert not eager.graph
    assert eager.layer == pytest.approx(np.full(m.num_layers, 10 * 1e-4))
    # a layer whose GPU work outlasts its launches pays the device-side gaps eager too: gpu + 10 x 1 us
    fast = CostModel(m, make_cluster(4, "h200"), cfg.replace(launch_s=1e-9), cuda_graph_max_bs=8)
    heavy = fast.step_time(dec16, zero)
    bare = CostModel(m, make_cluster(4, "h200"), EXACT).step_time(dec16, zero)
    assert not heavy.graph
    assert heavy.layer == pytest.approx(bare.layer + 10 * 1e-6)
    assert heavy.total == pytest.approx(bare.total + m.num_layers * 10 * 1e-6 + 2e-3)


def test_profile_replaces_the_roofline_with_interpolated_measurements(k3):
    prof = profile_from_dict({
        "format": "moeplace.calibration/1", "device": "cpu", "dtype": "fp32",
        "ops": {"expert_gemm": {"x": "tokens_per_expert", "hidden": 512, "intermediate": 512,
                                "points": [[1, 1e-5], [100, 2e-5], [1000, 1.1e-4]]},
                "dispatch": {"x": "bytes", "link": "any", "points": [[1000, 1e-5], [1e6, 1e-3]]}}})
    curve = prof.ops["expert_gemm"]
    assert curve(0.5) == pytest.approx(1e-5)  # below range: the first measurement
    assert curve(50.5) == pytest.approx(1.5e-5)  # linear between points
    assert curve(2000) == pytest.approx(1.1e-4 + 1e-7 * 1000)  # last segment extrapolated
    m = mini_model()  # measured at this model's shape: no scaling
    cm = CostModel(m, make_cluster(8, "h200"), EXACT, profile=prof)
    assert cm.expert_time(400, 4) == pytest.approx(4 * 2e-5)
    cm3 = CostModel(k3, make_cluster(32, "h200"), EXACT, profile=prof)  # K3: FLOP-scaled
    assert cm3.expert_time(400, 4) == pytest.approx(4 * 2e-5 * 3584 * 3072 / (512 * 512))
    # dispatch of 100 + 50 copies at 512 x 1.03125 B each, link "any": one curve over all bytes
    b = 150 * 512 * (1 + 4 / 128)
    assert cm.a2a_time(100, 50, "dispatch") == pytest.approx(1e-5 + (b - 1000) * (1e-3 - 1e-5) / (1e6 - 1000))
    # combine is not in the profile: roofline
    assert cm.a2a_time(100, 0, "combine") == pytest.approx(3e-6 + 100 * cm.ll_per_copy * 512 * 2 / 450e9)


def test_moe_tp_splits_the_experts_and_sends_every_group_member_its_copies(k3):
    """TEP (moe_tp t): each GPU of a group of t runs the group's selections on 1/t of each expert, and in
    the all-to-all receives every copy bound for its group (each member returns a partial output)."""
    L, G = k3.num_moe_layers, 8
    tokens = np.tile([40.0, 0, 0, 0, 8, 8, 8, 8], (L, 1))
    touched = np.tile([8.0, 0, 0, 0, 8, 8, 8, 8], (L, 1))
    nv = np.tile([4.0, 4, 0, 0, 2, 2, 2, 2], (L, 1))
    moe = MoeWork(tokens, touched, nv, np.zeros((L, G)))
    ep = CostModel(k3, make_cluster(G, "h200"), EXACT)
    tep = CostModel(k3, make_cluster(G, "h200"), EXACT, moe_tp=4)
    e_ep, c_ep, _ = ep.moe_layer_times(moe, "low_latency")
    e_tep, c_tep, _ = tep.moe_layer_times(moe, "low_latency")
    assert e_ep == pytest.approx(np.full(L, float(ep.expert_time(40.0, 8.0))))
    # group 0 serves 40 selections of 8 experts, group 1 32 of 32: each member a quarter of each expert
    want = max(float(ep.expert_time(40.0, 8.0, shard=4)), float(ep.expert_time(32.0, 32.0, shard=4)))
    assert e_tep == pytest.approx(np.full(L, want))
    np.testing.assert_array_equal(tep.tep_copies(moe)[0], np.tile([8.0] * 4 + [8.0] * 4, (L, 1)))
    one = lambda n: float(ep.a2a_time(n, 0.0, "dispatch") + ep.a2a_time(n, 0.0, "combine"))
    assert c_ep == pytest.approx(np.full(L, one(4.0)))
    assert c_tep == pytest.approx(np.full(L, one(8.0)))


def test_moe_tp_changes_a_tp8_run(tmp_path):
    """Issue 27: `--moe-tp 8` changed nothing in a TP8 run (stat mode gave every GPU the mean GPU's
    expert reads). At batch 1 the busiest EP rank reads its own experts whole; under TEP8 every GPU reads
    an eighth of all the touched experts: the expert time must drop, in stat mode as in replay (stated
    tolerance: stat within 10 % of replay, uniform routing)."""
    from simkit import build, linear_placement, write_trace

    from moeplace.sim.config import EngineConfig, SimConfig, WorkloadConfig
    m = mini_model(num_experts=64, top_k=8)
    path = write_trace(tmp_path / "t", m, num_requests=4, prompt=16, output=200, skew=0.0)
    out = {}
    for mode in ("stat", "replay"):
        for t in (1, 8):
            cfg = SimConfig(duration=0.002, mode=mode, cost=EXACT,
                            engine=EngineConfig(attention_tp=8, moe_tp=t, max_seqs=1, max_batched_tokens=64),
                            workload=WorkloadConfig(arrival="closed", concurrency=1))
            s = build(path, linear_placement(m, 8, 8), cfg, gpus=8).run().summary
            out[mode, t] = s["experts_s"] / s["iterations"]
    for mode in ("stat", "replay"):
        assert out[mode, 8] < 0.8 * out[mode, 1]
    for t in (1, 8):
        assert out["stat", t] == pytest.approx(out["replay", t], rel=0.1)


def test_collectives_at_measured_bus_bandwidth_by_message_size(k3):
    """All-reduce inside an NVLink domain at the measured table's time for its size: nccl-tests-class bus
    bandwidth for large messages (460-480 GB/s on 8 x H100-class, where the flat-efficiency model gave
    ~305), the latency rows for small ones, H800 at its 200 GB/s links (nccl: ~215 GB/s busbw)."""
    from moeplace.sim.cost import collective_time

    gb = 1 << 30
    busbw = 2 * 7 / 8 * gb / collective_time("all_reduce", gb, 8, 450e9)
    assert 455e9 < busbw < 485e9
    assert collective_time("all_reduce", 14336, 8, 450e9) == pytest.approx(3.54e-6, rel=0.02)  # one token
    assert 190e9 < 2 * 7 / 8 * gb / collective_time("all_reduce", gb, 8, 200e9) < 230e9  # H800
    assert 650e9 < 2 * 7 / 8 * gb / collective_time("all_reduce", gb, 8, 900e9) < 750e9  # B200 NVLink5
    # fewer GPUs move fewer bus bytes; beyond the table at its last bus bandwidth; nothing costs nothing
    assert collective_time("all_reduce", 1 << 26, 2, 450e9) < collective_time("all_reduce", 1 << 26, 8, 450e9)
    assert collective_time("all_reduce", 4 * gb, 8, 450e9) == pytest.approx(4 * collective_time("all_reduce", gb, 8, 450e9))
    assert collective_time("all_gather", 0.0, 8, 450e9) == 0.0 and collective_time("all_reduce", gb, 1, 450e9) == 0.0
    # the cost model's TP all-reduce is the table's (the roofline config keeps alpha-beta at link peak)
    tp = CostModel(k3, make_cluster(8, "h200"), CostConfig(), attention_tp=8)
    rows = np.array([1.0, 256.0])
    want = collective_time("all_reduce", rows * k3.hidden_size * 2, 8, 450e9)
    assert tp.allreduce_time(rows) == pytest.approx(want)
    assert 2 * 7 / 8 * 256 * k3.hidden_size * 2 / want[1] < 305e9  # mid-size messages: well below peak
    # TensorRT-LLM's MoE all-gather / reduce-scatter under attention DP: NCCL's measured times
    ag = CostModel(k3, make_cluster(8, "h200"), CostConfig(), a2a_mode="allgather")
    L = k3.num_moe_layers
    moe = MoeWork(np.full((L, 8), 100.0 * k3.top_k), np.full((L, 8), 4.0), np.zeros((L, 8)), np.zeros((L, 8)))
    _, comm, _ = ag.moe_layer_times(moe, "allgather")
    pool = 800
    assert comm == pytest.approx(collective_time("all_gather", pool * ag.allgather_bytes(), 8, 450e9)
                                 + collective_time("reduce_scatter", pool * ag.copy_bytes("combine"), 8, 450e9))


def test_kernel_gaps_by_layer_kind_and_engine_build(k3):
    """Each decoder layer pays the per-kernel gap for the kernels of its own kind in the engine build
    (KERNEL_BUILDS, counted from the engines' decode paths): a KDA layer runs KDA's kernels, not MLA's;
    TensorRT-LLM's fused NVFP4 build runs tech blog 1's 13 per MLA MoE layer."""
    from moeplace.foundation.model import load_model
    from moeplace.sim.cost import KERNEL_BUILDS

    cfg = CostConfig.roofline(graph_gap_s=1e-6)
    ds = load_model("deepseek-v3")
    unfused = CostModel(ds, make_cluster(8, "h200"), cfg).layer_kernels()
    fused = CostModel(ds, make_cluster(8, "h200"), cfg, kernel_build="fused").layer_kernels()
    moe = np.array([i in set(ds.moe_layers) for i in range(ds.num_layers)])
    assert np.all(fused[moe] == 13) and np.all(unfused[moe] == 26) and np.all(unfused[~moe] == 19)
    # Kimi K3 runs its engines' own kernels (sim.k3_kernels), not the generic build's: vLLM's MegaMoE path
    # (attention DP) per layer 2 attention-residual kernels + KDA 4 / MLA 9 + MoE 9 (dense MLP 3)
    kk = CostModel(k3, make_cluster(8, "h200"), cfg).layer_kernels()
    moe3 = set(k3.moe_layers)
    want = [2 + {"kda": 4, "mla": 9}[kind] + (9 if i in moe3 else 3) for i, kind in enumerate(k3.attention)]
    assert kk.tolist() == want and sum(want) == 68 * 15 + 24 * 20 + 9
    b = KERNEL_BUILDS["unfused"]
    assert {"kda", "mla"} <= set(k3.attention) and b["kda"] > b["mla"]  # the generic build: KDA runs more
    # the gaps follow the counts; one count for every layer overrides the build (a what-if)
    m = mini_model()
    zero, dec = _small_decode(m)
    bare = CostModel(m, make_cluster(4, "h200"), EXACT).step_time(dec, zero)
    st = CostModel(m, make_cluster(4, "h200"), cfg).step_time(dec, zero)
    want = CostModel(m, make_cluster(4, "h200"), cfg).layer_kernels().sum() * 1e-6
    assert st.total == pytest.approx(bare.total + want)
    with pytest.raises(InputError):
        CostModel(m, make_cluster(4, "h200"), cfg, kernel_build="turbo")


def test_a_latency_bound_layer_takes_at_least_its_kernels_times_the_floor():
    """Every kernel of a decode layer takes at least ``kernel_floor_s`` on the device: a tiny layer's time is
    its kernel count x the floor (plus the gaps); a layer whose work outlasts that is not changed."""
    m = mini_model()
    zero, dec = _small_decode(m)
    cfg = CostConfig.roofline(graph_gap_s=1e-6, kernel_floor_s=5e-6)
    cm = CostModel(m, make_cluster(4, "h200"), cfg)
    bare = CostModel(m, make_cluster(4, "h200"), EXACT).step_time(dec, zero)
    st = cm.step_time(dec, zero)
    k = cm.layer_kernels()
    assert np.all(bare.layer < k * 5e-6)  # the small decode is latency-bound in every layer
    assert st.layer == pytest.approx(k * 5e-6 + k * 1e-6)
    # a heavy layer's GPU work stays as it was: only the gaps are added
    heavy = RankWork(*(getattr(dec, f) * 4000 for f in ("tokens", "sampled", "dec_seqs", "dec_ctx", "pre_tokens",
                                                         "pre_seqs", "pre_pairs", "pre_ctx")))
    hb = CostModel(m, make_cluster(4, "h200"), EXACT, cuda_graph_max_bs=0).step_time(heavy, zero)
    hs = CostModel(m, make_cluster(4, "h200"), cfg.replace(launch_s=0.0, kernel_floor_s=2e-6),
                   cuda_graph_max_bs=0).step_time(heavy, zero)
    assert np.all(hb.layer > k * 2e-6)
    assert hs.layer == pytest.approx(hb.layer + k * 1e-6)


def test_mtp_drafts_pay_their_layer_head_and_small_kernels_at_the_floor():
    """Each draft step: the mean MoE layer, the LM head and MTP_KERNELS['draft'] latency-bound kernels;
    once per iteration MTP_KERNELS['step'] more (counted from TensorRT-LLM's one-model MTP)."""
    from moeplace.sim.cost import MTP_KERNELS

    m = mini_model()
    zero, dec = _small_decode(m)
    cfg = CostConfig.roofline(graph_gap_s=1e-6, kernel_floor_s=4e-6)
    cm = CostModel(m, make_cluster(4, "h200"), cfg)
    st = cm.step_time(dec, zero)
    head = float(np.max(cm.lm_head_time(dec)))
    layer = float(np.mean(st.layer[1:]))  # layers 1-3 are the MoE layers
    per = 5e-6
    assert cm.draft_time(st, dec, 3) == pytest.approx(3 * (layer + head + MTP_KERNELS["draft"] * per)
                                                      + MTP_KERNELS["step"] * per)
    assert cm.draft_time(st, dec, 0) == 0.0
    assert MTP_KERNELS["draft"] > 0 and MTP_KERNELS["step"] > 0


def test_fp4_gemms_at_the_published_fp4_over_fp8_gain_weight_only_int4_at_bf16(k3):
    """FP4 expert GEMMs on a GPU with FP4 tensor cores run at fp4_gemm_speedup x its FP8 rate (the published
    FP4 grouped GEMMs gain <= 15 % over FP8, not the 2x of the peaks); without FP4 tensor cores at the FP8
    rate; INT4 weight-only experts (W4A16) at the BF16 rate; attention cores at the attention dtype's."""
    b200 = CostModel(k3, make_cluster(8, "b200"), EXACT.replace(fp4_gemm_speedup=1.15))
    assert b200.gemm_flops("mxfp4") == pytest.approx(4.5e15 * 1.15)
    assert b200.gemm_flops("nvfp4") == pytest.approx(4.5e15 * 1.15)
    assert b200.gemm_flops("fp8") == pytest.approx(4.5e15)
    assert b200.gemm_flops("int4_g32") == pytest.approx(2.25e15)
    h200 = CostModel(k3, make_cluster(8, "h200"), EXACT)
    assert h200.gemm_flops("mxfp4") == pytest.approx(H200_FP8)  # no FP4 tensor cores: W4A8 at the FP8 rate
    assert h200.gemm_flops("int4_g32") == pytest.approx(H200_BF16)
    # compute-bound experts follow it: 100k selections over 29 experts on the B200
    want = 100_000 * 6 * 3584 * 3072 / (4.5e15 * 1.15)
    assert b200.expert_time(100_000, 29) == pytest.approx(want, rel=1e-12)
    # an NVFP4-weight model's attention core still runs at the BF16 rate
    import dataclasses

    fp4w = dataclasses.replace(k3, weight_dtype="nvfp4")
    a = CostModel(fp4w, make_cluster(8, "b200"), EXACT.replace(fp4_gemm_speedup=1.15))
    assert a.peak_other == pytest.approx(2.25e15) and a.peak_kda == pytest.approx(2.25e15 * EXACT.kda_flops_efficiency)
    assert a.peak_trunk == pytest.approx(4.5e15 * 1.15)
    # the pure roofline keeps the FP4 peak
    assert CostModel(fp4w, make_cluster(8, "b200"), EXACT).peak_trunk == pytest.approx(9e15)


def test_programmatic_dependent_launch_hides_part_of_each_gap_in_the_fused_build():
    """TensorRT-LLM's fused min-latency build runs with PDL: each kernel's gap is graph_gap_s less the
    ~0.5 us tech blog 1 measures PDL to save; the unfused builds pay the whole gap."""
    from moeplace.sim.cost import PDL_GAP_SAVING_S

    m = mini_model()
    cfg = CostConfig.roofline(graph_gap_s=2e-6)
    unfused = CostModel(m, make_cluster(4, "h200"), cfg)
    fused = CostModel(m, make_cluster(4, "h200"), cfg, kernel_build="fused")
    assert unfused.kernel_gap_s() == pytest.approx(2e-6)
    assert fused.kernel_gap_s() == pytest.approx(2e-6 - PDL_GAP_SAVING_S["fused"])
    assert fused.kernel_gaps_s() == pytest.approx(fused.layer_kernels() * (2e-6 - 0.5e-6))
    # never below zero
    assert CostModel(m, make_cluster(4, "h200"), cfg.replace(graph_gap_s=1e-7), kernel_build="fused").kernel_gap_s() == 0.0


def test_cost_models_on_one_pool_share_its_layout_and_price_by_their_own_constants():
    """A fit prices one pool under thousands of constant sets, so the layout no constant changes (layers,
    kernels per layer) is computed once per model, cluster and settings and shared: a cost model built
    after the cache is emptied prices every iteration exactly as one that reused it, each by its own
    constants, and a different model or setting gets its own layout."""
    from moeplace.sim import cost as cost_mod

    m, cl = mini_model(), make_cluster(4, "h200")
    w = RankWork.zeros(2)
    w.tokens[:] = w.dec_seqs[:] = w.sampled[:] = [8, 4]
    w.dec_ctx[:] = [8 * 900, 4 * 900]
    L = m.num_moe_layers
    moe = MoeWork(tokens=np.array([[40, 30, 20, 10]] * L, float), touched=np.array([[4, 4, 3, 2]] * L, float),
                  nvlink=np.array([[10, 10, 5, 5]] * L, float), nic=np.zeros((L, 4)))
    slow = CostConfig().replace(hbm_efficiency=0.5, kernel_floor_s=9e-6)
    a, b = CostModel(m, cl, CostConfig(), attention_tp=2), CostModel(m, cl, slow, attention_tp=2)
    assert a._layer_kernels is b._layer_kernels  # shared, not rebuilt
    with pytest.raises(ValueError):
        a._is_moe[0] = not a._is_moe[0]  # shared arrays are read-only
    ta, tb = a.step_time(w, moe).total, b.step_time(w, moe).total
    assert tb > ta
    cost_mod._LAYOUTS.clear()
    fresh = CostModel(m, cl, slow, attention_tp=2)
    assert fresh._layer_kernels is not b._layer_kernels
    assert fresh.step_time(w, moe).total == tb and CostModel(m, cl, CostConfig(), attention_tp=2).step_time(
        w, moe).total == ta
    assert cost_mod._layout(m, cl, 4, 0.0, "unfused", "vllm") is not cost_mod._layout(m, cl, 2, 0.0, "unfused", "vllm")
    other = mini_model(num_experts=32)
    assert CostModel(other, cl, CostConfig())._keys == CostModel(other, cl, CostConfig())._keys
    assert len({id(cost_mod._layout(x, cl, 1, 0.0, "unfused", "vllm")) for x in (m, other)}) == 2
