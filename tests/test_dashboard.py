"""The dashboard pages under Streamlit's AppTest, against a small run directory made by tests/dashkit.py:
each page shows the values the library computes for the same artifacts, its widgets change what is
shown, and bad input (missing directory, corrupt files, wrong model, bad settings) becomes a message,
never an exception."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from dashkit import NUM_GPUS, SWEEP_DIR, make_run_dir
from streamlit.testing.v1 import AppTest

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.memory import plan_memory
from moeplace.foundation.model import load_model
from moeplace.placement.compare import compare_policies
from moeplace.placement.evaluate import evaluate
from moeplace.placement.record import load_placement
from moeplace.traces.stats import affinity_lift, compute_stats

APP = str(Path(__file__).resolve().parent.parent / "moeplace" / "dashboard" / "app.py")
TIMEOUT = 120


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("dash") / "run")


def open_page(run_dir: Path | str, page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["run_dir"] = str(run_dir)
    at.run()
    if page:
        at.switch_page(f"views/{page}.py").run()
    return at


def no_failures(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}; have {[m.label for m in at.metric]}"
    return found[0]


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


# ---------------------------------------------------------------------------- overview / run dir
def test_overview_counts_the_artifacts(run_dir):
    at = open_page(run_dir)
    no_failures(at)
    assert at.title[0].value == "moeplace"
    counts = {m.label: m.value for m in at.metric}
    assert counts == {"Traces": "1", "Placements": "3", "Comparisons": "1", "Plans": "2", "Simulations": "1",
                      "Loads": "0", "Sweeps": "1"}
    paths = set(at.dataframe[0].value["path"])
    assert {"traces", "placements/moeplace.json", "comparison.json", "plan.json", "sim"} <= paths


@pytest.mark.parametrize("page", [None, "traces", "placement", "plan", "simulate", "sweep"])
def test_missing_run_dir_is_an_error_message_on_every_page(tmp_path, page):
    at = open_page(tmp_path / "nope", page)
    assert not at.exception
    assert any("no such directory" in e.value for e in at.error)


def test_run_dir_typed_in_the_sidebar_is_used(run_dir, tmp_path):
    at = open_page(tmp_path)  # an empty directory: nothing found, a hint, no error
    assert not at.exception and not at.error
    assert any("holds no moeplace artifacts" in w.value for w in at.warning)
    at.text_input(key="run_dir").set_value(str(run_dir)).run()
    assert metric(at, "Placements") == "3"


# ---------------------------------------------------------------------------- traces
def test_traces_page_shows_the_streaming_statistics(run_dir):
    at = open_page(run_dir, "traces")
    no_failures(at)
    assert any(s.value.startswith("valid") for s in at.success)
    at.number_input(key="tr_window").set_value(1024).run()
    no_failures(at)
    stats = compute_stats(run_dir / "traces", window_tokens=1024)
    assert metric(at, "Tokens") == f"{stats.num_tokens:,}" == "6,000"
    assert metric(at, "Windows") == f"{stats.loads.num_windows} x 1,024"
    assert metric(at, "Median skew (max/mean)") == f"{np.nanmedian(stats.layer_skew):.2f}"
    assert metric(at, "Locality (top-k overlap)") == f"{stats.locality:.3f}"
    # domain mix: one row per domain, all tokens accounted for
    dom = at.dataframe[-1].value
    assert set(dom["domain"]) == set(stats.domains) and dom["tokens"].sum() == pytest.approx(6000)
    # the heatmap's window picker lists every window
    assert len(at.selectbox(key="tr_heat_window").options) == stats.loads.num_windows + 1


def test_traces_affinity_follows_the_chosen_layer_pair(run_dir):
    at = open_page(run_dir, "traces")
    at.number_input(key="tr_window").set_value(1024).run()
    at.selectbox(key="tr_aff_a").set_value(3).run()
    to = at.selectbox(key="tr_aff_b_3")
    assert to.options == ["4", "5", "6", "7"]  # only later layers
    to.set_value(6).run()
    no_failures(at)
    stats = compute_stats(run_dir / "traces", window_tokens=1024)
    layers = list(stats.model.moe_layers)
    pair = stats.loads.samples[:, [layers.index(3), layers.index(6)]]
    _, lift, _, _ = affinity_lift(pair, stats.model.num_experts, max_pairs=1)
    assert metric(at, "Affinity lift (1 = independent)") == f"{lift[0]:.2f}"


def test_corrupt_trace_shows_the_validation_report(run_dir, tmp_path):
    bad = copy_run(run_dir, tmp_path)
    part = next((bad / "traces").glob("*.parquet"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # truncated file
    at = open_page(bad, "traces")
    assert not at.exception
    assert at.error, "a truncated trace must be reported"
    assert any("part-00000.parquet" in e.value for e in at.error) or any("part-00000.parquet" in c.value
                                                                          for c in at.code)


def test_other_trace_path_that_does_not_exist(run_dir):
    at = open_page(run_dir, "traces")
    at.selectbox(key="tr_path").set_value("other path...").run()
    at.text_input(key="tr_path_other").set_value(str(run_dir / "missing")).run()
    assert not at.exception
    assert any("no such file or directory" in e.value for e in at.error)


# ---------------------------------------------------------------------------- placement
def test_placement_page_scores_match_evaluate(run_dir):
    """By default each placement is scored on the windows it was not planned on (its provenance says
    which), labelled held out; 'every window' scores in-sample and says so. No column that cannot tell
    placements apart (bound, gap, cross-node share; GPUs and slots when all share them)."""
    at = open_page(run_dir, "placement")
    no_failures(at)
    from moeplace.dashboard.data import unseen_windows
    from moeplace.traces.stats import trace_loads

    loads = trace_loads(run_dir / "traces", 4096)
    table = at.dataframe[-1].value
    for name in ("moeplace", "eplb", "linear"):
        pl_ = load_placement(run_dir / "placements" / f"{name}.json")
        seen = unseen_windows(pl_, loads, run_dir / "traces", run_dir)
        assert seen.kind == "held-out" and seen.windows and seen.windows[0] > 0
        m = evaluate(pl_, loads.select(np.asarray(seen.windows)), "vllm", model=loads.model)
        assert metric(at, f"{name}: balancedness") == f"{m.balancedness:.4f}"
        row = table[table["policy"] == name].iloc[0]
        assert row["scored on"].startswith("held out: window")
    assert list(table["policy"]) == ["eplb", "linear", "moeplace"]
    assert not {"gap to bound", "bound (any placement)", "cross-node share", "GPUs", "slots"} & set(table.columns)
    assert (table["balancedness"] <= 1 + 1e-9).all()
    at.radio(key="pl_score_on").set_value("every window").run()
    no_failures(at)
    table = at.dataframe[-1].value
    assert all(v.startswith("in-sample") for v in table["scored on"])
    for name in ("moeplace", "eplb", "linear"):
        m = evaluate(load_placement(run_dir / "placements" / f"{name}.json"), loads, "vllm", model=loads.model)
        assert metric(at, f"{name}: balancedness") == f"{m.balancedness:.4f}"
    # one GPU-load chart per placement, for the chosen layer
    at.select_slider(key="pl_layer").set_value(4).run()
    heads = [m.value for m in at.markdown if "— layer 4:" in m.value]
    assert len(heads) == 3
    lin = load_placement(run_dir / "placements" / "linear.json")
    li = list(lin.moe_layers).index(4)
    assert any(f"{int((lin.logcnt[li] > 1).sum())} replicated experts" in h for h in heads if "linear" in h)
    # the moeplace placement recorded its balance-vs-traffic frontier (dashkit plans with pareto on)
    assert any(m.value.startswith("**Optimizer frontier, layer 4**") for m in at.markdown)


def test_placement_downloads_every_export_format(run_dir, tmp_path):
    at = open_page(run_dir, "placement")
    at.selectbox(key="pl_download").set_value("moeplace").run()
    from moeplace.dashboard import data
    from moeplace.placement.export import export_placement, format_names

    labels = [b.label for b in at.download_button]
    assert "placement JSON" in labels
    shown = [lab.split(" ")[0] for lab in labels if lab != "placement JSON"]  # "<format> (<engine>): <file>"
    rejected = [w.value.split(":")[0] for w in at.warning]
    assert sorted(shown + rejected) == sorted(format_names())
    # the bytes offered are what the exporter writes, and the placement JSON reads back unchanged
    p = load_placement(run_dir / "placements" / "moeplace.json")
    model = compute_stats(run_dir / "traces").model
    blob, name, _ = data.export_bytes(p, model, "sglang")
    export_placement(p, model, "sglang", tmp_path / "x.json")
    assert blob == (tmp_path / "x.json").read_bytes() and name.endswith(".json")
    (tmp_path / "p.json").write_bytes(data.placement_json_bytes(p))
    assert np.array_equal(load_placement(tmp_path / "p.json").phy2log, p.phy2log)


def test_optimize_from_the_page_matches_compare_policies(run_dir):
    at = open_page(run_dir, "placement")
    at.multiselect(key="opt_policies").set_value(["linear", "round_robin"])
    at.number_input(key="opt_red").set_value(16)
    at.button[0].click().run()  # the form's submit button
    no_failures(at)
    from moeplace.traces.stats import trace_loads

    loads = trace_loads(run_dir / "traces", 4096)
    cmp = compare_policies(loads, make_cluster(NUM_GPUS, "h200"), num_redundant=16,
                           policies=["linear", "round_robin"], plan_fraction=0.5, time_limit=5.0)
    rows = {r.policy: r for r in cmp.results}
    table = next(d.value for d in at.dataframe if "held-out balancedness" in d.value.columns
                 and "seconds" in d.value.columns and len(d.value) == 2)
    for _, row in table.iterrows():
        assert row["held-out balancedness"] == pytest.approx(rows[row["policy"]].held_out.balancedness)
    chosen = next(w for w in at.multiselect if w.label == "Placements to compare").value
    assert "optimize: round_robin" in chosen
    # scored on the windows that comparison held out, as everywhere on the page
    held = loads.select(cmp.held_windows)
    assert metric(at, "optimize: round_robin: balancedness") == f"{evaluate(rows['round_robin'].placement, held).balancedness:.4f}"


def test_placement_of_another_model_is_a_warning_and_bad_json_an_error(run_dir, tmp_path):
    bad = copy_run(run_dir, tmp_path)
    k3 = load_model("kimi-k3")
    from moeplace.placement.record import Placement

    Placement.from_phy2log(np.tile(np.arange(k3.num_experts), (k3.num_moe_layers, 1)), k3, 32, 8).save(
        bad / "placements" / "k3.json")
    d = json.loads((bad / "placements" / "eplb.json").read_text())
    d["phy2log"][0][0] = 999  # expert id out of range
    (bad / "placements" / "eplb.json").write_text(json.dumps(d))
    at = open_page(bad, "placement")
    assert not at.exception
    assert any("k3.json" in w.value and "kimi-k3" in w.value for w in at.warning)
    assert any("eplb.json" in e.value and "out of range" in e.value for e in at.error)
    assert {m.label for m in at.metric} == {"linear: balancedness", "moeplace: balancedness"}


# ---------------------------------------------------------------------------- plan
def test_plan_page_matches_plan_memory_and_replans(run_dir):
    at = open_page(run_dir, "plan")
    no_failures(at)
    from moeplace.dashboard.data import plan_inputs, resolve_model

    name, gpus, gpu, gpn, config = plan_inputs(json.loads((run_dir / "plan.json").read_text()))
    model = resolve_model(name, [run_dir / "traces"])
    plan = plan_memory(model, make_cluster(gpus, gpu, gpn), config)
    assert metric(at, "Concurrent sequences at 128k") == f"{plan.concurrency:,}"
    assert any(s.value == "verdict: FITS" for s in at.success)
    curve = next(d.value for d in at.dataframe if "limited by" in d.value.columns)
    for _, row in curve.iterrows():
        per_rank, _ = plan.pools.concurrency(((int(row["context_tokens"]), 1.0),))
        assert row["concurrency"] == per_rank * plan.layout.dp
    # fp8 KV halves the bytes per token: re-planned, the KV-limited end of the curve holds more
    at.selectbox(key="plan_plan.json_kv").set_value("fp8").run()
    no_failures(at)
    from dataclasses import replace

    plan8 = plan_memory(model, make_cluster(gpus, gpu, gpn), replace(config, kv_dtype="fp8"))
    curve8 = next(d.value for d in at.dataframe if "limited by" in d.value.columns)
    assert curve8["concurrency"].iloc[-1] == plan8.pools.concurrency(((int(curve8["context_tokens"].iloc[-1]),
                                                                       1.0),))[0] * plan8.layout.dp
    assert curve8["concurrency"].iloc[-1] > curve["concurrency"].iloc[-1]


def test_plan_bad_context_and_a_layout_that_does_not_fit(run_dir):
    at = open_page(run_dir, "plan")
    at.text_input(key="plan_plan.json_ctx").set_value("12q").run()
    assert not at.exception
    assert any("settings" in e.value and "12q" in e.value for e in at.error)
    at = open_page(run_dir, "plan")
    at.selectbox(key="plan_plan.json_model").set_value("kimi-k3").run()
    at.number_input(key="plan_plan.json_gpus").set_value(8).run()  # 8 x H200 cannot hold K3
    assert not at.exception and not at.error
    assert any("DOES NOT FIT" in w.value for w in at.warning)


# ---------------------------------------------------------------------------- simulate
def test_simulate_page_shows_the_summaries_side_by_side(run_dir):
    at = open_page(run_dir, "simulate")
    no_failures(at)
    summaries = {s["label"]: s for s in json.loads((run_dir / "sim" / "summary.json").read_text())["summaries"]}
    assert at.multiselect(key=f"sim_labels_{run_dir / 'sim'}").value == ["moeplace", "linear"]
    assert metric(at, "moeplace: output tok/s") == f"{summaries['moeplace']['output_tok_s']:,.0f}"
    table = at.dataframe[0].value
    row = table[table["metric"] == "requests finished"].iloc[0]
    assert row["linear"] == f"{summaries['linear']['requests_finished']:,}"
    at.multiselect(key=f"sim_labels_{run_dir / 'sim'}").set_value(["linear"]).run()
    no_failures(at)
    assert list(at.dataframe[0].value.columns) == ["metric", "linear"]


def test_corrupt_simulation_output_is_an_error(run_dir, tmp_path):
    bad = copy_run(run_dir, tmp_path)
    (bad / "sim" / "linear.timeseries.parquet").write_bytes(b"not parquet")
    at = open_page(bad, "simulate")
    assert not at.exception
    assert any("linear.timeseries.parquet" in e.value for e in at.error)


# ---------------------------------------------------------------------------- place dashboard
def test_place_dashboard_rejects_a_missing_run_dir(tmp_path, capsys):
    from moeplace.cli.main import main

    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error: ") and "no such run directory" in err and "place demo" in err


def test_place_dashboard_runs_streamlit_on_the_app_with_the_run_dir(run_dir):
    from moeplace.cli.commands.dashboard import streamlit_command

    cmd, env = streamlit_command(run_dir, 8600, "127.0.0.1", headless=True)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and Path(cmd[4]) == Path(APP)
    opts = dict(zip(cmd[5::2], cmd[6::2]))
    assert opts["--server.port"] == "8600" and opts["--server.address"] == "127.0.0.1"
    assert opts["--server.headless"] == "true"
    assert env["MOEPLACE_RUN_DIR"] == str(run_dir.resolve())


def test_an_artifact_rewritten_on_disk_is_reread(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path)
    at = open_page(run, "placement")
    before, eplb_value = metric(at, "linear: balancedness"), metric(at, "eplb: balancedness")
    eplb = load_placement(run / "placements" / "eplb.json")
    eplb.save(run / "placements" / "linear.json")  # same path, new content: the cache key (mtime, size) changes
    (run / "placements" / "eplb.json").unlink()  # else the two files are one placement, listed once
    at.run()
    no_failures(at)
    after = metric(at, "linear: balancedness")
    assert after == eplb_value != before


def test_scan_finds_artifacts_by_content_and_follows_the_simulated_trace(run_dir, tmp_path):
    from moeplace.dashboard.data import scan_run_dir

    run = copy_run(run_dir, tmp_path)
    outside = tmp_path / "elsewhere" / "k3-default"
    outside.parent.mkdir()
    shutil.move(run / "traces", outside)  # as `place demo --traces data/k3-default` keeps it
    cfg = json.loads((run / "sim" / "config.json").read_text())
    cfg["trace"]["path"] = str(outside)
    (run / "sim" / "config.json").write_text(json.dumps(cfg))
    (run / "notes.json").write_text('{"rows": 1}')  # JSON that is no artifact: ignored
    (run / "broken.json").write_text("{")
    idx = scan_run_dir(run)
    assert idx.traces == (outside,)
    assert [p.name for p in idx.placements] == ["eplb.json", "linear.json", "moeplace.json"]
    assert [p.name for p in idx.comparisons] == ["comparison.json"] and [p.name for p in idx.plans] == ["plan.json",
                                                                                                  "serve-plan.json"]
    assert [p.name for p in idx.sims] == ["sim"] and idx.loads == ()
    # the sweep directory, and nothing from its cache/ (its own traces and placements) among the run's artifacts
    assert idx.sweeps == (run / SWEEP_DIR,)
    assert any("broken.json" in n for n in idx.notes)


# ---------------------------------------------------------------------------- sweep
def chart_data(at: AppTest, i: int = 0) -> list:
    """The data frames of the i-th Altair chart on the page (decoded from the Arrow datasets it sends)."""
    import pyarrow as pa

    proto = at.get("vega_lite_chart")[i].proto
    return [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in proto.datasets]


def test_sweep_page_shows_the_frontier_and_the_recommended_deployment(run_dir):
    import polars as pl

    from moeplace.sim.frontier import pareto_mask

    sweep = run_dir / SWEEP_DIR
    rep = json.loads((sweep / "frontier.json").read_text())
    table = pl.read_parquet(sweep / "sweep.parquet")
    at = open_page(run_dir, "sweep")
    no_failures(at)
    assert at.title[0].value == "Sweep"
    assert at.selectbox(key="sweep_dir").value == SWEEP_DIR
    w = rep["workloads"]["chat"]
    assert [h.value for h in at.header] == ["Workload chat"]
    assert metric(at, "Points") == "7" and metric(at, "ok") == "3" and metric(at, "infeasible") == "2"
    # the scatter: every simulated point at (GPUs, output tok/s), coloured by p99 TPOT, frontier marked
    points = next(d for d in chart_data(at) if "frontier" in d.columns)
    assert len(points) == len(w["points"]) == 3
    assert points["output tok/s"].tolist() == [r["output_tok_s"] for r in w["points"]]
    assert points["p99 TPOT ms"].tolist() == pytest.approx([r["tpot_p99_s"] * 1e3 for r in w["points"]])
    marked = (points["frontier"] == "on the frontier").tolist()
    assert marked == [r["on_frontier"] for r in w["points"]]
    assert marked == pareto_mask(points["GPUs"], points["output tok/s"], points["p99 TPOT ms"]).tolist()
    # the frontier table: the frontier points of the file, in its order, TPOT in ms
    front = next(d.value for d in at.dataframe if "TPOT p99 ms" in d.value.columns)
    assert front["#"].tolist() == [r["index"] for r in w["frontier"]]
    assert front["output tok/s"].tolist() == [r["output_tok_s"] for r in w["frontier"]]
    assert front["TPOT p99 ms"].tolist() == pytest.approx([r["tpot_p99_s"] * 1e3 for r in w["frontier"]])
    # the recommendation and its launch command
    best = w["recommended"]
    assert best is not None and best["on_frontier"]
    assert at.success[0].value.startswith(f"#{best['index']} {best['label']}")
    assert metric(at, "GPUs") == str(best["gpus"]) == "8"
    assert metric(at, "p99 TPOT") == f"{best['tpot_p99_s'] * 1e3:.1f} ms"
    launch = rep["recommended_launch"]["chat"]
    assert [c.value for c in at.code] == [launch["command"].rstrip("\n")]
    assert "vllm serve" in launch["command"] and "--data-parallel-size 8" in launch["command"]
    # the points not simulated, with the reason (tests/data/sweep-small.yaml: 2 do not fit, TP3, EP4)
    rest = next(d.value for d in at.dataframe if list(d.value.columns) == ["index", "label", "status", "stage",
                                                                            "reason"])
    assert rest["index"].tolist() == [0, 1, 5, 6]
    assert rest["status"].tolist() == ["infeasible", "infeasible", "invalid", "unsupported"]
    expected = table.filter(pl.col("status") != "ok").sort("index")["reason"].to_list()
    assert rest["reason"].tolist() == expected and all(expected)
    assert "does not divide" in expected[2]


@pytest.mark.parametrize("damage, needle", [
    ("garbage", "frontier.json: not readable JSON"),
    ("no_points", "workloads.chat.points: expected a list of point objects"),
    ("old_version", "field 'version': expected 1"),
    ("other_kind", "field 'format' says a moeplace.sim-summary file, expected a moeplace.frontier file"),
    ("new_version", "field 'format' is 'moeplace.frontier/2': version 2 unknown"),
    ("missing", "frontier.json: missing (the sweep has not finished"),
])
def test_corrupt_or_missing_frontier_json_is_an_error_message(run_dir, tmp_path, damage, needle):
    run = copy_run(run_dir, tmp_path)
    f = run / SWEEP_DIR / "frontier.json"
    rep = json.loads(f.read_text())
    if damage == "garbage":
        f.write_text('{"version": 1, "workloads": {"chat": [')
    elif damage == "no_points":
        del rep["workloads"]["chat"]["points"]
        f.write_text(json.dumps(rep))
    elif damage == "old_version":  # an untagged frontier (the previous release's) is checked by its field
        del rep["format"]
        rep["version"] = 0
        f.write_text(json.dumps(rep))
    elif damage in ("other_kind", "new_version"):
        rep["format"] = "moeplace.sim-summary/1" if damage == "other_kind" else "moeplace.frontier/2"
        f.write_text(json.dumps(rep))
    else:
        f.unlink()
    at = open_page(run, "sweep")
    assert not at.exception, [e.value for e in at.exception]
    # the sweep is still found (by its sweep.parquet) and its frontier file is reported, not plotted
    assert at.selectbox(key="sweep_dir").value == SWEEP_DIR
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and needle in errors[0] and str(f) in errors[0], errors
    assert not at.get("vega_lite_chart") and not at.code


def test_corrupt_sweep_table_is_an_error_but_the_frontier_still_shows(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path)
    t = run / SWEEP_DIR / "sweep.parquet"
    t.write_bytes(t.read_bytes()[: t.stat().st_size // 2])
    at = open_page(run, "sweep")
    assert not at.exception
    assert any("sweep.parquet: not a readable Parquet file" in e.value for e in at.error)
    assert len(at.get("vega_lite_chart")) == 1 and len(at.code) == 1


def test_comparison_table_follows_place_optimize(run_dir, tmp_path):
    """The `place optimize` comparison shows what the command prints: held-out columns only, its shift
    estimate labelled as an estimate, "scored on N of M MoE layers" for a partial log, no x-node share."""
    run = copy_run(run_dir, tmp_path)
    d = json.loads((run / "comparison.json").read_text())
    d["shift"] = {r["policy"]: {"mean": 0.5 + 0.1 * i, "worst": 0.4, "method": "leave-one-window-group-out"}
                  for i, r in enumerate(d["rows"])}
    d["shift_scenarios"] = ["windows 0-1", "windows 2-3"]
    d["scored_layers"], d["moe_layers"] = 5, 7
    (run / "comparison.json").write_text(json.dumps(d))
    at = open_page(run, "placement")
    no_failures(at)
    table = next(t.value for t in at.dataframe if "shift estimate: mean" in t.value.columns)
    assert list(table["shift estimate: mean"]) == [d["shift"][p]["mean"] for p in table["policy"]]
    for r in d["rows"]:
        row = table[table["policy"] == r["policy"]].iloc[0]
        assert row["held-out balancedness"] == pytest.approx(r["held_out"]["balancedness"])
    assert not any("cross" in c or "x-node" in c or "bound" in c for c in table.columns)
    cap = " ".join(c.value for c in at.caption)
    assert "scored on 5 of 7 MoE layers" in cap and "an estimate (leave-one-window-group-out" in cap


def test_unseen_windows_follow_the_planning_record(run_dir, tmp_path):
    """A Loads file of the planning trace, or a copy of it, is the same routing (held-out windows only); a
    Loads file that does not say what it summarizes cannot be told apart (nothing counts as held out);
    another trace was never seen (every window)."""
    from moeplace.dashboard.data import unseen_windows
    from moeplace.placement.windows import routing_windows
    from moeplace.traces.loads import Loads

    run = copy_run(run_dir, tmp_path)
    pl_ = load_placement(run / "placements" / "eplb.json")
    on = pl_.provenance["planned_on"]
    from_token = on["held_out_from_token"]
    trace_ld = compute_stats(run / "traces", 1024, loads_only=True)
    trace_ld.save(run / "loads.npz")
    ld = routing_windows([run / "loads.npz"])
    seen = unseen_windows(pl_, ld, run / "loads.npz", run)
    assert seen.kind == "held-out" and seen.windows[0] == -(-from_token // 1024) and seen.windows[-1] == ld.num_windows - 1
    Loads(trace_ld.counts, trace_ld.model, 1024, (), {}).save(run / "anon.npz")
    anon = unseen_windows(pl_, routing_windows([run / "anon.npz"]), run / "anon.npz", run)
    assert anon.kind == "unknown" and anon.windows == ()
    shutil.copytree(run / "traces", run / "copy")  # the same routing elsewhere is not unseen
    assert unseen_windows(pl_, trace_ld, run / "copy", run).kind == "held-out"
    from dashkit import mini_k3

    from moeplace.traces.synth import SynthConfig, synthesize

    synthesize(mini_k3(), SynthConfig(num_tokens=2000, seed=9, num_domains=2, max_running=16, prompt_median=256,
                                      output_median=64, long_fraction=0.0), run / "other")
    other_ld = compute_stats(run / "other", 1024, loads_only=True)
    other = unseen_windows(pl_, other_ld, run / "other", run)
    assert other.kind == "unseen input" and len(other.windows) == other_ld.num_windows


# ---------------------------------------------------------------------------- issue 29: hints, launch, cost
def test_accuracy_note_under_every_simulated_figure(run_dir):
    from moeplace.sim.fidelity import fidelity_doc

    note = fidelity_doc()["note"]
    at = open_page(run_dir, "simulate")
    no_failures(at)
    assert [i.value for i in at.info if note in i.value] == [f"**Simulated figures** — {note}"]
    at = open_page(run_dir, "sweep")
    no_failures(at)
    recorded = json.loads((run_dir / SWEEP_DIR / "frontier.json").read_text())["fidelity"]["note"]
    assert any(i.value == f"**Simulated figures** — {recorded}" for i in at.info)
    for page in ("placement", "plan", "traces"):  # no simulated figure there: no note
        assert not any("Simulated figures" in i.value for i in open_page(run_dir, page).info)


def test_placement_page_shows_each_engines_launch_command_from_the_export_library(run_dir):
    """Each tab's command is what `place export --flags --plan serve-plan.json` prints (the run's plan for
    this placement: TP4 x DP4, not the default TP8 x DP2), and passes the recorded parser of the engine
    release as the CLI's does."""
    from importlib import resources

    from moeplace.dashboard import data
    from moeplace.foundation.errors import InputError
    from moeplace.placement.export import format_names
    from moeplace.placement.export.engines import command_argv
    from moeplace.placement.export.flags import TARGET_OF_FORMAT, FlagOptions, build_launch

    at = open_page(run_dir, "placement")
    at.selectbox(key="pl_download").set_value("moeplace").run()
    no_failures(at)
    p = load_placement(run_dir / "placements" / "moeplace.json")
    model = compute_stats(run_dir / "traces").model
    export_dir = Path(run_dir).resolve() / "export"
    codes = [c.value for c in at.code]
    shown = {}
    for fmt in format_names():
        if fmt not in TARGET_OF_FORMAT:
            continue
        try:
            built = build_launch(p, model, fmt, export_dir / data.export_name(p, fmt),
                                 FlagOptions(placement_path=str(export_dir / "placement.json")),
                                 run_dir / "serve-plan.json")
        except InputError as exc:  # the engine refuses this layout: the page says why instead
            assert any(i.value == f"No launch command: {exc}" for i in at.info), fmt
        else:
            assert built.launch.text().rstrip("\n") in codes, fmt
            shown[fmt] = built.launch
    assert {"sglang", "vllm-expert-map", "vllm-jsonl"} <= set(shown)
    for fmt, launch in shown.items():
        assert "# attention TP4 x DP4, EP16" in launch.text(), fmt  # the plan's layout, not the default
        if launch.version is None:
            continue
        rec = json.loads(resources.files("moeplace.placement.export").joinpath(
            "engine_options", f"{launch.engine}-{launch.version}.json").read_text())
        (argv,) = command_argv(launch.text())
        for argv_ in (argv, launch.argv(worker=True)):
            opts = [a for a in argv_ if a.startswith("--")]
            assert opts and all(o in rec["options"] and o not in rec["deprecated"] for o in opts), (fmt, opts)
    vl = shown["vllm-expert-map"].argv(worker=True)
    assert vl[vl.index("--data-parallel-size") + 1] == "4" and "--enable-expert-parallel" in vl
    assert vl[vl.index("--data-parallel-size-local") + 1] == "2"
    assert vl[vl.index("--data-parallel-start-rank") + 1] == "$((NODE_RANK*2))"  # node 1 holds DP ranks 2, 3
    # TensorRT-LLM runs attention all-TP or all-DP: TP4 x DP4 gets the reason, never a command with ADP off
    assert any(i.value.startswith("No launch command:") and "cannot be expressed" in i.value for i in at.info)
    assert not any("trtllm-serve" in c for c in codes)
    assert any("memory plan: " in c.value and "(serve-plan.json)" in c.value for c in at.caption)


