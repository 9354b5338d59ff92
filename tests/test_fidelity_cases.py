"""The committed fidelity results (bench/results/fidelity.json) belong to the committed case table
(bench/fidelity_cases.yaml): same cases, splits and configurations, so a case edited without re-running
bench/fidelity.py fails here."""
from __future__ import annotations

import json

import numpy as np
from benchkit import REPO, load_bench


def _fidelity():
    return load_bench("fidelity")


def test_committed_results_match_the_case_table():
    fid = _fidelity()
    frozen = fid.load_frozen()
    cases = fid.load_cases(REPO / "bench" / "fidelity_cases.yaml")
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    rows = res["cases"]
    assert [r["id"] for r in rows] == [c["id"] for c in cases]
    for r, c in zip(rows, cases):
        assert (r["split"], r["published"], r["config_full"], r["assumptions"], r["published_on"]) == (
            c["split"], c["published"], c["config"], c["assumptions"], str(c["published_on"])), c["id"]
        assert r["after_cutoff"] == fid.after_cutoff(c, frozen)
        assert r["error"] == r["simulated"] / r["published"] - 1
        assert r["cv_error"] == r["cv_simulated"] / r["published"] - 1
    assert res["frozen"] == {"frozen_on": str(frozen["frozen_on"]), "cutoff": str(frozen["cutoff"]),
                             **({"structure_cutoff": str(frozen["structure_cutoff"])}
                                if frozen.get("structure_cutoff") else {}),
                             "code_commit": frozen["code_commit"]}


def test_cases_after_the_cutoff_never_enter_the_ensemble():
    """The shipped ensemble is drawn from, fitted on and its residuals taken from the cases published on or
    before the frozen cut-off only; a case after it is priced by every member (none saw it)."""
    from moeplace.sim.ensemble import load_ensemble

    fid = _fidelity()
    frozen = fid.load_frozen()
    cases = fid.load_cases(fid.CASES)
    before = [c for c in cases if not fid.after_cutoff(c, frozen)]
    ens = load_ensemble()
    assert list(ens.groups) == list(dict.fromkeys(c["group"] for c in before))
    assert [c["id"] for c in ens.cases] == [c["id"] for c in before if c["kind"] in fid.E2E]
    assert ens.provenance["cutoff"] == str(frozen["cutoff"]) == ens.provenance["cutoff"]
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    after = [r for r in res["cases"] if r["after_cutoff"]]
    assert res["after_cutoff"]["ids"] == [r["id"] for r in after]
    assert res["ensemble"]["groups"] == list(ens.groups) and res["ensemble"]["members"] == ens.size


def test_the_frozen_structure_is_checked(tmp_path):
    """bench/fidelity_frozen.yaml is the structure a run fits and scores: a sourced constant of the code that
    differs from it, or a missing date, stops the run with one line saying to re-freeze."""
    import datetime

    import pytest
    import yaml

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    raw = yaml.safe_load(fid.FROZEN.read_text())
    bad = tmp_path / "frozen.yaml"
    bad.write_text(yaml.safe_dump({**raw, "fixed": {**raw["fixed"], "fp4_gemm_speedup": 2.0}}))
    with pytest.raises(InputError, match="fp4_gemm_speedup .* differs from the frozen .* re-freeze"):
        fid.load_frozen(bad)
    bad.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "cutoff"}))
    with pytest.raises(InputError, match="field 'cutoff' missing"):
        fid.load_frozen(bad)
    bad.write_text(yaml.safe_dump({**raw, "structure_cutoff": raw["cutoff"] + datetime.timedelta(days=1)}))
    with pytest.raises(InputError, match="structure_cutoff .* is after cutoff"):
        fid.load_frozen(bad)
    bad.write_text(yaml.safe_dump({**raw, "structure_cutoff": "soon"}))
    with pytest.raises(InputError, match="'structure_cutoff' must be a date"):
        fid.load_frozen(bad)
    bad.write_text(yaml.safe_dump({**raw, "interval": {**raw["interval"], "level": 0.9}}))
    with pytest.raises(InputError, match="level .* re-freeze"):
        fid.load_frozen(bad)


