"""The aiconfigurator peer column of bench/fidelity.py: records of bench/peer_aiconfigurator.py joined per case,
the shared-case count, and the reason given where the peer is closer; and the peer script's case mapping
(one rule for all cases, no aiconfigurator needed to check it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from benchkit import REPO, load_bench


def _row(id_, kind, metric, published, simulated, **config):
    return {"id": id_, "split": "validation", "kind": kind, "metric": metric, "published": published,
            "simulated": simulated, "error": simulated / published - 1, "config_full": config, "detail": {}}


def test_join_attaches_the_peer_counts_shared_cases_and_says_why_where_it_is_closer():
    fid = load_bench("fidelity", "bench_fidelity_peer")
    rows = [_row("a", "serve", "output_tok_s_per_gpu", 1000.0, 1500.0, batch_per_rank=100, attention_tp=1),
            _row("b", "decode", "per_user_tok_s", 100.0, 95.0),
            _row("c", "prefill", "input_tok_s_per_node", 50_000.0, 60_000.0),
            _row("k", "gemm", "tflops", 900.0, 800.0)]
    rows[0]["detail"]["tpot_p50_s"] = 0.0667
    peer = {"version": "0.12.0", "cases": [
        {"id": "a", "supported": True, "simulated": 1100.0, "result": {"tpot": 90.0}},
        {"id": "b", "supported": True, "simulated": 150.0, "result": {"tpot": 6.7}},
        {"id": "c", "supported": False, "reason": "no H800 tables in aiconfigurator"},
        {"id": "k", "supported": False, "reason": "kernel-table case"}]}
    s = fid.join_peer(rows, peer)
    assert rows[0]["peer"]["aiconfigurator"]["error"] == pytest.approx(0.1)
    assert rows[1]["peer"]["aiconfigurator"]["error"] == pytest.approx(0.5)
    assert rows[2]["peer"] == {"aiconfigurator": {"supported": False, "reason": "no H800 tables in aiconfigurator"}}
    assert "peer" not in rows[3]  # kernel tables are not deployments
    assert s["shared_cases"] == 2 and s["moeplace_at_least_as_close"] == 1  # rows without a held-out figure: theirs
    assert [b["id"] for b in s["peer_closer"]] == ["a"]
    why = s["peer_closer"][0]["why"]  # moeplace's TPOT, the peer's, and what the published rate implies
    assert "66.7 ms (too fast)" in why and "90.0 ms" in why and "100.0 ms" in why
    assert "1 of 2" in fid.peer_text(s)[0]
    assert fid.peer_cell(rows[2]) == "n/a" and fid.peer_cell(rows[0]) == "1,100 (+10.0%)"
    # a case that prints its own TPOT (InferenceX's means) is compared on it, against the run's same statistic,
    # not on the TPOT its throughput would imply
    rows[0]["published_latency"] = {"tpot_mean_ms": 80.0}
    rows[0]["detail"]["tpot_mean_s"] = 0.0612
    why = fid.join_peer(rows, peer)["peer_closer"][0]["why"]
    assert "61.2 ms (too fast)" in why and "published 80.0 ms (mean of its requests)" in why and "implies" not in why


def test_committed_results_carry_the_peer_for_every_case_the_peer_file_supports():
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    peer = json.loads((REPO / "bench" / "results" / "peer_aiconfigurator.json").read_text())
    supported = {r["id"]: r for r in peer["cases"] if r.get("supported")}
    assert supported  # the peer supports some cases
    for row in res["cases"]:
        if row["id"] in supported:
            p = row["peer"]["aiconfigurator"]
            assert p["simulated"] == supported[row["id"]]["simulated"]
            assert p["error"] == pytest.approx(p["simulated"] / row["published"] - 1)
    ps = res["peer_summary"]
    assert ps["shared_cases"] == len(supported)
    closer = {r["id"] for r in res["cases"] if "peer" in r and "simulated" in r["peer"]["aiconfigurator"]
              and abs(r["peer"]["aiconfigurator"]["error"]) < abs(r["cv_error"])}  # moeplace held out
    assert {b["id"] for b in ps["peer_closer"]} == closer
    assert ps["moeplace_at_least_as_close"] == len(supported) - len(closer)
    # aisimulate 0.13 (its newest build on PyPI), joined the same way from its own file, both releases compared
    ais = ps["aisimulate"]
    theirs = json.loads((REPO / "bench" / "results" / "peer_aisimulate.json").read_text())
    assert ais["peer"] == "aisimulate" and ais["run"] and ais["version"] == theirs["version"]
    assert ais["version"].startswith("0.13.0") and "placeholder" in ais["index"]
    supported = {r["id"]: r for r in theirs["cases"] if r.get("supported")}
    assert ais["shared_cases"] == len(supported) > 0
    for row in res["cases"]:
        if row["id"] in supported:
            assert row["peer"]["aisimulate"]["simulated"] == supported[row["id"]]["simulated"]
    assert ais["versions"]["shared_cases"] == len(set(supported) & {r["id"] for r in peer["cases"] if r.get("supported")})
    predicted = {r["id"]: r["predict"]["simulated"] for r in theirs["cases"] if (r.get("predict") or {}).get("supported")}
    assert predicted and {c["id"]: c["predict"] for c in ais["predict"]["cases"]} == predicted


def test_peer_mapping_follows_the_case_file():
    peer = load_bench("peer_aiconfigurator", "bench_peer_aiconfigurator")
    cases = {c["id"]: c for c in yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())}
    kw, why = peer.call_of(cases["trtllm-b200-max-throughput-fp8kv"])
    assert why is None and kw["system_name"] == "b200_sxm" and kw["backend_name"] == "trtllm"
    assert kw["mode"] == "agg" and kw["batch_size"] == 896 and kw["ctx_tokens"] == 2048
    assert kw["attention_dp_size"] == 8 and kw["moe_ep_size"] == 8 and kw["moe_quant_mode"] == "nvfp4"
    assert kw["kvcache_quant_mode"] == "fp8" and kw["free_gpu_memory_fraction"] == 0.93
    kw, _ = peer.call_of(cases["trtllm-b200-min-latency"])
    assert (kw["mode"], kw["tp_size"], kw["moe_tp_size"], kw["moe_ep_size"]) == ("static_gen", 8, 4, 2)
    assert kw["nextn"] == 3 and kw["nextn_accepted"] == pytest.approx(0.92 + 0.92 * 0.717 + 0.92 * 0.717 * 0.364)
    assert peer.call_of(cases["deepseek-day6-decode-ep144"]) == (None, "no H800 tables in aiconfigurator")
    kw, _ = peer.call_of(cases["lmsys-h100-prefill-ep32-4k"])
    assert kw["mode"] == "static_ctx" and kw["batch_size"] == 4 and kw["backend_name"] == "sglang"


def test_committed_results_carry_the_measured_source_per_case_and_its_summary():
    fid = load_bench("fidelity", "bench_fidelity_measured")
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    e2e = [r for r in res["cases"] if r["kind"] in fid.E2E]
    assert all("measured" in r for r in e2e)
    covered = [r for r in e2e if "simulated" in r["measured"]]
    assert covered and all(r["measured"]["error"] == pytest.approx(r["measured"]["simulated"] / r["published"] - 1)
                           for r in covered)
    # the engine's tables by the case's engine (its field, else its source's organisation): no tables for
    # DeepSeek's or RTP-LLM's own engines
    assert all(fid.case_engine(r) for r in covered)
    assert not any(r["source"]["org"] in ("DeepSeek", "Alibaba RTP-LLM") for r in covered)
    assert res["measured_summary"] == json.loads(json.dumps(fid.measured_summary(res["cases"])))


def test_independent_tally_counts_one_vote_per_group_on_cross_validated_errors():
    """The fair count: correlated rows of one group give one vote (their medians), moeplace's side is its
    cross-validated error (not the split's, where a calibration case's margin is fitted), and a case
    without a cross-validated figure is not counted."""
    fid = load_bench("fidelity", "bench_fidelity_peer_tally")
    rows = [_row(f"t{i}", "decode", "per_user_tok_s", 100.0, 100.0) for i in range(4)]
    rows.append(_row("x", "decode", "per_user_tok_s", 100.0, 100.0))
    for r, g, cv in zip(rows, ["table", "table", "table", "blog", "blog"], [0.05, 0.10, 0.50, 0.40, None]):
        r["group"], r["cv_error"] = g, cv
    rows[4]["cv_error"] = None
    peer = {"version": "0.12.0", "cases": [
        {"id": r["id"], "supported": True, "simulated": s, "result": {}}
        for r, s in zip(rows, [120.0, 120.0, 120.0, 110.0, 101.0])]}  # peer errors 20, 20, 20, 10, 1 %
    s = fid.join_peer(rows, peer)
    ind = s["independent"]
    assert ind["deployments"] == 2 and ind["moeplace_as_close"] == 1
    by = {d["group"]: d for d in ind["by_deployment"]}
    assert by["table"]["moeplace_cv_median_abs_error"] == pytest.approx(0.10) and by["table"]["moeplace_as_close"]
    assert by["blog"]["cases"] == ["t3"] and not by["blog"]["moeplace_as_close"]  # x has no CV figure
    assert "1 of 2" in "\n".join(fid.peer_text(s))
    # the per-case count is still there, and says something else (rows without a held-out figure count theirs)
    assert s["moeplace_at_least_as_close"] == 3


def test_peer_takes_the_largest_batch_that_fits_where_the_case_batch_is_oom():
    """bench/peer_aiconfigurator.py: an OOM at the case's batch bisects to the largest batch that fits and
    records the case's; another error, or OOM at batch 1, is the peer's refusal."""
    peer = load_bench("peer_aiconfigurator", "bench_peer_aiconfigurator_oom")

    def estimate(batch_size, **_):
        if batch_size > 1000:
            raise RuntimeError("OOM: the model does not fit")
        return {"bs": batch_size}

    kw, res, reduced = peer.estimate_fitting(estimate, {"batch_size": 1792, "mode": "agg"})
    assert (kw["batch_size"], res["bs"], reduced) == (1000, 1000, 1792)
    kw, res, reduced = peer.estimate_fitting(estimate, {"batch_size": 512})
    assert reduced is None and res["bs"] == 512
    with pytest.raises(RuntimeError, match="OOM"):
        peer.estimate_fitting(lambda **_: (_ for _ in ()).throw(RuntimeError("OOM: no")), {"batch_size": 64})
    with pytest.raises(ValueError):
        peer.estimate_fitting(lambda **_: (_ for _ in ()).throw(ValueError("no table")), {"batch_size": 64})


def _peer_doc(name, version, figures, reasons=()):
    """A peer file: ``figures`` {id: (simulated, call)}, ``reasons`` {id: why not supported}."""
    cases = [{"id": i, "supported": True, "simulated": v, "call": call, "result": {}} for i, (v, call) in figures.items()]
    cases += [{"id": i, "supported": False, "reason": why} for i, why in dict(reasons).items()]
    return {"peer": name, "version": version, "cases": cases}


def test_two_releases_of_the_peer_are_compared_on_the_cases_both_support():
    """aiconfigurator 0.12 against aisimulate 0.13: medians of each and of moeplace (held out) on the cases
    both support, overall and after the cut-off; a disagreement is a change of support or estimates more
    than 1 % apart (hand-computed)."""
    fid = load_bench("fidelity", "bench_fidelity_versions")
    rows = [_row(i, "decode", "per_user_tok_s", 100.0, 100.0) for i in "abcdef"]
    rows.append(_row("k", "gemm", "tflops", 900.0, 800.0))
    for r, cv in zip(rows, [0.10, -0.20, 0.30, 0.40, 0.05, 0.0, 0.0]):
        r["cv_error"], r["group"], r["after_cutoff"] = cv, "g" + r["id"], r["id"] == "e"
    call = {"mode": "static_gen", "batch_size": 8}
    old = _peer_doc("aiconfigurator", "0.12.0", {"a": (120.0, call), "b": (150.0, call), "c": (90.0, call),
                                                 "e": (110.0, call), "k": (1.0, call)}, {"d": "no table"})
    new = _peer_doc("aisimulate", "0.13.0.dev1", {"a": (120.5, call), "b": (75.0, {**call, "batch_size": 4}),
                                                  "e": (104.0, call), "k": (1.0, call)},
                    {"c": "aisimulate raised OOM", "d": "no table"})
    v = fid.compare_versions(rows, old, new)
    assert v["old"] == "aiconfigurator 0.12.0" and v["new"] == "aisimulate 0.13.0.dev1"
    assert v["shared_cases"] == 3 and v["same_call"] == 2  # a, b, e; b's call differs
    m = v["median_abs_error"]  # |errors| a, b, e: moeplace .10 .20 .05; 0.12: .20 .50 .10; 0.13: .205 .25 .04
    assert (m["cases"], m["moeplace"], m["aiconfigurator"], m["aisimulate"]) == (3, pytest.approx(0.10),
                                                                                pytest.approx(0.20), pytest.approx(0.205))
    ac = v["after_cutoff"]
    assert ac["cases"] == 1 and ac["aisimulate"] == pytest.approx(0.04) and ac["moeplace"] == pytest.approx(0.05)
    assert v["by_kind"] == {"serving": None, "decode and prefill": m}  # every row here is a decode case
    dis = {d["id"]: d for d in v["disagree"]}
    assert set(dis) == {"b", "c", "e"}  # a: 120.5 / 120 is within 1 %; e: 104 / 110 is not
    assert dis["b"]["ratio"] == pytest.approx(0.5) and not dis["b"]["same_call"]
    assert dis["b"]["aiconfigurator_error"] == pytest.approx(0.5) and dis["b"]["aisimulate_error"] == pytest.approx(-0.25)
    assert dis["c"] == {"id": "c", "supported_by": "aiconfigurator", "reason": "aisimulate raised OOM"}
    assert v["not_run_by_both"] == [{"id": "f", "run_by": []}]
    text = "\n".join(fid.peer_text({**fid.join_peer(rows, old), "aisimulate": {
        **fid.join_peer(rows, new), "run": True, "index": "newest build", "versions": v}}))
    assert "3 cases both support (2 with the same call)" in text and "disagree on c: only aiconfigurator supports it" in text


def test_both_peers_join_side_by_side_and_a_missing_file_says_why(tmp_path):
    """peer_summary_of: each peer's entry on the row (re-joining one keeps the other), aisimulate's summary with
    its run's details and the comparison; without its file, a record saying why."""
    fid = load_bench("fidelity", "bench_fidelity_both_peers")
    rows = [_row("a", "decode", "per_user_tok_s", 100.0, 110.0), _row("b", "decode", "per_user_tok_s", 100.0, 80.0)]
    for r in rows:
        r["cv_error"], r["group"] = r["error"], "g"
    old = _peer_doc("aiconfigurator", "0.12.0", {"a": (130.0, {}), "b": (95.0, {})})
    new = _peer_doc("aisimulate", "0.13.0.dev1", {"a": (105.0, {})}, {"b": "aisimulate raised KeyError"})
    ps = fid.peer_summary_of(rows, old, {**new, "run": True, "api": "x.cli_estimate", "index": "placeholder note"})
    assert rows[0]["peer"]["aiconfigurator"]["error"] == pytest.approx(0.3)
    assert rows[0]["peer"]["aisimulate"]["error"] == pytest.approx(0.05)
    assert rows[1]["peer"]["aisimulate"] == {"supported": False, "reason": "aisimulate raised KeyError"}
    ais = ps["aisimulate"]
    assert (ais["shared_cases"], ais["moeplace_at_least_as_close"], ais["api"]) == (1, 0, "x.cli_estimate")
    assert ais["median_abs_error"] == {"moeplace": pytest.approx(0.10), "aisimulate": pytest.approx(0.05)}
    assert ais["versions"]["shared_cases"] == 1 and ais["versions"]["disagree"][-1]["supported_by"] == "aiconfigurator"
    assert ps["shared_cases"] == 2 and ps["moeplace_at_least_as_close"] == 1  # b: moeplace -20 %, peer -5 %
    fid.join_peer(rows, old)  # --peer-only re-joins aiconfigurator: aisimulate's entries stay
    assert "aisimulate" in rows[0]["peer"] and "aiconfigurator" in rows[1]["peer"]
    fid.join_peer(rows, {**old, "cases": []})  # a peer that no longer lists a case: its entry goes, the other stays
    assert set(rows[0]["peer"]) == {"aisimulate"}
    gone = fid.aisimulate_status(tmp_path / "peer_aisimulate.json")
    assert gone["run"] is False and "peer_aisimulate.json is absent" in gone["why"]
    assert fid.peer_summary_of(rows, old, gone)["aisimulate"] is gone


