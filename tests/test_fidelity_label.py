"""`place simulate` labels its absolute figures as estimates: what they are (the shipped ensemble's median and
80 % interval) and how far they were, and how often the interval held, on published deployments held out by
group (recomputed here from the committed bench/results/fidelity.json, so a summary left stale after a
fidelity run fails); what was checked on its own data and what never was; `--json` carries it, and only a
full fidelity run writing the committed results rewrites the package's summary."""
from __future__ import annotations

import json
import math
import sys

import pytest
import yaml
from benchkit import REPO, load_bench
from simkit import mini_model, write_trace

from moeplace.cli.main import main
from moeplace.sim import fidelity as sim_fidelity


def _bench_fidelity():
    return load_bench("fidelity", "bench_fidelity_label")


def _committed() -> dict:
    return json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("simlabel")
    return write_trace(d / "trace", mini_model(), num_requests=6, prompt=32, output=8, skew=1.2)


COMMON = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--duration", "0.1",
          "--concurrency", "8", "--no-progress", "--placement", "linear"]


def test_the_committed_summary_is_its_results_summary():
    """sim/fidelity_summary.json (what the commands read) is summarize_results of the committed results."""
    assert sim_fidelity.load_summary() == json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))


def _k3_phrase(s: dict) -> str:
    if "kimi-k3" in s["models"]:
        return "Kimi K3 is among the fitted cases"
    if "kimi-k3" in s["after_cutoff"]["models"]:
        return "Kimi K3 itself only on the unseen cases after the cut-off"
    return "not checked: Kimi K3 itself"


def test_note_says_where_kimi_k3_was_checked_and_the_ttft_interval():
    """The label names K3 as unchecked only when no case runs it, and says so when its only cases are after the
    cut-off; a TTFT with intervals says how many held."""
    s = json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))
    s.update(models=["deepseek-v3"], ttft_cases=3, ttft_median_abs_error=0.5, ttft_covered=1)
    s["after_cutoff"] = {**s["after_cutoff"], "cases": 2, "median_abs_error": 0.4, "covered": 0, "models": []}
    assert "not checked: Kimi K3 itself" in sim_fidelity.fidelity_note(s)
    assert "TTFT on 3 (median off 50%, 1 inside its interval)" in sim_fidelity.fidelity_note(s)
    s["after_cutoff"]["models"] = ["kimi-k3"]
    note = sim_fidelity.fidelity_note(s)
    assert "Kimi K3 itself only on the unseen cases after the cut-off" in note and "not checked: Kimi K3" not in note
    s["models"] = ["deepseek-v3", "kimi-k3"]
    assert "Kimi K3 is among the fitted cases" in sim_fidelity.fidelity_note(s)
    s["ttft_covered"] = None
    assert "no interval)" in sim_fidelity.fidelity_note(s)


def test_note_says_which_way_the_unseen_cases_after_the_cut_off_were_off():
    """The after-cut-off clause says how many of the unseen cases the ensemble simulated slower than published
    (a throughput below it), counted from the committed rows, so a user knows which way the tool leans."""
    res = _committed()
    after = [r for r in res["cases"] if r["after_cutoff"]]
    s = json.loads(json.dumps(sim_fidelity.summarize_results(res)))
    assert s["after_cutoff"]["too_slow"] == sum(r["cv_simulated"] < r["published"] for r in after
                                                if r["metric"] != "latency_us")
    a = {"cases": 4, "median_abs_error": 0.3, "covered": 1, "models": []}
    s["after_cutoff"] = {**a, "too_slow": 4}
    assert "4 unseen case(s): median off by 30%, 1 inside the interval, all 4 simulated slower than published" \
        in sim_fidelity.fidelity_note(s)
    s["after_cutoff"] = {**a, "too_slow": 1}
    assert "1 inside the interval, 1 simulated slower and 3 faster than published" in sim_fidelity.fidelity_note(s)
    s["after_cutoff"] = {**a, "too_slow": 0}
    assert "all 4 simulated faster than published" in sim_fidelity.fidelity_note(s)
    assert sim_fidelity.too_slow({"metric": "latency_us", "cv_error": 0.2})
    assert not sim_fidelity.too_slow({"metric": "output_tok_s", "cv_error": 0.2})


