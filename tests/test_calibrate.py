"""`place calibrate`: the result readers on files the released tools wrote, the deployment settings, the
calibration math (reweight, refit within bounds), CAL.json, and `place simulate --calibration`."""
import dataclasses
import datetime
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.sim.bench_results import AIPERF, SGLANG, VLLM, read_results
from moeplace.sim.calibrate import (
    REFIT,
    Member,
    calibrate_members,
    calibrated_ensemble,
    cfg_of,
    deployment_of,
    median_member,
    refit,
    reweight,
    x_of,
)
from moeplace.sim.config import CostConfig
from moeplace.sim.ensemble import load_ensemble, speed_interval, weighted_quantile, within_interval
from moeplace.sim.point import shipped_members

DATA = Path(__file__).parent / "data" / "bench_results"
TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"


# ---------------------------------------------------------------------------- readers
def test_vllm_bench_serve_results_as_written():
    (p,) = read_results(DATA / "vllm-bench-serve-c4-detailed.json")
    assert p.tool == VLLM and p.concurrency == 4 and p.rate is None and p.num_requests == 16
    assert p.isl == 1024 and p.osl == 64 and p.range_ratio == 0.0  # input_lens saved in detail: all 1,024
    assert p.output_tok_s == pytest.approx(166.5238407621192)
    assert p.total_tok_s == pytest.approx(2830.905292956026)
    assert p.tpot_s == pytest.approx(23.590652865081328e-3) and p.ttft_s == pytest.approx(26.35757049984022e-3)
    (q,) = read_results(DATA / "vllm-bench-serve-c16.json")  # without --save-detailed: lengths from totals
    assert q.concurrency == 16 and q.num_requests == 32 and q.osl == 64
    a, b = read_results(DATA / "vllm-bench-serve-append.json")  # --append-result: one object per line
    assert (a.concurrency, b.concurrency, a.isl, b.osl) == (2, 8, 2048, 32) and b.source.endswith(":2")


def test_sglang_jsonl_one_run_per_line_and_aiperf_export():
    a, b = read_results(DATA / "sglang-bench-serving.jsonl")
    assert (a.tool, a.concurrency, b.concurrency) == (SGLANG, 4, 16)
    assert a.source.endswith(":1") and b.source.endswith(":2")
    assert b.output_tok_s == pytest.approx(539.5085979901457) and b.tpot_s == pytest.approx(29.15348614285341e-3)
    (c,) = read_results(DATA / "aiperf-c4-profile_export_aiperf.json")
    assert c.tool == AIPERF and c.concurrency == 4 and c.isl == 1024 and c.osl == 64
    assert c.output_tok_s == pytest.approx(164.0140339793432)
    assert c.tpot_s == pytest.approx(23.448332571428573e-3)  # inter_token_latency p50, in ms in the export


def _edit(tmp_path, name, fn, lines=False):
    src = (DATA / name).read_text()
    if lines:
        objs = [json.loads(x) for x in src.splitlines() if x.strip()]
        fn(objs)
        text = "\n".join(json.dumps(o) for o in objs) + "\n"
    else:
        obj = json.loads(src)
        fn(obj)
        text = json.dumps(obj)
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name,edit,lines,want", [
    ("vllm-bench-serve-c16.json", lambda o: o.pop("output_throughput"), False, "field 'output_throughput'"),
    ("vllm-bench-serve-c16.json", lambda o: o.update(completed="16"), False, "field 'completed' is '16'"),
    ("vllm-bench-serve-c16.json", lambda o: o.update(max_concurrency=0), False, "field 'max_concurrency' is 0"),
    ("sglang-bench-serving.jsonl", lambda os: os[1].update(duration=-1.0), True, ":2: field 'duration'"),
    ("aiperf-c4-profile_export_aiperf.json", lambda o: o["time_to_first_token"].update(unit="fortnights"), False,
     "field 'time_to_first_token.unit'"),
])
def test_reader_errors_name_file_and_field(tmp_path, name, edit, lines, want):
    p = _edit(tmp_path, name, edit, lines)
    with pytest.raises(InputError) as exc:
        read_results(p)
    msg = str(exc.value)
    assert str(p) in msg and want in msg and "\n" not in msg


