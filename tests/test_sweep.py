"""place sweep: spec parsing and expansion, point hashing, plan verdicts, the Pareto frontier, and small
end-to-end sweeps on a process pool and on a local Ray instance (same table), with resume."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from moeplace.cli.main import main
from moeplace.cli.sweep import comparable, expand_points, load_spec, pareto_mask, run_sweep
from moeplace.cli.sweep.spec import optimize_key, point_hash, workload_fingerprint
from moeplace.cli.sweep.stages import plan_point
from moeplace.cli.sweep.store import ResultStore, make_row
from moeplace.foundation.errors import InputError
from moeplace.sim.frontier import recommend

SMALL = Path(__file__).parent / "data" / "sweep-small.yaml"
EXAMPLE = Path(__file__).parent.parent / "examples" / "sweep-k3.yaml"


@pytest.fixture(scope="module")
def small():
    return load_spec(SMALL)


@pytest.fixture(scope="module")
def local_run(small, tmp_path_factory):
    """The small sweep once on a 2-process pool (shared by the comparison tests)."""
    out = tmp_path_factory.mktemp("sweep-local")
    return run_sweep(small, out, backend="local", workers=2)


def _seed_workloads(run, out: Path) -> None:
    """Copy the synthesized trace and its Loads of an earlier run into ``out``'s cache (not its placements:
    the sweep under test still optimizes)."""
    for sub in ("workloads", "loads"):
        shutil.copytree(run.table_path.parent / "cache" / sub, out / "cache" / sub)


def _write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------- spec
def test_small_spec_expands_grid_then_extra_points(small):
    pts = expand_points(small)
    assert len(pts) == 7
    # grid: gpus x policy with the policy (later axis) varying fastest, then the three explicit points
    assert [(p.gpus, p.policy) for p in pts[:4]] == [(1, "eplb"), (1, "linear"), (8, "eplb"), (8, "linear")]
    assert pts[4].rebalance.startswith("every=8") and pts[4].policy == "eplb" and pts[4].gpus == 8
    assert (pts[5].tp, pts[6].ep) == (3, 4)
    assert [p.index for p in pts] == list(range(7))


def test_sweep_point_lengths_follow_place_simulate(small):
    """A sweep workload's context_mix gives the prompt lengths `place simulate --context-mix` would."""
    from moeplace.cli.sweep.run import sim_config
    from moeplace.sim.config import LengthMix

    cfg = sim_config(small, expand_points(small)[2], 8)
    assert cfg.workload.lengths == LengthMix.context_mix(((512, 1.0),), cfg.workload.lengths.output_mean,
                                                         small.model.max_context)


def test_example_spec_has_20_points():
    pts = expand_points(load_spec(EXAMPLE))
    assert len(pts) == 20
    assert len({tuple(p.axes().items()) for p in pts}) == 20


def test_redundant_per_gpu_resolves_against_ep(small):
    p = expand_points(small)[0]
    assert replace(p, redundant="2/gpu", gpus=32).num_redundant == 64
    assert replace(p, redundant="2/gpu", gpus=32, ep=16).num_redundant == 32
    assert replace(p, redundant=5).num_redundant == 5


def test_duplicate_extra_point_is_dropped(tmp_path):
    extra = "  - {gpus: 8, tp: 3}\n  - {gpus: 8, policy: eplb}"
    text = SMALL.read_text().replace("  - {gpus: 8, tp: 3}", extra)
    spec = load_spec(_write(tmp_path, text))
    assert len(expand_points(spec)) == 7  # {gpus: 8, policy: eplb} is grid point #2