def test_note_says_how_the_cases_the_structure_never_saw_were_predicted():
    """After a refit fitted the cases published after the structure's own cut-off, the label says how they were
    predicted held out by group (they were never used to choose the structure), counted from the committed rows."""
    res = _committed()
    s = json.loads(json.dumps(sim_fidelity.summarize_results(res)))
    if res.get("after_structure"):
        ids = set(res["after_structure"]["ids"])
        late = [r for r in res["cases"] if r["id"] in ids]
        assert len(late) == s["after_structure"]["cases"] and all(not r["after_cutoff"] for r in late)
        assert all(r["published_on"] > s["after_structure"]["structure_cutoff"] for r in late)
        assert s["after_structure"]["too_slow"] == sum(r["cv_simulated"] < r["published"] for r in late)
    s["after_structure"] = {"structure_cutoff": "2026-02-13", "cases": 34, "median_abs_error": 0.164, "covered": 25,
                            "too_slow": 25}
    assert ("of them, the 34 published after 2026-02-13 (never used to choose the model's structure): median off "
            "by 16%, 25 inside the interval, 25 simulated slower and 9 faster than published") \
        in sim_fidelity.fidelity_note(s)
    s["after_structure"]["cases"] = 0
    assert "never used to choose" not in sim_fidelity.fidelity_note(s)


def test_printed_label_carries_the_held_out_errors_and_coverage_of_the_committed_cases(trace_dir, capsys):
    assert main(["simulate", trace_dir, *COMMON]) == 0
    lines = capsys.readouterr().out.splitlines()
    label = next(i for i, line in enumerate(lines) if line.startswith("absolute figures are model estimates"))
    assert lines[label - 1].startswith("iterations")  # directly under the table's last row
    text = lines[label]
    res = _committed()
    held = [r for r in res["cases"] if r["kind"] in ("prefill", "decode", "serve") and not r["after_cutoff"]]
    cv, cov = res["cv"]["all"], res["coverage"]["all"]
    assert f"median of {res['ensemble']['members']} fitted constant sets" in text
    assert f"on {len(held)} published deployments in {len({r['group'] for r in held})} groups" in text
    assert f"the median was off by {cv['median']:.0%} (worst {cv['worst_error']:+.0%}" in text and cv["worst_case"] in text
    assert f"held the published figure in {cov['covered']} of {cov['cases']} cases ({cov['coverage']:.0%}" in text
    kinds = ", ".join(f"{k} {v['covered']} of {v['cases']}" for k, v in res["coverage"].items()
                      if k != "all" and v.get("cases"))
    assert f"by kind of run: {kinds};" in text and "decode" in kinds
    s = sim_fidelity.summarize_results(res)
    assert "cut-off" in text and _k3_phrase(s) in text
    assert "no fitted case runs mini-k3" in text
    assert "compare placements by their ratios" in text


def test_json_carries_the_same_figures(trace_dir, capsys):
    assert main(["simulate", trace_dir, *COMMON, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.sim-summary/1" and [s["label"] for s in doc["summaries"]] == ["linear"]
    f = doc["fidelity"]
    want = json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))
    assert {k: f[k] for k in want} == want
    assert f["provenance"] == sim_fidelity.PROVENANCE
    assert f["run"]["ensemble"] is True and f["run"]["near"] == doc["summaries"][0]["ensemble"]["near"]
    assert f["note"] == sim_fidelity.fidelity_note(f, f["run"])


