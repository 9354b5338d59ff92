"""`place simulate` labels its absolute figures as estimates with the simulator's measured fidelity: the
numbers it prints are the validation errors of the committed bench/results/fidelity.json (recomputed here
from its cases, so a summary left stale after a fidelity run fails), `--json` carries them, and only a
full fidelity run writing the committed results rewrites the package's summary."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from benchkit import REPO, load_bench
from simkit import mini_model, write_trace

from moeplace.cli.main import main
from moeplace.sim import fidelity as sim_fidelity


def _bench_fidelity():
    return load_bench("fidelity", "bench_fidelity_label")


def _expected() -> dict:
    """The label's figures, straight from the committed per-case rows: the end-to-end cases' grouped
    cross-validation errors."""
    rows = [r for r in json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())["cases"]
            if r["kind"] in ("prefill", "decode", "serve")]
    assert all(r.get("cv_error") is not None for r in rows)
    thr = [(r["id"], r["cv_error"]) for r in rows if r["metric"] not in ("per_user_tok_s", "latency_us")]
    tpot = [(r["id"], r["cv_tpot_error"]) for r in rows if "cv_tpot_error" in r]
    worst_thr = max(thr, key=lambda p: abs(p[1]))
    worst_tpot = max(tpot, key=lambda p: abs(p[1]))
    return {"n": len(rows), "groups": len({r["group"] for r in rows}), "thr_cases": len(thr),
            "thr_median": float(np.median([abs(e) for _, e in thr])),
            "thr_worst": worst_thr, "tpot_cases": len(tpot),
            "tpot_median": float(np.median([abs(e) for _, e in tpot])), "tpot_worst": worst_tpot,
            "far": sorted((r["id"], r["cv_error"]) for r in rows if abs(r["cv_error"]) > 0.35)}


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("simlabel")
    return write_trace(d / "trace", mini_model(), num_requests=6, prompt=32, output=8, skew=1.2)


COMMON = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--duration", "0.1",
          "--concurrency", "8", "--no-progress", "--placement", "linear"]


def test_printed_label_carries_the_validation_errors_of_the_committed_cases(trace_dir, capsys):
    assert main(["simulate", trace_dir, *COMMON]) == 0
    lines = capsys.readouterr().out.splitlines()
    label = next(i for i, line in enumerate(lines) if line.startswith("absolute figures are model estimates"))
    assert lines[label - 1].startswith("iterations")  # directly under the table's last row
    text = lines[label]
    e = _expected()
    assert f"on {e['n']} published deployments in {e['groups']} groups" in text
    assert "grouped cross-validation" in text
    way = "fast" if e["thr_worst"][1] > 0 else "slow"
    assert f"throughput was off by a median {e['thr_median']:.0%} (worst {e['thr_worst'][1]:+.0%}, too {way}" in text
    assert e["thr_worst"][0] in text
    assert f"{len(e['far'])} of {e['n']} cases beyond 35%" in text
    way = "slow" if e["tpot_worst"][1] > 0 else "fast"
    assert f"TPOT by a median {e['tpot_median']:.0%} (worst {e['tpot_worst'][1]:+.0%}, too {way})" in text
    assert "compare placements by their ratios" in text


def test_json_carries_the_same_figures_and_keeps_its_summaries(trace_dir, capsys):
    assert main(["simulate", trace_dir, *COMMON, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.sim-summary/1" and [s["label"] for s in doc["summaries"]] == ["linear"]
    f, e = doc["fidelity"], _expected()
    assert f["cases"] == e["n"] and f["groups"] == e["groups"] and f["provenance"] == sim_fidelity.PROVENANCE
    assert f["throughput"]["cases"] == e["thr_cases"] and f["tpot"]["cases"] == e["tpot_cases"]
    assert f["throughput"]["median_abs_error"] == pytest.approx(e["thr_median"], rel=1e-12)
    assert f["tpot"]["median_abs_error"] == pytest.approx(e["tpot_median"], rel=1e-12)
    assert (f["throughput"]["worst_case"], f["throughput"]["worst_error"]) == pytest.approx(e["thr_worst"])
    assert (f["tpot"]["worst_case"], f["tpot"]["worst_error"]) == pytest.approx(e["tpot_worst"])
    far = sorted((c["id"], c["error"]) for c in f["far_off"])
    assert [i for i, _ in far] == [i for i, _ in e["far"]]
    assert [x for _, x in far] == pytest.approx([x for _, x in e["far"]], rel=1e-12)
    assert f["note"] == sim_fidelity.fidelity_note(f, f["run"]) and f["note"].startswith("absolute figures are model estimates")


def test_note_reads_the_signs_and_says_what_was_never_checked():
    s = {"provenance": "p", "cases": 3, "groups": 2, "ttft_cases": 0, "far_off_threshold": 0.35, "far_off": [],
         "throughput": {"cases": 2, "median_abs_error": 0.1, "worst_error": -0.2, "worst_case": "a", "worst_org": "O"},
         "tpot": {"cases": 1, "median_abs_error": 0.05, "worst_error": -0.05, "worst_case": "b", "worst_org": "O"}}
    note = sim_fidelity.fidelity_note(s)
    assert "(worst -20%, too slow: O a)" in note and "(worst -5%, too fast)" in note
    assert "beyond" not in note and "TTFT never checked" in note
    assert "TTFT" not in sim_fidelity.fidelity_note({**s, "ttft_cases": 1})


def _kernel_cases(tmp_path: Path) -> Path:
    """A two-case table of the committed kernel cases (evaluated on formulas: no simulation), one moved to
    the validation split."""
    cases = [c for c in yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())
             if c["kind"] == "gemm"][:2]
    cases[1]["split"] = "validation"
    p = tmp_path / "cases.yaml"
    p.write_text(yaml.safe_dump(cases))
    return p


def test_only_a_full_run_writing_the_committed_results_rewrites_the_summary(tmp_path, monkeypatch):
    fid = _bench_fidelity()
    results, summary = tmp_path / "results", tmp_path / "fidelity_summary.json"
    results.mkdir()
    monkeypatch.setattr(fid, "RESULTS", results)  # the committed results file, here
    monkeypatch.setattr(sim_fidelity, "SUMMARY_PATH", summary)  # the package's summary, here
    cases = str(_kernel_cases(tmp_path))

    def run(*extra):
        monkeypatch.setattr(sys, "argv", ["fidelity.py", "--cases", cases, "--no-fit", *extra])
        assert fid.main() == 0

    run("--quick")  # a smoke run writes its results but leaves the summary alone
    assert json.loads((results / "fidelity.json").read_text())["quick"] is True and not summary.exists()
    run("--out", str(tmp_path / "elsewhere.json"))  # results written elsewhere: the same
    assert (tmp_path / "elsewhere.json").exists() and not summary.exists()
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--summary-only"])
    assert fid.main() == 2 and not summary.exists()  # nor is a quick run's results file ever summarized

    run()
    rows = json.loads((results / "fidelity.json").read_text())["cases"]
    written = json.loads(summary.read_text())
    assert written == json.loads(json.dumps(sim_fidelity.summarize_cases(rows)))
    # --no-fit: no cross-validation, so the validation split stands in, and the provenance says so
    assert written["cases"] == 1 and written["throughput"]["worst_case"] == rows[1]["id"]
    assert written["provenance"] == sim_fidelity.PROVENANCE_SPLIT
    assert written["throughput"]["worst_error"] == pytest.approx(rows[1]["error"], rel=1e-12)
    summary.unlink()
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--summary-only"])
    assert fid.main() == 0 and json.loads(summary.read_text()) == written


def test_regime_rule_over_the_run_settings():
    r = sim_fidelity.regime
    assert r("prefill", False, 0) == "prefill-heavy"
    assert r("both", False, 64, prompt_len=8000, output_len=200) == "prefill-heavy"
    assert r("decode", False, 1) == r("both", False, 4) == "single-user latency"
    assert r("decode", False, 256) == r("both", True, 64) == "disaggregated"
    assert r("both", False, 128) == "max-throughput" and r("both", False, 32) == "mid-batch decode"
    # the committed cases: every end-to-end validation case has a regime, the kernel tables none
    cases = yaml.safe_load((REPO / "bench" / "fidelity_cases.yaml").read_text())
    got = {c["id"]: sim_fidelity.case_regime({"kind": c["kind"], "config_full": c["config"]}) for c in cases}
    assert got["trtllm-b200-min-latency"] == "single-user latency"
    assert got["trtllm-h200-max-throughput"] == "max-throughput"
    assert got["lmsys-h100-prefill-ep32-1k"] == "prefill-heavy" and got["lmsys-h100-decode-ep72"] == "disaggregated"
    assert got["deepgemm-masked-1x1024-n4096"] is None


def test_note_names_the_regime_its_error_and_what_no_case_covers(trace_dir, capsys):
    s = {"provenance": "p", "cases": 3, "groups": 2, "ttft_cases": 1, "far_off_threshold": 0.35, "far_off": [],
         "throughput": {"cases": 2, "median_abs_error": 0.1, "worst_error": -0.2, "worst_case": "a", "worst_org": "O"},
         "tpot": {"cases": 0}, "models": ["deepseek-v3"], "gpus": ["b200", "h100"],
         "regimes": {"single-user latency": {"cases": 2, "median_abs_error": 0.12, "worst_error": -0.2,
                                             "worst_case": "a", "worst_org": "O", "models": ["deepseek-v3"],
                                             "gpus": ["b200"]},
                     "mid-batch decode": {"cases": 0, "models": [], "gpus": []}}}
    s["regimes"]["single-user latency"].update(groups=2, errors=[-0.2, 0.05])
    note = sim_fidelity.fidelity_note(s, {"regime": "single-user latency", "model": "kimi-k3", "gpu": "gb300-nvl72"})
    assert "this run is single-user latency: there the median was 12% over 2 cases" in note
    assert "errors from -20% to +5%" in note
    assert "no case runs kimi-k3 (only deepseek-v3)" in note and "none on gb300-nvl72" in note
    note = sim_fidelity.fidelity_note(s, {"regime": "mid-batch decode", "model": "deepseek-v3", "gpu": "h100"})
    assert "no case resembles this run" in note and "runs" not in note and "none on" not in note
    # place simulate: 8 sequences over 2 TP2 ranks (4 each) is single-user latency; 32 is mid-batch decode
    assert main(["simulate", trace_dir, *COMMON, "--json"]) == 0
    f = json.loads(capsys.readouterr().out)["fidelity"]
    assert f["run"]["regime"] == "single-user latency" and f["run"]["model"] == "mini-k3"
    assert "this run is single-user latency: there the median was" in f["note"]
    assert "no case runs mini-k3" in f["note"]
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fidelity"]["run"]["regime"] == "mid-batch decode"


def test_ranges_come_from_the_regime_errors_and_vanish_where_no_case_resembles_the_run():
    """A throughput S under signed errors e in [lo, hi] lies in [S / (1 + hi), S / (1 + lo)]; a per-token
    time in [S (1 + lo), S (1 + hi)]; one group's cases give no range, nor does an empty regime."""
    reg = {"cases": 3, "groups": 2, "errors": [-0.2, 0.1, 0.25], "median_abs_error": 0.2}
    s = {"regimes": {"max-throughput": reg, "mid-batch decode": {**reg, "groups": 1},
                     "prefill-heavy": {"cases": 0}}, "min_groups_for_range": 2}
    summary = {"output_tok_s": 1000.0, "tpot_p99_s": 0.05, "ttft_p99_s": 1.0, "per_user_tok_s": None}
    r = sim_fidelity.figure_ranges(s, {"regime": "max-throughput"}, summary)
    assert r["output_tok_s_range"] == pytest.approx([1000 / 1.25, 1000 / 0.8])
    assert r["tpot_p99_s_range"] == pytest.approx([0.05 * 0.8, 0.05 * 1.25])
    assert "ttft_p99_s_range" not in r and "per_user_tok_s_range" not in r  # TTFT never checked; no figure
    for name in ("mid-batch decode", "prefill-heavy", None):
        assert sim_fidelity.figure_ranges(s, {"regime": name}, summary) == {
            "output_tok_s_range": None, "tpot_p99_s_range": None}
    assert list(sim_fidelity.with_ranges(summary, s, {"regime": "max-throughput"})) == [
        "output_tok_s", "output_tok_s_range", "tpot_p99_s", "tpot_p99_s_range", "ttft_p99_s", "per_user_tok_s"]