def test_aisimulate_runs_the_aiconfigurator_mapping_naming_itself(monkeypatch, tmp_path):
    """bench/peer_aisimulate.py gives aisimulate the call bench/peer_aiconfigurator.py gives aiconfigurator
    (its functions, imported), records the call by model name, and names itself in every refusal; no
    aisimulate needed: the peer's ``cli_estimate`` and its model-config module are stand-ins."""
    import types

    ais = load_bench("peer_aisimulate", "bench_peer_aisimulate")
    aic = sys.modules["peer_aiconfigurator"]  # what the aisimulate script imported
    assert ais.run_cases is aic.run_cases and ais.UTILS == "aisimulate_core.sdk.utils"
    utils = types.ModuleType("fake_peer_utils")
    utils.DefaultHFModels = {"deepseek-ai/DeepSeek-R1"}  # resolved by name; DeepSeek-V3 from a shipped config
    utils._get_model_config_path = lambda: tmp_path
    (tmp_path / "deepseek-ai--DeepSeek-V3_config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    monkeypatch.setitem(sys.modules, "fake_peer_utils", utils)
    cases = {c["id"]: c for c in yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())}
    calls = []

    def estimate(**kw):
        calls.append(kw)
        if kw["system_name"] == "h100_sxm":  # the peer sees a local folder holding the shipped config
            assert (Path(kw["model_path"]) / "config.json").read_text().startswith('{"architectures"')
            raise KeyError(f"no table for {kw['model_path']}")
        raw = {"tokens/s/user": 300.0, "tpot": 3.3}
        return types.SimpleNamespace(raw=raw, backend_version="1.3.0rc20", kv_cache_warning=None)

    picked = [cases[i] for i in ("trtllm-b200-min-latency", "lmsys-h100-prefill-ep32-4k", "deepseek-day6-decode-ep144")]
    recs = ais.run_cases(picked, estimate, "aisimulate", "fake_peer_utils")
    want, _ = aic.call_of(picked[0], "aisimulate")
    assert calls[0] == want and recs[0]["call"] == want  # the mapping's call, unchanged
    assert recs[0]["simulated"] == 300.0 and recs[0]["error"] == pytest.approx(300.0 / picked[0]["published"] - 1)
    # recorded by model name, not by the run's temporary folder
    assert recs[1]["reason"] == "aisimulate raised KeyError: 'no table for deepseek-ai/DeepSeek-V3'"
    assert recs[1]["call"]["model_path"] == "deepseek-ai/DeepSeek-V3" and not recs[1]["supported"]
    assert recs[2]["reason"] == "no H800 tables in aisimulate" and len(calls) == 2