def test_note_says_what_was_checked_and_what_never_was():
    s = json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))
    note = sim_fidelity.fidelity_note(s)
    assert f"structure frozen {s['frozen_on']}" in note and s["cutoff"] in note
    if s["tpot_cases"]:
        assert f"TPOT checked on {s['tpot_cases']} cases that print it" in note
    assert ("TTFT on" in note) == bool(s["ttft_cases"]) and ("TTFT never checked" in note) == (not s["ttft_cases"])
    for m in s["models"]:
        assert m in note
    far = sim_fidelity.fidelity_note(s, {"model": "mini-k3", "gpu": "gb300-nvl72", "cost": "roofline",
                                          "ensemble": True, "near": 0.1})
    assert "no published case is near this run" in far and "no fitted case runs mini-k3" in far
    near = sim_fidelity.fidelity_note(s, {"model": s["models"][0], "gpu": s["gpus"][0], "cost": "roofline",
                                           "ensemble": True, "near": 2.5})
    assert "published cases near this run: 2.5 groups' worth" in near and "no fitted case runs" not in near
    own = sim_fidelity.fidelity_note(s, {"cost": "roofline", "ensemble": False})
    assert "constants of its own" in own and "no interval is printed" in own


def test_only_a_full_run_writing_the_committed_results_rewrites_the_summary(tmp_path, monkeypatch):
    """A --quick run, or results written elsewhere, leave the package's summary and ensemble alone;
    --summary-only rewrites the summary from the committed results file of a full run."""
    fid = _bench_fidelity()
    results, summary = tmp_path / "results", tmp_path / "fidelity_summary.json"
    results.mkdir()
    monkeypatch.setattr(fid, "RESULTS", results)  # the committed results file, here
    monkeypatch.setattr(sim_fidelity, "SUMMARY_PATH", summary)  # the package's summary, here
    assert fid.summary_target(results / "fidelity.json", True) is None
    assert fid.summary_target(tmp_path / "elsewhere.json", False) is None
    assert fid.summary_target(results / "fidelity.json", False) == summary
    (results / "fidelity.json").write_text(json.dumps({**_committed(), "quick": True}))
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--summary-only"])
    assert fid.main() == 2 and not summary.exists()  # a quick run's results file is never summarized
    (results / "fidelity.json").write_text(json.dumps(_committed()))
    assert fid.main() == 0
    assert json.loads(summary.read_text()) == sim_fidelity.load_summary(sim_fidelity.SUMMARY_PATH)
    assert json.loads(summary.read_text()) == json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))


def test_regime_rule_over_the_case_settings():
    """The case table's ``regime`` (a label for kinds of deployment; no interval depends on it)."""
    r = sim_fidelity.regime
    assert r("prefill", False, 0) == "prefill-heavy"
    assert r("both", False, 64, prompt_len=8000, output_len=200) == "prefill-heavy"
    assert r("decode", False, 1) == r("both", False, 4) == "single-user latency"
    assert r("decode", False, 256) == r("both", True, 64) == "disaggregated"
    assert r("both", False, 128) == "max-throughput" and r("both", False, 32) == "mid-batch decode"
    cases = yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())
    got = {c["id"]: sim_fidelity.case_regime({"kind": c["kind"], "config_full": c["config"]}) for c in cases}
    assert got["trtllm-b200-min-latency"] == "single-user latency"
    assert got["deepgemm-masked-1x1024-n4096"] is None


def test_a_run_priced_by_another_cost_source_prints_no_range_and_says_why():
    """The ensemble was fitted for the roofline cost model: a run priced by a calibration profile or
    aiconfigurator's measured tables gets no interval, and the note says why."""
    s = json.loads(json.dumps(sim_fidelity.summarize_results(_committed())))
    for cost in ("profile", "measured"):
        note = sim_fidelity.run_note(s, {"cost": cost, "ensemble": False})
        assert "no interval is printed" in note and "near this run" not in note
    summary = {"output_tok_s": 1000.0, "tpot_p99_s": 0.05}
    assert list(sim_fidelity.with_ranges(summary)) == ["output_tok_s", "tpot_p99_s"]
    ranged = {"output_tok_s": 1.0, "tpot_p99_s": 2.0, "output_tok_s_range": [0.5, 1.5]}
    assert list(sim_fidelity.with_ranges(ranged)) == ["output_tok_s", "output_tok_s_range", "tpot_p99_s"]