def test_unknown_file_and_cli_error_is_one_line(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"throughput": 3}))
    with pytest.raises(InputError, match="vllm bench serve"):
        read_results(p)
    rc = main(["calibrate", str(p), "--model", "kimi-k2", "--gpu", "h200", "--gpus", "8", "--out",
               str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and str(p) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cal.json").exists()


def test_a_speculative_run_needs_the_deployments_mtp(tmp_path, capsys):
    p = _edit(tmp_path, "vllm-bench-serve-c16.json", lambda o: o.update(spec_decode_acceptance_length=2.4))
    rc = main(["calibrate", str(p), "--model", "kimi-k2", "--gpu", "h200", "--gpus", "8", "--out",
               str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "field 'spec_decode_acceptance_length' is 2.40" in err and "mtp" in err


def test_a_trace_of_another_model_is_refused(tmp_path, tiny_trace, capsys):
    rc = main(["calibrate", str(DATA / "vllm-bench-serve-c16.json"), "--model", "qwen3-30b-a3b", "--gpu", "h200",
               "--gpus", "8", "--trace", str(tiny_trace), "--out", str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "routing of tiny-moe" in err and "qwen3-30b-a3b" in err and "Traceback" not in err


def test_deployment_keys_checked_with_the_nearest_valid_one():
    with pytest.raises(InputError, match="attention_tpp: unknown key; did you mean 'attention_tp'"):
        deployment_of({"model": "kimi-k2", "gpu": "h200", "gpus": 8, "attention_tpp": 8}, "dep.yaml")
    with pytest.raises(InputError, match="attention_dp 4 x attention_tp 8"):
        deployment_of({"model": "kimi-k2", "gpu": "h200", "gpus": 8, "attention_tp": 8, "attention_dp": 4}, "d")
    with pytest.raises(InputError, match="'gpus' missing"):
        deployment_of({"model": "kimi-k2", "gpu": "h200"}, "d")
    d = deployment_of({"model": "kimi-k2", "gpu": "h200", "gpus": 16, "attention_tp": 8, "ep": 8}, "d")
    assert d.moe_tp == 2 and "TP8 DP2" in d.describe() and "TEP2" in d.describe()


# ---------------------------------------------------------------------------- the math
def test_refit_bounds_are_the_fits():
    """What a calibration may change keeps the bounds the global fit uses (bench/fidelity_harness.FIT)."""
    from benchkit import load_bench

    fit = {n: (lo, hi) for n, lo, hi in load_bench("fidelity_harness").FIT}
    for n, lo, hi in REFIT:
        assert fit[n] == (lo, hi), n


def _sensitive(target_sust: float):
    """Residual of one 'measured' figure proportional to the sustained efficiency (a compute-bound point)."""
    return lambda cfg: np.array([math.log(cfg.sustained_efficiency / target_sust)])


def test_refit_moves_the_least_and_explains_the_point():
    base = Member(CostConfig(), 1.0)
    m, info = refit(base, _sensitive(0.5), np.full(len(REFIT), 0.25))
    assert m.cost.sustained_efficiency == pytest.approx(0.5, rel=0.02)  # explained (sigma << prior)
    assert set(info["moved"]) == {"sustained_efficiency"}  # nothing the point does not see
    same, info0 = refit(base, _sensitive(CostConfig().sustained_efficiency), np.full(len(REFIT), 0.25))
    assert same.cost == base.cost and not info0["moved"]
    # beyond the bound: stops at it and says so
    low, info_low = refit(base, _sensitive(0.1), np.full(len(REFIT), 0.25))
    assert low.cost.sustained_efficiency == pytest.approx(0.3) and info_low["moved"]["sustained_efficiency"]["bound"]


def test_reweight_prefers_the_member_that_explains_the_point():
    members = [Member(CostConfig().replace(sustained_efficiency=s), 1 / 3, f"m{s}") for s in (0.4, 0.6, 0.8)]
    out, info = reweight(members, _sensitive(0.6))
    w = [m.weight for m in out]
    assert w[1] > 0.9 and sum(w) == pytest.approx(1.0) and 1.0 <= info["ess"] < 1.3
    assert median_member(out).name == "m0.6"
    cal, cinfo = calibrate_members(members, _sensitive(0.6))
    assert [m.name for m in cal] == ["m0.6"] or cal[0].weight > 0.9  # the unlikely ones dropped
    assert cinfo["prior_sd"][0] >= 0.05  # the members' own spread


def test_shipped_members_are_the_shipped_ensemble():
    """A calibration starts from issue 40's ensemble: every member, its constants on the reference's, its
    weight (normalized)."""
    ens = load_ensemble()
    members = shipped_members()
    assert len(members) == ens.size >= 32
    assert sum(m.weight for m in members) == pytest.approx(1.0)
    for m, row in zip(members, ens.members):
        assert {n: getattr(m.cost, n) for n in ens.names} == pytest.approx(dict(zip(ens.names, map(float, row))))
    # what no member fits stays the reference's (= CostConfig()'s defaults)
    assert members[0].cost.replace(**{n: getattr(CostConfig(), n) for n in ens.names}) == CostConfig()
    assert len({m.cost for m in members}) > 1


def test_x_of_and_cfg_of_round_trip():
    c = CostConfig()
    back = cfg_of(c, x_of(c))
    # the refitted constants come back to rounding (scaled to their bounds and back), the rest untouched
    assert {n: getattr(back, n) for n, _, _ in REFIT} == pytest.approx({n: getattr(c, n) for n, _, _ in REFIT},
                                                                      rel=1e-12, abs=1e-18)
    assert back.replace(**{n: getattr(c, n) for n, _, _ in REFIT}) == c
    moved = cfg_of(c, np.full(len(REFIT), 0.5))  # the middle of every bound
    assert [getattr(moved, n) for n, _, _ in REFIT] == pytest.approx([(lo + hi) / 2 for _, lo, hi in REFIT])


def test_within_interval_combines_the_members_spread_and_the_residuals():
    """A calibrated figure's interval: the 10th / 90th weighted percentiles of member + residual over every
    pair, widened to hold the median (bench/fidelity_frozen.yaml, calibration)."""
    e = [-0.2, -0.1, 0.0, 0.1, 0.2]
    one = within_interval([0.0], [1.0], e)  # one member: the residuals alone
    assert (one.median, one.lo, one.hi) == pytest.approx((0.0, weighted_quantile(e, np.ones(5), 0.1),
                                                          weighted_quantile(e, np.ones(5), 0.9)))
    assert one.lo == pytest.approx(-0.2) and one.hi == pytest.approx(0.2) and one.near is None
    spread = within_interval([-0.3, 0.3], [0.5, 0.5], [0.0])  # no residual error: the members' spread alone
    assert (spread.median, spread.lo, spread.hi) == pytest.approx((0.0, -0.3, 0.3))
    both = within_interval([-0.3, 0.3], [0.5, 0.5], [-0.2, 0.2])  # both: wider than either
    assert both.lo == pytest.approx(-0.5) and both.hi == pytest.approx(0.5)
    weighted = within_interval([-0.3, 0.3], [0.9, 0.1], [0.0])  # member weights move it
    assert weighted.median < 0 and weighted.lo == pytest.approx(-0.3) and weighted.hi < 0.3
    lean = within_interval([0.0], [1.0], [0.1, 0.2])  # the residuals all lean one way: widened to the median
    assert lean.lo == 0.0 and lean.hi > 0.1
    # an ensemble that carries residuals uses this interval
    ens = dataclasses.replace(load_ensemble(), within=(-0.1, 0.1))
    z = np.linspace(-0.1, 0.1, ens.size)
    assert speed_interval(ens, z, {}) == within_interval(z, ens.weights, (-0.1, 0.1))


def _member_figure(trace, cfg, ensemble=None):
    """output tok/s of the tiny model on 2 x H200 at concurrency 4 (closed loop), priced by ``cfg`` alone or
    by ``ensemble`` (whose event constants ``cfg`` are)."""
    from moeplace.foundation.cluster import make_cluster
    from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.runner import resolve_placement, simulate
    from moeplace.sim.workload import load_trace_tokens

    tr = load_trace_tokens(trace)
    cl = make_cluster(2, "h200", None)
    lab, pl = resolve_placement("linear", tr, cl, 0, "vllm", 0)
    wl = WorkloadConfig(arrival="closed", concurrency=4, lengths=LengthMix(
        components=((512, 1.0),), sigma=0.0, output_mean=32, output_sigma=0.0, max_len=4096))
    config = SimConfig(duration=5, mode="stat", seed=0, engine=EngineConfig(attention_tp=1), cost=cfg, workload=wl,
                       ensemble=ensemble is not None)
    return simulate(tr, [(lab, pl)], cl, config, ensemble=ensemble)[0].summary


def test_a_calibrated_run_is_the_weighted_median_of_its_members(tiny_trace):
    """A run with a calibration is priced by every calibrated member (one event simulation on their weighted
    median member, each member re-pricing it), not by the median member alone: three members whose median
    member (by constants) is the slowest, so its figure and the members' weighted median differ by far."""
    members = [Member(CostConfig().replace(iteration_overhead_s=0.2e-3, kernel_floor_s=9e-6), 0.3, "fast host"),
               Member(CostConfig().replace(iteration_overhead_s=1.5e-3, kernel_floor_s=2e-6), 0.3, "fast kernels"),
               Member(CostConfig().replace(iteration_overhead_s=1.5e-3, kernel_floor_s=9e-6), 0.4, "slow")]
    med = median_member(members)
    assert med.name == "slow"  # the weighted median of each constant
    ens = calibrated_ensemble(members, {"coverage": 0.8, "residuals_log": [0.0]})
    s = _member_figure(tiny_trace, med.cost, ens)
    own = [_member_figure(tiny_trace, m.cost)["output_tok_s"] for m in members]  # each member's own simulation
    want = weighted_quantile(own, [m.weight for m in members], 0.5)
    assert s["output_tok_s"] == pytest.approx(want, rel=0.03)  # re-pricing the median member's schedule
    assert s["output_tok_s"] / own[2] - 1 > 0.15  # far from the median member's own figure
    assert s["ensemble"]["reference_figures"]["output_tok_s"] == pytest.approx(own[2])  # the event simulation's
    assert s["ensemble"]["calibrated"] and s["ensemble"]["members"] == 3
    # residuals of 0: the interval is the members' spread, inside the fastest and slowest member
    lo, hi = s["output_tok_s_range"]
    assert min(own) * 0.97 <= lo < s["output_tok_s"] < hi <= max(own) * 1.03


# ---------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    assert main(["trace", "synth", "--model", str(TINY), "--tokens", "3000", "--out", str(d / "trace"),
                 "--no-progress"]) == 0
    return d / "trace"


def test_calibrate_then_simulate_with_the_calibration(tmp_path, tiny_trace, capsys):
    res = tmp_path / "res"
    res.mkdir()
    for name in ("vllm-bench-serve-c4-detailed.json", "sglang-bench-serving.jsonl"):
        shutil.copy(DATA / name, res)
    (res / "deployment.yaml").write_text(f"model: {TINY}\ngpu: h200\ngpus: 2\nattention_tp: 1\nengine: vllm\n")
    cal = tmp_path / "cal.json"
    rc = main(["calibrate", str(res / "vllm-bench-serve-c4-detailed.json"), str(res / "sglang-bench-serving.jsonl"),
               "--trace", str(tiny_trace), "--out", str(cal)])
    out = capsys.readouterr().out
    assert rc == 0 and "calibrated on 3 measured point(s) of tiny-moe" in out
    doc = json.loads(cal.read_text())
    assert doc["format"] == "moeplace.serving-calibration/1"
    assert doc["changes"]["refit"] == [n for n, _, _ in REFIT] and doc["changes"]["what"] == "reweight+refit"
    # the shipped ensemble, reweighted: its members' own spread is the refit's prior
    ens = load_ensemble()
    assert len(doc["base_members"]) == ens.size and "spread of the shipped ensemble" in doc["changes"]["prior_source"]
    assert sum(m["weight"] for m in doc["members"]) == pytest.approx(1.0)
    assert 1.0 <= doc["changes"]["reweight"]["ess"] <= ens.size
    assert doc["interval"]["log_lo"] < 0 < doc["interval"]["log_hi"]
    assert [p["concurrency"] for p in doc["points"]] == [4, 4, 16] and doc["points"][2]["source"].endswith(":2")

    def rms(key):
        return math.sqrt(sum(math.log(p[key]["output_tok_s"] / p["measured"]["output_tok_s"]) ** 2
                             for p in doc["points"]) / 3)
    assert rms("after") < rms("before")  # moved towards the measurements
    for n, lo, hi in REFIT:  # within the bounds
        assert lo - 1e-12 <= doc["members"][0]["constants"][n] <= hi + 1e-12
    # the report's before is what place simulate prints for the point uncalibrated (the shipped ensemble's
    # median), its after what a run with the calibration prints (the calibrated members' median): the c16 point
    p16 = doc["points"][2]
    sim = ["simulate", str(tiny_trace), "--placement", "linear", "--gpus", "2", "--gpu", "h200", "--attention-tp", "1",
           "--isl", str(round(p16["isl"])), "--osl", str(round(p16["osl"])), "--concurrency", "16", "--duration",
           repr(p16["simulated_s"]), "--kv-dtype", "fp8", "--engine", "vllm", "--no-progress"]
    assert main([*sim, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["summaries"][0]
    assert plain["output_tok_s"] == pytest.approx(p16["before"]["output_tok_s"], rel=1e-9)
    assert plain["ensemble"]["members"] == ens.size
    assert main([*sim, "--calibration", str(cal), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    s = js["summaries"][0]
    assert s["output_tok_s"] == pytest.approx(p16["after"]["output_tok_s"], rel=1e-9)
    assert s["output_tok_s_range"] == pytest.approx(p16["after"]["output_tok_s_range"], rel=1e-9)
    assert s["output_tok_s"] != plain["output_tok_s"]  # the same run uncalibrated is priced by other constants
    # priced by every calibrated member; the interval holds the figure and is the within-deployment one
    e = s["ensemble"]
    assert e["calibrated"] and e["members"] == len(doc["members"]) and e["near"] is None
    assert e["within_cases"] == len(doc["interval"]["residuals_log"]) > 0
    lo, hi = s["output_tok_s_range"]
    assert lo <= s["output_tok_s"] <= hi and lo < hi
    run = js["fidelity"]["run"]["calibration"]
    assert run["points"] == 3 and run["members"] == len(doc["members"]) and 1.0 <= run["ess"] <= len(doc["members"])
    assert run["interval"]["residuals"] == len(doc["interval"]["residuals_log"])
    assert "calibrated on 3 measured points of tiny-moe on 2 x h200" in js["fidelity"]["note"]
    assert (f"weighted median of the {len(doc['members'])} calibrated constant sets" if len(doc["members"]) > 1 else
            "collapsed to one member") in js["fidelity"]["note"]
    # the report says when the reweighting collapsed to about one member
    assert ("collapsed to about one member" in out) == (doc["changes"]["reweight"]["ess"] < 1.5)
    assert "before: as place simulate prints it uncalibrated" in out
    # another GPU: refused, one line
    rc = main([("b200" if a == "h200" else a) for a in sim] + ["--calibration", str(cal)])
    err = capsys.readouterr().err
    assert rc != 0 and "applies to its own model and GPU only" in err and "Traceback" not in err
    # a CAL.json without the within-deployment residuals (an older place calibrate): one line, not a guess
    old = json.loads(cal.read_text())
    del old["interval"]["residuals_log"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    rc = main([*sim, "--calibration", str(tmp_path / "old.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "residuals_log" in err and "run place calibrate again" in err and "Traceback" not in err


def test_a_calibrated_sweep_prices_with_the_constants_and_hashes_them():
    """place sweep --calibration: every point's SimConfig carries the calibrated constants, and a point's
    hash changes with them (a resumed sweep never reuses a row priced by other constants)."""
    from moeplace.cli.sweep import expand_points, load_spec
    from moeplace.cli.sweep.run import sim_config
    from moeplace.cli.sweep.spec import point_hash

    spec = load_spec(Path(__file__).parent / "data" / "sweep-small.yaml")
    cost = dataclasses.asdict(CostConfig().replace(kernel_floor_s=9e-6, sustained_efficiency=0.5))
    cal = dataclasses.replace(spec, cost=cost)
    p = expand_points(spec)[2]
    assert sim_config(cal, p, 1).cost == CostConfig(**cost)
    assert sim_config(spec, p, 1).cost == CostConfig()
    assert point_hash(cal, p, "fp") != point_hash(spec, p, "fp")
    # every point is priced by the calibration's members (sim.calibrate.calibrated_ensemble): they are hashed too
    members = [Member(CostConfig(**cost), 0.6, "a"), Member(CostConfig().replace(kernel_floor_s=9e-6), 0.4, "b")]
    ens = calibrated_ensemble(members, {"coverage": 0.8, "residuals_log": [0.1, -0.1]})
    with_ens = dataclasses.replace(cal, ensemble=ens)
    other = dataclasses.replace(cal, ensemble=ens.reweighted([0.5, 0.5]))
    assert len({point_hash(with_ens, p, "fp"), point_hash(other, p, "fp"), point_hash(cal, p, "fp")}) == 3


def test_anchored_groups_start_from_their_out_of_bag_members():
    """bench/fidelity_anchored.py: group g starts from the members whose resample never drew g, with their
    weights renormalized; a group the bootstrap never drew from starts from every member."""
    from benchkit import load_bench

    fa = load_bench("fidelity_anchored")
    ens = load_ensemble()
    g = ens.groups[0]
    oob = fa.oob_members(ens, g)
    drew = np.asarray(ens.bags)[:, 0] > 0
    assert 0 < len(oob) == int((~drew).sum()) < ens.size
    assert sum(m.weight for m in oob) == pytest.approx(1.0)
    configs = ens.member_configs(ens.reference_config())
    assert all(m.cost == configs[int(m.name.split()[1])] and not drew[int(m.name.split()[1])] for m in oob)
    assert len(fa.oob_members(ens, "a-group-published-after-the-cut-off")) == ens.size
    assert np.all(fa.prior_widths(oob) >= 0.05)


def test_anchored_leaves_out_cases_published_after_the_cut_off():
    """bench/fidelity_anchored.py: a group published after the frozen cut-off is scored once in its own
    column; its anchored errors never become residuals of the interval place calibrate ships, so the
    anchored pass hands no such group to the calibration (the same group, dated before the cut-off, is)."""
    from benchkit import load_bench

    fa = load_bench("fidelity_anchored")
    ens = load_ensemble()
    group = [c for c in fa.load_cases(fa.CASES) if c["group"] == "trtllm-b200-mtp-table"][:2]
    day_after = fa.load_frozen()["cutoff"] + datetime.timedelta(days=1)
    late = [{**c, "published_on": day_after.isoformat()} for c in group]
    handed = []

    def capture(todo):
        handed.extend(t[0] for t in todo)
        return [[] for _ in todo]
    fa.anchored_all(late, ens, True, None, report=False, map_groups=capture)
    assert handed == []
    fa.anchored_all(group, ens, True, None, report=False, map_groups=capture)
    assert [[c["id"] for c in cs] for cs in handed] == [[c["id"] for c in group]]


def test_anchored_cases_are_predicted_by_every_calibrated_member_and_covered_as_a_run_is():
    """bench/fidelity_anchored.py prices a left-out case as a calibrated run is priced (the members'
    weighted median, not the median member's figure), and checks each case's interval the way
    sim.ensemble.within_interval makes a run's: its own members' spread plus the other groups' residuals."""
    from benchkit import load_bench

    fa = load_bench("fidelity_anchored")
    case = next(c for c in fa.load_cases(fa.CASES) if c["kind"] not in fa.E2E and c["metric"] != "latency_us")
    members = [Member(CostConfig().replace(gemm_efficiency=g), w, f"m{g}") for g, w in ((0.4, 0.3), (0.6, 0.3),
                                                                                          (0.9, 0.4))]
    p = fa.priced(case, members[1].cost, members, quick=True)
    own = [fa.kernel_metric(case, m.cost) for m in members]
    # the median of the members' log figures (interpolated between members, as a run's)
    assert p["figure"] == pytest.approx(math.exp(weighted_quantile(np.log(own), [m.weight for m in members], 0.5)))
    assert p["single"] == pytest.approx(own[1]) and p["figure"] != pytest.approx(own[1])
    # coverage: a case is covered when its published figure lies in its members' spread plus the other
    # groups' residuals; a group's own residuals never enter its interval
    row = {"metric": "output_tok_s", "kind": "decode", "member_weights": [0.5, 0.5]}
    rows = [{**row, "id": "a", "group": "g1", "published": 100.0, "anchored": 100.0,
             "member_log_speeds": [math.log(90.0), math.log(104.0)]},
            {**row, "id": "b", "group": "g2", "published": 100.0, "anchored": 150.0,
             "member_log_speeds": [math.log(150.0), math.log(150.0)]}]
    cov = fa.coverage(rows)
    a, b = rows
    assert a["covered"] is False  # b's residual (log 100 / 150) shifts a's members (median 96.7) further below 100
    assert b["covered"] is False  # a's residual is 0: b's interval is its members' (150), not holding 100
    assert cov["coverage"] == 0.0 and b["interval_log"] == pytest.approx([math.log(1.5), math.log(1.5)])