def test_simulate_prints_and_writes_each_figure_with_its_range(trace_dir, capsys):
    """place simulate: every throughput and per-token time of --json has its range beside it, from the
    committed summary's errors of the run's regime; the printed table carries the same ranges."""
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    f, summ = doc["fidelity"], doc["summaries"][0]
    lo_hi = sim_fidelity.regime_range(f, f["run"]["regime"])
    keys = list(summ)
    figures = [k for k in (*sim_fidelity.THROUGHPUT_FIGURES, *sim_fidelity.TIME_FIGURES) if summ.get(k) is not None]
    assert "output_tok_s" in figures
    for key in figures:
        assert keys[keys.index(key) + 1] == f"{key}_range"
        if lo_hi is None:
            assert summ[f"{key}_range"] is None
        elif key in sim_fidelity.TIME_FIGURES:
            assert summ[f"{key}_range"] == pytest.approx([summ[key] * (1 + lo_hi[0]), summ[key] * (1 + lo_hi[1])])
        else:
            assert summ[f"{key}_range"] == pytest.approx([summ[key] / (1 + lo_hi[1]), summ[key] / (1 + lo_hi[0])])
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("output tok/s "))
    if lo_hi is None:
        assert row.endswith("[no case resembles this run]")
    else:
        lo, hi = summ["output_tok_s_range"]
        assert row.endswith(f"[{lo:,.0f}-{hi:,.0f}]")