def test_simulate_with_a_calibration_profile_prints_no_roofline_range(trace_dir, tmp_path, capsys):
    """place simulate --profile: the cost line names the profile, the table has no [lo-hi] cells, --json
    no *_range keys, and the label says the published errors do not apply."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({
        "format": "moeplace.calibration/1", "device": "cpu", "dtype": "fp32",
        "ops": {"expert_gemm": {"x": "tokens_per_expert", "hidden": 512, "intermediate": 512,
                                "points": [[1, 1e-5], [100, 2e-5], [1000, 1.1e-4]]}}}))
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64", "--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert f"corrected by the calibration profile {prof} (cpu, expert_gemm)" in out
    row = next(line for line in out.splitlines() if line.startswith("output tok/s "))
    assert "[" not in row
    assert "priced by a calibration profile" in out and "no interval is printed" in out
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64", "--profile", str(prof), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fidelity"]["run"]["cost"] == "profile"
    assert not any(k.endswith("_range") for k in doc["summaries"][0])


def test_anchored_only_joins_a_full_anchored_run_and_prints_it(tmp_path, monkeypatch, capsys):
    """bench/fidelity.py --anchored-only: bench/fidelity_anchored.py's results become the results file's
    ``anchored`` block and its figures are printed next to the uncalibrated ones; a --quick or --groups
    run's anchored results are refused, and the results file is left as it was."""
    fid = _bench_fidelity()
    out, an = tmp_path / "fidelity.json", tmp_path / "anchored.json"
    out.write_text(json.dumps({k: v for k, v in _committed().items() if k != "anchored"}))
    row = {"id": "a", "group": "g1", "kind": "decode", "metric": "output_tok_s", "published": 100.0, "anchored": 104.0,
           "uncalibrated": 120.0, "anchored_error": 0.04, "uncalibrated_error": 0.2, "ratio_error": 0.1,
           "anchored_member": 104.0, "anchored_member_error": 0.04, "uncalibrated_member_error": 0.2,
           "member_log_speeds": [math.log(104.0)], "member_weights": [1.0]}
    rows = [row, {**row, "id": "b", "group": "g2", "anchored": 90.0, "anchored_error": -0.1, "anchored_member": 90.0,
                  "anchored_member_error": -0.1, "member_log_speeds": [math.log(90.0)]}]
    doc = {"rows": rows, "summary": fid.fa.summarize(rows), "quick": True, "groups_only": None}
    an.write_text(json.dumps(doc))
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--anchored-only", "--out", str(out), "--anchored", str(an)])
    assert fid.main() == 2 and "anchored" not in json.loads(out.read_text())
    an.write_text(json.dumps({**doc, "quick": False}))
    capsys.readouterr()
    assert fid.main() == 0
    printed = capsys.readouterr().out
    assert "end-to-end, uncalibrated" in printed and "end-to-end, anchored (place calibrate)" in printed
    assert "median |error|   7.0%" in printed  # |+4 %| and |-10 %|
    got = json.loads(out.read_text())["anchored"]
    assert got["summary"]["end_to_end"]["anchored"]["median"] == pytest.approx(0.07)


def test_the_committed_results_carry_the_committed_anchored_figures():
    """bench/results/fidelity.json's ``anchored`` block is bench/results/fidelity_anchored.json's run (a full
    bench/fidelity.py run writes both; --anchored-only joins the latter into the former)."""
    anchored = json.loads((REPO / "bench" / "results" / "fidelity_anchored.json").read_text())
    block = _committed()["anchored"]
    assert block["summary"] == anchored["summary"] and not block["quick"] and block["groups_only"] is None
