"""Fourth hostile-input round (issue 42): bounded --phases, advice that agrees with itself, refusals before
any simulation, and messages that name the real cause. (Launch files: tests/test_launch_injection.py; path
arguments: tests/test_path_args.py; checkpoints, configs and manifests: tests/test_hostile_checkpoints.py.)"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex

import numpy as np
import pytest
from fuzzkit import GPUS, SIM, assert_refused, make_inputs, run_place, snapshot
from simkit import mini_model, write_trace

from moeplace.cli.commands import simulate as simulate_cmd
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.sim import inputs as sim_inputs
from moeplace.sim.inputs import MAX_PHASES, parse_phases, read_workload
from moeplace.sim.online import ratio_gain
from moeplace.sim.tune import format_tune
from moeplace.traces.loads import Loads


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("round4") / "base"
    make_inputs(root)
    m = mini_model()
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(1, m.num_moe_layers, m.num_experts))  # one thin window
    Loads(counts=counts, model=m, window_tokens=64, labels=("only",)).save(root / "one.npz")
    write_trace(root / "trace2", m, num_requests=40, prompt=16, output=4, skew=1.0, seed=2)
    return root


@pytest.fixture
def w(base, monkeypatch):
    monkeypatch.chdir(base)
    return base


def _no_simulation(monkeypatch):
    """Any simulation from here on fails the test: what is refused must be refused before one runs."""
    def boom(*a, **k):
        raise AssertionError("a simulation ran before the refusal")
    monkeypatch.setattr(simulate_cmd, "simulate", boom)
    monkeypatch.setattr("moeplace.sim.online.simulate", boom)


# ----------------------------------------------------------------------- bounded --phases
@pytest.mark.parametrize("n", [MAX_PHASES + 1, 5000])
def test_phases_past_the_ceiling_refused_before_any_file_is_read(w, capsys, n):
    spec = ",".join(["nowhere.npz:60"] * n)  # no such file: the ceiling speaks first
    line = assert_refused(run_place(["simulate", "--phases", spec, "--placement", "linear", *SIM], capsys),
                          "--phases", f"{n:,} entries", f"ceiling of {MAX_PHASES}")
    assert "nowhere" not in line


def test_a_source_named_by_many_phases_is_read_once(w, monkeypatch):
    calls = []
    real = sim_inputs._read_one

    def counting(source, *a):
        calls.append(source)
        return real(source, *a)

    monkeypatch.setattr(sim_inputs, "_read_one", counting)
    one = read_workload(None, parse_phases("loads.npz:10"))
    many = read_workload(None, parse_phases(",".join(["loads.npz:10"] * MAX_PHASES)))
    assert calls == ["loads.npz", "loads.npz"]  # once per workload, whatever the number of entries
    assert many.trace.num_tokens == one.trace.num_tokens  # the tokens of the one source, not 100 copies
    assert many.timeline.counts.shape[0] == MAX_PHASES * one.timeline.counts.shape[0]


def test_phases_without_seconds_last_by_traffic(w):
    wl = read_workload(None, parse_phases("loads.npz,trace"))
    assert not wl.fixed_time and "each by its traffic" in wl.what


# ----------------------------------------------------------------------- one definition of gain
def test_gain_is_the_ratio_of_the_totals_the_columns_show():
    static = np.full(10, 100.0)
    online = np.full(10, 98.0)  # 2 % below static in every batch (was shown as +-0.0 % by nobody's column)
    g, lo, hi = ratio_gain(online, static)
    assert g == pytest.approx(-0.02) and lo == pytest.approx(-0.02) and hi == pytest.approx(-0.02)
    rng = np.random.default_rng(0)
    static = rng.uniform(50, 150, 20)
    online = static * 0.98 + rng.normal(0, 2, 20)
    g, lo, hi = ratio_gain(online, static)
    assert g == pytest.approx(online.sum() / static.sum() - 1) and lo < g < hi


def test_rebalance_rows_show_the_static_alternative_their_gain_is_the_ratio_of():
    row = {"label": "vLLM a", "flags": "--enable-eplb", "online": True, "ranked": True, "tok_s": 1000.0,
           "static_tok_s": 1020.0, "gain": 1000 / 1020 - 1, "gain_lo": -0.03, "gain_hi": -0.01, "rebalances": 6,
           "num_redundant": 4, "decision_s": 0.1, "transfer_s": 0.2, "stall_s": 0.0}
    other = {**row, "label": "vLLM b", "tok_s": 990.0, "static_tok_s": 960.0, "gain": 990 / 960 - 1}
    lines = format_tune({"engines": {"vllm": {"best": row, "rows": [row, other]}}})
    body = [ln for ln in lines if ln.startswith("    ") and ln.strip().startswith(("1,000", "990"))]
    assert len(body) == 2, lines
    for ln, r in zip(body, (row, other)):
        tok, static, gain = re.match(r"\s+([\d,]+)\s+([\d,]+)\s+([-+][\d.]+)%", ln).groups()
        assert float(gain) / 100 == pytest.approx(float(tok.replace(",", "")) / float(static.replace(",", "")) - 1,
                                                  abs=5e-4)


# ----------------------------------------------------------------------- capability facts, cheap refusals
def test_recommend_does_not_simulate_vllm_eplb_for_a_model_vllm_cannot_rebalance(tmp_path):
    m = dataclasses.replace(mini_model(), hf_model_type="qwen2_moe")
    wl = read_workload(write_trace(tmp_path / "t", m, num_requests=40, prompt=64, output=16))
    from moeplace.foundation.cluster import make_cluster
    from moeplace.placement.policies import PlacementProblem, get_policy
    from moeplace.sim.config import EngineConfig, SimConfig
    cluster = make_cluster(4, "h200", 2)
    pl = get_policy("linear")(PlacementProblem(np.ones((1, m.num_moe_layers, m.num_experts)), m, cluster, 0))
    plan = simulate_cmd.recommend_plan(wl, ("linear", pl), cluster, SimConfig(engine=EngineConfig(attention_tp=2)),
                                       16, 1.5, 1)
    names = [c.name for c in plan.candidates]
    assert not any(n.startswith("vLLM EPLB") for n in names) and any(n.startswith("SGLang EPLB") for n in names)
    assert plan.left_out[0]["engine"] == "vllm" and "MixtureOfExperts" in plan.left_out[0]["why"]
    text = simulate_cmd.format_recommendation({
        "horizon": {"text": "h"}, "placement": "linear", "routing": "r", "interval": "i", "verdict": "v",
        "not_simulated": plan.left_out,
        "rows": [{"name": "static", "online": False, "tok_s": 1.0, "straggler_share": 0.0, "rebalances": 0,
                  "stall_s": 0.0, "decision_s": 0.0, "transfer_s": 0.0, "a2a_slowdown_s": 0.0}]})
    assert "vLLM EPLB (window 1000, every 3000, async): not simulated -- vLLM 0.34.0: qwen2_moe.py" in text


@pytest.mark.parametrize("extra,says", [
    (["--rebalance", "every=10,window=10,moves=2"], "drop --rebalance"),
    ([], "cannot be cut into 2 parts"),
    (["--recommend-splits", "3"], "fewer --recommend-splits (it is 3)"),
])
def test_recommend_refuses_before_the_first_simulation(w, capsys, monkeypatch, extra, says):
    _no_simulation(monkeypatch)
    before = snapshot(w)
    line = assert_refused(run_place(["simulate", "one.npz", "--placement", "linear", *SIM, "--recommend", *extra],
                                    capsys))
    assert says in line, line
    assert snapshot(w) == before


def test_rebalance_names_the_gpu_count_not_the_splits(w, capsys, monkeypatch):
    _no_simulation(monkeypatch)
    line = assert_refused(run_place(["rebalance", "one.npz", "--gpus", "7", "--gpus-per-node", "7", "--quick",
                                     "--engine", "sglang"], capsys), "--attention-tp 8", "7 GPUs")
    assert "--splits" not in line


class _Planned(Exception):
    """The comparison's horizon, measured by its pilot: the work the command would do."""


