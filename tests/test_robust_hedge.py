"""The widened robust plan (``--robust --dilate``): it plans for workloads farther from the planning
centroid than any planning scenario, it beats the plain robust plan where the unseen workload is known to
lie there, and the workload left out of a leave-one-domain-out never reaches the planner."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from benchkit import load_bench

import moeplace.placement.policies.moeplace as planner_module
from moeplace.cli.main import main
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.placement.compare import compare_policies, scenarios
from moeplace.placement.optimizer import OptimizerConfig, solve_layer
from moeplace.placement.optimizer.greedy import normalize_scenarios
from moeplace.placement.optimizer.layer import dilate_windows, scenario_loads, spread_rows
from moeplace.placement.optimizer.local_search import LayerState
from moeplace.traces.loads import Loads

E, L, K = 16, 2, 2


def balancedness(p2l, loads_e, G):
    return 1.0 / LayerState(normalize_scenarios(np.asarray(loads_e, float)[None], G), p2l, G).value()


def _spy_on_planner(monkeypatch) -> list[np.ndarray]:
    """Record every loads array the moeplace policy hands its layer optimizer (the planner's whole input)."""
    received: list[np.ndarray] = []
    real = planner_module.optimize_layers

    def spy(loads_wle, *args, **kw):
        received.append(np.asarray(loads_wle).copy())
        return real(loads_wle, *args, **kw)

    monkeypatch.setattr(planner_module, "optimize_layers", spy)
    return received


def test_dilation_scales_each_groups_offset_from_the_centroid_and_keeps_window_noise():
    # two groups, two windows each; group shares (0.6, 0.4) and (0.2, 0.8), centroid (0.4, 0.6)
    loads = np.array([[70.0, 30], [50, 50], [10, 40], [30, 120]])
    groups = np.array([0, 0, 1, 1])
    out = dilate_windows(loads, groups, 2.0)
    np.testing.assert_allclose(out.sum(axis=1), 1.0)
    # window 0: its share (0.7, 0.3) + (2 - 1) * ((0.6, 0.4) - (0.4, 0.6)) = (0.9, 0.1)
    np.testing.assert_allclose(out[0], [0.9, 0.1])
    # window 3: (0.2, 0.8) + ((0.2, 0.8) - (0.4, 0.6)) = (0.0, 1.0); clipped at 0
    np.testing.assert_allclose(out[3], [0.0, 1.0])
    # factor 1, or a single group: the windows as they are
    np.testing.assert_allclose(dilate_windows(loads, groups, 1.0), loads / loads.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(dilate_windows(loads, np.zeros(4, int), 3.0), loads / loads.sum(axis=1, keepdims=True))
    wn = scenario_loads(loads, OptimizerConfig(robust=True, dilate=2.0), 2, groups)
    np.testing.assert_allclose(wn[0], [1.8, 0.2])  # normalized to G = 2


def test_dilate_below_one_is_refused():
    with pytest.raises(InputError, match="--dilate must be >= 1"):
        OptimizerConfig(robust=True, dilate=0.5)


def test_widened_plan_beats_plain_robust_where_the_unseen_workload_is_known():
    # Three planning groups on a line through the load space (t = -1, 0, +1); the unseen workload lies at
    # t = 1.5 — exactly where the group t = +1 sits seen from the others' centroid (t = -0.5), i.e. in the
    # jackknife-widened scenario set (factor 3 / 2) and outside the plain one.
    rng = np.random.default_rng(3)
    E_, G, R = 8, 4, 4
    base = rng.uniform(50, 150, E_)
    v = rng.normal(0, 40, E_)
    v -= v.mean()
    loads = np.array([np.clip(base + t * v, 1, None) for t in (-1.0, 0.0, 1.0)])
    groups = np.arange(3)
    unseen = np.clip(base + 1.5 * v, 1, None)
    deadline = time.time() + 30
    plain = solve_layer(0, loads, E_ + R, G, G, OptimizerConfig(robust=True), deadline, groups=groups)
    wide = solve_layer(0, loads, E_ + R, G, G, OptimizerConfig(robust=True, dilate=1.5), deadline, groups=groups)
    b_plain, b_wide = balancedness(plain.p2l, unseen, G), balancedness(wide.p2l, unseen, G)
    # the unseen workload is one of the widened plan's scenarios: its guarantee covers it
    assert b_wide >= 1.0 / wide.value - 1e-9
    assert b_wide > b_plain + 0.02
    # what it pays on the planning groups themselves is small here
    assert min(balancedness(wide.p2l, w, G) for w in loads) >= min(balancedness(plain.p2l, w, G) for w in loads) - 0.01


@pytest.fixture(scope="module")
def small(k3):
    return replace(k3, name="small", num_layers=L + 1, moe_layers=tuple(range(1, L + 1)), num_experts=E,
                   top_k=K, attention=("kda",) * (L + 1), mla=None)


def _domains(model, per_domain=3, seed=0):
    """Four domains (tags a-d), ``per_domain`` windows each; every window distinct; domain d favours
    experts 4d..4d+3."""
    rng = np.random.default_rng(seed)
    counts, tags = [], []
    for d, tag in enumerate("abcd"):
        for _ in range(per_domain):
            w = np.ones(E)
            w[4 * d:4 * d + 4] = 6.0
            counts.append(rng.multinomial(400, w / w.sum(), size=L))
            tags.append(tag)
    return Loads(np.array(counts, np.int64), model, 200, (), {"window_domains": tags})


@pytest.mark.parametrize("rule", ["jackknife", "auto"])
def test_left_out_domain_never_reaches_the_planner(small, monkeypatch, rule):
    loads = _domains(small)
    ids, names, _ = scenarios(loads)
    held = names.index("c")
    train = np.flatnonzero(ids != held)
    held_rows = {loads.counts[w].tobytes() for w in np.flatnonzero(ids == held)}
    train_rows = {loads.counts[w].tobytes() for w in train}
    received = _spy_on_planner(monkeypatch)
    cmp = compare_policies(loads.select(train), make_cluster(8, "h200", 4), num_redundant=0,
                           policies=["moeplace"], plan_fraction=1.0, shift=True,
                           options={"robust": True, "dilate": rule, "workers": 1, "lns_rounds": 0})
    # the final plan, the shift estimate's folds and (auto) the rule's own folds: all from the 3 other domains
    assert len(received) >= 1 + 3
    for arr in received:
        for row in arr.astype(np.int64):
            assert row.tobytes() not in held_rows
            assert row.tobytes() in train_rows
    summary = cmp.results[0].placement.provenance["params"]["summary"]
    assert summary["dilate_rule"] == rule
    assert cmp.results[0].placement.provenance["params"]["config"]["dilate"] == pytest.approx(1.5) or (
        rule == "auto" and summary["dilate_chosen"] == "none")


def test_dilate_needs_robust_on_the_command_line(small, tmp_path, capsys):
    path = tmp_path / "l.npz"
    _domains(small).save(path)
    rc = main(["optimize", str(path), "--gpus", "8", "--gpus-per-node", "4", "--dilate", "auto", "--no-out"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--dilate needs --robust" in err and len(err.splitlines()) == 1


def test_dilate_below_one_exits_2_with_one_line(small, tmp_path, capsys):
    path = tmp_path / "l.npz"
    _domains(small).save(path)
    rc = main(["optimize", str(path), "--gpus", "8", "--robust", "--dilate", "0.5", "--no-out"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "expected a number >= 1 or one of jackknife, auto, got '0.5'" in err


# ---------------------------------------------------------------------------- --spread (mean + k sd)
def _gpu_of(p2l, G):
    S = len(p2l) // G
    return {int(e): g for g in range(G) for e in p2l[g * S:(g + 1) * S]}


def test_spread_rows_are_the_mean_moved_k_sd_along_the_principal_direction():
    # two windows differing along (1, 1, -1, -1): mean (30, 10, 20, 20), offsets +-(4, 4, -4, -4)
    wn = normalize_scenarios(np.array([[34.0, 14, 16, 16], [26, 6, 24, 24]]), 2)
    rows = spread_rows(wn, 2.0)
    assert rows.shape == (2, 4)  # one direction with variance, both ways
    m = wn.mean(axis=0)
    # normalized (rows sum to G = 2): offsets +-(0.1, 0.1, -0.1, -0.1), so the sd along v is 0.2 and the
    # rows are m +- 2 * 0.2 * v = (0.95, 0.45, 0.3, 0.3) and (0.55, 0.05, 0.7, 0.7)
    v = np.array([1.0, 1, -1, -1]) / 2
    expect = sorted([tuple(m + 0.4 * v), tuple(m - 0.4 * v)])
    np.testing.assert_allclose(sorted(map(tuple, rows)), [(0.55, 0.05, 0.7, 0.7), (0.95, 0.45, 0.3, 0.3)])
    np.testing.assert_allclose(sorted(map(tuple, rows)), expect)
    np.testing.assert_allclose(rows.sum(axis=1), 2.0)
    # a GPU holding experts {0, 1}: worst row = its mean load + k * its load's sd along v
    x = np.array([1.0, 1, 0, 0])
    sd_g = abs(x @ (wn - m).T).max()
    assert (rows @ x).max() == pytest.approx(x @ m + 2.0 * sd_g)
    # identical windows: no direction, no rows; spread 0: the robust scenarios unchanged
    assert spread_rows(np.repeat(wn[:1], 3, axis=0), 2.0).shape == (0, 4)
    loads = np.array([[34.0, 14, 16, 16], [26, 6, 24, 24]])
    np.testing.assert_allclose(scenario_loads(loads, OptimizerConfig(robust=True), 2), wn)
    assert scenario_loads(loads, OptimizerConfig(robust=True, spread=2.0), 2).shape == (4, 4)


def test_spread_separates_two_experts_that_rise_together_where_mean_and_windows_pair_them():
    # Experts A=0, B=1, C=2, D=3 with mean loads 3 : 1 : 2 : 2 on 2 GPUs, 2 slots each. A and B rise and
    # fall together (by 0.4). The mean plan pairs them ({A, B} | {C, D} is perfectly even on the mean),
    # and so does the plain robust plan (the windows' own spread costs {A, B} 1.20 max/mean, less than the
    # 1.25 of any other pairing). Planned at mean +- 2 sd along that co-movement, {A, B} would reach 1.40:
    # the hedged plan splits them.
    loads = np.array([[34.0, 14, 16, 16], [26, 6, 24, 24]])
    G, deadline = 2, time.time() + 30
    mean = solve_layer(0, loads, 4, G, G, OptimizerConfig(robust=False), deadline)
    plain = solve_layer(0, loads, 4, G, G, OptimizerConfig(robust=True), deadline)
    hedged = solve_layer(0, loads, 4, G, G, OptimizerConfig(robust=True, spread=2.0), deadline)
    for res in (mean, plain):
        where = _gpu_of(res.p2l, G)
        assert where[0] == where[1]
    where = _gpu_of(hedged.p2l, G)
    assert where[0] != where[1]
    # the co-movement grown to twice what was seen: the hedged plan keeps 0.80, the plain one 0.71
    grown = np.array([38.0, 18, 12, 12])
    assert balancedness(hedged.p2l, grown, G) == pytest.approx(0.8)
    assert balancedness(plain.p2l, grown, G) == pytest.approx(40 / 56)
    # what it pays on the planning windows themselves: 1.25 against 1.20 max/mean on the worse window
    wins = normalize_scenarios(loads, G)
    assert LayerState(wins, hedged.p2l, G).value() == pytest.approx(1.25)
    assert LayerState(wins, plain.p2l, G).value() == pytest.approx(1.2)


def test_spread_auto_picks_from_the_planning_domains_only(small, monkeypatch):
    loads = _domains(small)
    ids, names, _ = scenarios(loads)
    held = names.index("b")
    train = np.flatnonzero(ids != held)
    held_rows = {loads.counts[w].tobytes() for w in np.flatnonzero(ids == held)}
    received = _spy_on_planner(monkeypatch)
    cmp = compare_policies(loads.select(train), make_cluster(8, "h200", 4), num_redundant=0,
                           policies=["moeplace"], plan_fraction=1.0, shift=False,
                           options={"robust": True, "spread": "auto", "workers": 1, "lns_rounds": 0})
    assert len(received) == 2 * 3 + 1  # 2 candidates x 3 planning groups, then the final plan
    for arr in received:
        for row in arr.astype(np.int64):
            assert row.tobytes() not in held_rows
    params = cmp.results[0].placement.provenance["params"]
    summary = params["summary"]
    assert summary["spread_rule"] == "auto" and set(summary["spread_cv"]) == {"none", "sd"}
    chosen = params["config"]["spread"]
    assert chosen == (pytest.approx(np.sqrt(2 * np.log(8))) if summary["spread_chosen"] == "sd" else 0.0)
    cv = summary["spread_cv"]
    better = (cv["sd"]["worst"], cv["sd"]["mean"]) > (cv["none"]["worst"], cv["none"]["mean"])
    assert (summary["spread_chosen"] == "sd") == better


@pytest.mark.parametrize("argv, msg", [
    (["--spread", "2"], "--spread needs --robust"),
    (["--robust", "--spread", "auto", "--dilate", "auto"], "--dilate auto and --spread auto cannot be combined"),
    (["--robust", "--spread", "-1"], "expected a number >= 0 or one of auto, got '-1'"),
])
def test_spread_bad_flags_exit_2_with_one_line(small, tmp_path, capsys, argv, msg):
    path = tmp_path / "l.npz"
    _domains(small).save(path)
    rc = main(["optimize", str(path), "--gpus", "8", "--gpus-per-node", "4", "--no-out", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and msg in err


LIMIT = 1.0


def test_spread_auto_keeps_the_time_limit(small):
    from moeplace.placement.policies import PlacementProblem, get_policy

    loads = _domains(small, per_domain=4)
    ids, _, _ = scenarios(loads)
    problem = PlacementProblem(loads=loads.counts.astype(np.float64), model=small, cluster=make_cluster(8, "h200", 4),
                               num_redundant=8, time_limit=LIMIT,
                               options={"robust": True, "spread": "auto", "scenarios": ids, "workers": 1})
    t0 = time.monotonic()
    placement = get_policy("moeplace")(problem)
    assert time.monotonic() - t0 < 1.0 + 1.5  # 9 plans share the limit; the last one gets what is left
    summary = placement.provenance["params"]["summary"]
    assert summary["spread_chosen"] in ("none", "sd") and summary["max_gap"] >= 0.0


def test_spread_on_the_command_line_says_what_the_plan_optimizes(small, tmp_path, capsys):
    path = tmp_path / "l.npz"
    _domains(small).save(path)
    rc = main(["optimize", str(path), "--gpus", "8", "--gpus-per-node", "4", "--robust", "--spread", "2",
               "--policy", "moeplace", "--no-shift", "--time-limit", "20", "--out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "moeplace: on the worst planning window and the windows' mean moved +-2.00 sd along the top" in out
    import json
    config = json.loads((tmp_path / "p.json").read_text())["provenance"]["params"]["config"]
    assert config["spread"] == 2.0 and config["robust"] is True


def test_hot_hits_counts_the_unseen_domains_hot_experts_each_statistic_finds():
    bench = load_bench("shift_lodo")
    # 3 domains x 2 windows (equal), 1 layer, experts A..F; the unseen domain 2 is hot on A and B. A and B
    # are steady in domains 0 and 1 (top of their mean, zero spread); C and D are hot in one domain each (top
    # of their maximum and of their spread) and cold in domain 2.
    dom = {0: [30, 25, 40, 0, 5, 0], 1: [30, 25, 0, 35, 10, 0], 2: [50, 40, 2, 2, 3, 3]}
    counts = np.array([dom[d] for d in (0, 0, 1, 1, 2, 2)], dtype=np.float64)[:, None, :]  # [W, L, E]
    hits = bench._hot_hits(counts, np.array([0, 0, 1, 1, 2, 2]), 2, r=2)
    assert hits == {"mean": 1.0, "max": 0.0, "sd": 0.0, "random": 2 / 6, "own_half": 1.0}
    # left out in turn, domain 0's hot pair {C, A} is half found by the others' mean (A) and by their max (A)
    hits0 = bench._hot_hits(counts, np.array([0, 0, 1, 1, 2, 2]), 0, r=2)
    assert hits0["mean"] == 0.5 and hits0["max"] == 0.5
