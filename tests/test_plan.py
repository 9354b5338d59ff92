"""The memory planner (`place plan`): hand-computed breakdowns on a tiny model, the K3 facts of the
issue, pool rules, admission, validation, suggestions, sweep and the CLI."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from moeplace.cli.main import main
from moeplace.foundation.cluster import ClusterSpec, GPUSpec, make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory import (
    GiB,
    KiB,
    MemoryConfig,
    MiB,
    attention_split,
    deepep_low_latency_bytes,
    default_sweep_gpus,
    parse_context_mix,
    parse_tokens,
    plan_memory,
    render_plan,
    resolve_layout,
    sweep_plans,
)
from moeplace.foundation.model import KDAConfig, MLAConfig, ModelSpec, load_model


# ---------------------------------------------------------------------------- a tiny model, by hand
@pytest.fixture(scope="module")
def tiny():
    # layer 0: dense MLP + KDA; layer 1: MoE + MLA
    return ModelSpec(
        name="tiny", num_layers=2, moe_layers=(1,), num_experts=8, top_k=2, hidden_size=128,
        moe_intermediate_size=64, expert_hidden_size=128, num_shared_experts=1, shared_intermediate_size=64,
        dense_intermediate_size=256, vocab_size=1000, max_context=4096, attention=("kda", "mla"),
        mla=MLAConfig(num_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16),
        kda=KDAConfig(num_heads=4, head_dim=16, conv_kernel=4, full_rank_gate=True),
    )


def tiny_cluster(hbm=2e6, gpus=4):
    gpu = GPUSpec(name="tiny", hbm_bytes=hbm, hbm_bw=1e12, flops_bf16=1e15, flops_fp8=2e15, flops_fp4=0,
                  nvlink_bw=1e11, nvlink_latency=1e-6, nic_bw=1e10, nic_latency=1e-5, gpus_per_node=gpus)
    return ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=gpus)


TINY_CFG = MemoryConfig(tp=2, dp=2, ep=4, num_redundant=4, context=1000, gpu_memory_utilization=0.5,
                      max_batched_tokens=16, page_size=16, ll_max_dispatch_tokens=4, other_reserve_bytes=0)


def test_tiny_weight_lines_by_hand(tiny):
    plan = plan_memory(tiny, tiny_cluster(), TINY_CFG)
    got = {x.name: x.bytes for x in plan.lines}
    expert = 3 * 128 * 64 * 2  # gate, up, down at bf16
    assert got["routed experts"] == 8 / 4 * expert
    assert got["redundant replicas"] == 4 / 4 * expert
    assert got["shared experts"] == 3 * 128 * 64 * 2 / 2  # / dense-TP = attention TP 2
    assert got["routers"] == 128 * 8 * 2
    assert got["dense MLP layers"] == 3 * 128 * 256 * 2 / 2
    assert got["embeddings + LM head"] == 2 * 1000 * 128 * 2 / 2
    # MLA: q 128*4*24, kv_a 128*40 (replicated), kv_b 32*4*32, o 4*16*128
    mla_rep, mla_shard = 128 * 40, 128 * 4 * 24 + 32 * 4 * 32 + 4 * 16 * 128
    # KDA: q,k,v,o 4*128*64; f_a 128*16 (replicated); f_b 16*64; dt_bias 64; A_log 4; beta 128*4;
    # gate 128*64; conv 3*64*4
    kda_rep = 128 * 16
    kda_shard = 4 * 128 * 64 + 16 * 64 + 64 + 4 + 128 * 4 + 128 * 64 + 3 * 64 * 4
    assert attention_split(tiny, "mla") == (mla_rep, mla_shard)
    assert attention_split(tiny, "kda") == (kda_rep, kda_shard)
    assert got["attention"] == (mla_rep + mla_shard / 2 + kda_rep + kda_shard / 2) * 2
    assert "vision tower" not in got


def test_tiny_runtime_reserve_by_hand(tiny):
    plan = plan_memory(tiny, tiny_cluster(), TINY_CFG)
    got = {x.name: x.bytes for x in plan.lines}
    T = 16
    residual = 3 * T * 128 * 2
    mla = T * (2 * (2 * 24 + 2 * 16) + 32 + 8) * 2  # 2 heads per GPU: q, k (nope+rope), v, out + latents
    kda = T * 2 * 16 * 6 * 2
    dense = 3 * T * 256 / 2 * 2
    copies = 2.0 * 2 * T * 2 / 4  # peak x dp x T x top_k / EP
    moe = copies * (2 * 128 + 3 * 64) * 2 + 3 * T * 64 / 2 * 2
    logits = T * 1000 / 2 * 4
    assert got["activations"] == residual + max(mla, kda, dense, moe) + logits
    # all-to-all: normal 2*2*16*min(2,4)/4 = 32 tokens x 128 x 4 B, DeepEP LL with 12 slots x 4 tokens
    msg_d, msg_c = 16 + max(256, 128 + 4), 256
    ll = 2 * (max(4 * msg_d, 12 * 4 * msg_c) + 12 * 4 * max(msg_d, msg_c) + 4 * 12)
    assert deepep_low_latency_bytes(12, 128, 4) == ll
    assert got["all-to-all buffers"] == 32 * 128 * 4 + ll
    assert got["CUDA graphs / NCCL / slack"] == 0


def test_tiny_pools_and_concurrency_by_hand(tiny):
    plan = plan_memory(tiny, tiny_cluster(), TINY_CFG)
    weights_reserve = sum(x.bytes for x in plan.lines if x.section != "cache")
    free = 0.5 * 2e6 - weights_reserve
    assert plan.free_bytes == pytest.approx(free)
    p = plan.pools
    assert p.kv_bytes_per_token == 1 * 40 * 2  # one MLA layer, latent 32 + rope 8, bf16, replicated
    assert p.state_bytes_per_seq == (4 * 16 * 16 * 4 + 3 * 64 * 3 * 2) / 2  # recurrent fp32 + conv bf16, / TP
    per_seq = p.state_bytes_per_seq + 1008 * 80  # 1000 tokens -> 63 pages of 16
    assert plan.concurrency_per_rank == int(free // per_seq)
    assert plan.concurrency == 2 * plan.concurrency_per_rank
    assert plan.pool_max_context == int((free - p.state_bytes_per_seq) // (80 * 16)) * 16
    assert plan.max_context == min(plan.pool_max_context, 4096)
    assert plan.fits


def test_lines_add_up_to_the_budget(k3):
    plan = plan_memory(k3, make_cluster(32), MemoryConfig())
    cache = sum(x.bytes for x in plan.lines if x.section == "cache")
    assert plan.weight_bytes + plan.reserve_bytes + cache == pytest.approx(plan.budget_bytes)
    assert plan.budget_bytes == pytest.approx(0.9 * 150.12e9)  # the H200's device-reported 139.81 GiB


def test_the_budget_is_a_fraction_of_the_memory_the_device_reports(k3):
    """vLLM sizes from torch.cuda.mem_get_info()'s total and SGLang from the free memory after start-up:
    the device-reported figure, not the marketing one; a GPU spec without it falls back to the marketing."""
    cluster = make_cluster(32, "h200")
    assert cluster.gpu.hbm_bytes == 141e9 and cluster.gpu.memory_bytes == cluster.gpu.device_memory_bytes == 150.12e9
    plan = plan_memory(k3, cluster, MemoryConfig(gpu_memory_utilization=0.8))
    assert plan.hbm_bytes == 150.12e9 and plan.budget_bytes == pytest.approx(0.8 * 150.12e9)
    marketing = replace(cluster, gpu=replace(cluster.gpu, device_memory_bytes=None))
    before = plan_memory(k3, marketing, MemoryConfig(gpu_memory_utilization=0.8))
    assert before.budget_bytes == pytest.approx(0.8 * 141e9)
    assert plan.free_bytes - before.free_bytes == pytest.approx(0.8 * 9.12e9)  # the reserve does not move
    assert "as the device reports it (marketing 141 GB)" in render_plan(plan)
    assert "marketing capacity" in render_plan(before)
    for name in ("h100", "h800", "h200", "b200", "b300"):  # established from the devices' own reports
        assert make_cluster(8, name).gpu.device_memory_bytes is not None


# ---------------------------------------------------------------------------- K3 facts from the issue
def test_8_h200_cannot_hold_k3(k3):
    plan = plan_memory(k3, make_cluster(8, "h200"), MemoryConfig(context=8192))
    assert not plan.fits
    assert "1.56 TB" in plan.reasons[0] and "8 x 150 GB = 1.20 TB" in plan.reasons[0]
    s = plan.suggestions[0]
    assert s.kind == "more GPUs" and s.gpus > 8
    assert plan_memory(k3, make_cluster(s.gpus, "h200"), s.config, suggest=False).fits


@pytest.mark.parametrize(("gpus", "expect_gb"), [(16, 90.4), (32, 45.2)])
def test_routed_expert_bytes_per_gpu(k3, gpus, expect_gb):
    plan = plan_memory(k3, make_cluster(gpus), MemoryConfig(ep=gpus, context=8192), suggest=False)
    routed = next(x.bytes for x in plan.lines if x.name == "routed experts")
    assert routed / 1e9 == pytest.approx(expect_gb, abs=0.1)
    # EP16 on 32 GPUs shards each slot over MoE-TP 2: the same bytes as EP32
    if gpus == 32:
        half = plan_memory(k3, make_cluster(32), MemoryConfig(ep=16, context=8192), suggest=False)
        assert next(x.bytes for x in half.lines if x.name == "routed experts") == pytest.approx(routed)


def test_redundant_slots_add_R_over_EP_experts_per_layer(k3):
    plan = plan_memory(k3, make_cluster(32), MemoryConfig(num_redundant=32, context=8192), suggest=False)
    red = next(x.bytes for x in plan.lines if x.name == "redundant replicas")
    assert red == pytest.approx(1 * 92 * k3.bytes_per_routed_expert)  # 32 / 32 = 1 extra slot per layer


def test_mla_kv_and_kda_state_sizes(k3):
    bf16 = plan_memory(k3, make_cluster(32), MemoryConfig(kv_dtype="bf16"), suggest=False).pools
    fp8 = plan_memory(k3, make_cluster(32), MemoryConfig(kv_dtype="fp8"), suggest=False).pools
    assert bf16.kv_bytes_per_token == 27 * KiB
    assert fp8.kv_bytes_per_token == 13.5 * KiB
    assert bf16.kv_tokens(2**20) * bf16.kv_bytes_per_token == 27 * GiB  # one 1M-token sequence
    tp1 = plan_memory(k3, make_cluster(32), MemoryConfig(tp=1), suggest=False).pools
    assert tp1.state_bytes_per_seq / MiB == pytest.approx(428.6, abs=0.1)
    assert bf16.state_bytes_per_seq == pytest.approx(tp1.state_bytes_per_seq / 32)  # attention TP 32
    dcp = plan_memory(k3, make_cluster(32), MemoryConfig(dcp=8), suggest=False).pools
    assert dcp.kv_tokens(2**20) == 2**20 // 8  # DCP shards the tokens, not the state
    assert dcp.state_bytes_per_seq == bf16.state_bytes_per_seq


def test_sglang_h200_deployments_fit(k3):
    # SGLang's K3 guide (docs/design.md Sources §1): SGLang runs K3 on H200 as 4x8 TP32/EP32 and 2x8 TP16/EP16
    p32 = plan_memory(k3, make_cluster(32, "h200"), MemoryConfig(tp=32, ep=32))
    assert p32.fits and p32.concurrency >= 1
    p16 = plan_memory(k3, make_cluster(16, "h200"), MemoryConfig(tp=16, ep=16, context=128 * KiB))
    assert p16.fits


def test_dp_attention_replicates_attention_weights(k3):
    tp1 = plan_memory(k3, make_cluster(32), MemoryConfig(tp=1), suggest=False)
    tp32 = plan_memory(k3, make_cluster(32), MemoryConfig(tp=32), suggest=False)
    att = {p: next(x.bytes for x in p.lines if x.name == "attention") for p in (tp1, tp32)}
    assert att[tp1] == pytest.approx(k3.param_breakdown()["attention"] * 2)
    assert att[tp32] < att[tp1] / 16
    assert not tp1.fits  # 72 GB of replicated attention + 45 GB experts + 24 GB shared experts
    fixed = plan_memory(k3, make_cluster(32), MemoryConfig(tp=1))
    first = fixed.suggestions[0]
    assert first.kind == "larger attention TP" and first.config.tp > 1
    assert first.config.tp * first.config.dp == 32
    smaller = [t for t in (2, 3, 4, 6, 8, 12, 16, 24, 32) if t < first.config.tp and 96 % t == 0 and 32 % t == 0]
    for t in smaller:  # it is the smallest TP that fits
        assert not plan_memory(k3, make_cluster(32), replace(first.config, tp=t, dp=32 // t, dense_tp=t),
                               suggest=False).fits


# ---------------------------------------------------------------------------- other models
def test_deepseek_v3_preset_same_rules():
    ds = load_model("deepseek-v3")
    plan = plan_memory(ds, make_cluster(16), MemoryConfig(context=128 * KiB))
    routed = next(x.bytes for x in plan.lines if x.name == "routed experts")
    assert routed == pytest.approx(256 / 16 * 58 * ds.bytes_per_routed_expert)
    assert plan.pools.kv_bytes_per_token == 61 * 576 * 2
    assert plan.pools.state_bytes_per_seq == 0
    assert plan.fits


def test_hf_configs_plan(tmp_path):
    ds_cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "n_routed_experts": 256,
              "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_attention_heads": 128, "q_lora_rank": 1536,
              "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "n_shared_experts": 1, "moe_intermediate_size": 2048, "intermediate_size": 18432,
              "vocab_size": 129280, "max_position_embeddings": 163840, "quantization_config": {"quant_method": "fp8"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ds_cfg))
    hf = plan_memory(load_model(str(path)), make_cluster(16), MemoryConfig(context=32 * KiB))
    preset = plan_memory(load_model("deepseek-v3"), make_cluster(16), MemoryConfig(context=32 * KiB))
    assert hf.pools.kv_bytes_per_token == preset.pools.kv_bytes_per_token
    assert hf.fits
    # a GQA model: KV heads split over TP, never below one head per GPU
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960}
    path.write_text(json.dumps(qwen))
    q = load_model(str(path))
    for tp, heads in ((1, 4), (2, 2), (4, 1), (8, 1)):
        plan = plan_memory(q, make_cluster(8), MemoryConfig(tp=tp, context=32 * KiB), suggest=False)
        assert plan.pools.kv_bytes_per_token == 48 * 2 * heads * 128 * 2
        assert plan.fits


# ---------------------------------------------------------------------------- pools and admission
@pytest.mark.parametrize("split", [("shared", None), ("ratio", 0.9), ("ratio", 0.05), ("slots", 3)])
def test_admission_matches_concurrency(tiny, split):
    cfg = replace(TINY_CFG, pool_split=split[0], pool_param=split[1])
    plan = plan_memory(tiny, tiny_cluster(), cfg)
    pools = plan.pools
    used_tokens = used = 0
    while pools.can_admit(1000, used_tokens, used):
        used_tokens += pools.kv_tokens(1000)
        used += 1
    assert used == plan.concurrency_per_rank
    assert pools.fits(used_tokens, used) and not pools.fits(used_tokens + pools.kv_tokens(1000), used + 1)
    if split[0] == "ratio":
        r = split[1]
        free = plan.free_bytes
        assert pools.state_pool_bytes == pytest.approx(free * r / (1 + r))
        assert pools.state_slots == int(free * r / (1 + r) // pools.state_bytes_per_seq)
        expect = "state" if pools.state_slots < pools.kv_token_capacity // 1008 else "kv"
        assert plan.concurrency_ceiling == expect
    if split[0] == "slots":
        assert pools.state_slots == 3 and plan.concurrency_per_rank <= 3


def test_ratio_split_can_make_state_the_ceiling(tiny):
    low = replace(TINY_CFG, pool_split="ratio", pool_param=0.02, context=16)
    plan = plan_memory(tiny, tiny_cluster(), low)
    assert plan.pools.state_slots >= 1
    assert plan.concurrency_ceiling == "state" and plan.concurrency_per_rank == plan.pools.state_slots
    shared = plan_memory(tiny, tiny_cluster(), replace(low, pool_split="shared"))
    assert shared.concurrency_per_rank > plan.concurrency_per_rank  # the shared pool adapts to short sequences


def test_context_mix_and_max_num_seqs(k3):
    mix = parse_context_mix("8k:0.7,128k:0.25,1M:0.05")
    plan = plan_memory(k3, make_cluster(32), MemoryConfig(context_mix=mix))
    p = plan.pools
    per_seq = p.state_bytes_per_seq + p.kv_bytes_per_token * (0.7 * 8192 + 0.25 * 131072 + 0.05 * 2**20)
    assert plan.mix_concurrency_per_rank == int(p.pool_bytes // per_seq)
    assert plan.mix_concurrency > plan.concurrency
    capped = plan_memory(k3, make_cluster(32), MemoryConfig(context=1024, max_num_seqs=7))
    assert capped.concurrency == 7 and capped.concurrency_ceiling == "max_num_seqs"


def test_mix_needs_room_for_its_longest_sequence(k3):
    # 16 x H200 TP16 at --gpu-memory-utilization 0.85 holds ~785k tokens: a mix with 5% 1M sequences admits
    # none, although its mean fits
    mix = parse_context_mix("8k:0.95,1M:0.05")
    plan = plan_memory(k3, make_cluster(16), MemoryConfig(tp=16, context=8192, context_mix=mix,
                                                          gpu_memory_utilization=0.85), suggest=False)
    assert plan.concurrency > 0 and plan.max_context < 2**20
    assert plan.mix_concurrency == 0 and not plan.fits


def test_context_beyond_the_model(k3):
    plan = plan_memory(k3, make_cluster(32), MemoryConfig(context=2 * 2**20))
    assert not plan.fits and "exceeds the model's maximum context 1,048,576" in plan.reasons[0]
    assert [s.change for s in plan.suggestions] == ["--context 1M"]


def test_prefix_cache_state_slots_multiply_state(k3):
    one = plan_memory(k3, make_cluster(32), MemoryConfig(), suggest=False).pools
    four = plan_memory(k3, make_cluster(32), MemoryConfig(state_slots_per_seq=4), suggest=False).pools
    assert four.state_bytes_per_seq == pytest.approx(4 * one.state_bytes_per_seq)


# ---------------------------------------------------------------------------- validation and suggestions
@pytest.mark.parametrize(("cfg", "msg"), [
    (MemoryConfig(tp=4, dp=4), "must equal the 32 GPUs"),
    (MemoryConfig(ep=12), "must divide the 32 GPUs"),
    (MemoryConfig(tp=32, dcp=3), "--dcp 3 must divide"),
    (MemoryConfig(tp=1, dp=32, ep=32, num_redundant=5), "use --redundant 32"),
])
def test_layout_errors(k3, cfg, msg):
    with pytest.raises(InputError, match=msg):
        resolve_layout(k3, 32, cfg)


def test_tp_must_divide_heads(k3):
    with pytest.raises(InputError, match="does not divide the 96 attention heads"):
        resolve_layout(k3, 64, MemoryConfig(tp=64))
    assert resolve_layout(k3, 64, MemoryConfig()).tp == 32  # default: largest TP the heads allow
    assert resolve_layout(k3, 72, MemoryConfig(num_redundant=40)).tp == 24


def test_parse_sizes():
    assert parse_tokens("1M") == 1_048_576
    assert parse_tokens("128k") == 131_072
    assert parse_tokens("4096") == 4096
    assert parse_tokens("1.5k") == 1536
    for bad in ("12x", "", "-3", "0"):
        with pytest.raises(InputError):
            parse_tokens(bad)
    assert parse_context_mix("8k:0.7,128k:0.25,1M:0.05") == ((8192, 0.7), (131072, 0.25), (1048576, 0.05))
    with pytest.raises(InputError, match="sum to 0.9"):
        parse_context_mix("8k:0.6,1M:0.3")


def test_fp8_is_the_smallest_change_for_1m_on_16_h200(k3):
    plan = plan_memory(k3, make_cluster(16), MemoryConfig(tp=16, ep=16, gpu_memory_utilization=0.85))
    assert not plan.fits and "1M-token sequence" in plan.reasons[0]
    assert plan.suggestions[0].kind == "fp8 KV"
    for s in plan.suggestions:
        assert plan_memory(k3, make_cluster(s.gpus), s.config, suggest=False).fits


def test_fewer_redundant_suggestion(tiny):
    # A budget between what R=4 and R=0 need for one 1000-token sequence: only dropping replicas fits.
    fp8 = replace(TINY_CFG, kv_dtype="fp8")
    used4 = 1e6 - plan_memory(tiny, tiny_cluster(), fp8).free_bytes
    base0 = plan_memory(tiny, tiny_cluster(), replace(fp8, num_redundant=0))
    used0, need = 1e6 - base0.free_bytes, base0.pools.seq_bytes(1000)
    assert used4 > used0
    hbm = 2 * (used0 + need + (used4 - used0) / 2)  # gpu_memory_utilization 0.5
    plan = plan_memory(tiny, tiny_cluster(hbm), fp8)
    assert not plan.fits
    assert plan.suggestions[0].kind == "fewer redundant" and plan.suggestions[0].config.num_redundant == 0
    assert plan_memory(tiny, tiny_cluster(hbm), plan.suggestions[0].config, suggest=False).fits


# ---------------------------------------------------------------------------- sweep and CLI
def test_sweep_monotone_in_gpus(k3):
    rows = sweep_plans(k3, MemoryConfig(context=128 * KiB), gpu="h200", gpus_per_node=None,
                       gpu_counts=[8, 16, 32, 64], ep_sizes=None, redundant=[0, 32])
    by_gpus = {}
    for r in rows:
        assert r.plan is not None
        assert (k3.num_experts + r.num_redundant) % r.ep == 0
        by_gpus.setdefault(r.gpus, []).append(r.plan)
    weights = [min(p.weight_bytes for p in by_gpus[g]) for g in (8, 16, 32, 64)]
    assert weights == sorted(weights, reverse=True)
    assert not any(p.fits for p in by_gpus[8]) and all(p.fits for p in by_gpus[32])
    assert default_sweep_gpus(32, 8) == [8, 16, 32, 64, 128]


def test_cli_fits_and_does_not_fit(capsys):
    # the README examples (.notes/plan.md)
    fit = "plan --model kimi-k3 --gpus 32 --gpu h200 --tp 32 --ep 32 --context 1M --context-mix 8k:0.7,128k:0.25,1M:0.05"
    assert main(fit.split(" ")) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "routed experts" in out and "45.20" in out
    # 70.13 GB free / 29.01 GB per 1M sequence -> 2
    assert "concurrent sequences at 1M: 2 (2 per DP rank x 1); ceiling: MLA KV cache" in out
    no_fit = "plan --model kimi-k3 --gpus 8 --gpu h200 --context 128k"
    assert main(no_fit.split(" ")) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "smallest change: --gpus" in out


def test_cli_json_and_errors(capsys):
    assert main(["plan", "--gpus", "16", "--context-mix", "8k:0.7,128k:0.25,1M:0.05", "--kv-dtype", "fp8",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["layout"]["ep"] == 16 and d["mix_concurrency"] >= 1
    assert math.isclose(d["pools"]["kv_bytes_per_token"], 13.5 * KiB)
    assert main(["plan", "--gpus", "32", "--ep", "12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error: --ep 12") and err.count("\n") == 1
    assert main(["plan", "--context-mix", "8k:0.5"]) == 2
    assert main(["plan", "--sweep", "--sweep-gpus", "16,32", "--context", "128k"]) == 0
    out = capsys.readouterr().out
    assert "seqs@128k" in out and "fits" in out
