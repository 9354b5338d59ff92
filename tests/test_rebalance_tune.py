"""`place rebalance`: the engines' own rebalancer settings, spelled as their released parsers take them,
searched on a trace and scored only on routing the rebalancer has not observed."""
from __future__ import annotations

import json
import shlex

import pytest
from simkit import mini_model, write_trace

from moeplace.cli.main import main
from moeplace.foundation.model import load_model
from moeplace.sim.tune import engine_settings, unavailable

# vLLM 0.34 EPLBConfig fields the flag may carry; SGLang 0.5.23 server-args fields
VLLM_EPLB_FIELDS = {"window_size", "step_interval", "num_redundant_experts", "log_balancedness",
                    "log_balancedness_interval", "use_async", "policy", "communicator", "enable_migration_batching"}
SGLANG_FLAGS = {"--enable-eplb", "--ep-num-redundant-experts", "--eplb-rebalance-num-iterations",
                "--ep-dispatch-algorithm"}


def test_settings_are_the_engines_own_flags():
    vllm = engine_settings("vllm", 896, 92, 32)
    assert {s.num_redundant for s in vllm} == {0, 32}  # 896 divides over 32 GPUs; and one more slot per GPU
    for s in vllm:
        words = shlex.split(s.flags())
        assert words[:3] == ["--enable-expert-parallel", "--enable-eplb", "--eplb-config"]  # EPLB requires EP
        cfg = json.loads(words[3])
        assert set(cfg) <= VLLM_EPLB_FIELDS and (896 + cfg["num_redundant_experts"]) % 32 == 0
        assert s.rebalance.every == cfg["step_interval"] and s.rebalance.window == cfg["window_size"]
        assert s.rebalance.asynchronous == cfg["use_async"]
    sg = engine_settings("sglang", 128, 48, 16)
    for s in sg:
        words = shlex.split(s.flags())
        assert {w for w in words if w.startswith("--")} == SGLANG_FLAGS
        algo = words[words.index("--ep-dispatch-algorithm") + 1]
        assert algo in ("static", "dynamic") and s.rule == ("sglang" if algo == "static" else "vllm")
        assert not s.rebalance.asynchronous  # SGLang rebalances inside the forward pass
    tr = engine_settings("trtllm", 128, 48, 16)
    static = [s for s in tr if s.params["layer_updates_per_iter"] == 0]
    assert static and all(s.rebalance is None for s in static)
    one = next(s for s in tr if s.params["layer_updates_per_iter"] == 1)
    assert one.rebalance.every == 48 and "layer_updates_per_iter: 1" in one.flags()
    assert len(engine_settings("vllm", 896, 92, 32, quick=True)) < len(vllm)


def test_rebalancers_that_do_nothing_for_k3_are_reported_from_the_capability_table(k3):
    assert "load balancer excludes KimiK3ForConditionalGeneration" in unavailable("trtllm", k3)
    assert unavailable("trtllm", load_model("qwen3-30b-a3b")) is None
    # vLLM 0.34.0 and SGLang 0.5.23 accept the flags and change nothing for K3: said, with the route instead
    vllm = unavailable("vllm", k3)
    assert "does not wire K3 into EPLB" in vllm and "#50647" in vllm and "MOEPLACE_PLACEMENT" in vllm
    sglang = unavailable("sglang", k3)
    assert "kimi_k3.py lacks get_model_config_for_expert_location" in sglang and "--format checkpoint" in sglang
    assert unavailable("vllm", load_model("deepseek-v3")) is None and unavailable("sglang", load_model("deepseek-v3")) is None


