"""The shipped ensemble of cost-model constants (sim.ensemble): its artifact, how a run is priced by every
member, and the 80 % interval (jackknife+-after-bootstrap weighted by nearness): continuous in the run's
settings, wider where no published case is near, and what `place simulate` prints and writes."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from simkit import mini_model, write_trace

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.sim import ensemble as E
from moeplace.sim.config import CostConfig


def _toy(residuals, features, groups=None, bags=None, B=8, prior=1.0) -> E.Ensemble:
    """An ensemble of ``B`` members over the cases' groups (each case its own group unless given)."""
    groups = groups or [f"g{i}" for i in range(len(residuals))]
    uniq = list(dict.fromkeys(groups))
    if bags is None:
        rng = np.random.default_rng(0)
        bags = np.stack([np.bincount(rng.integers(0, len(uniq), len(uniq)), minlength=len(uniq)) for _ in range(B)])
    cases = tuple({"id": f"c{i}", "group": g, "kind": "decode", "features": f, "residual": r}
                  for i, (r, f, g) in enumerate(zip(residuals, features, groups)))
    names = ("sustained_efficiency",)
    return E.Ensemble(names, {"sustained_efficiency": 0.6}, np.full((len(bags), 1), 0.6), np.full(len(bags), 1 / len(bags)),
                      tuple(uniq), np.asarray(bags), cases, {f: 1.0 for f in E.FEATURES}, 0.8, {}, prior)


def _x(**kw) -> dict:
    x = {f: 0.0 for f in E.FEATURES}
    x.update(kw)
    return x


def test_weighted_quantile_interpolates_and_is_continuous_in_the_weights():
    v = [1.0, 2.0, 3.0, 4.0]
    assert E.weighted_quantile(v, [1, 1, 1, 1], 0.5) == pytest.approx(2.5)
    assert E.weighted_quantile(v, [0, 0, 1, 0], 0.3) == 3.0
    # a tiny change of one weight moves the quantile by a tiny amount (no jump at a cumulative edge)
    a = E.weighted_quantile(v, [1, 1, 1, 1], 0.375)
    b = E.weighted_quantile(v, [1, 1 + 1e-6, 1, 1], 0.375)
    assert abs(a - b) < 1e-5


def test_the_interval_moves_continuously_with_the_run_and_widens_where_no_case_is_near():
    rng = np.random.default_rng(1)
    feats = [_x(batch=float(b)) for b in np.linspace(0, 8, 12)]
    # errors small near batch 0, large near batch 8
    res = [float(rng.normal(0, 0.02 + 0.08 * f["batch"] / 8)) for f in feats]
    ens = _toy(res, feats)
    z = np.zeros(ens.size)
    near0 = E.speed_interval(ens, z, _x(batch=0.0))
    near8 = E.speed_interval(ens, z, _x(batch=8.0))
    assert near8.hi - near8.lo > near0.hi - near0.lo  # the local spread, not one global range
    a, b = E.speed_interval(ens, z, _x(batch=4.0)), E.speed_interval(ens, z, _x(batch=4.0 + 1e-6))
    assert abs(a.lo - b.lo) < 1e-5 and abs(a.hi - b.hi) < 1e-5
    far = E.speed_interval(ens, z, _x(batch=4.0, gpus=30.0))  # no case anywhere near
    assert far.near < 1e-6 < near0.near
    allcases = min(res), max(res)
    assert allcases[0] <= far.lo < far.hi <= allcases[1]
    assert far.hi - far.lo > near0.hi - near0.lo


def test_members_spread_widens_the_interval_and_a_held_out_group_is_left_out():
    feats = [_x() for _ in range(6)]
    res = [0.0] * 6
    ens = _toy(res, feats, B=32)
    tight = E.speed_interval(ens, np.zeros(ens.size), _x())
    spread = E.speed_interval(ens, np.linspace(-0.2, 0.2, ens.size), _x())
    assert tight.hi - tight.lo == pytest.approx(0.0, abs=1e-12)
    assert spread.hi - spread.lo > 0.05
    # leaving a group out drops its cases and every member that drew it
    out = E.speed_interval(ens, np.zeros(ens.size), _x(), exclude_group="g0")
    assert out.members == int((ens.bags[:, 0] == 0).sum())


def test_iteration_sample_is_a_bounded_systematic_sample():
    from moeplace.sim.cost import MoeWork, RankWork

    s = E.IterationSample(keep=4)
    w = RankWork.zeros(2)
    m = MoeWork(*(np.zeros((1, 2)) for _ in range(4)))
    for i in range(100):
        s.offer(w, m, float(i))
    idx = [it[0] for it in s.items]
    assert 4 <= len(idx) < 8 and s.seen == 100
    assert len(set(np.diff(idx))) == 1 and idx[0] == 0  # every stride-th iteration, from the first


def test_reweighting_changes_the_median_not_the_members():
    ens = _toy([0.0] * 4, [_x()] * 4, B=4)
    w = ens.reweighted([0, 0, 0, 1])
    z = np.array([0.0, 0.1, 0.2, 0.3])
    assert E.speed_interval(w, z, _x()).median == pytest.approx(0.3)
    assert np.array_equal(w.members, ens.members)
    with pytest.raises(InputError, match="non-negative"):
        ens.reweighted([1, -1, 0, 0])