def test_publication_dates_are_checked_and_split_the_cases():
    import datetime

    fid = _fidelity()
    frozen = {"cutoff": datetime.date(2025, 6, 30)}
    assert fid.publication_date({"published_on": "2025-05"}) == datetime.date(2025, 5, 31)
    assert not fid.after_cutoff({"published_on": "2025-06-30"}, frozen)
    assert fid.after_cutoff({"published_on": "2025-07-01"}, frozen)
    assert not fid.after_cutoff({"published_on": "unknown"}, frozen)  # counts as seen
    assert all(fid.publication_date(c) or str(c["published_on"]) == "unknown" for c in fid.load_cases(fid.CASES))
    # after a refit moved the cut-off, the structure's own cut-off still marks the cases never used to choose it
    assert not fid.after_structure({"published_on": "2026-05-01"}, frozen)  # no structure cut-off: none
    frozen["structure_cutoff"] = datetime.date(2025, 3, 31)
    assert fid.after_structure({"published_on": "2025-04"}, frozen)
    assert not fid.after_structure({"published_on": "2025-03-31"}, frozen)
    assert not fid.after_structure({"published_on": "unknown"}, frozen)


def test_balanced_routing_is_exactly_balanced():
    """``routing: balanced`` (DeepSeek's profiles simulate absolutely balanced routing): every expert of every
    layer is chosen by exactly T k / E tokens, each token's k experts distinct."""
    fid = _fidelity()
    case = next(c for c in fid.load_cases(fid.CASES) if c["config"].get("routing") == "balanced")
    trace = fid.case_trace(case, quick=True)
    T, L, k = trace.expert_ids.shape
    E = trace.model.num_experts
    counts = trace.expert_counts()
    assert counts.shape == (L, E) and (counts == T * k // E).all()
    ids = np.sort(trace.expert_ids.astype(np.int64), axis=2)
    assert (np.diff(ids, axis=2) > 0).all()


def test_breakdown_composes_the_steady_iteration():
    """The stored per-case breakdown is the steady iteration's own composition: under dual-batch overlap a
    MoE layer is the larger of its compute and communication sides (a pipeline fill per iteration aside),
    the busiest GPU never beats the mean one, and the iteration's total is the metric's iteration."""
    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    case = next(c for c in fid.load_cases(fid.CASES) if c["id"] == "deepseek-profile-decode-ep128")
    steady = fid.Steady(case, quick=True)
    b = steady.breakdown(CostConfig())
    assert b["mode"] == "low_latency" and b["dbo"] and b["graph"]
    assert np.isclose(b["layer_us"], max(b["overlap_compute_us"], b["overlap_comm_us"]), rtol=1e-9)
    assert b["experts_busiest_us"] >= b["experts_mean_us"] > 0
    assert b["dispatch_slowest_us"] >= b["dispatch_mean_us"] > 0 and b["combine_slowest_us"] >= b["combine_mean_us"]
    assert 1.0 <= b["busiest_over_mean_selections"] < 1.2  # exactly balanced routing: sampling noise only
    # the published figure is output tokens per node per second of the iteration (with its drafting)
    c = case["config"]
    per_node = 8 * c["batch_per_rank"] * steady.engine.mtp_tokens_per_step() / ((b["iteration_ms"] + b["drafting_ms"]) / 1e3)
    assert np.isclose(steady.metric(CostConfig()), per_node, rtol=1e-9)


def test_validation_coverage():
    """Issue 27's coverage floor on the case table itself: >= 30 validation cases from >= 6 source
    organisations, >= 3 models (a Kimi K2/K3-class one among them), all three engines, GPUs of three
    generations (Hopper, Blackwell, Blackwell Ultra)."""
    fid = _fidelity()
    val = [c for c in fid.load_cases(fid.CASES) if c["split"] == "validation"]
    assert len(val) >= 30
    assert len({c["source"]["org"] for c in val}) >= 6
    models = {c["model"] for c in val}
    assert len(models) >= 3 and models & {"kimi-k2", "kimi-k3"}
    assert {fid.case_engine(c) for c in val} >= set(fid.ENGINES)
    gens = {"hopper": {"h100", "h200", "h800"}, "blackwell": {"b200", "gb200-nvl72"},
            "blackwell-ultra": {"b300", "gb300-nvl72"}}
    gpus = {c["gpu"] for c in val}
    assert all(gpus & g for g in gens.values()), gpus


def test_engine_and_metric_fields_are_checked(tmp_path):
    """A case's ``engine`` names one of the three engines and its ``metric`` one the script computes; a
    wrong value is one line naming the case and field."""
    import pytest

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    for c in fid.load_cases(fid.CASES):
        assert c["metric"] in fid.METRICS
        if c["kind"] in fid.E2E and c["source"]["org"] not in ("DeepSeek", "Alibaba RTP-LLM"):
            assert fid.case_engine(c) in fid.ENGINES, c["id"]
    case = ("- id: x\n  source: {{org: o, title: t, url: u}}\n  published_on: '2025-05-05'\n  split: validation\n  group: g\n"
            "  regime: mid-batch decode\n  kind: serve\n  gpu: h200\n"
            "  model: deepseek-v3\n  engine: {engine}\n  config: {{gpus: 8, batch_per_rank: 8}}\n  metric: {metric}\n  published: 1\n"
            "  assumptions: []\n")
    bad = tmp_path / "cases.yaml"
    bad.write_text(case.format(engine="tgi", metric="output_tok_s_per_gpu"))
    with pytest.raises(InputError, match=r"case 1 \(x\): field 'engine' must be one of"):
        fid.load_cases(bad)
    bad.write_text(case.format(engine="vllm", metric="tok_s"))
    with pytest.raises(InputError, match=r"case 1 \(x\): field 'metric' must be one of"):
        fid.load_cases(bad)


def test_every_case_has_a_source_a_date_and_fields_of_the_right_kinds(tmp_path):
    """Every case of the table parses with its source (org, title, web address), a publication date (or
    ``unknown``: counted as seen), its assumptions as lines of text, a GPU and model preset and the
    configuration fields its kind runs on as whole numbers; the cases after the cut-off all carry an
    established date. A field of the wrong kind is one line naming the case and the field."""
    import pytest
    import yaml

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    frozen = fid.load_frozen()
    cases = fid.load_cases(fid.CASES)
    for c in cases:
        assert c["source"]["url"].startswith("https://") and c["source"]["org"] and c["source"]["title"], c["id"]
        assert fid.publication_date(c) is not None or str(c["published_on"]) == "unknown", c["id"]
        assert c["assumptions"] and all(isinstance(a, str) for a in c["assumptions"]), c["id"]
        if fid.after_cutoff(c, frozen):
            assert fid.publication_date(c) > frozen["cutoff"] and c["split"] == "validation", c["id"]
    raw = yaml.safe_load(fid.CASES.read_text())
    k3 = next(c for c in raw if c["id"] == "vllm-k3-gb300-tp8-bs1")
    bad = tmp_path / "cases.yaml"
    for change, match in [
            ({"config": {**k3["config"], "gpus": "8"}}, r"field 'config.gpus' must be a whole number >= 1, got '8'"),
            ({"config": {**k3["config"], "attention_tp": 3}}, r"field 'config.attention_tp' \(3\) must divide"),
            ({"config": {k: v for k, v in k3["config"].items() if k != "osl"}}, r"field 'config.osl' missing"),
            ({"config": {**k3["config"], "kv_dtype": "fp6"}}, r"field 'config.kv_dtype' must be one of"),
            ({"config": {**k3["config"], "expert_dtype": "int3"}}, r"field 'config.expert_dtype' must be one of"),
            ({"config": {**k3["config"], "duration": -1}}, r"field 'config.duration' must be a positive number"),
            ({"gpu": "h300"}, r"field 'gpu' must be a GPU preset"),
            ({"model": "kimi-k4"}, r"field 'model' must be a model preset"),
            ({"source": {**k3["source"], "url": "vllm.ai"}}, r"field 'source' needs org, title and url as text"),
            ({"assumptions": []}, r"field 'assumptions' must be a list of at least one line"),
            ({"published_on": "July 2026"}, r"field 'published_on' must be YYYY-MM-DD")]:
        bad.write_text(yaml.safe_dump([{**k3, **change}]))
        with pytest.raises(InputError, match=r"case 1 \(vllm-k3-gb300-tp8-bs1\): " + match):
            fid.load_cases(bad)
    bad.write_text(yaml.safe_dump([k3]))
    assert fid.load_cases(bad)[0]["config"] == k3["config"]


def test_total_and_per_gpu_prompt_metrics():
    """``total_tok_s`` is the deployment's prompt plus output tokens per second; ``input_tok_s_per_gpu`` the
    prompt tokens one GPU computes; a stated ``kv_tokens`` is the KV pool the simulation gets."""
    fid = _fidelity()
    s = {"prefill_tok_s_per_gpu": 1000.0, "output_tok_s_per_gpu": 50.0, "per_user_tok_s": None}
    total = {"metric": "total_tok_s", "config": {"gpus": 8}}
    assert fid._from_summary(total, s) == 8 * 1050.0
    assert fid._from_summary({"metric": "input_tok_s_per_gpu", "config": {"gpus": 8}}, s) == 1000.0
    assert fid._from_summary({"metric": "output_tok_s", "config": {"gpus": 8}}, s) == 400.0
    assert fid._from_summary({"metric": "input_tok_s_per_node", "config": {"gpus": 8}}, s) == 8000.0
    case = next(c for c in fid.load_cases(fid.CASES) if c["config"].get("kv_tokens"))
    assert fid.case_kv_tokens(case, None, None, None) == case["config"]["kv_tokens"]


def test_group_and_regime_fields_are_checked(tmp_path):
    """Every case names its deployment group and its regime; the regime must be the label's rule over the
    case's configuration (``kernel`` for kernel tables), one line naming the case and field otherwise."""
    import pytest
    import yaml

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    cases = fid.load_cases(fid.CASES)
    assert all(c["group"] and c["regime"] for c in cases)
    raw = yaml.safe_load(fid.CASES.read_text())
    bad = tmp_path / "cases.yaml"
    wrong = next(c for c in raw if c["id"] == "trtllm-b200-min-latency")
    bad.write_text(yaml.safe_dump([{**wrong, "regime": "max-throughput"}]))
    with pytest.raises(InputError, match=r"case 1 \(trtllm-b200-min-latency\): field 'regime' must be "
                                         r"'single-user latency'"):
        fid.load_cases(bad)
    bad.write_text(yaml.safe_dump([{k: v for k, v in wrong.items() if k != "group"}]))
    with pytest.raises(InputError, match=r"case 1 \(trtllm-b200-min-latency\): missing field 'group'"):
        fid.load_cases(bad)


def test_committed_coverage_is_its_rows_summary():
    """bench/results/fidelity.json's ``cv`` and ``coverage`` are the summaries of its own rows (each case's
    held-out figure and whether its interval held the published figure), before the cut-off only."""
    fid = _fidelity()
    fe = fid.fe
    res = json.loads((REPO / "bench" / "results" / "fidelity.json").read_text())
    held = [r for r in res["cases"] if not r["after_cutoff"] and r["kind"] in fid.E2E]
    assert res["cv"]["all"] == json.loads(json.dumps(fe.error_stats([(r, r["cv_error"]) for r in held])))
    cov = res["coverage"]["all"]
    assert cov["cases"] == len(held) and cov["covered"] == sum(r["covered"] for r in held)
    for r in held:  # the flag is the interval's own verdict
        lo, hi = r["interval"]
        assert r["covered"] == (lo <= r["published"] <= hi), r["id"]
    assert set(res["width"]) == set(res["coverage"]) and res["width"]["all"] == cov["median_width"]
    for kind, c in res["coverage"].items():  # how precisely the groups measure it: from the same rows' flags
        if not c.get("cases"):
            continue
        by_group: dict[str, list[bool]] = {}
        for r in held:
            if kind == "all" or r["kind"] == kind:
                by_group.setdefault(r["group"], []).append(r["covered"])
        assert c["coverage_range"] == fe.coverage_range(by_group), kind
        assert c["coverage_range"][0] <= c["coverage"] <= c["coverage_range"][1], kind


def test_the_coverage_range_resamples_whole_groups():
    """A coverage measured on few groups is imprecise, the more so when one group holds many of the cases:
    the 5-95 % range over group resamples is that of a ratio of whole groups' hits to their cases, repeats
    with its seed, and is a point when every group agrees."""
    fe = _fidelity().fe
    assert fe.coverage_range({"a": [True, True], "b": [True]}) == [1.0, 1.0]
    assert fe.coverage_range({"a": [False] * 3, "b": [False]}) == [0.0, 0.0]
    # two groups: a (3 cases, all inside) and b (1 case, missed). Each resample draws two groups, so its
    # coverage is 1 (a, a: 1/4 of draws), 3/4 (a, b or b, a: 1/2) or 0 (b, b: 1/4)
    lo, hi = fe.coverage_range({"a": [True] * 3, "b": [False]})
    assert lo == 0.0 and hi == 1.0
    # the same 12 cases, 6 of them missed: one group of 6 misses is far less precise than 6 groups of one
    big = fe.coverage_range({"miss": [False] * 6, **{f"g{i}": [True] for i in range(6)}})
    assert fe.coverage_range({"miss": [False] * 6, **{f"g{i}": [True] for i in range(6)}}) == big  # repeats
    small = fe.coverage_range({**{f"m{i}": [False] for i in range(6)}, **{f"g{i}": [True] for i in range(6)}})
    assert big[0] < small[0] and big[1] > small[1], (big, small)
    assert small[0] < 0.5 < small[1]


def test_out_of_bag_members_never_drew_the_group_they_predict(monkeypatch):
    """Each member's fit weighs every case by its group's draws (0: left out), and a case's held-out figure
    is the median over the members that never drew its group (the kernel tables here: no simulation)."""
    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    fe = fid.fe
    cases = [c for c in fid.load_cases(fid.CASES) if c["kind"] == "gemm"]
    groups = list(dict.fromkeys(c["group"] for c in cases))
    bags = fe.bootstrap_bags(groups, 6, 0)
    assert (bags.sum(axis=1) == len(groups)).all()
    seen = []
    real_fit = fe.fit

    def recording_fit(fit_cases, quick, weights=None, **kw):
        seen.append(dict(weights))
        return real_fit(fit_cases, True, weights=weights, **kw)

    monkeypatch.setattr(fe, "fit", recording_fit)
    params, _ = fe.fit_members(cases, groups, bags, CostConfig(), {}, {}, True, workers=1, log=lambda *_: None)
    gi = {g: i for i, g in enumerate(groups)}
    for b, weights in enumerate(seen):
        assert weights == {c["id"]: float(bags[b, gi[c["group"]]]) for c in cases}
    configs = fe.member_configs(params, CostConfig())
    speeds = {c["id"]: fe.member_speeds(c, None, configs, CostConfig()) for c in cases}
    recs, residuals = fe.held_out(cases, speeds, {}, groups, bags, {}, 0.8, 1.0)
    assert residuals == []  # kernel tables give no interval residuals
    for c, rec in zip(cases, recs):
        oob = fe.oob_mask(bags, gi, c["group"])
        assert rec["oob_log_speed"] == fe.wmedian(speeds[c["id"]]["figure"], oob)


def test_loading_a_bench_script_leaves_sys_path_alone():
    """bench/kernels.py must never answer ``import kernels`` (transformers probes Hugging Face's library of
    that name) in a test process that loaded a bench script before."""
    import sys

    before = list(sys.path)
    load_bench("fidelity", "bench_fidelity_path_check")
    assert sys.path == before


def test_event_simulations_in_two_spawned_workers_equal_one_process(monkeypatch):
    """bench/fidelity.py runs its event simulations in spawned workers (polars' pool hangs in a fork): with
    two workers every figure, detail and sampled iteration is the one-process run's, bit for bit, whatever
    order the work is handed out in (here the last case first)."""
    import functools
    import pickle

    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    fe = fid.fe
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the spawned workers import the bench modules by name
    cases = [c for c in fid.load_cases(fid.CASES)
             if c["kind"] == "prefill" and c["config"].get("routing") == "balanced"][:2]
    assert len(cases) == 2
    for c in cases:
        fid.case_trace(c, quick=True)  # built here; the workers get this process's traces
    run = functools.partial(fe.reference_run, cfg=CostConfig(), quick=True)
    one = fe.spawn_map(run, cases, 1)
    two = fe.spawn_map(run, cases, 2, cost=[0.0, 1.0])

    def same(r):
        return pickle.dumps((r.simulated, {k: v for k, v in r.detail.items() if k != "wall_s"}, r.features,
                             [it[3] for it in r.sample.items]))
    assert [same(r) for r in one] == [same(r) for r in two]


def test_a_refit_within_the_tolerance_keeps_its_start():
    """bench/fidelity.py keeps the start (the CostConfig defaults) as the reference when the refit moves no
    constant by more than REFERENCE_TOL of its bounds' range, and names every constant that moved further."""
    from moeplace.sim.config import CostConfig

    fid = _fidelity()
    name, lo, hi = next(f for f in fid.FIT if f[0] == "hbm_efficiency")
    start = CostConfig()
    near = start.replace(hbm_efficiency=start.hbm_efficiency + 0.5 * fid.REFERENCE_TOL * (hi - lo))
    far = start.replace(hbm_efficiency=start.hbm_efficiency - 2 * fid.REFERENCE_TOL * (hi - lo))
    assert fid.drift(start, near) == {}
    assert fid.drift(start, far) == {name: [start.hbm_efficiency, far.hbm_efficiency]}


def _latency_ensemble(residual: float):
    """Two groups' worth of a tiny ensemble: 4 members (0 and 3 drew g1, 1 and 2 drew g2), one published case
    per group at the run's own settings, residuals +r (g1) and -r (g2)."""
    from moeplace.sim.ensemble import FEATURES, Ensemble

    x = {f: 0.0 for f in FEATURES}
    cases = ({"id": "a", "group": "g1", "kind": "serve", "features": x, "residual": residual},
             {"id": "b", "group": "g2", "kind": "serve", "features": x, "residual": -residual})
    ens = Ensemble(("gemm_efficiency",), {}, np.zeros((4, 1)), np.full(4, 0.25), ("g1", "g2"),
                   np.array([[1, 0], [0, 1], [0, 1], [1, 0]]), cases, {f: 1.0 for f in FEATURES}, 0.8, {}, 1.0)
    return ens, x


def test_a_latency_is_compared_with_its_own_median_and_interval():
    """A per-request TTFT / TPOT: after the cut-off every member's median and the shipped interval (the members'
    out-of-bag medians plus each published case's residual: here 200 ms x / 1.25 -> 160 - 250 ms); before it
    only the members that never drew the case's group (200 ms, not the all-member 350 ms) and an interval
    with the group left out (its one remaining case: 200 x 1.25, widened to the median: 200 - 250 ms)."""
    import math

    fid = _fidelity()
    ens, x = _latency_ensemble(math.log(1.25))
    z = -np.log(np.full(4, 0.2))  # every member: 200 ms
    r = fid.latency_record({"id": "new", "group": "g3"}, 240.0, z, ens, x, after=True)
    assert np.isclose(r["simulated_ms"], 200.0) and np.isclose(r["error"], 200 / 240 - 1)
    assert np.allclose(r["interval_ms"], [160.0, 250.0]) and r["covered"]
    assert not fid.latency_record({"id": "new", "group": "g3"}, 300.0, z, ens, x, after=True)["covered"]
    z = -np.log([0.5, 0.2, 0.2, 0.6])  # members 1 and 2 never drew g1
    r = fid.latency_record({"id": "a", "group": "g1"}, 260.0, z, ens, x, after=False)
    assert np.isclose(r["simulated_ms"], 200.0) and np.allclose(r["interval_ms"], [200.0, 250.0]) and not r["covered"]


def test_ttft_is_checked_on_the_cases_that_publish_it(monkeypatch):
    """latency.ttft holds, per case that publishes a TTFT, the ensemble median and interval from its members'
    TTFT speeds, the reference run's own TTFT and how many prompt iterations re-priced it; a case marked not
    comparable is listed with its reason and left out of the summary; cases without a published TTFT are not
    there."""
    import datetime
    import math
    from types import SimpleNamespace

    fid = _fidelity()
    ens, x = _latency_ensemble(math.log(1.25))
    cases = [{"id": "t", "group": "g3", "published_on": "2026-07-27", "published_latency": {"ttft_p50_ms": 240.0}},
             {"id": "q", "group": "g3", "published_on": "2026-07-27",
              "published_latency": {"ttft_p50_ms": 9000.0, "ttft_comparable": False, "why": "open-loop burst"}},
             {"id": "d", "group": "g3", "published_on": "2026-07-27", "published_latency": {"tpot_p50_ms": 9.0}}]
    run = SimpleNamespace(detail={"ttft_p50_s": 0.25, "tpot_p50_s": 0.01},
                          sample=SimpleNamespace(prefill=SimpleNamespace(items=[0, 1, 2])))
    z = -np.log(np.full(4, 0.2))
    speeds = {"t": {"ttft": z}, "q": {"ttft": z}, "d": {"tpot": -np.log(np.full(4, 0.01))}}
    lat = fid.latency_checks(cases, {c["id"]: run for c in cases}, speeds, ens, {c["id"]: x for c in cases},
                             {"cutoff": datetime.date(2026, 2, 13)})
    t, q = lat["ttft"]["cases"]
    assert t["id"] == "t" and np.isclose(t["simulated_ms"], 200.0) and np.allclose(t["interval_ms"], [160, 250])
    assert t["covered"] and t["after_cutoff"] and t["reference_ms"] == 250.0 and t["prefill_iterations"] == 3
    assert not q["comparable"] and q["why"] == "open-loop burst"
    assert lat["ttft"]["n"] == 1 and lat["ttft"]["covered"] == 1 and np.isclose(lat["ttft"]["median_abs_error"], 40 / 240)
    assert [r["id"] for r in lat["tpot"]["cases"]] == ["d"] and np.isclose(lat["tpot"]["cases"][0]["simulated_ms"], 10.0)
    text = "\n".join(fid.latency_text(lat))
    assert "TTFT t" in text and "[160.0 - 250.0]" in text and "TTFT: 1 comparable cases" in text


def test_the_prefill_sample_only_observes():
    """PrefillAwareSample keeps the pool's sample exactly as sim.ensemble.IterationSample does, and apart the
    iterations that compute prompt tokens; with none of those sampled a TTFT falls back to the all-iteration
    ratio."""
    from types import SimpleNamespace

    from moeplace.sim.cost import RankWork
    from moeplace.sim.ensemble import IterationSample

    fe = _fidelity().fe
    plain, aware = IterationSample(keep=4), fe.PrefillAwareSample(keep=4)
    for i in range(40):
        w = RankWork.zeros(2)
        w.pre_tokens[:] = 100.0 if i % 5 == 0 else 0.0
        for s in (plain, aware):
            s.offer(w, RankWork.zeros(2), 0.01 * (i + 1))
    assert [(it[0], it[3]) for it in aware.items] == [(it[0], it[3]) for it in plain.items]
    assert aware.prefill.seen == 8 and all(float(it[1].pre_tokens.sum()) > 0 for it in aware.prefill.items)
    run = SimpleNamespace(sample=plain)
    fallback = np.array([1.1, 0.9])
    assert fe.prefill_iterations(run) == 0 and fe.ttft_ratio(run, [None, None], None, fallback) is fallback


def test_the_prefill_sample_sees_the_prompt_iterations_of_a_real_run(tmp_path):
    """On the event simulator (a tiny closed-loop run, no published case): under prefill_sampling the pool's
    sample is a PrefillAwareSample whose prefill part holds only iterations that compute prompt tokens, the
    run's figures and main sample are those of a run without it, and the simulator's own class is restored."""
    from simkit import linear_placement, mini_model, write_trace

    from moeplace.foundation.cluster import make_cluster
    from moeplace.sim import engine as sim_engine
    from moeplace.sim.config import CostConfig, EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.ensemble import IterationSample
    from moeplace.sim.runner import simulate
    from moeplace.sim.workload import load_trace_tokens

    fe = _fidelity().fe
    m = mini_model()
    trace = load_trace_tokens(write_trace(tmp_path / "t", m, num_requests=6, prompt=40, output=20))
    cfg = SimConfig(cost=CostConfig.roofline(), duration=0.05, mode="stat", engine=EngineConfig(attention_tp=2, max_seqs=8),
                    workload=WorkloadConfig(arrival="closed", concurrency=8,
                                            lengths=LengthMix(components=((64, 1.0),), output_mean=16)),
                    ensemble=False)
    args = (trace, [("a", linear_placement(m, 4, 4))], make_cluster(4, "h200"), cfg)
    with fe.prefill_sampling():
        a = simulate(*args, keep_samples=True)[0]
    assert sim_engine.IterationSample is IterationSample
    b = simulate(*args, keep_samples=True)[0]
    sa, sb = a.pools[-1].sample, b.pools[-1].sample
    assert isinstance(sa, fe.PrefillAwareSample) and type(sb) is IterationSample
    assert a.summary["output_tok_s"] == b.summary["output_tok_s"] and a.summary["ttft_p50_s"] == b.summary["ttft_p50_s"]
    assert [(it[0], it[3]) for it in sa.items] == [(it[0], it[3]) for it in sb.items]
    assert sa.prefill.items and all(float(it[1].pre_tokens.sum()) > 0 for it in sa.prefill.items)
    assert sa.prefill.seen < sa.seen


def test_a_published_mean_latency_is_compared_with_the_simulated_mean(tmp_path):
    """A case that publishes per-request means (InferenceX's tables) is checked against the mean of the simulated
    requests of the steady window, a median against the median: the statistic is recorded and printed; a case
    may give one statistic per metric, and the means come from the finished requests after the warm-up."""
    import datetime
    import math
    from types import SimpleNamespace

    import polars as pl
    import pytest
    import yaml

    from moeplace.foundation.errors import InputError

    fid = _fidelity()
    ens, x = _latency_ensemble(math.log(1.25))
    cases = [{"id": "m", "group": "g3", "published_on": "2026-09-10",
              "published_latency": {"ttft_mean_ms": 500.0, "tpot_mean_ms": 12.0}}]
    run = SimpleNamespace(detail={"ttft_p50_s": 0.25, "tpot_p50_s": 0.01, "ttft_mean_s": 0.4, "tpot_mean_s": 0.011},
                          sample=SimpleNamespace(prefill=SimpleNamespace(items=[0])))
    speeds = {"m": {"ttft": -np.log(np.full(4, 0.4)), "tpot": -np.log(np.full(4, 0.011))}}
    lat = fid.latency_checks(cases, {"m": run}, speeds, ens, {"m": x}, {"cutoff": datetime.date(2026, 2, 13)})
    (t,), (p,) = lat["ttft"]["cases"], lat["tpot"]["cases"]
    assert t["statistic"] == p["statistic"] == "mean" and t["reference_ms"] == 400.0  # the run's mean, not its p50
    assert np.isclose(t["error"], 400 / 500 - 1) and np.isclose(p["simulated_ms"], 11.0)
    assert "TTFT mean m" in "\n".join(fid.latency_text(lat))
    # the run's means: finished requests after the warm-up only
    reqs = pl.DataFrame({"finished_s": [5.0, 20.0, 30.0, None], "ttft_s": [9.0, 0.2, 0.4, None],
                         "tpot_s": [9.0, 0.01, 0.03, None]})
    assert fid.latency_means(reqs, 10.0) == pytest.approx({"ttft_mean_s": 0.3, "tpot_mean_s": 0.02})
    raw = yaml.safe_load(fid.CASES.read_text())
    case = next(c for c in raw if c["id"] == "inferencex-dsr1-fp8-h200-sglang-mtp-c4")
    bad = tmp_path / "cases.yaml"
    bad.write_text(yaml.safe_dump([{**case, "published_latency": {"ttft_mean_ms": 400.0, "ttft_p50_ms": 390.0}}]))
    with pytest.raises(InputError, match="one of the two for each"):
        fid.load_cases(bad)