def test_placement_page_refuses_to_launch_without_a_plan_for_the_placement(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path)
    (run / "serve-plan.json").unlink()  # plan.json stays: a plan without the placement's redundant slots
    at = open_page(run, "placement")
    at.selectbox(key="pl_download").set_value("moeplace").run()
    no_failures(at)
    assert not any("vllm serve" in c.value or "sglang.launch_server" in c.value for c in at.code)
    assert any("no memory plan of this run is for this placement" in i.value and "--redundant 16" in i.value
               and "a plan with 0 redundant experts per layer" in i.value for i in at.info)


def test_the_same_placement_in_two_files_is_listed_once(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path)
    shutil.copy(run / "placements" / "moeplace.json", run / "placement.json")  # what place demo writes
    at = open_page(run)
    no_failures(at)
    assert metric(at, "Placements") == "3"
    rows = at.dataframe[0].value
    assert "placement file (the same placement as placement.json)" in set(rows["kind"])
    at = open_page(run, "placement")
    no_failures(at)
    chosen = next(m for m in at.multiselect if m.key.startswith("pl_chosen_"))
    assert sorted(chosen.options) == ["eplb", "linear", "placement"]
    assert any("Listed once" in c.value and "placement.json = placements/moeplace.json" in c.value
               for c in at.caption)