@pytest.mark.slow
def test_place_rebalance_prints_launch_flags_gain_interval_and_static_alternative(tmp_path, capsys):
    path = write_trace(tmp_path / "t", mini_model(num_experts=16), num_requests=40, prompt=48, output=12,
                       skew=1.5, hot_shift=5)
    rc = main(["rebalance", path, "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--concurrency",
               "8", "--quick", "--engine", "vllm", "--engine", "sglang", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["format"] == "moeplace.rebalance-report/1"
    assert set(res["engines"]) == {"vllm", "sglang"} and len(res["splits"]) == 1
    for sp in res["splits"]:
        assert sp["observe_windows"][1] == sp["score_windows"][0]  # scored on the part after the one it observed
    for d in res["engines"].values():
        b = d["best"]
        assert b["gain_lo"] <= b["gain"] <= b["gain_hi"] and b["flags"].startswith(("--enable-eplb", "--enable-expert-parallel"))
        assert b["rebalances"] >= 5 and all(r["rebalances"] >= 5 for r in d["rows"] if r["ranked"])
        assert b["tok_s"] == max(r["tok_s"] for r in d["rows"] if r["ranked"]) and b["tok_s"] > 0
    # the same from the trace's Loads (place trace stats --out): routes drawn from its windows
    loads = tmp_path / "loads.npz"
    assert main(["trace", "stats", path, "--out", str(loads), "--window-tokens", "64"]) == 0
    capsys.readouterr()
    rc = main(["rebalance", str(loads), "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2",
               "--concurrency", "8", "--quick", "--engine", "sglang"])
    out = capsys.readouterr().out
    assert rc == 0 and "routes drawn from the expert loads" in out and "rebalances after warm-up" in out


@pytest.mark.parametrize("bad", [["--splits", "0"], ["--engine", "tgi"], ["--budget", "0.5"]])
def test_place_rebalance_rejects_bad_flags_and_unaffordable_horizons(tmp_path, capsys, bad):
    path = write_trace(tmp_path / "t", mini_model(num_experts=16), num_requests=40, prompt=48, output=12)
    assert main(["rebalance", path, "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--quick",
                 "--engine", "sglang", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    if "--budget" in bad:
        assert "more than --budget" in err and "--quick" in err  # says what to change


def test_simulate_takes_loads_and_phases(tmp_path, capsys):
    """A Loads file (place trace stats --out) is simulated from its per-window distributions, said in the
    output; --phases replays inputs one after the other for their seconds."""
    m = mini_model(num_experts=16)
    a = write_trace(tmp_path / "a", m, num_requests=12, prompt=32, output=8, skew=1.5)
    b = write_trace(tmp_path / "b", m, num_requests=12, prompt=32, output=8, skew=1.5, hot_shift=7, seed=1)
    loads = tmp_path / "a.npz"
    assert main(["trace", "stats", a, "--out", str(loads), "--window-tokens", "64"]) == 0
    capsys.readouterr()
    common = ["--placement", "linear", "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2",
              "--concurrency", "8", "--isl", "32", "--osl", "8", "--no-progress"]
    assert main(["simulate", str(loads), *common, "--duration", "0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["summaries"][0]
    assert "drawn from the expert loads" in s["routing_source"] and s["output_tok_s"] > 0
    assert main(["simulate", "--phases", f"{loads}:0.3,{b}:0.4", *common, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summaries"][0]
    assert s["duration_s"] == pytest.approx(0.7) and "2 phases" not in s["routing_source"]
    assert main(["simulate", "--phases", f"{loads}:x", *common]) == 2
    assert "is not a number of seconds" in capsys.readouterr().err
    assert main(["simulate", str(loads), *common, "--mode", "replay"]) == 2
    assert "use --mode stat" in capsys.readouterr().err


def test_optimize_advice_on_loads_names_only_commands_that_take_them(tmp_path, capsys):
    """The advice under `place optimize` on Loads input suggests `place simulate LOADS --recommend` and
    `place rebalance LOADS`; both read the file (several inputs: as --phases)."""
    import shlex as sh

    from moeplace.cli.main import build_parser
    from moeplace.sim.inputs import parse_phases, read_workload

    m = mini_model(num_experts=16)
    loads = []
    for i in range(2):
        t = write_trace(tmp_path / f"t{i}", m, num_requests=16, prompt=48, output=12, skew=1.5, seed=i)
        loads.append(tmp_path / f"l{i}.npz")
        assert main(["trace", "stats", t, "--out", str(loads[-1]), "--window-tokens", "128"]) == 0
    for inputs in (loads[:1], loads):
        capsys.readouterr()
        assert main(["optimize", *map(str, inputs), "--gpus", "4", "--gpus-per-node", "2", "--policy", "eplb",
                     "--out", str(tmp_path / "p.json"), "--force"]) == 0
        out = capsys.readouterr().out
        advice = out[out.index("check online rebalancing: ") + len("check online rebalancing: "):].splitlines()[0]
        cmds = [c.strip() for c in advice.split(", or tune the engine's own: ")]
        assert cmds[0].startswith("place simulate") and "--recommend" in cmds[0]
        assert cmds[1].startswith("place rebalance")
        for c in cmds:
            args = build_parser().parse_args(sh.split(c)[1:])
            src = args.traces if args.command == "simulate" else args.trace
            wl = read_workload(src, parse_phases(args.phases) if args.phases else ())
            assert wl.drawn and wl.timeline.num_windows >= 1


def test_what_if_simulates_a_rebalancer_the_release_lacks_and_labels_it(tmp_path):
    """Without --what-if a rebalancer the capability table says does nothing for the model is reported, not
    simulated; with it, simulated all the same and its entry carries the reason, in every output."""
    from dataclasses import replace

    from moeplace.foundation.cluster import make_cluster
    from moeplace.sim.config import EngineConfig, SimConfig, WorkloadConfig
    from moeplace.sim.inputs import read_workload
    from moeplace.sim.tune import format_tune, tune

    m = mini_model(num_experts=16)
    wl = read_workload(write_trace(tmp_path / "t", m, num_requests=40, prompt=48, output=12, skew=1.5, hot_shift=5))
    wl = replace(wl, trace=replace(wl.trace, model=replace(wl.trace.model, hf_model_type="kimi_k3")))
    cluster = make_cluster(4, "h200", 2)
    cfg = SimConfig(duration=5.0, seed=0, engine=EngineConfig(attention_tp=2), workload=WorkloadConfig(concurrency=8))
    plain = tune(wl, cluster, cfg, None, ["trtllm"], quick=True)
    assert "excludes KimiK3ForConditionalGeneration" in plain["engines"]["trtllm"]["unavailable"]
    assert plain["horizon"] is None  # nothing simulated
    res = tune(wl, cluster, cfg, None, ["trtllm"], quick=True, what_if=True)
    d = res["engines"]["trtllm"]
    assert "excludes KimiK3ForConditionalGeneration" in d["what_if"] and "unavailable" not in d
    assert d["rows"] and any(r["rebalances"] >= 5 for r in d["rows"] if r["ranked"])
    lines = format_tune(res)
    assert lines[0].startswith("TensorRT-LLM (what-if, not served today: ")