def test_toml_spec_equals_yaml(small, tmp_path):
    toml = """
name = "small"
model = "qwen3-30b-a3b"
seed = 0
points = [{gpus = 8, rebalance = "every=8,window=8,moves=0,policy=eplb"}, {gpus = 8, tp = 3},
          {gpus = 8, ep = 4}]
[[workloads]]
name = "chat"
synth = {num_tokens = 3000, seed = 1, max_prefill_tokens = 512, max_decode_tokens = 128}
concurrency = 16
context_mix = "512:1.0"
output_len = 24
[axes]
gpu = "h100"
gpus = [1, 8]
tp = 1
redundant = 0
policy = ["eplb", "linear"]
rebalance = "static"
kv_dtype = "fp8"
[plan]
context = "32k"
min_seqs = 12
[engine]
max_batched_tokens = 2048
max_seqs = 64
[optimize]
plan_fraction = 0.5
window_tokens = 512
[simulate]
duration = 0.5
mode = "stat"
max_trace_tokens = 3000
[objective]
tpot_p99_ms = 1000
"""
    spec = load_spec(_write(tmp_path, toml, "spec.toml"))
    assert expand_points(spec) == expand_points(small)
    fp = workload_fingerprint(spec, spec.workloads[0])
    assert fp == workload_fingerprint(small, small.workloads[0])
    hashes = [point_hash(small, p, fp) for p in expand_points(small)]
    assert [point_hash(spec, p, fp) for p in expand_points(spec)] == hashes


@pytest.mark.parametrize("old,new,needle", [
    ("  kv_dtype: fp8\n", "  kv_dtype: fp8\n  colour: red\n", "field 'axes.colour': unknown axis"),
    ("policy: [eplb, linear]", "policy: [eplb, nosuch]", "field 'axes.policy[1]': unknown policy 'nosuch'"),
    ("gpus: [1, 8]", "gpus: [1, -8]", "field 'axes.gpus[1]': must be >= 1"),
    ("redundant: 0", "redundant: lots", "field 'axes.redundant[0]': expected a slot count or 'N/gpu'"),
    ("duration: 0.5", "duration: 0", "field 'simulate.duration'"),
    ("min_seqs: 12", "min_seqs: many", "field 'plan.min_seqs': expected a whole number"),
    ("  - {gpus: 8, tp: 3}", "  - {gpus: 8, tpp: 3}", "field 'points[1].tpp': unknown axis"),
    ("    concurrency: 16", "    concurency: 16", "field 'workloads[0].concurency': unknown key"),
    ("engine: {max_batched_tokens", "engine: {max_batch", "field 'engine.max_batch': unknown key"),
])
def test_bad_spec_names_file_and_field(tmp_path, old, new, needle):
    text = SMALL.read_text()
    assert old in text
    p = _write(tmp_path, text.replace(old, new))
    with pytest.raises(InputError, match=None) as info:
        load_spec(p)
    assert str(p) in str(info.value) and needle in str(info.value)


