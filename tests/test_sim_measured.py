"""The measured cost source (sim/measured.py): aiconfigurator's silicon tables answer the cost model's questions
where they hold the op (table values, interpolated between the grid the tables are queried on), each GPU's
routed experts at its own tokens and distinct experts, and the roofline elsewhere, labelled; `place simulate`
says which source priced the run."""
from __future__ import annotations

import json

import numpy as np
import pytest
from simkit import mini_model, write_trace

from moeplace.cli.main import main
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.sim.config import CostConfig, EngineConfig
from moeplace.sim.cost import CostModel, RankWork
from moeplace.sim.measured import ROWS, TOKENS, MeasuredCostModel, make_cost_model, resolve_tables

ENGINE = EngineConfig(attention_tp=1, a2a_mode="allgather", kv_dtype="bf16")


@pytest.fixture(scope="module")
def ds3():
    """DeepSeek-V3 on 8 x H200 under TensorRT-LLM's tables (covered: its MoE shape and FP8 block scales)."""
    cost = make_cost_model(load_model("deepseek-v3"), make_cluster(8, "h200"), CostConfig(), ENGINE,
                           cost_model="auto", framework="trtllm")
    assert isinstance(cost, MeasuredCostModel)
    return cost


def test_covered_terms_return_the_tables_values(ds3):
    t, ops, q = ds3.tables, ds3.tables.ops, ds3.tables.common
    m = ds3.model
    # routed experts at a grid point: 32 touched local experts at 8 rows each is the table's EP8 GPU at x = 256
    assert 8 in ROWS
    moe = ops.MoE("moe", 1, m.expert_hidden_size, m.moe_intermediate_size, m.top_k, m.num_experts, 1, 8,
                  q.MoEQuantMode.fp8_block, "balanced", 1)
    table, src = t.query([moe], x=8 * m.num_experts // m.top_k)
    assert src == "silicon"
    assert float(ds3.expert_time(256.0, 32.0)) == pytest.approx(table, rel=1e-9)
    # the LM head GEMM at a grid point of the token curve
    assert 64 in TOKENS
    head, _ = t.query([ops.GEMM("h", 1, m.vocab_size, m.hidden_size, q.GEMMQuantMode.bfloat16)], context=True, x=64)
    w = RankWork.zeros(1)
    w.sampled[:] = 64
    assert float(ds3.lm_head_time(w)[0]) == pytest.approx(head, rel=1e-9)
    # between grid points: interpolated, between its neighbours, and not the roofline's value
    lo, hi = float(ds3.expert_time(32 * 6.0, 32.0)), float(ds3.expert_time(32 * 8.0, 32.0))
    mid = float(ds3.expert_time(32 * 7.0, 32.0))
    roof = CostModel(m, ds3.cluster, CostConfig(), attention_tp=1, kv_dtype="bf16", a2a_mode="allgather")
    assert lo <= mid <= hi and mid != pytest.approx(float(roof.expert_time(32 * 7.0, 32.0)), rel=1e-3)
    for term in ("experts", "projections:mla", "trunk:moe", "lm_head", "mla_decode", "mla_prefill", "allgather"):
        assert ds3.terms[term].startswith("aiconfigurator h200_sxm/trtllm") and "(silicon" in ds3.terms[term], term


def test_each_gpu_is_charged_at_its_own_tokens_and_distinct_experts(ds3):
    tokens = np.array([[256.0, 256.0, 64.0]])
    touched = np.array([[32.0, 8.0, 32.0]])
    t = ds3.expert_time(tokens, touched)
    # same tokens over fewer distinct experts read fewer weights; fewer tokens over the same experts cost less
    assert t[0, 1] < t[0, 0] and t[0, 2] < t[0, 0]
    assert float(ds3.expert_time(0.0, 0.0)) == 0.0


def test_uncovered_runs_and_terms_fall_back_to_the_roofline_labelled():
    m = load_model("deepseek-v3")
    h800 = make_cluster(32, "h800")
    cost = make_cost_model(m, h800, CostConfig(), EngineConfig(attention_tp=1), cost_model="auto")
    assert type(cost) is CostModel and cost.cost_source["source"] == "roofline"
    assert "no tables for GPU 'h800'" in cost.cost_source["why"]
    with pytest.raises(InputError, match="--cost-model measured: aiconfigurator has no tables for GPU 'h800'"):
        make_cost_model(m, h800, CostConfig(), EngineConfig(attention_tp=1), cost_model="measured")
    # a covered GPU and engine whose tables lack one term: that term is the roofline's, and says so
    tables, _ = resolve_tables("h200", "vllm")
    k3 = load_model("kimi-k3")
    cl = make_cluster(32, "h200")
    cost = MeasuredCostModel(k3, cl, tables, CostConfig(), attention_tp=8)
    assert cost.terms["experts"].startswith("aiconfigurator h200_sxm/vllm")
    assert cost.terms["mla_decode"].startswith("roofline: aiconfigurator h200_sxm/vllm")
    assert cost.terms["kda_decode"].startswith("aiconfigurator h200_sxm/vllm")
    w = RankWork.zeros(4)
    w.tokens[:] = w.sampled[:] = w.dec_seqs[:] = 16
    w.dec_ctx[:] = 16 * 4096
    roof = CostModel(k3, cl, CostConfig(), attention_tp=8)
    core = cost.mla_time(w) - cost._projections("mla", w, 4)
    assert core == pytest.approx(roof.mla_time(w) - roof._projections("mla", w, 4))


def test_simulate_says_which_source_priced_the_run(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace", mini_model(), num_requests=4, prompt=16, output=4)
    common = ["simulate", trace, "--placement", "linear", "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2",
              "--duration", "0.1", "--concurrency", "4", "--no-progress", "--json"]
    assert main(common) == 0  # the default: the roofline
    assert json.loads(capsys.readouterr().out)["summaries"][0]["cost_model"]["source"] == "roofline"
    assert main([*common, "--cost-model", "auto"]) == 0  # the mini model's expert shape is in no table
    doc = json.loads(capsys.readouterr().out)["summaries"][0]["cost_model"]
    assert doc["source"] == "roofline" and doc["requested"] == "auto" and "MoE table" in doc["why"]
    assert main([*common, "--cost-model", "roofline"]) == 0
    assert json.loads(capsys.readouterr().out)["summaries"][0]["cost_model"] == {"source": "roofline",
                                                                                   "requested": "roofline"}
    assert main([*common, "--cost-model", "measured"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("place: error: --cost-model measured:") and "MoE table" in err[0]


def test_without_aiconfigurator_auto_runs_the_roofline_and_says_why(monkeypatch):
    from moeplace.sim import measured

    monkeypatch.setattr(measured, "package_version", lambda: None)
    args = (load_model("deepseek-v3"), make_cluster(8, "h200"), CostConfig(), ENGINE)
    cost = make_cost_model(*args, cost_model="auto", framework="trtllm")
    assert type(cost) is CostModel
    assert cost.cost_source == {"source": "roofline", "requested": "auto", "why": "aiconfigurator-core is not installed"}
    with pytest.raises(InputError, match="^--cost-model measured: aiconfigurator-core is not installed$"):
        make_cost_model(*args, cost_model="measured", framework="trtllm")
