"""The aiconfigurator peer column of bench/fidelity.py: records of bench/peer_aiconfigurator.py joined per case,
the shared-case count, and the reason given where the peer is closer; and the peer script's case mapping
(one rule for all cases, no aiconfigurator needed to check it)."""
from __future__ import annotations

import json

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
    # aisimulate 0.13: run, or why not, in the same summary
    ais = ps["aisimulate"]
    assert ais["peer"] == "aisimulate" and ais["version"] == "0.13.0" and (ais.get("run") or ais["why"])


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