def test_aisimulate_predict_maps_each_serving_case_by_one_rule():
    """bench/peer_aisimulate.py's predict configuration: the estimate's deployment and resolved dtypes, the case's
    batch per rank as the sequence cap (not the estimate's OOM-reduced batch), its concurrency, 8 requests per
    slot; decode cases and cases the estimate refused are not run; the figure from predict's summary."""
    ais = load_bench("peer_aisimulate", "bench_peer_aisimulate_predict")
    aic = sys.modules["peer_aiconfigurator"]
    cases = {c["id"]: c for c in yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())}
    case = cases["trtllm-b200-max-throughput-fp8kv"]
    kw, _ = aic.call_of(case, "aisimulate")
    rec = {"supported": True, "call": {**kw, "batch_size": 500}, "backend_version": "1.3.0rc20",
           "result": {"gemm": "fp8_block", "moe": "nvfp4", "fmha": "bfloat16", "kvcache": "fp8"}}
    cfg, why = ais.predict_config(case, rec, "/tmp/model")
    eng, w = cfg["engine"], cfg["engine"]["workers"]["aggregated"]
    assert why is None and (eng["hardware"], eng["backend"], eng["backend_version"]) == ("b200_sxm", "trtllm", "1.3.0rc20")
    assert w["parallelism"] == {"tensor": 1, "attention_data": 8, "moe_tensor": 1, "moe_expert": 8}
    assert w["scheduler"] == {"max_batched_tokens": 2048, "max_sequences": 896}  # the case's cap, not the 500
    assert w["kv_cache"] == {"capacity": {"memory_fraction": 0.93}} and eng["moe_quant_mode"] == "nvfp4"
    assert cfg["traffic"] == {"source": {"type": "synthetic", "input_tokens": 1024, "output_tokens": 2048},
                              "load": {"type": "concurrency", "concurrency": 7168}, "stop": {"requests": 8 * 7168}}
    decode = cases["trtllm-b200-min-latency"]
    assert ais.predict_config(decode, rec, "m")[0] is None
    assert ais.predict_config(case, {"supported": False}, "m") == (None, ("the estimate, on the same tables, does "
                                                                          "not support the case"))
    summary = {"output_throughput_tok_s": 40_000.0, "total_throughput_tok_s": 60_000.0,
               "median_output_token_throughput_per_user": 12.5}
    assert ais.predict_figure(case, summary) == pytest.approx(5_000.0)  # per GPU of 8
    assert ais.predict_figure(cases["vllm-k3-gb300-tp8-bs1"], summary) == 12.5
    assert ais.predict_figure(cases["vllm-recipe-kimi-k2-thinking-h200-tp8"], summary) == 60_000.0


