"""Disaggregated pools: one deployment description (--pools) read by plan, optimize --phase, simulate and
export; the decode steps and the decode figure; the moeplace-decode policy; the KV hand-off."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from simkit import mini_model, random_placement, write_trace

from moeplace.cli.main import main
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.deployment import parse_pools
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.planner import pool_layout
from moeplace.placement.decode import PhaseTokens, decode_steps, score_decode
from moeplace.placement.export.engines import check_args
from moeplace.placement.policies import PlacementProblem, get_policy, policy_names
from moeplace.placement.policies.decode import _max_gpu_cost, decode_weights
from moeplace.placement.record import Placement
from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
from moeplace.sim.runner import RunInputs, pool_setups, prepare_run, simulate
from moeplace.traces.format import TraceWriter
from moeplace.traces.phases import phase_knowledge

K3_GB300 = ["prefill:gpus=8,tp=8,ep=8", "decode:gpus=16,dp=16,ep=16,batch=64"]
K3_H200 = ["prefill:gpus=16,tp=8,dp=2,ep=16", "decode:gpus=32,tp=8,dp=4,ep=32,batch=16"]


# ---------------------------------------------------------------------------- the description
def test_pool_words_and_yaml_are_one_description(tmp_path):
    words = parse_pools(K3_GB300)
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump({"gpu": "gb300-nvl72", "pools": {"decode": {"gpus": 16, "dp": 16, "ep": 16, "batch": 64},
                                                                 "prefill": {"gpus": 8, "tp": 8, "ep": 8}}}))
    from_file = parse_pools([str(f)])
    assert from_file.pools == words.pools and from_file.gpu == "gb300-nvl72" and words.gpu is None
    assert [p.role for p in from_file.pools] == ["prefill", "decode"]  # prefill first whatever the order given
    assert from_file.num_gpus == 24


@pytest.mark.parametrize("words, message", [
    (["prefill:gpus=8,tp=8,ep=8", "decode:gpus=16,dpp=16"], "did you mean 'dp'"),
    (["prefill:gpus=8,tp=4,dp=4"], "tp 4 x dp 4 = 16"),
    (["prefill:gpus=8", "prefill:gpus=8"], "one prefill and one decode pool"),
    (["prefill:gpus=8", "decode:gpus=x"], "expected a whole number"),
    (["prefill:gpus=8", "decode:tp=2"], "'gpus' is required"),
    (["prefil:gpus=8", "decode:gpus=8"], "pool 'prefil' unknown"),
    (["prefill:gpus=8", "decode:gpus=16,ep=3"], "ep 3 must divide"),
])
def test_bad_pool_words_name_the_key(words, message):
    with pytest.raises(InputError, match=message):
        parse_pools(words)


# ---------------------------------------------------------------------------- place plan
def test_plan_k3_gb300_pools_and_the_change_that_makes_decode_fit(capsys):
    argv = ["plan", "--pools", *K3_GB300, "--gpu", "gb300-nvl72", "--context", "32k", "--kv-dtype", "fp8"]
    assert main([*argv, "--json"]) == 3  # 64 x 16 sequences of 32k do not fit the DEP16 decode pool
    doc = json.loads(capsys.readouterr().out)
    pre, dec = doc["pools"]["prefill"], doc["pools"]["decode"]
    assert pre["fits"] and not dec["fits"]
    assert pre["layout"]["tp"] == 8 and pre["layout"]["ep"] == 8 and dec["layout"]["dp"] == 16
    assert dec["config"]["min_concurrency"] == 64 * 16 and pre["config"]["min_concurrency"] == 1
    # both pools hold the experts of their EP size: 896/8 vs 896/16 per GPU
    experts = {r: next(x["bytes"] for x in doc["pools"][r]["per_gpu"]["lines"] if x["name"] == "routed experts")
               for r in ("prefill", "decode")}
    assert experts["prefill"] == pytest.approx(2 * experts["decode"])
    first = dec["changes"][0].split()[0]
    assert first.startswith("decode:") and ",batch=" in first
    # the change it names makes the deployment fit, as it says
    assert main(["plan", "--pools", K3_GB300[0], first, "--gpu", "gb300-nvl72", "--context", "32k",
                 "--kv-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "pools side by side" in out and out.count("fits") >= 2


def test_plan_h200_variant_fits_and_tep8_on_h200_gets_a_pool_word(capsys):
    assert main(["plan", "--pools", *K3_H200, "--gpu", "h200", "--context", "32k", "--kv-dtype", "fp8"]) == 0
    capsys.readouterr()
    assert main(["plan", "--pools", "prefill:gpus=8,tp=8,ep=8", K3_H200[1], "--gpu", "h200", "--context", "32k",
                 "--kv-dtype", "fp8"]) == 3
    out = capsys.readouterr().out
    assert "prefill: the model's weights (1.56 TB) exceed the memory of 8 x 150 GB" in out
    assert "prefill: smallest change: prefill:gpus=16" in out


def test_plan_refuses_pool_flags_next_to_pools(capsys):
    assert main(["plan", "--pools", *K3_GB300, "--tp", "8"]) == 2
    assert "--tp goes in the pool words" in capsys.readouterr().err


# ---------------------------------------------------------------------------- decode steps, by hand
def _tokens(model, lengths, experts=None):
    """Requests of the given decode lengths, tokens interleaved in file order (as engines log them)."""
    rid, pos = [], []
    for r, n in enumerate(lengths):
        rid += [r] * n
        pos += list(range(10, 10 + n))
    order = np.lexsort((np.array(rid), np.array(pos)))  # by position, then request: interleaved
    rid, pos = np.array(rid)[order], np.array(pos)[order]
    T = len(rid)
    ids = (np.zeros((T, model.num_moe_layers, model.top_k), np.uint16) if experts is None
           else np.asarray(experts, np.uint16)[order])
    return PhaseTokens(ids, rid.astype(np.int64), pos.astype(np.int64), np.arange(T) * 2, model, "t", "decode", 2 * T)


def test_decode_steps_batch_like_the_engine(tiny):
    pt = _tokens(tiny, [3, 1, 2, 4, 2])
    s = decode_steps(pt, dp=2, batch=1)
    # slot 0: request 0 (steps 0-2), then request 3 (3-6); slot 1: 1 (0), 2 (1-2), 4 (3-4); step 5 is short
    assert s.num_steps == 5 and s.tokens_per_step == 2
    got = {(int(st), int(pt.request_ids[r]), int(pt.positions[r]), int(rk), int(p))
           for r, st, rk, p in zip(s.rows, s.step, s.rank, s.pos)}
    want = {(0, 0, 10, 0, 0), (1, 0, 11, 0, 0), (2, 0, 12, 0, 0), (3, 3, 10, 0, 0), (4, 3, 11, 0, 0),
            (0, 1, 10, 1, 0), (1, 2, 10, 1, 0), (2, 2, 11, 1, 0), (3, 4, 10, 1, 0), (4, 4, 11, 1, 0)}
    assert got == want
    # two sequences per rank: positions 0 and 1 of each rank's batch, ranks alternate over slots
    s2 = decode_steps(_tokens(tiny, [2] * 8), dp=2, batch=2)
    assert s2.num_steps == 4 and s2.tokens_per_step == 4
    for st in range(4):
        on = s2.step == st
        for rk in (0, 1):
            assert sorted(s2.pos[on & (s2.rank == rk)].tolist()) == [0, 1]


def test_score_decode_counts_slots_read_by_hand(tiny):
    # 2 GPUs, experts {0, 1} on GPU 0 and {2, 3} on GPU 1; top-2 tokens, one sequence per DP rank
    pl = Placement.from_phy2log(np.array([[0, 1, 2, 3]]), tiny, 2, 2, {"policy": "t"})
    experts = [[[0, 1]], [[0, 2]], [[0, 1]], [[1, 3]]]  # request 0: (0,1) then (0,1); request 1: (0,2) then (1,3)
    pt = _tokens(tiny, [2, 2], experts=np.array(experts)[[0, 2, 1, 3]])
    s = decode_steps(pt, dp=2, batch=1)
    f = score_decode(pl, pt, s, "vllm")
    # step 0: tokens (0,1) and (0,2): GPU 0 reads 0,1 (2), GPU 1 reads 2 (1); step 1: (0,1) and (1,3): 2 and 1
    assert s.num_steps == 2
    assert f.active_max == 2 and f.active_mean == 1.5 and f.active_ratio == pytest.approx(2 / 1.5)
    assert f.experts_per_step == 3
    # tokens: step 0: GPU 0 gets 3 selections, GPU 1 gets 1 -> max/mean 1.5; step 1: 3 and 1 again
    assert f.token_ratio == pytest.approx(1.5)


# ---------------------------------------------------------------------------- the decode policy
def test_decode_policy_is_listed_for_decode_only():
    assert "moeplace-decode" not in policy_names() and "moeplace-decode" in policy_names("decode")
    assert "moeplace-decode" not in policy_names("prefill")


@pytest.mark.parametrize("step_tokens", [4, 64, 4096])
def test_decode_policy_minimises_its_objective(step_tokens):
    model = mini_model(num_experts=32, top_k=4)
    rng = np.random.default_rng(1)
    loads = (rng.pareto(1.0, (1, model.num_moe_layers, 32)) * 50 + 1).round()
    cl = make_cluster(4, "h200")
    prob = lambda **kw: PlacementProblem(loads=loads, model=model, cluster=cl, num_redundant=4, **kw)
    dec = get_policy("moeplace-decode")(prob(options={"decode_step_tokens": step_tokens}))
    read_s, token_s = decode_weights(model, cl)
    for li in range(model.num_moe_layers):
        p = loads[0, li] / (loads[0, li].sum() / model.top_k)
        mine = _max_gpu_cost(dec.phy2log[li], p, step_tokens, token_s / read_s, 4)
        for other in ("eplb", "linear", "round_robin"):
            pl = get_policy(other)(prob())
            assert mine <= _max_gpu_cost(pl.phy2log[li], p, step_tokens, token_s / read_s, 4) + 1e-9, (other, li)
    assert (dec.logcnt >= 1).all() and not dec.duplicate_on_gpu().any()
    with pytest.raises(InputError, match="decode pool's batch"):
        get_policy("moeplace-decode")(prob())


# ---------------------------------------------------------------------------- optimize --phase
@pytest.fixture(scope="module")
def mini_trace(tmp_path_factory):
    model = mini_model(num_experts=16, top_k=4)
    return model, write_trace(tmp_path_factory.mktemp("tr") / "t", model, num_requests=48, prompt=8, output=24,
                              skew=1.0)


def test_optimize_phase_decode_scores_every_policy(mini_trace, tmp_path, capsys):
    model, trace = mini_trace
    out = tmp_path / "dec.json"
    assert main(["optimize", trace, "--phase", "decode", "--gpus", "4", "--redundant", "0", "--batch", "2",
                 "--no-shift", "--window-tokens", "64", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    dec = doc["decode"]
    assert set(dec["rows"]) == {"moeplace-decode", "eplb", "linear", "round_robin", "moeplace"}
    assert dec["pool"] == {"dp": 4, "batch": 2, "attention_tp": 1} and dec["tokens_per_step"] == 8
    for row in dec["rows"].values():
        assert row["active_mean"] <= row["active_max"] <= 4  # 4 slots per GPU
        assert row["active_slots_per_step"] <= 16
    assert doc["written"]["policy"] == "moeplace-decode"
    on = json.loads(out.read_text())["provenance"]["planned_on"]
    assert on["phase"] == "decode"
    # the first held-out token, in the trace's own order, is a decode token
    first = on["held_out_from_token"]
    df = pl.read_parquet(Path(trace) / "*.parquet")
    L = model.num_moe_layers
    assert df["phase"][first * L] == 1 and (df["phase"][: first * L] == 0).sum() > 0


def test_optimize_phase_prefill_plans_on_prompt_tokens_only(mini_trace, capsys):
    _, trace = mini_trace
    assert main(["optimize", trace, "--phase", "prefill", "--gpus", "4", "--redundant", "0", "--no-shift",
                 "--window-tokens", "64", "--no-out", "--policy", "eplb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["phase"] == "prefill" and "decode" not in doc and doc["tokens"] == 48 * 8


def test_phase_refused_when_the_source_cannot_tell(tmp_path, capsys):
    model = mini_model(num_experts=16, top_k=4)
    path = tmp_path / "imp"
    with TraceWriter(path, model, {"kind": "imported", "format": "vllm-jsonl", "phases_known": False,
                                   "phase": "unknown in the log; all rows marked prefill (0)"}) as w:
        n = 4 * model.num_moe_layers
        w.write(request_id=np.zeros(n, np.int64), position=np.repeat(np.arange(4), model.num_moe_layers),
                phase=np.zeros(n, np.uint8), step=np.repeat(np.arange(4), model.num_moe_layers),
                layer=np.tile(np.array(model.moe_layers), 4), expert_ids=np.tile(np.arange(4, dtype=np.uint16), (n, 1)))
    assert main(["optimize", str(path), "--phase", "decode", "--gpus", "4", "--no-out"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "cannot tell prompt tokens from generated ones" in err and "unknown in the log" in err


def test_phase_knowledge_of_sources():
    assert phase_knowledge({"kind": "synthetic"})[0] and phase_knowledge({"kind": "captured"})[0]
    assert not phase_knowledge({"kind": "imported", "format": "trtllm-stats", "phases_known": False})[0]
    assert not phase_knowledge({"kind": "imported", "format": "old"})[0]  # an older import that did not say
    assert phase_knowledge({"kind": "imported", "phases_known": True, "phase": "forward mode"}) == (True, "forward mode")


# ---------------------------------------------------------------------------- simulate --pools
def test_simulate_pools_runs_each_pool_as_deployed(mini_trace, capsys):
    model, trace = mini_trace
    words = ["prefill:gpus=2,tp=2,ep=2", "decode:gpus=4,dp=4,ep=4,batch=8"]
    argv = ["simulate", trace, "--pools", *words, "--placement", "linear", "--placement",
            "prefill=eplb,decode=moeplace-decode", "--isl", "64", "--osl", "16", "--concurrency", "8",
            "--duration", "4", "--route-all", "--no-progress", "--gpus-per-node", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # each pool's cluster as it ran: --gpus-per-node 2 splits the decode pool's 4 GPUs into 2 nodes
    assert "prefill pool 1x2 h200" in out and "decode pool 2x2 h200" in out
    for row in ("prefill pool: prefill tok/s", "TTFT p50", "TPOT p50",
                "decode pool: decode tok/s per GPU", "KV hand-off p50", "output tok/s per GPU"):
        assert row in out, row
    assert "eplb|moeplace-decode" in out and "(6 GPUs in all)" in out
    # the hand-off bytes: every handed-off request moved its prompt's KV + state as the decode pool holds it
    dep = parse_pools(words)
    cfg = SimConfig(duration=4, engine=EngineConfig(disaggregated=True), workload=WorkloadConfig(
        concurrency=8, lengths=LengthMix(components=((64, 1.0),), sigma=0.0, output_mean=16, output_sigma=0.0)))
    prep = prepare_run(RunInputs(trace=trace, placements=("linear",), route_all=True, pools=dep),
                       make_cluster(4))
    res = simulate(prep.trace, prep.placements, make_cluster(4), cfg, deployment=dep,
                   pool_placements=prep.pool_placements)[0]
    s = res.summary
    assert s["num_gpus"] == 6 and s["output_tok_s_per_gpu"] == pytest.approx(s["output_tok_s"] / 6)
    moved = res.requests.filter(res.requests["kv_transfer_s"].is_not_null())
    assert moved.height > 0
    dec = pool_setups(prep.trace, dep, prep.pool_placements[0], cfg, "h200")[1]
    per_req = dec.pools.kv_tokens(64) * dec.pools.kv_bytes_per_token + dec.pools.state_bytes_per_seq
    assert s["kv_transfer_bytes"] == pytest.approx(moved.height * per_req * pool_layout(model, dep.decode).tp)
    assert s["pool_figures"]["prefill"]["attention_tp"] == 2 and s["pool_figures"]["decode"]["dp"] == 4
    assert s["prefill_pool_tok_s"] > 0 and s["decode_pool_tok_s_per_gpu"] > 0
    # busy share: each pool's iterations ending in the steady window, counted only from the window's start
    # (an iteration that straddles the warm-up's end used to count whole, and the share went over 100 %)
    warm, window = res.summary["warmup_s"], 4 - res.summary["warmup_s"]
    for pool in ("prefill", "decode"):
        it = res.timeseries.filter(pl.col("pool") == pool)
        start, end = it["time"].to_numpy(), (it["time"] + it["duration"]).to_numpy()
        keep = (end >= warm) & (end <= 4)
        busy = float(np.sum(end[keep] - np.maximum(start[keep], warm))) / window
        assert s[f"{pool}_pool_busy"] == pytest.approx(busy) and 0 < s[f"{pool}_pool_busy"] <= 1


def test_simulate_pools_refuses_the_flags_the_pools_set(mini_trace, capsys):
    _, trace = mini_trace
    assert main(["simulate", trace, "--pools", "prefill:gpus=2", "decode:gpus=4", "--placement", "linear",
                 "--attention-tp", "2"]) == 2
    assert "--attention-tp does not go with --pools" in capsys.readouterr().err


# ---------------------------------------------------------------------------- export --pools
@pytest.fixture(scope="module")
def k3_pool_files(tmp_path_factory, k3):
    d = tmp_path_factory.mktemp("k3pools")
    random_placement(k3, 8, 0, gpus_per_node=8).save(d / "pre.json")
    random_placement(k3, 16, 0, gpus_per_node=16, seed=1).save(d / "dec.json")
    return d


@pytest.mark.parametrize("fmt", ["vllm-expert-map", "sglang"])
def test_export_pools_prints_one_checked_command_per_pool(k3_pool_files, fmt, capsys):
    d = k3_pool_files
    assert main(["export", f"prefill={d / 'pre.json'},decode={d / 'dec.json'}", "--pools", *K3_GB300,
                 "--gpu", "gb300-nvl72", "--format", fmt, "--out", str(d / f"{fmt}.json"), "--flags", "--force",
                 "--model-path", "prefill=/ckpt/pre,decode=/ckpt/dec", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {Path(p).name for p in doc["wrote"]} == {f"{fmt}.prefill.json", f"{fmt}.decode.json"}
    for role, pool in doc["pools"].items():
        launch = pool["launch"]
        argv = launch["argv"]
        assert not check_args(launch["engine"], launch["engine_version"], argv)  # the recorded parser
        assert f"/ckpt/{role[:3]}" in " ".join(argv)
        if fmt == "sglang":
            assert argv[argv.index("--disaggregation-mode") + 1] == role
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "nixl"
            dp = 1 if role == "prefill" else 16
            assert argv[argv.index("--max-running-requests") + 1] == str((256 if role == "prefill" else 64) * dp)
        else:
            cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            assert "--enable-expert-parallel" in argv
            assert argv[argv.index("--tensor-parallel-size") + 1] == ("8" if role == "prefill" else "1")
            assert launch["env"]["MOEPLACE_PLACEMENT"].endswith("pre.json" if role == "prefill" else "dec.json")


def test_export_pools_launch_files_start_both_pools(k3_pool_files, capsys):
    d = k3_pool_files
    base = ["export", f"prefill={d / 'pre.json'},decode={d / 'dec.json'}", "--pools", *K3_GB300, "--gpu",
            "gb300-nvl72", "--format", "sglang", "--flags", "--force"]
    assert main([*base, "--out", str(d / "s.json"), "--target", "slurm"]) == 0
    text = (d / "s.sbatch").read_text()
    assert "#SBATCH hetjob" in text and "srun --het-group=0" in text and "srun --het-group=1" in text
    assert subprocess.run(["bash", "-n", str(d / "s.sbatch")], check=False).returncode == 0
    assert main([*base, "--out", str(d / "k.json"), "--target", "k8s"]) == 0
    objs = list(yaml.safe_load_all((d / "k.lws.yaml").read_text()))
    lws = [o["metadata"]["name"] for o in objs if o["kind"] == "LeaderWorkerSet"]
    assert lws == ["moeplace-kimi-k3-sglang-prefill", "moeplace-kimi-k3-sglang-decode"]
    assert main([*base, "--out", str(d / "h.json"), "--target", "shell"]) == 0
    r = subprocess.run(["bash", str(d / "h.launch.sh")], capture_output=True, text=True, check=False,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "set POOL to prefill or decode" in r.stderr
    capsys.readouterr()


def test_export_pools_refuses_a_placement_of_another_size(k3_pool_files, capsys):
    d = k3_pool_files
    assert main(["export", str(d / "dec.json"), "--pools", *K3_GB300, "--gpu", "gb300-nvl72", "--format", "sglang",
                 "--out", str(d / "x.json"), "--flags"]) == 2
    assert "the prefill pool has 8" in capsys.readouterr().err
    assert not (d / "x.prefill.json").exists() and not (d / "x.decode.json").exists()


# ---------------------------------------------------------------------------- dashboard
def test_dashboard_shows_the_two_pools_side_by_side(mini_trace, tmp_path, capsys):
    from streamlit.testing.v1 import AppTest  # the dashboard extra; imported where this test needs it

    _, trace = mini_trace
    run = tmp_path / "run"
    run.mkdir()
    assert main(["simulate", trace, "--pools", "prefill:gpus=2,tp=2,ep=2", "decode:gpus=4,dp=4,ep=4,batch=8",
                 "--placement", "linear", "--isl", "64", "--osl", "16", "--concurrency", "8", "--duration", "4",
                 "--route-all", "--no-progress", "--out", str(run / "sim")]) == 0
    capsys.readouterr()
    summary = json.loads((run / "sim" / "summary.json").read_text())["summaries"][0]
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "moeplace" / "dashboard" / "app.py"),
                           default_timeout=120)
    at.session_state["run_dir"] = str(run)
    at.run()
    at.switch_page("views/simulate.py").run()
    assert not at.exception and not at.error
    assert any(h.value == "Pools side by side" for h in at.subheader)
    pools = at.dataframe[1].value
    assert list(pools.columns) == ["figure", "prefill", "decode"]
    row = lambda name: pools[pools["figure"] == name].iloc[0]
    assert row("GPUs")["prefill"] == "2" and row("GPUs")["decode"] == "4"
    assert row("attention TP x DP")["prefill"] == "TP2 x DP1" and row("attention TP x DP")["decode"] == "TP1 x DP4"
    # the run's TPOT (the decode pool's, priced like every figure), not a second, unpriced copy
    assert row("TPOT p50 (ms)")["decode"] == f"{summary['tpot_p50_s'] * 1e3:.1f}"
    assert row("TPOT p50 (ms)")["prefill"] == "" and row("prefill tok/s")["decode"] == ""
    # the per-pool rows of the main table are there for this run, as place simulate prints them
    main_table = at.dataframe[0].value
    assert "decode pool: decode tok/s per GPU" in set(main_table["metric"])


def test_optimize_phase_keeps_the_tags_given_on_the_command_line(mini_trace, tmp_path, capsys):
    """--tag under --phase: the shift estimate leaves out the tag's values (it used to drop them and cluster)."""
    model, _ = mini_trace
    traces = [write_trace(tmp_path / f"t{i}", model, num_requests=24, prompt=8, output=24, skew=1.0, seed=i,
                          hot_shift=3 * i) for i in range(3)]
    argv = ["optimize", *traces, "--phase", "decode", "--gpus", "4", "--redundant", "0", "--batch", "2",
            "--window-tokens", "64", "--policy", "linear", "--no-out", "--json"]
    for i, t in enumerate(traces):
        argv += ["--tag", f"{t}:dataset=d{i}"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    grouping = doc["shift_groupings"][0]
    assert grouping["key"] == "dataset" and grouping["what"] == "a new dataset", grouping
    # the planning windows' inputs (the last input's windows are all held out)
    assert len(grouping["groups"]) >= 2 and set(grouping["groups"]) <= {"d0", "d1", "d2"}


def test_optimize_phase_reads_the_tags_in_the_traces_own_metadata(mini_trace, tmp_path, capsys):
    """A trace's own metadata tags reach the shift estimate under --phase (phase_loads kept no trace
    provenance, so --phase clustered where the plain path grouped by the tag)."""
    model, _ = mini_trace
    traces = [write_trace(tmp_path / f"t{i}", model, num_requests=24, prompt=8, output=24, skew=1.0, seed=i,
                          hot_shift=3 * i, tags={"dataset": f"d{i}"}) for i in range(3)]
    assert main(["optimize", *traces, "--phase", "decode", "--gpus", "4", "--redundant", "0", "--batch", "2",
                 "--window-tokens", "64", "--policy", "linear", "--no-out", "--json"]) == 0
    grouping = json.loads(capsys.readouterr().out)["shift_groupings"][0]
    assert grouping["key"] == "dataset" and grouping["what"] == "a new dataset", grouping
    assert len(grouping["groups"]) >= 2 and set(grouping["groups"]) <= {"d0", "d1", "d2"}


def test_bench_pools_sizes_each_tpot_run_by_what_it_simulated(monkeypatch, tmp_path):
    """bench/pools.py's decode TPOT run doubles its simulated seconds until every placement has finished one
    request per running slot (a whole wave: its percentiles are over a full batch whatever a step costs), never
    by the clock, and stops with a clear error rather than write a TPOT of too few requests."""
    import json

    from benchkit import REPO, load_bench

    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the script imports its helpers (_timing) from there
    pools = load_bench("pools", "bench_pools_sizing")
    calls = []

    def fake(finished_by_duration):
        def place(cmd):
            d = float(cmd[cmd.index("--duration") + 1])
            calls.append(d)
            n = finished_by_duration(d)
            return json.dumps({"summaries": [{"label": lab, "requests_finished": n, "tpot_p50_s": 0.1}
                                             for lab in ("placement-a", "placement-b")]})
        return place

    monkeypatch.setattr(pools, "_place", fake(lambda d: 100 if d < 40 else 300))
    out = pools.simulate_decode(tmp_path / "t", {}, 0, 16, "gb300-nvl72", 24.0)  # 16 GPUs x 16 = 256 slots
    assert calls == [24.0, 48.0] and out["duration_s"] == 48.0 and "--duration 48" in out["command"]
    calls.clear()
    monkeypatch.setattr(pools, "_place", fake(lambda d: 0))
    with pytest.raises(SystemExit, match="fewer than 256 requests finished in 192 simulated seconds"):
        pools.simulate_decode(tmp_path / "t", {}, 0, 16, "gb300-nvl72", 24.0)
    assert calls == [24.0, 48.0, 96.0, 192.0]
