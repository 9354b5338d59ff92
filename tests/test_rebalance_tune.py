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


def test_place_rebalance_prints_launch_flags_gain_interval_and_static_alternative(tmp_path, capsys):
    path = write_trace(tmp_path / "t", mini_model(num_experts=16), num_requests=18, prompt=48, output=12,
                       skew=1.5, hot_shift=5)
    rc = main(["rebalance", path, "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--concurrency",
               "8", "--duration", "0.05", "--quick", "--engine", "vllm", "--engine", "sglang", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["format"] == "moeplace.rebalance-report/1"
    assert set(res["engines"]) == {"vllm", "sglang"} and len(res["splits"]) == 2
    for sp in res["splits"]:
        assert sp["observe"][1] == sp["score"][0]  # scored on the part after the one it observed
    for d in res["engines"].values():
        b = d["best"]
        assert b["gain_lo"] <= b["gain"] <= b["gain_hi"] and b["flags"].startswith(("--enable-eplb", "--enable-expert-parallel"))
        assert b["tok_s"] == max(r["tok_s"] for r in d["rows"]) and b["tok_s"] > 0
    report = tmp_path / "rb.json"
    rc = main(["rebalance", path, "--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--concurrency",
               "8", "--duration", "0.05", "--quick", "--engine", "vllm", "--report", str(report)])
    out = capsys.readouterr().out
    assert json.loads(report.read_text())["engines"]["vllm"]["best"]["flags"] in out
    assert rc == 0 and "vLLM: best of" in out and "--eplb-config" in out and "static alternative" in out
    assert "over static (80 % interval" in out


@pytest.mark.parametrize("bad", [["--splits", "0"], ["--splits", "1"], ["--engine", "tgi"]])
def test_place_rebalance_rejects_bad_flags(tmp_path, capsys, bad):
    path = write_trace(tmp_path / "t", mini_model(num_experts=16), num_requests=6, prompt=16, output=4)
    assert main(["rebalance", path, *bad]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
