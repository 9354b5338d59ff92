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
    case = ("- id: x\n  source: {{org: o, title: t, url: u}}\n  split: validation\n  group: g\n"
            "  regime: mid-batch decode\n  kind: serve\n  gpu: h200\n"
            "  model: deepseek-v3\n  engine: {engine}\n  config: {{gpus: 8, batch_per_rank: 8}}\n  metric: {metric}\n  published: 1\n"
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


def test_group_and_regime_fields_are_checked(tmp_path):
    """Every case names its deployment group and its regime; the regime must be the label's rule over the
    case's configuration (``kernel`` for kernel tables), one line naming the case and field otherwise."""
    import pytest
    import yaml

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    cases = fid.load_cases(fid.CASES)
    assert all(c["group"] and c["regime"] for c in cases)
    raw = yaml.safe_load(fid.CASES.read_text())
    bad = tmp_path / "cases.yaml"
    wrong = next(c for c in raw if c["id"] == "trtllm-b200-min-latency")
    bad.write_text(yaml.safe_dump([{**wrong, "regime": "max-throughput"}]))
    with pytest.raises(InputError, match=r"case 1 \(trtllm-b200-min-latency\): field 'regime' must be "
                                         r"'single-user latency'"):
        fid.load_cases(bad)
    bad.write_text(yaml.safe_dump([{k: v for k, v in wrong.items() if k != "group"}]))
    with pytest.raises(InputError, match=r"case 1 \(trtllm-b200-min-latency\): missing field 'group'"):
        fid.load_cases(bad)


def test_committed_cross_validation_is_its_rows_summary():
    """bench/results/fidelity.json's ``cv`` is cv_summary of its own rows; every case carries its group and
    its cross-validated figure, one fold per group holding exactly that group's cases."""
    fid = _fidelity()
    cases = fid.load_cases(fid.CASES)
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    rows, cv = res["cases"], res["cv"]
    assert [r["group"] for r in rows] == [c["group"] for c in cases]
    for r in rows:
        assert r["cv_error"] == r["cv_simulated"] / r["published"] - 1, r["id"]
    want = json.loads(json.dumps(fid.cv_summary(rows)))
    assert {k: cv[k] for k in want} == want
    groups = list(dict.fromkeys(c["group"] for c in cases))
    assert list(cv["folds"]) == groups  # one fold per group, kernel tables' too
    assert cv["groups"] == len({c["group"] for c in cases if c["kind"] in fid.E2E})  # the headline's groups
    for g, fold in cv["folds"].items():
        assert fold["cases"] == [c["id"] for c in cases if c["group"] == g]


def test_cross_validation_never_fits_on_the_group_it_predicts(monkeypatch):
    """Each fold's fit sees every case outside the held-out group and none inside it (the kernel tables
    here: no simulation), and the held-out cases are predicted with that fold's constants."""
    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    cases = [c for c in fid.load_cases(fid.CASES) if c["kind"] == "gemm"]
    cfg = CostConfig()
    rows = [{"id": c["id"], "kind": c["kind"], "group": c["group"], "published": c["published"],
             "simulated": fid.kernel_metric(c, cfg), "error": 0.0, "split": c["split"], "metric": c["metric"]}
            for c in cases]
    seen, fitted = [], {}
    real_fit = fid.fit

    def recording_fit(fit_cases, quick, **kw):
        out = real_fit(fit_cases, True, **kw)
        seen.append([c["id"] for c in fit_cases])
        fitted[tuple(seen[-1])] = out[0]
        return out

    monkeypatch.setattr(fid, "fit", recording_fit)
    cv = fid.cross_validate(cases, rows, cfg, quick=True, log=lambda *_: None)
    groups = list(dict.fromkeys(c["group"] for c in cases))
    assert seen[0] == [c["id"] for c in cases]  # the start of every fold: the fit on all cases
    for g, ids in zip(groups, seen[1:], strict=True):
        assert ids == [c["id"] for c in cases if c["group"] != g]
        fold_cfg = fitted[tuple(ids)]
        for c, r in zip(cases, rows):
            if c["group"] == g:
                assert r["cv_simulated"] == fid.kernel_metric(c, fold_cfg)
    assert cv["kernel_tables"]["cases"] == len(cases) and cv["cases"] == 0


def test_loading_a_bench_script_leaves_sys_path_alone():
    """bench/kernels.py must never answer ``import kernels`` (transformers probes Hugging Face's library of
    that name) in a test process that loaded a bench script before."""
    import sys

    before = list(sys.path)
    load_bench("fidelity", "bench_fidelity_path_check")
    assert sys.path == before