def test_optimize_advice_names_a_horizon_the_comparison_chooses(w, capsys, monkeypatch):
    """Several inputs: the advice names them as phases without seconds, on the cluster planned for, with
    --quick. An hour per phase fixed the horizon at the phases' 7,200 s (734 minutes of simulation for K3,
    refused by the command it recommended); now the horizon is the comparison's own minimum, as for one input:
    warm-up + 5 of the longest interval x the pilot's iteration time x the margin. (Whether it then fits the
    default budget is a wall-time estimate, this machine's load included: not asserted here.)"""
    res = run_place(["optimize", "trace2", "trace", *GPUS, "--policy", "linear", "--no-out", "--window-tokens", "64"],
                    capsys)
    assert res.rc == 0, res.err
    m = re.search(r"place rebalance (.+?)(?:$|\n)", res.out)
    assert m, res.out
    argv = shlex.split(m.group(1))
    assert argv[0] == "--phases" and ":" not in argv[1] and argv[argv.index("--gpus") + 1] == "4" and "--quick" in argv
    from moeplace.sim import online
    real = online._plan

    def plan_then_stop(*a, **k):
        raise _Planned(real(*a[:-2], float("inf"), 2.0))  # the horizon, whatever the budget (a short pilot)

    monkeypatch.setattr(online, "_plan", plan_then_stop)
    with pytest.raises(_Planned) as planned:
        run_place(["rebalance", *argv], capsys)
    hz = planned.value.args[0]
    assert not hz.fixed
    assert hz.duration_s == pytest.approx(hz.warmup_s + online.INTERVALS * hz.longest_interval * hz.iter_s
                                          * online.MARGIN)


# ----------------------------------------------------------------------- a figure that was not simulated
def test_prefill_only_run_says_decode_was_never_simulated(w, capsys):
    res = run_place(["simulate", "trace", "--placement", "linear", *SIM, "--phase", "prefill"], capsys)
    assert res.rc == 0, res.err
    assert "TPOT p50 (ms), TPOT p99 (ms) '-' = not simulated" in res.out
    res = run_place(["simulate", "trace", "--placement", "linear", *SIM, "--phase", "prefill", "--json"], capsys)
    s = json.loads(res.out)["summaries"][0]
    assert s["tpot_p50_s"] is None and "no decode step" in s["not_simulated"]["tpot_p50_s"]


# ----------------------------------------------------------------------- messages that name the cause
def test_engines_model_messages(w, capsys):
    line = assert_refused(run_place(["engines", "--model", "placement.json"], capsys), "placement.json")
    assert "is a moeplace.placement file" in line and "not a model" in line and "'attention'" not in line
    assert assert_refused(run_place(["engines", "--model", ""], capsys), "--model").endswith("is expected")
    with pytest.raises(InputError, match="empty"):
        load_model("")


def test_trace_validate_json_has_the_error_field(w, capsys, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "part-00000.parquet").write_bytes(b"PAR1")
    res = run_place(["trace", "validate", bad, "--json"], capsys)
    doc = json.loads(res.out)
    assert res.rc == 2 and doc["ok"] is False and doc["exit_code"] == 2
    assert doc["error"] == doc["traces"][0]["problems"][0]["line"]