def test_predict_summary_sets_predict_beside_the_estimate_and_moeplace():
    fid = load_bench("fidelity", "bench_fidelity_predict")
    rows = [_row(i, "serve", "output_tok_s", 100.0, 100.0) for i in "abce"] + [_row("d", "decode", "per_user_tok_s",
                                                                                   10.0, 10.0)]
    for r, cv in zip(rows, [0.1, -0.3, 0.2, 0.0, 0.0]):
        r["cv_error"], r["after_cutoff"] = cv, r["id"] == "c"
    aisim = {"peer": "aisimulate", "cases": [
        {"id": "a", "supported": True, "simulated": 150.0, "predict": {"supported": True, "simulated": 90.0}},
        {"id": "b", "supported": True, "simulated": 80.0, "predict": {"supported": True, "simulated": 140.0}},
        {"id": "c", "supported": True, "simulated": 100.0, "predict": {"supported": True, "simulated": 125.0}},
        {"id": "e", "supported": True, "simulated": 100.0, "predict": {"supported": False, "reason": "no KV budget"}},
        {"id": "d", "supported": True, "simulated": 10.0, "predict": {"supported": False, "reason": "not a serving run"}}]}
    pm = fid.predict_summary(rows, aisim)
    m = pm["median_abs_error"]  # |errors| moeplace .1 .3 .2; estimate .5 .2 0; predict .1 .4 .25
    assert (m["cases"], m["moeplace"], m["estimate"], m["predict"]) == (3, pytest.approx(0.2), pytest.approx(0.2),
                                                                        pytest.approx(0.25))
    assert pm["after_cutoff"]["cases"] == 1 and pm["after_cutoff"]["predict"] == pytest.approx(0.25)
    assert pm["not_run"] == [{"id": "e", "reason": "no KV budget"}]  # a serving case it refused; d is no serving run
    assert fid.predict_summary(rows, {"cases": [{"id": "a", "supported": True, "simulated": 1.0}]}) is None