def test_empty_sweep_page_points_to_a_command_that_makes_a_sweep(tmp_path):
    at = open_page(tmp_path, "sweep")
    no_failures(at)
    (hint,) = [i.value for i in at.info]
    assert "place sweep examples/sweep-k3.yaml --local --out" in hint and "place demo" not in hint
    spec = Path(__file__).resolve().parent.parent / "examples" / "sweep-k3.yaml"
    assert spec.is_file()  # the spec the hint names ships with the repository


def test_dashboard_help_names_all_six_pages(capsys):
    from moeplace.cli.main import main

    assert main(["dashboard", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for page in ("Overview", "Traces", "Placement", "Plan", "Simulate", "Sweep"):
        assert page in text, page


def test_cost_points_price_by_gpu_type():
    from moeplace.dashboard.data import cost_points

    pts = [{"index": 0, "gpus": 8, "gpu": "h200", "output_tok_s": 1000.0, "tpot_p99_s": 0.05},
           {"index": 1, "gpus": 8, "gpu": "b200", "output_tok_s": 1100.0, "tpot_p99_s": 0.05},
           {"index": 2, "gpus": 16, "gpu": "h200", "output_tok_s": 900.0, "tpot_p99_s": 0.06},
           {"index": 3, "gpus": 4, "gpu": "gb300-nvl72", "output_tok_s": 10.0, "tpot_p99_s": 0.01}]
    out = cost_points(pts, {"h200": 3.0, "b200": 6.0})
    assert [r["usd_per_hour"] for r in out] == [24.0, 48.0, 48.0, None]
    assert out[0]["usd_per_mtok"] == pytest.approx(24.0 / (1000 * 3600) * 1e6)
    # same GPU count, but the B200 point costs twice as much per hour for 10% more: both on the frontier;
    # the 16-GPU point is dominated by the 8 x H200 one; the unpriced one is left off
    assert [r["on_cost_frontier"] for r in out] == [True, True, False, False]
    out = cost_points(pts, {"h200": 3.0, "b200": 3.0})  # at the same price the B200 point dominates
    assert [r["on_cost_frontier"] for r in out] == [False, True, False, False]


def test_sweep_cost_frontier_follows_the_edited_prices(run_dir):
    from moeplace.dashboard.data import DEFAULT_GPU_PRICES, cost_points

    rep = json.loads((run_dir / SWEEP_DIR / "frontier.json").read_text())
    w = rep["workloads"]["chat"]
    at = open_page(run_dir, "sweep")
    no_failures(at)
    assert at.number_input(key="price_h100").value == DEFAULT_GPU_PRICES["h100"]

    def cost_table():
        return next(d.value for d in at.dataframe if "USD/hour" in d.value.columns)

    want = [r for r in cost_points(w["points"], {"h100": DEFAULT_GPU_PRICES["h100"]}) if r["on_cost_frontier"]]
    got = cost_table()
    assert sorted(got["#"].tolist()) == sorted(r["index"] for r in want)
    assert got["USD/hour"].tolist() == [round(8 * DEFAULT_GPU_PRICES["h100"], 2)] * len(want)
    at.number_input(key="price_h100").set_value(10.0).run()
    no_failures(at)
    got = cost_table()
    assert got["USD/hour"].tolist() == [80.0] * len(want)
    best = min(want, key=lambda r: 80.0 / r["output_tok_s"])
    assert metric(at, "Cheapest per million output tokens") == f"${80.0 / (best['output_tok_s'] * 3600) * 1e6:.3f}"
    at.radio(key="sweep_axis").set_value("cost (USD/hour)").run()
    no_failures(at)
    points = next(d for d in chart_data(at) if "USD/hour" in d.columns and "frontier" in d.columns)
    assert points["USD/hour"].tolist() == [10.0 * r["gpus"] for r in w["points"]]