def test_a_broken_ensemble_file_is_refused_in_one_line(tmp_path):
    doc = json.loads(E.ENSEMBLE_PATH.read_text())
    bad = dict(doc, names=["no_such_constant"])
    p = tmp_path / "e.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="no_such_constant"):
        E.parse_ensemble(bad, str(p))
    with pytest.raises(InputError, match="not a complete cost ensemble"):
        E.parse_ensemble({k: v for k, v in doc.items() if k != "members"}, str(p))
    with pytest.raises(InputError, match="moeplace.cost-ensemble"):
        E.parse_ensemble({"format": "moeplace.placement/1"}, str(p))


def test_the_shipped_ensemble_is_complete_and_its_reference_is_the_default():
    ens = E.load_ensemble()
    assert ens.size >= 32 and ens.weights.sum() == pytest.approx(1.0)
    assert E.on_reference(CostConfig(), ens)  # the defaults are the reference fit
    assert ens.cases and all(c["group"] in ens.groups for c in ens.cases)
    assert (ens.bags.sum(axis=1) == len(ens.groups)).all()  # each member drew as many groups as there are
    for cfg in ens.member_configs():  # every member is a valid configuration
        assert isinstance(cfg, CostConfig)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ens")
    return write_trace(d / "trace", mini_model(), num_requests=8, prompt=64, output=16, skew=1.2)


COMMON = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--duration", "0.2",
          "--concurrency", "8", "--no-progress", "--placement", "linear", "--output-len", "16"]


def _run_json(trace_dir, capsys, *extra) -> dict:
    assert main(["simulate", trace_dir, *COMMON, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_prints_every_throughput_and_tpot_as_the_ensemble_median_with_its_interval(trace_dir, capsys):
    doc = _run_json(trace_dir, capsys, "--context-mix", "64:1")
    s = doc["summaries"][0]
    ens = s["ensemble"]
    assert ens["members"] == E.load_ensemble().size and ens["level"] == 0.8
    for key in ("output_tok_s", "output_tok_s_per_gpu", "prefill_tok_s", "per_user_tok_s", "tpot_p50_s", "tpot_p99_s"):
        lo, hi = s[f"{key}_range"]
        assert lo < hi and math.isfinite(lo)
        assert key in ens["reference_figures"]
    assert list(s).index("output_tok_s_range") == list(s).index("output_tok_s") + 1
    assert "ttft_p50_s_range" not in s  # TTFT is not re-priced
    # the printed table shows the same intervals
    assert main(["simulate", trace_dir, *COMMON, "--context-mix", "64:1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("output tok/s "))
    assert "[" in row and "-" in row.split("[")[1]
    assert "median of" in out and "80 % interval" in out


def test_the_interval_for_isl_8191_and_8192_differs_by_under_5_percent(tmp_path_factory, capsys):
    d = tmp_path_factory.mktemp("isl")
    trace = write_trace(d / "trace", mini_model(), num_requests=4, prompt=64, output=16, skew=1.2)
    docs = [_run_json(trace, capsys, "--context-mix", f"{n}:1", "--duration", "2") for n in (8191, 8192)]
    a, b = (doc["summaries"][0] for doc in docs)
    for key in ("output_tok_s", "tpot_p50_s"):
        for x, y in zip(a[f"{key}_range"], b[f"{key}_range"]):
            assert abs(x / y - 1) < 0.05, (key, a[f"{key}_range"], b[f"{key}_range"])


def test_a_run_on_constants_of_its_own_has_no_interval_and_says_so(trace_dir, capsys, monkeypatch):
    from moeplace.sim import config as sim_config
    from moeplace.sim.config import SimConfig

    cfg = SimConfig(cost=CostConfig().replace(sustained_efficiency=0.5))
    assert E.ensemble_for(cfg) is None
    assert E.ensemble_for(SimConfig()) is not None
    assert E.ensemble_for(SimConfig(ensemble=False)) is None
    assert E.ensemble_for(SimConfig(cost_model="measured")) is None
    assert sim_config.SimConfig().ensemble is True


def test_a_member_prices_throughput_by_its_time_ratio_and_an_open_loop_serves_what_it_was_offered():
    r = {"total": np.array([0.5, 1.0, 1.5, 3.0]), "decode": np.array([1.0, 1.0, 2.0, 2.0])}
    summary = {"output_tok_s": 100.0, "tpot_p50_s": 0.05, "ttft_p50_s": 1.0, "per_user_tok_s": 20.0}
    closed = E.member_log_speeds(summary, {"both": {**r, "busy": 0.5}}, closed=True)
    assert np.allclose(closed["output_tok_s"], -np.log(r["total"]))
    assert np.allclose(closed["tpot_p50_s"], -np.log(r["decode"])) and "ttft_p50_s" not in closed
    opened = E.member_log_speeds(summary, {"both": {**r, "busy": 0.5}}, closed=False)
    # half busy: a faster member serves no more than was offered; a 1.5x slower one still keeps up; 3x does not
    assert np.allclose(opened["output_tok_s"], [0.0, 0.0, 0.0, np.log(1 / (0.5 * 3.0))])
    assert np.allclose(opened["per_user_tok_s"], -np.log(r["decode"]))  # per-token speed scales regardless
    saturated = E.member_log_speeds(summary, {"both": {**r, "busy": 0.99}}, closed=False)
    assert np.allclose(saturated["output_tok_s"], -np.log(r["total"]))
