"""`place simulate`: the side-by-side table, the output files, the Chrome trace, and one-line errors."""
import json
import re

import polars as pl
import pytest
from simkit import linear_placement, mini_model, write_trace

from moeplace.cli.main import main


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("simcli")
    return write_trace(d / "trace", mini_model(), num_requests=6, prompt=32, output=8, skew=1.2)


COMMON = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--duration", "0.1",
          "--concurrency", "8", "--no-progress"]


def test_table_outputs_and_chrome_trace(trace_dir, tmp_path, capsys):
    pfile = tmp_path / "lin.json"
    linear_placement(mini_model(), 4, 2).save(pfile)
    out, chrome = tmp_path / "out", tmp_path / "trace.json"
    rc = main(["simulate", trace_dir, "--placement", str(pfile), "--placement", "round_robin", *COMMON,
               "--out", str(out), "--chrome-trace", str(chrome), "--mode", "replay"])
    assert rc == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("metric"))
    assert "lin" in header and "round_robin" in header
    for row in ("output tok/s", "TTFT p99 (ms)", "straggler total (s)", "straggler share of step",
                "NIC bytes (GB)", "KV pool peak", "preemptions"):
        assert any(line.startswith(row) for line in text.splitlines()), row
    summary = json.loads((out / "summary.json").read_text())["summaries"]
    assert [s["label"] for s in summary] == ["lin", "round_robin"]
    assert summary[0]["requests_arrived"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sim"]["mode"] == "replay" and cfg["cluster"]["num_gpus"] == 4
    reqs = pl.read_parquet(out / "lin.requests.parquet")
    assert {"request_id", "ttft_s", "tpot_s", "queue_s", "preemptions", "rejected"} <= set(reqs.columns)
    ts = pl.read_parquet(out / "round_robin.timeseries.parquet")
    assert {"batch_tokens", "kv_occupancy", "state_occupancy", "layer_straggler_s", "nvlink_bytes",
            "nic_bytes"} <= set(ts.columns)
    assert ts["layer_straggler_s"].dtype == pl.Array(pl.Float32, 3)
    events = json.loads(chrome.read_text())["traceEvents"]
    assert {e["ph"] for e in events} >= {"M", "X", "b", "e"}
    assert {e["pid"] for e in events} == {0, 1}
    its = [e for e in events if e.get("cat") == "iteration" and e["pid"] == 0]
    assert its and all(e["dur"] > 0 for e in its)


def test_json_and_identical_placements_get_distinct_labels(trace_dir, capsys):
    rc = main(["simulate", trace_dir, "--placement", "linear", "--placement", "linear", *COMMON, "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)["summaries"]
    assert [r["label"] for r in res] == ["linear#1", "linear#2"]
    a, b = ({k: v for k, v in r.items() if "wall" not in k and k not in ("label", "placement")} for r in res)
    assert a == b  # same placement, same seed: same run


def test_a_run_that_completes_no_request_is_refused_before_any_output(trace_dir, tmp_path, capsys):
    """3 simulated ms is a couple of iterations: no request finishes, so the table would be zeros; it is an
    error that says why and what to change, and neither --out nor --chrome-trace is written."""
    out, chrome = tmp_path / "out", tmp_path / "trace.json"
    short = [x if x != "0.1" else "0.003" for x in COMMON]
    rc = main(["simulate", trace_dir, "--placement", "linear", *short, "--out", str(out), "--chrome-trace", str(chrome)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert re.match(r"place: error: linear: the run completed no request in 0\.003 simulated s \([1-9]\d* iterations", err)
    for hint in ("--duration", "--context-mix", "--output-len", "--concurrency", "--max-trace-tokens"):
        assert hint in err, hint
    assert not out.exists() and not chrome.exists()
    # the same workload long enough to finish requests runs
    assert main(["simulate", trace_dir, "--placement", "linear", *COMMON, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["summaries"][0]["requests_finished"] > 0


def opts(**over):
    d = {"--gpus": "4", "--gpus-per-node": "2", "--attention-tp": "2", "--duration": "0.1", "--concurrency": "8"}
    d.update(over)
    return [x for kv in d.items() for x in kv] + ["--no-progress"]


@pytest.mark.parametrize("args, message", [
    (["--placement", "nosuch", *opts()], "--placement 'nosuch': no such file and not a policy"),
    (["--placement", "linear", "--rebalance", "every", *opts()], "--rebalance: 'every' is not KEY=VALUE"),
    (["--placement", "linear", "--profile", "/nonexistent/p.json", *opts()], "no such calibration profile"),
    (["--placement", "linear", *opts(**{"--gpus": "6", "--gpus-per-node": "2"})], "do not divide evenly"),
    (["--placement", "linear", *opts(**{"--attention-tp": "3"})], "does not divide"),
    (["--placement", "linear", *opts(**{"--duration": "0"})], "argument --duration: expected a number > 0"),
    (["--placement", "linear", "--isl", "64", *opts()], "--isl and --osl go together"),
    (["--placement", "linear", "--mtp", "two", *opts()], "--mtp: 'two' is not DRAFT:ACCEPTANCE"),
    (["--placement", "linear", "--prefill-gpus", "2", *opts()], "--prefill-gpus needs --disaggregated"),
    (["--placement", "linear", "--gpu", "/nonexistent/gpu.json", *opts()], "no such GPU spec file"),
])
def test_bad_input_is_one_line_and_exit_code_2(trace_dir, capsys, args, message):
    rc = main(["simulate", trace_dir, *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("place: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_benchmark_shapes_and_per_gpu_per_user_figures(trace_dir, tmp_path, capsys):
    spec = tmp_path / "mygpu.json"  # an H200 with 1/1000 of its HBM bandwidth (the tiny model is latency-bound)
    spec.write_text(json.dumps({"hbm_bytes": 141e9, "hbm_bw": 4.8e9, "flops_bf16": 989e12, "flops_fp8": 1979e12,
                                "nvlink_bw": 450e9, "nvlink_latency": 3e-6, "nic_bw": 50e9, "nic_latency": 8e-6}))
    base = ["--placement", "linear", "--isl", "24", "--osl", "16", "--phase", "decode", "--json",
            *opts(**{"--duration": "0.2"})]
    rc = main(["simulate", trace_dir, *base])
    fast = json.loads(capsys.readouterr().out)["summaries"][0]
    assert rc == 0 and fast["output_tok_s"] > 0 and fast["tpot_p50_s"] is not None
    assert fast["output_tok_s_per_gpu"] == pytest.approx(fast["output_tok_s"] / 4)
    assert fast["warmup_s"] == pytest.approx(0.04) and fast["num_gpus"] == 4
    # decode phase: requests arrive with their KV, so no prompt is prefilled
    assert fast["prefill_tok_s"] == 0 and fast["per_user_tok_s"] > 0
    rc = main(["simulate", trace_dir, *base, "--gpu", str(spec)])
    slow = json.loads(capsys.readouterr().out)["summaries"][0]
    assert rc == 0 and slow["per_user_tok_s"] < fast["per_user_tok_s"]  # decode reads weights from HBM
    # MTP with every draft accepted: each step keeps 1 + 2 tokens per sequence but runs 2 draft steps and
    # verifies 3 tokens, so the speed-up is real but below 3x; with nothing accepted drafting only costs
    rc = main(["simulate", trace_dir, *base, "--mtp", "2:1.0"])
    mtp = json.loads(capsys.readouterr().out)["summaries"][0]
    assert rc == 0 and 1.5 * fast["per_user_tok_s"] < mtp["per_user_tok_s"] < 3 * fast["per_user_tok_s"]
    rc = main(["simulate", trace_dir, *base, "--mtp", "2:0.0"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["summaries"][0]["per_user_tok_s"] < fast["per_user_tok_s"]
    # asymmetric disaggregation: 2 prefill GPUs + the 4 decode GPUs
    rc = main(["simulate", trace_dir, "--placement", "linear", "--disaggregated", "--prefill-gpus", "2", "--json",
               *opts(**{"--duration": "0.2"})])
    dis = json.loads(capsys.readouterr().out)["summaries"][0]
    assert rc == 0 and dis["num_gpus"] == 6 and dis["requests_finished"] > 0


def test_placement_for_another_cluster_is_refused(trace_dir, tmp_path, capsys):
    pfile = tmp_path / "p8.json"
    linear_placement(mini_model(), 8, 4).save(pfile)
    assert main(["simulate", trace_dir, "--placement", str(pfile), *COMMON]) == 2
    assert "placement is for 8 GPUs" in capsys.readouterr().err


def test_missing_trace(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "none"), "--placement", "linear", *COMMON]) == 2
    assert "no such file or directory" in capsys.readouterr().err