def test_bad_spec_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
    p = _write(tmp_path, "model: kimi-k3\nworkloads: []\n")
    assert main(["sweep", str(p), "--local", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("place: error: ") and "field 'workloads'" in err[0]
    p2 = _write(tmp_path, "a: [1,\n", "broken.yaml")
    assert main(["sweep", str(p2), "--local"]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_sweep_of_only_infeasible_points_records_them_without_starting_workers(tmp_path):
    text = SMALL.read_text().replace("gpus: [1, 8]", "gpus: [1]").split("points:")[0]
    spec = load_spec(_write(tmp_path, text))
    res = run_sweep(spec, tmp_path / "out", backend="ray", workers=2)
    assert res.table["status"].to_list() == ["infeasible", "infeasible"] and res.num_optimized == 0
    assert (res.table["plan_concurrency"] < 8).all()
    rep = json.loads(res.frontier_path.read_text())["workloads"]["chat"]
    assert rep["frontier"] == [] and rep["recommended"] is None and rep["status_counts"] == {"infeasible": 2}
    assert not (tmp_path / "out" / "cache" / "workloads").exists()  # nothing to simulate: nothing synthesized


def test_trace_workload_must_exist(tmp_path):
    synth = "    synth: {num_tokens: 3000, seed: 1, max_prefill_tokens: 512, max_decode_tokens: 128}"
    text = SMALL.read_text().replace(synth, "    trace: no/such/dir")
    with pytest.raises(InputError, match=r"workloads\[0\].trace.*no such trace"):
        load_spec(_write(tmp_path, text))


# ---------------------------------------------------------------------------- hashes
def test_point_hash_tracks_what_the_result_depends_on(small):
    pts = expand_points(small)
    fp = workload_fingerprint(small, small.workloads[0])
    hashes = [point_hash(small, p, fp) for p in pts]
    assert len(set(hashes)) == len(pts)
    assert hashes == [point_hash(small, p, fp) for p in pts]  # stable
    longer = replace(small, simulate={**small.simulate, "duration": 1.0})
    assert not set(hashes) & {point_hash(longer, p, fp) for p in pts}
    # the objective only changes the recommendation, not any row; the index is not part of a point
    assert hashes == [point_hash(replace(small, objective={"tpot_p99_ms": 1.0}), p, fp) for p in pts]
    assert point_hash(small, replace(pts[3], index=99), fp) == hashes[3]


def test_optimize_key_is_shared_across_rebalancing_and_kv(small):
    pts = expand_points(small)
    fp = "w"
    eplb8, linear8, online8 = pts[2], pts[3], pts[4]
    assert optimize_key(small, eplb8, fp) == optimize_key(small, online8, fp)
    assert optimize_key(small, eplb8, fp) == optimize_key(small, replace(eplb8, kv_dtype="bf16", tp=2), fp)
    assert optimize_key(small, eplb8, fp) != optimize_key(small, linear8, fp)
    assert optimize_key(small, eplb8, fp) != optimize_key(small, eplb8, "other workload")
    assert optimize_key(small, eplb8, fp) != optimize_key(small, replace(eplb8, engine="sglang"), fp)


# ---------------------------------------------------------------------------- plan verdicts
def test_plan_point_statuses(small):
    pts = expand_points(small)
    fields, lay = plan_point(small, pts[0])
    assert fields["status"] == "infeasible" and "12 required" in fields["reason"]
    assert fields["plan_concurrency"] < 12 and lay.tp == 1
    fields, lay = plan_point(small, pts[5])
    assert fields["status"] == "invalid" and lay is None
    assert "--tp 3 does not divide 8 GPUs" in fields["reason"]
    fields, lay = plan_point(small, pts[6])
    assert fields["status"] == "unsupported" and "EP4 x MoE-TP2" in fields["reason"]
    fields, lay = plan_point(small, pts[2])
    assert "status" not in fields and (lay.tp, lay.dp, lay.ep) == (1, 8, 8)
    assert fields["plan_concurrency"] >= 12 and fields["free_gb_per_gpu"] > 0


# ---------------------------------------------------------------------------- frontier
def test_pareto_mask_hand_example():
    # (GPUs, output tok/s, p99 TPOT): C and E are dominated by B, D by A; F equals A (neither dominates)
    gpus = np.array([16, 32, 32, 16, 64, 16])
    thr = np.array([100.0, 150.0, 120.0, 90.0, 150.0, 100.0])
    tpot = np.array([0.05, 0.04, 0.05, 0.06, 0.04, 0.05])
    assert pareto_mask(gpus, thr, tpot).tolist() == [True, True, False, False, False, True]
    assert pareto_mask(np.zeros(0), np.zeros(0), np.zeros(0)).shape == (0,)


def test_recommend_max_throughput_per_gpu_under_limits():
    rows = [{"index": 0, "gpus": 16, "output_tok_s": 100.0, "output_tok_s_per_gpu": 6.25, "tpot_p99_s": 0.05,
             "ttft_p99_s": 0.5},
            {"index": 1, "gpus": 32, "output_tok_s": 150.0, "output_tok_s_per_gpu": 4.6875,
             "tpot_p99_s": 0.04,
             "ttft_p99_s": 0.4},
            {"index": 5, "gpus": 16, "output_tok_s": 100.0, "output_tok_s_per_gpu": 6.25, "tpot_p99_s": 0.05,
             "ttft_p99_s": 0.5}]
    best, _ = recommend(rows, {})
    assert best["index"] == 0  # tie with #5 broken by the index
    best, why = recommend(rows, {"tpot_p99_ms": 45})
    assert best["index"] == 1 and "tpot_p99_ms 45" in why
    best, why = recommend(rows, {"tpot_p99_ms": 10})
    assert best is None and "TPOT" in why
    # an online point that rebalanced fewer than 5 times is never recommended, however fast
    fast = {"index": 7, "gpus": 16, "output_tok_s": 300.0, "output_tok_s_per_gpu": 18.75, "tpot_p99_s": 0.03,
            "ttft_p99_s": 0.3, "rebalance": "every=100,window=100", "rebalances": 2}
    best, why = recommend([*rows, fast], {})
    assert best["index"] == 0 and "fewer than 5 rebalances" in why
    best, _ = recommend([*rows, {**fast, "rebalances": 5}], {})
    assert best["index"] == 7


# ---------------------------------------------------------------------------- store
def test_store_keeps_final_rows_and_retries_errors(tmp_path):
    store = ResultStore(tmp_path)
    store.write_row(make_row(index=0, point_hash="a", status="ok", stage="done", output_tok_s=1.0))
    store.write_row(make_row(index=1, point_hash="b", status="error", stage="simulate", reason="boom"))
    store.write_row(make_row(index=2, point_hash="c", status="infeasible", stage="plan", reason="too big"))
    assert set(store.finished()) == {"a", "c"}
    table = store.write_table(["c", "a"], {"c": 0, "a": 1})
    assert table["point_hash"].to_list() == ["c", "a"] and table["index"].to_list() == [0, 1]
    assert pl.read_parquet(tmp_path / "sweep.parquet").equals(table)
    with pytest.raises(KeyError):
        make_row(status="ok", not_a_column=1)


# ---------------------------------------------------------------------------- end to end
def test_local_sweep_reports_every_point(local_run):
    t = local_run.table
    assert t["index"].to_list() == list(range(7))
    assert t["status"].to_list() == ["infeasible", "infeasible", "ok", "ok", "ok", "invalid", "unsupported"]
    ok = t.filter(pl.col("status") == "ok")
    assert (ok["output_tok_s"] > 0).all() and (ok["tpot_p99_s"] > 0).all()
    assert (ok["requests_finished"] > 0).all()
    assert np.allclose(ok["output_tok_s_per_gpu"].to_numpy(), ok["output_tok_s"].to_numpy() / 8)
    assert ((ok["held_out_balancedness"] > 0) & (ok["held_out_balancedness"] <= 1)).all()
    # one optimize per distinct (topology, policy, workload): eplb static and eplb online share a placement
    assert local_run.num_optimized == 2
    eplb = ok.filter(pl.col("policy") == "eplb")
    assert eplb["placement_fingerprint"].n_unique() == 1 and eplb["optimize_key"].n_unique() == 1
    online = ok.filter(pl.col("rebalance") != "static")
    assert online["rebalances"].to_list()[0] >= 1
    assert (t.filter(pl.col("status") != "ok")["reason"].str.len_chars() > 0).all()


def test_frontier_json_and_recommended_launch(local_run):
    rep = json.loads(local_run.frontier_path.read_text())
    assert rep["format"] == "moeplace.frontier/1"  # foundation.formats: the tag leads the document
    scores = sorted((local_run.frontier_path.parent / "cache" / "placements").glob("*.scores.json"))
    assert scores and all(json.loads(f.read_text())["format"] == "moeplace.sweep-scores/1" for f in scores)
    w = rep["workloads"]["chat"]
    assert len(w["points"]) == 3
    front = w["frontier"]
    assert front and all(r["on_frontier"] for r in front)
    g = np.array([r["gpus"] for r in w["points"]])
    thr = np.array([r["output_tok_s"] for r in w["points"]])
    tp = np.array([r["tpot_p99_s"] for r in w["points"]])
    assert [r["on_frontier"] for r in w["points"]] == pareto_mask(g, thr, tp).tolist()
    best = w["recommended"]
    assert best["index"] in [r["index"] for r in front]
    eligible = [r for r in front if r["rebalance"] == "static" or r["rebalances"] >= 5]
    assert best["output_tok_s_per_gpu"] == max(r["output_tok_s_per_gpu"] for r in eligible)
    launch = rep["recommended_launch"]["chat"]
    assert Path(launch["engine_file"]).exists() and Path(launch["placement"]).exists()
    assert "--data-parallel-size 8" in launch["command"]
    assert Path(launch["launch_script"]).read_text() == launch["command"]
    # the same printer as `place export --flags`: only options the newest checked vLLM release accepts
    from moeplace.placement.export.engines import check_args, command_argv

    (argv,) = command_argv(launch["command"])
    if argv[0].startswith("MOEPLACE_PLACEMENT="):  # a replica-free placement: loaded through the vLLM plugin
        assert argv.pop(0) == f"MOEPLACE_PLACEMENT={Path(launch['placement']).resolve()}" and launch["applies_placement"]
        if argv[0].startswith("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY="):  # several DP ranks: Ray's actors get it too
            assert argv.pop(0) == "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=MOEPLACE_PLACEMENT"
    assert argv[:2] == ["vllm", "serve"] and check_args("vllm", "0.34.0", argv) == []
    assert "--enable-expert-parallel" in argv
    assert rep["fidelity"]["cases"] > 0 and rep["fidelity"]["note"].startswith("absolute figures")
    # every simulated point: its throughput and TPOT as the shipped ensemble's median with its 80 % interval
    for r in w["points"]:
        for key in ("output_tok_s", "tpot_p99_s"):
            lo, hi = r[f"{key}_range"]
            assert (lo, hi) == (r[f"{key}_lo"], r[f"{key}_hi"]) and lo < hi
        assert r["ensemble_near"] >= 0


def test_ray_sweep_matches_local(small, local_run, tmp_path):
    pytest.importorskip("ray")
    _seed_workloads(local_run, tmp_path)
    res = run_sweep(small, tmp_path, backend="ray", workers=2)
    assert res.backend == "ray" and res.num_optimized == 2
    assert comparable(res.table).equals(comparable(local_run.table))
    import ray
    assert not ray.is_initialized()  # the instance it started is shut down


def test_interrupted_sweep_resumes_without_redoing_points(small, local_run, tmp_path, capsys):
    _seed_workloads(local_run, tmp_path)
    seen = []

    def interrupt_after_first_simulation(row):
        seen.append(row)
        if row["status"] == "ok":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(small, tmp_path, backend="local", workers=2, on_row=interrupt_after_first_simulation)
    store = ResultStore(tmp_path)
    done = store.finished()
    assert len(done) == len(seen) == 5  # 4 plan verdicts + the first simulated point
    parts = {h: (tmp_path / "points" / f"{h}.parquet").stat().st_mtime_ns for h in done}
    assert not (tmp_path / "sweep.parquet").exists()

    rows = []
    res = run_sweep(small, tmp_path, backend="local", workers=2, on_row=rows.append)
    assert res.num_resumed == 5 and res.num_run == 2 and len(rows) == 2
    assert not {r["point_hash"] for r in rows} & set(done)
    assert {h: (tmp_path / "points" / f"{h}.parquet").stat().st_mtime_ns for h in done} == parts
    assert comparable(res.table).equals(comparable(local_run.table))
    # the placements finished before the interruption are reused, none is optimized twice
    assert res.num_optimized + res.num_placements_reused == len({r["optimize_key"] for r in rows})
    # a third run (through the CLI) finds everything done: no work, the same table, the frontier printed
    assert main(["sweep", str(SMALL), "--local", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "0 point(s) run, 7 resumed, 0 optimize task(s)" in out and "recommended: #" in out
    assert "absolute figures are model estimates" in out  # its tok/s and TPOT are the simulator's
    assert comparable(pl.read_parquet(tmp_path / "sweep.parquet")).equals(comparable(local_run.table))


@pytest.mark.slow
def test_example_k3_sweep_same_table_locally_and_on_ray(tmp_path):
    """The acceptance run: the 20-point K3 example on a process pool and on a local Ray instance."""
    pytest.importorskip("ray")
    spec = load_spec(EXAMPLE)
    local = run_sweep(spec, tmp_path / "local", backend="local", workers=2)
    on_ray = run_sweep(spec, tmp_path / "ray", backend="ray", workers=2)
    assert local.table.height == 20 and local.num_optimized == 8
    counts = dict(local.table.group_by("status").len().iter_rows())
    assert counts == {"ok": 15, "infeasible": 4, "unsupported": 1}
    assert comparable(local.table).equals(comparable(on_ray.table))
    assert local.report["workloads"]["chat"]["recommended"] is not None


def test_engine_deployment_shapes_reach_the_simulator_and_bad_values_name_the_field(tmp_path):
    from moeplace.cli.sweep.run import sim_config
    from moeplace.cli.sweep.spec import expand_points, load_spec

    def spec_with(engine: str):
        p = tmp_path / "s.yaml"
        p.write_text("name: t\nmodel: qwen3-30b-a3b\nworkloads:\n  - {name: w, synth: {num_tokens: 2000}}\n"
                     "axes: {gpus: [8]}\n" + engine)
        return load_spec(p)

    spec = spec_with("engine: {mtp_draft: 1, mtp_acceptance: 0.8, prefix_hit: 0.5, dp_balance: tokens}\n")
    e = sim_config(spec, expand_points(spec)[0], 1).engine
    assert (e.mtp_draft, e.mtp_acceptance, e.prefix_hit, e.dp_balance) == (1, 0.8, 0.5, "tokens")
    with pytest.raises(InputError, match="engine.prefix_hit"):
        spec_with("engine: {prefix_hit: 1.5}\n")
    with pytest.raises(InputError, match="engine.deepep_mode"):
        spec_with("engine: {deepep_mode: fast}\n")


@pytest.mark.parametrize("section,needle", [
    ("engine: {max_seqs: lots}\n", "field 'engine.max_seqs': expected a whole number, got 'lots'"),
    ("engine: {max_seq: 8}\n", "field 'engine.max_seq': unknown key; did you mean 'max_seqs'?"),
    ("engine: {chunked_prefill: 1}\n", "field 'engine.chunked_prefill': expected true or false, got 1"),
    ("engine: {admission: always}\n", "field 'engine.admission': expected one of on_demand, reserve"),
    ("simulate: {duraton: 2}\n", "field 'simulate.duraton': unknown key; did you mean 'duration'?"),
    ("simulate: {mode: stats}\n", "field 'simulate.mode': expected one of replay, stat, got 'stats'; did you mean 'stat'?"),
    ("simulate: {max_trace_tokens: 0}\n", "field 'simulate.max_trace_tokens': must be >= 1, got 0"),
    ("simulate: {max_trace_tokens: null}\n", "field 'simulate.max_trace_tokens': expected a whole number"),
])
def test_simulation_sections_are_checked_against_sim_settings(tmp_path, section, needle):
    """The engine and simulate sections are SimSettings fields (cli.sim_settings): an unknown key names the
    nearest, a wrong type or value names the key, before any work."""
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nmodel: qwen3-30b-a3b\nworkloads:\n  - {name: w, synth: {num_tokens: 2000}}\n"
                 "axes: {gpus: [8]}\n" + section)
    with pytest.raises(InputError) as info:
        load_spec(p)
    assert str(info.value).startswith(f"{p}: ") and needle in str(info.value)


def test_workload_settings_are_sim_settings_and_new_engine_keys_reach_the_simulator(tmp_path):
    from moeplace.cli.sim_settings import SimSettings
    from moeplace.cli.sweep.run import sim_config
    from moeplace.cli.sweep.spec import ENGINE_FIELDS, WORKLOAD_FIELDS
    from moeplace.foundation.settings import field_types

    assert set(ENGINE_FIELDS) | set(WORKLOAD_FIELDS) <= set(field_types(SimSettings))
    base = ("name: t\nmodel: qwen3-30b-a3b\nworkloads:\n  - {name: w, synth: {num_tokens: 2000}, %s}\n"
            "axes: {gpus: [8], engine: trtllm}\n")
    p = tmp_path / "s.yaml"
    p.write_text(base % "rate: 2" + "engine: {admission: reserve, kernel_build: fused}\n")
    spec = load_spec(p)
    cfg = sim_config(spec, expand_points(spec)[0], 1)
    assert (cfg.engine.admission, cfg.engine.kernel_build, cfg.engine.replica_rule) == ("reserve", "fused", "trtllm")
    assert (cfg.workload.arrival, cfg.workload.rate) == ("poisson", 2.0)
    assert cfg.engine.prefill_batches == "mixed"  # TensorRT-LLM's in-flight batching
    p.write_text((base % "rate: 2").replace("engine: trtllm", "engine: sglang"))
    spec = load_spec(p)
    assert sim_config(spec, expand_points(spec)[0], 1).engine.prefill_batches == "separate"  # SGLang's default
    p.write_text((base % "rate: 2").replace("engine: trtllm", "engine: sglang") + "engine: {prefill_batches: mixed}\n")
    spec = load_spec(p)
    assert sim_config(spec, expand_points(spec)[0], 1).engine.prefill_batches == "mixed"  # --enable-mixed-chunk
    p.write_text(base % "concurrency: 0")
    with pytest.raises(InputError, match=r"field 'workloads\[0\].concurrency': must be >= 1, got 0"):
        load_spec(p)
    p.write_text(base % "arrival: poison, rate: 2")
    with pytest.raises(InputError, match=r"field 'workloads\[0\].arrival': expected one of closed, poisson"):
        load_spec(p)