def test_a_run_priced_by_another_cost_source_prints_no_range_and_says_why():
    """The published cases checked the roofline cost model: a run priced by a calibration profile or
    aiconfigurator's measured tables gets no range (their errors do not apply), and the note says why."""
    reg = {"cases": 3, "groups": 2, "errors": [-0.2, 0.1, 0.25], "median_abs_error": 0.2,
           "models": ["deepseek-v3"], "gpus": ["h200"]}
    s = {"regimes": {"max-throughput": reg}, "min_groups_for_range": 2}
    summary = {"output_tok_s": 1000.0, "tpot_p99_s": 0.05}
    assert sim_fidelity.figure_ranges(s, {"regime": "max-throughput", "cost": "roofline"}, summary)
    for cost in ("profile", "measured"):
        run = {"regime": "max-throughput", "cost": cost}
        assert sim_fidelity.figure_ranges(s, run, summary) == {}
        assert list(sim_fidelity.with_ranges(summary, s, run)) == ["output_tok_s", "tpot_p99_s"]
        note = sim_fidelity.regime_note(s, run)
        assert "no range is printed" in note and "errors from" not in note


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
    assert "priced by a calibration profile" in out and "no range is printed" in out
    assert main(["simulate", trace_dir, *COMMON, "--concurrency", "64", "--profile", str(prof), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fidelity"]["run"]["cost"] == "profile"
    assert not any(k.endswith("_range") for k in doc["summaries"][0])
