"""The committed fidelity results (bench/results/fidelity.json) belong to the committed case table
(bench/fidelity_cases.yaml): same cases, splits and configurations, so a case edited without re-running
bench/fidelity.py fails here."""
from __future__ import annotations

import json

import numpy as np
from benchkit import REPO, load_bench


def _fidelity():
    return load_bench("fidelity")


def test_committed_results_match_the_case_table():
    fid = _fidelity()
    cases = fid.load_cases(REPO / "bench" / "fidelity_cases.yaml")
    rows = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())["cases"]
    assert [r["id"] for r in rows] == [c["id"] for c in cases]
    for r, c in zip(rows, cases):
        assert (r["split"], r["published"], r["config_full"], r["assumptions"]) == (
            c["split"], c["published"], c["config"], c["assumptions"]), c["id"]
        assert r["error"] == r["simulated"] / r["published"] - 1


def test_validation_cases_never_enter_the_fit():
    fid = _fidelity()
    cases = fid.load_cases(REPO / "bench" / "fidelity_cases.yaml")
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    assert res["fit"]["calibration_cases"] == [c["id"] for c in cases if c["split"] == "calibration"]


def test_balanced_routing_is_exactly_balanced():
    """``routing: balanced`` (DeepSeek's profiles simulate absolutely balanced routing): every expert of every
    layer is chosen by exactly T k / E tokens, each token's k experts distinct."""
    fid = _fidelity()
    case = next(c for c in fid.load_cases(fid.CASES) if c["config"].get("routing") == "balanced")
    trace = fid.case_trace(case, quick=True)
    T, L, k = trace.expert_ids.shape
    E = trace.model.num_experts
    counts = trace.expert_counts()
    assert counts.shape == (L, E) and (counts == T * k // E).all()
    ids = np.sort(trace.expert_ids.astype(np.int64), axis=2)
    assert (np.diff(ids, axis=2) > 0).all()


def test_breakdown_composes_the_steady_iteration():
    """The stored per-case breakdown is the steady iteration's own composition: under dual-batch overlap a
    MoE layer is the larger of its compute and communication sides (a pipeline fill per iteration aside),
    the busiest GPU never beats the mean one, and the iteration's total is the metric's iteration."""
    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    case = next(c for c in fid.load_cases(fid.CASES) if c["id"] == "deepseek-profile-decode-ep128")
    steady = fid.Steady(case, quick=True)
    b = steady.breakdown(CostConfig())
    assert b["mode"] == "low_latency" and b["dbo"] and b["graph"]
    assert np.isclose(b["layer_us"], max(b["overlap_compute_us"], b["overlap_comm_us"]), rtol=1e-9)
    assert b["experts_busiest_us"] >= b["experts_mean_us"] > 0
    assert b["dispatch_slowest_us"] >= b["dispatch_mean_us"] > 0 and b["combine_slowest_us"] >= b["combine_mean_us"]
    assert 1.0 <= b["busiest_over_mean_selections"] < 1.2  # exactly balanced routing: sampling noise only
    # the published figure is output tokens per node per second of the iteration (with its drafting)
    c = case["config"]
    per_node = 8 * c["batch_per_rank"] * steady.engine.mtp_tokens_per_step() / ((b["iteration_ms"] + b["drafting_ms"]) / 1e3)
    assert np.isclose(steady.metric(CostConfig()), per_node, rtol=1e-9)


def test_validation_coverage():
    """Issue 27's coverage floor on the case table itself: >= 30 validation cases from >= 6 source
    organisations, >= 3 models (a Kimi K2/K3-class one among them), all three engines, GPUs of three
    generations (Hopper, Blackwell, Blackwell Ultra)."""
    fid = _fidelity()
    val = [c for c in fid.load_cases(fid.CASES) if c["split"] == "validation"]
    assert len(val) >= 30
    assert len({c["source"]["org"] for c in val}) >= 6
    models = {c["model"] for c in val}
    assert len(models) >= 3 and models & {"kimi-k2", "kimi-k3"}
    assert {fid.case_engine(c) for c in val} >= set(fid.ENGINES)
    gens = {"hopper": {"h100", "h200", "h800"}, "blackwell": {"b200", "gb200-nvl72"},
            "blackwell-ultra": {"b300", "gb300-nvl72"}}
    gpus = {c["gpu"] for c in val}
    assert all(gpus & g for g in gens.values()), gpus


def test_engine_and_metric_fields_are_checked(tmp_path):
    """A case's ``engine`` names one of the three engines and its ``metric`` one the script computes; a
    wrong value is one line naming the case and field."""
    import pytest

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    for c in fid.load_cases(fid.CASES):
        assert c["metric"] in fid.METRICS
        if c["kind"] in fid.E2E and c["source"]["org"] not in ("DeepSeek", "Alibaba RTP-LLM"):
            assert fid.case_engine(c) in fid.ENGINES, c["id"]
    case = ("- id: x\n  source: {{org: o, title: t, url: u}}\n  split: validation\n  kind: serve\n  gpu: h200\n"
            "  model: deepseek-v3\n  engine: {engine}\n  config: {{gpus: 8}}\n  metric: {metric}\n  published: 1\n"
            "  assumptions: []\n")
    bad = tmp_path / "cases.yaml"
    bad.write_text(case.format(engine="tgi", metric="output_tok_s_per_gpu"))
    with pytest.raises(InputError, match=r"case 1 \(x\): field 'engine' must be one of"):
        fid.load_cases(bad)
    bad.write_text(case.format(engine="vllm", metric="tok_s"))
    with pytest.raises(InputError, match=r"case 1 \(x\): field 'metric' must be one of"):
        fid.load_cases(bad)


def test_total_and_per_gpu_prompt_metrics():
    """``total_tok_s`` is the deployment's prompt plus output tokens per second; ``input_tok_s_per_gpu`` the
    prompt tokens one GPU computes; a stated ``kv_tokens`` is the KV pool the simulation gets."""
    fid = _fidelity()
    s = {"prefill_tok_s_per_gpu": 1000.0, "output_tok_s_per_gpu": 50.0, "per_user_tok_s": None}
    total = {"metric": "total_tok_s", "config": {"gpus": 8}}
    assert fid._from_summary(total, s) == 8 * 1050.0
    assert fid._from_summary({"metric": "input_tok_s_per_gpu", "config": {"gpus": 8}}, s) == 1000.0
    assert fid._from_summary({"metric": "output_tok_s", "config": {"gpus": 8}}, s) == 400.0
    assert fid._from_summary({"metric": "input_tok_s_per_node", "config": {"gpus": 8}}, s) == 8000.0
    case = next(c for c in fid.load_cases(fid.CASES) if c["config"].get("kv_tokens"))
    assert fid.case_kv_tokens(case, None, None, None) == case["config"]["kv_tokens"]