def test_peer_only_recomputes_the_committed_peer_summary(tmp_path, capsys):
    """``bench/fidelity.py --peer-only`` on a copy of the committed results, from the committed peer files,
    gives back the committed ``peer_summary`` and per-case peer entries (what the README / docs figures show),
    and touches nothing else."""
    fid = load_bench("fidelity", "bench_fidelity_peer_only")
    results = REPO / "bench" / "results"
    committed = json.loads((results / "fidelity.json").read_text())
    out = tmp_path / "fidelity.json"
    stale = {**committed, "peer_summary": None, "cases": [{k: v for k, v in r.items() if k != "peer"}
                                                           for r in committed["cases"]]}
    out.write_text(json.dumps(stale))
    assert fid.peer_only(out, results / "peer_aiconfigurator.json", results / "peer_aisimulate.json") == 0
    assert json.loads(out.read_text()) == committed
    assert "aiconfigurator 0.12.0 vs aisimulate 0.13.0" in capsys.readouterr().out


def test_peer_run_of_a_few_cases_merges_into_the_results_file_of_the_same_release(monkeypatch, tmp_path, capsys):
    """``--only ID --merge`` runs the named cases and keeps the file's other records in the case file's order;
    it refuses a selection without --merge, an unknown id, and a file written by another release of the peer
    (which it leaves as it was). No peer needed: its ``cli_estimate`` and model-config module are stand-ins."""
    import types

    aic = load_bench("peer_aiconfigurator", "bench_peer_aiconfigurator_merge")
    utils = types.ModuleType("fake_merge_utils")
    utils.DefaultHFModels = {"deepseek-ai/DeepSeek-R1"}
    utils._get_model_config_path = lambda: tmp_path
    monkeypatch.setitem(sys.modules, "fake_merge_utils", utils)
    all_cases = {c["id"]: c for c in yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())}
    ids = ["trtllm-b200-min-latency", "trtllm-b200-gtc-mtp0", "trtllm-b200-gtc-mtp1"]
    cases_file = tmp_path / "cases.yaml"
    cases_file.write_text(yaml.safe_dump([all_cases[i] for i in ids]))
    out = tmp_path / "peer.json"
    old = {"peer": "aiconfigurator", "version": "0.12.0", "cases": [
        {"id": i, "published": all_cases[i]["published"], "supported": True, "simulated": 1.0} for i in ids[::-1]]}
    out.write_text(json.dumps(old))

    def estimate(**kw):
        return types.SimpleNamespace(raw={"tokens/s/user": 300.0, "tpot": 3.3}, backend_version="1.3.0rc20",
                                     kv_cache_warning=None)

    def run(*argv, version="0.12.0"):
        monkeypatch.setattr(sys, "argv", ["peer", "--cases", str(cases_file), "--out", str(out), *argv])
        return aic.peer_main("doc", out, "aiconfigurator", lambda: (estimate, {"version": version}), "hint",
                             "fake_merge_utils")

    assert run("--only", ids[1]) == 2 and "add --merge" in capsys.readouterr().err
    assert run("--only", "no-such-case", "--merge") == 2 and "no-such-case" in capsys.readouterr().err
    assert run("--only", ids[1], "--merge", version="0.13.0") == 2 and "two releases" in capsys.readouterr().err
    assert json.loads(out.read_text()) == old  # every refusal leaves the file as it was
    assert run("--only", ids[1], "--merge") == 0
    recs = json.loads(out.read_text())["cases"]
    assert [r["id"] for r in recs] == ids  # the case file's order
    assert recs[0]["simulated"] == recs[2]["simulated"] == 1.0  # kept
    assert recs[1]["simulated"] == 300.0 and recs[1]["call"]["system_name"] == "b200_sxm"  # run now
