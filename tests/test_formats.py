"""Artifact format tags: every JSON artifact moeplace writes names its kind and version; every reader checks
it (another kind's file, an unknown version: one line naming the file and what was expected); only the
one kind a reader expects may arrive untagged, from the previous release; the dashboard and --force
recognise files by their tag, never by which keys they hold."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from simkit import linear_placement, mini_model, write_trace

from moeplace.cli.commands.demo import RUN_DIRECTORY, RUN_MARKER
from moeplace.cli.commands.optimize import COMPARISON_REPORT
from moeplace.cli.commands.plan import PLAN_REPORT
from moeplace.cli.main import main
from moeplace.foundation import formats
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import check_output
from moeplace.placement.record import PLACEMENT_JSON

GPUS = ["--gpus", "4", "--gpus-per-node", "2"]
SIM = [*GPUS, "--attention-tp", "2", "--duration", "0.1", "--concurrency", "8", "--no-progress"]
PROFILE = {"format": formats.tag("calibration"), "device": "cpu", "dtype": "bf16", "world_size": 2,
           "ops": {"expert_gemm": {"x": "tokens_per_expert", "points": [[1, 2e-5], [64, 3e-5]]}}}


def _place(*argv) -> str:
    """``place ARGV`` in-process; its stdout (exit 3, a plan that does not fit, still writes its report)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([str(a) for a in argv])
    assert rc in (0, 3), (argv, rc)
    return buf.getvalue()


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    """Every artifact made here, each by the code that writes it for users: kind -> file. What ``--json``
    prints is saved as ``<kind>.stdout.json`` (key ``<kind>:stdout``). (frontier.json and the sweep's
    scores: tests/test_sweep.py; the kernel bench report: tests/test_kernels_bench.py.)"""
    from moeplace.cli.commands.demo import _run_in
    from moeplace.sim.calibration import profile_from_dict

    d = tmp_path_factory.mktemp("formats")
    m = mini_model()
    model = d / "model.json"
    model.write_text(m.to_json())
    trace = write_trace(d / "trace", m, num_requests=6, prompt=32, output=8, skew=1.2)
    a = {"placement": d / "placement.json", "loads": d / "loads.npz", "calibration": d / "profile.json",
         "memory-plan": d / "plan.json", "comparison": d / "comparison.json", "trace-stats": d / "stats.json",
         "sim-summary": d / "sim" / "summary.json", "sim-config": d / "sim" / "config.json",
         "chrome-trace": d / "chrome.json", "run": d / "run" / RUN_MARKER}
    linear_placement(m, 4, 2).save(a["placement"])
    profile_from_dict(PROFILE, "test").save(a["calibration"])
    _place("trace", "stats", trace, "--out", a["loads"], "--window-tokens", "100")
    _place("trace", "stats", trace, "--out", a["trace-stats"])
    printed = {
        "memory-plan": _place("plan", "--model", model, *GPUS, "--report", a["memory-plan"], "--json"),
        "memory-plan-sweep": _place("plan", "--model", model, "--sweep", "--sweep-gpus", "4", "--json"),
        "comparison": _place("optimize", trace, *GPUS, "--policy", "linear", "--no-out", "--no-shift",
                             "--window-tokens", "100", "--report", a["comparison"], "--json"),
        "metrics": _place("evaluate", a["placement"], a["loads"], "--json"),
        "trace-stats": _place("trace", "stats", trace, "--json"),
        "synth-summary": _place("trace", "synth", "--model", model, "--tokens", "2000", "--out", d / "synth",
                                "--json"),
        "model-facts": _place("model", "show", model, "--json"),
        "sim-summary": _place("simulate", trace, "--placement", a["placement"], *SIM, "--out", d / "sim",
                              "--chrome-trace", a["chrome-trace"], "--json"),
    }
    for kind, text in printed.items():
        a[f"{kind}:stdout"] = d / f"{kind}.stdout.json"
        a[f"{kind}:stdout"].write_text(text)
    assert _run_in(d / "run", lambda: 0) == 0
    return a


def _meta(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def _with_meta(src: Path, dst: Path, meta: dict) -> None:
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["meta"] = np.array(json.dumps(meta))
    with open(dst, "wb") as fh:
        np.savez(fh, **arrays)


def _doc(path: Path) -> dict:
    """The JSON object that carries the tag (the chrome trace keeps it in its 'otherData')."""
    if path.suffix == ".npz":
        return _meta(path)
    d = json.loads(path.read_text())
    return d["otherData"] if "traceEvents" in d else d


# ------------------------------------------------------------------ the rule itself, for every kind
@pytest.mark.parametrize("kind", list(formats.FORMATS))
def test_check_accepts_its_kind_and_refuses_others_in_one_line(kind):
    f = formats.FORMATS[kind]
    assert formats.check({"format": f.tag}, kind, "x.json") == f.version
    assert formats.parse(f.tag) == (kind, f.version) and formats.kind_of({"format": f.tag}) == kind
    for other in formats.FORMATS:
        if other == kind:
            continue
        with pytest.raises(InputError) as e:
            formats.check({"format": formats.tag(other)}, kind, "x.json")
        assert str(e.value) == (f"x.json: field 'format' says a moeplace.{other} file, "
                                f"expected a moeplace.{kind} file")
    with pytest.raises(InputError) as e:
        formats.check({"format": f"moeplace.{kind}/99"}, kind, "x.json")
    assert str(e.value) == (f"x.json: field 'format' is 'moeplace.{kind}/99': version 99 unknown, expected "
                            f"moeplace.{kind} version {', '.join(map(str, f.versions))} (written by a newer moeplace?)")
    for foreign in ("vllm-eplb", f"moeplace.{kind}", "moeplace.nothing/1", 7, None):
        with pytest.raises(InputError, match=rf"^x\.json: field 'format' is .*, expected a moeplace\.{kind} file$"):
            formats.check({"format": foreign}, kind, "x.json")
    with pytest.raises(InputError, match=rf"^x\.json: a JSON list, expected a moeplace\.{kind} file$"):
        formats.check([1], kind, "x.json")
    if f.legacy:  # the previous release wrote this kind untagged: read as version 0
        assert formats.check({"rows": []}, kind, "x.json") == 0
    else:
        with pytest.raises(InputError, match=rf"^x\.json: field 'format' missing, expected a moeplace\.{kind}"):
            formats.check({"rows": []}, kind, "x.json")


def test_tagged_puts_the_tag_first_and_replaces_an_old_one():
    d = formats.tagged("comparison", {"engine": "vllm", "format": "moeplace.placement/1"})
    assert list(d) == ["format", "engine"] and d["format"] == "moeplace.comparison/1"


# ------------------------------------------------------------------ writers
WRITTEN = ["placement", "loads", "calibration", "memory-plan", "comparison", "trace-stats", "sim-summary",
           "sim-config", "chrome-trace", "run", "memory-plan:stdout", "memory-plan-sweep:stdout",
           "comparison:stdout", "metrics:stdout", "trace-stats:stdout", "sim-summary:stdout",
           "synth-summary:stdout", "model-facts:stdout"]


@pytest.mark.parametrize("name", WRITTEN)
def test_every_artifact_is_written_with_its_tag(art, name):
    kind = name.split(":")[0]
    doc = _doc(art[name])
    assert doc["format"] == formats.tag(kind) and formats.kind_of(doc) == kind
    if name.endswith(":stdout") and kind in art:  # --json prints the document the file holds
        assert _doc(art[kind]).keys() == doc.keys()


def test_printed_and_written_documents_keep_their_content(art):
    plan = _doc(art["memory-plan"])
    assert plan["fits"] in (True, False) and plan["cluster"]["num_gpus"] == 4
    rows = _doc(art["memory-plan-sweep:stdout"])["rows"]
    assert rows and all(r["gpus"] == 4 and (r["plan"] is None or r["plan"]["cluster"]["num_gpus"] == 4)
                        for r in rows)
    assert [r["policy"] for r in _doc(art["comparison"])["rows"]] == ["linear"]
    summaries = _doc(art["sim-summary"])["summaries"]
    assert [s["label"] for s in summaries] == ["placement"] and summaries[0]["requests_arrived"] > 0
    assert _doc(art["sim-config"])["cluster"]["num_gpus"] == 4
    chrome = json.loads(art["chrome-trace"].read_text())
    assert chrome["traceEvents"] and chrome["displayTimeUnit"] == "ms"
    assert _doc(art["trace-stats"])["tokens"] == _doc(art["trace-stats:stdout"])["tokens"] > 0
    assert _doc(art["metrics:stdout"])["num_windows"] >= 1
    assert _doc(art["model-facts:stdout"])["num_experts"] == 16
    assert _doc(art["synth-summary:stdout"])["config"]["num_tokens"] == 2000


# ------------------------------------------------------------------ readers
def _readers():
    from moeplace.cli.sweep.run import read_scores
    from moeplace.dashboard.data import read_artifact
    from moeplace.placement.export.flags import memory_config_from_report
    from moeplace.placement.record import load_placement
    from moeplace.sim.calibration import load_profile
    from moeplace.sim.results import read_sim_config, read_summaries
    from moeplace.traces.loads import load_loads

    return {"placement": load_placement, "loads": load_loads, "calibration": load_profile,
            "memory-plan": memory_config_from_report, "comparison": lambda p: read_artifact(p, "comparison"),
            "sim-summary": read_summaries, "sim-config": read_sim_config, "sweep-scores": read_scores}


def _good(art, kind: str, tmp_path: Path) -> Path:
    if kind == "sweep-scores":  # what the sweep writes next to a cached placement (tests/test_sweep.py)
        p = tmp_path / "k.scores.json"
        p.write_text(json.dumps(formats.tagged("sweep-scores", {"scores": {"held_out_balancedness": 0.9}})))
        return p
    return art[kind]


def _retagged(src: Path, dst: Path, value) -> Path:
    if src.suffix == ".npz":
        _with_meta(src, dst, {**_meta(src), "format": value})
    else:
        dst.write_text(json.dumps({**json.loads(src.read_text()), "format": value}))
    return dst


@pytest.mark.parametrize("kind", ["placement", "loads", "calibration", "memory-plan", "comparison", "sim-summary",
                                  "sim-config", "sweep-scores"])
def test_readers_refuse_another_kind_and_an_unknown_version(art, tmp_path, kind):
    read = _readers()[kind]
    good = _good(art, kind, tmp_path)
    read(good)  # the writer's own file is read
    other = "sim-summary" if kind == "placement" else "placement"
    bad = _retagged(good, tmp_path / f"other{good.suffix}", formats.tag(other))
    with pytest.raises(InputError) as e:
        read(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}: field 'format' says a moeplace.{other} file, expected a moeplace.{kind} file")
    assert "\n" not in msg
    new = _retagged(good, tmp_path / f"new{good.suffix}", f"moeplace.{kind}/99")
    with pytest.raises(InputError) as e:
        read(new)
    assert str(e.value).startswith(f"{new}: field 'format' is 'moeplace.{kind}/99': version 99 unknown")


def test_the_cli_says_which_file_and_kind_in_one_line(art, tmp_path, capsys):
    # a comparison report given where a placement goes, a placement where a plan report goes
    assert main(["evaluate", str(art["comparison"]), str(art["loads"])]) == 2
    err = capsys.readouterr().err
    assert err == (f"place: error: {art['comparison']}: field 'format' says a moeplace.comparison file, expected "
                   "a moeplace.placement file (engine files are read with `place import-placement`)\n")
    assert main(["export", str(art["placement"]), "--format", "sglang", "--out", str(tmp_path / "x.json"),
                 "--model", str(art["placement"].parent / "model.json"), "--flags", "--plan",
                 str(art["placement"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "says a moeplace.placement file, expected a moeplace.memory-plan file" in err
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------ the previous release's files
def _untagged(src: Path, dst: Path) -> Path:
    d = json.loads(src.read_text())
    del d["format"]
    dst.write_text(json.dumps(d))
    return dst


def test_untagged_files_of_the_kinds_the_previous_release_wrote_so_are_read(art, tmp_path):
    r = _readers()
    config, cluster = r["memory-plan"](_untagged(art["memory-plan"], tmp_path / "plan.json"))
    assert cluster["num_gpus"] == 4 and (config, cluster) == r["memory-plan"](art["memory-plan"])
    old = tmp_path / "summary.json"  # a bare list of summaries
    old.write_text(json.dumps(_doc(art["sim-summary"])["summaries"]))
    assert r["sim-summary"](old) == _doc(art["sim-summary"])["summaries"]
    assert r["sim-config"](_untagged(art["sim-config"], tmp_path / "config.json"))["cluster"]["num_gpus"] == 4
    old = tmp_path / "k.scores.json"  # the bare scores object
    old.write_text(json.dumps({"held_out_balancedness": 0.9}))
    assert r["sweep-scores"](old) == {"held_out_balancedness": 0.9}


def test_kinds_that_always_carried_their_tag_refuse_an_untagged_file(art, tmp_path):
    r = _readers()
    for kind in ("placement", "calibration"):
        p = _untagged(art[kind], tmp_path / f"{kind}.json")
        with pytest.raises(InputError, match=rf"^{p}: field 'format' missing, expected a moeplace\.{kind} file"):
            r[kind](p)
    p = tmp_path / "l.npz"
    _with_meta(art["loads"], p, {k: v for k, v in _meta(art["loads"]).items() if k != "format"})
    with pytest.raises(InputError, match=rf"^{p}: field 'format' missing, expected a moeplace\.loads file"):
        r["loads"](p)
    # an untagged object is not a summary file even though summaries are a legacy kind: only the bare list was
    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"summaries": []}))
    with pytest.raises(InputError, match="field 'format' missing, expected a moeplace.sim-summary file"):
        r["sim-summary"](p)


# ------------------------------------------------------------------ recognition by tag: --force, the dashboard
FORCE = [("placement", "placement JSON"), ("loads", "Loads .npz"), ("calibration", "calibration profile"),
         ("memory-plan", "plan report"), ("comparison", "comparison report"), ("trace-stats", "trace statistics JSON"),
         ("chrome-trace", "Chrome trace")]


@pytest.mark.parametrize("kind, output", FORCE)
def test_force_replaces_only_a_file_tagged_with_its_kind(art, tmp_path, kind, output):
    own = tmp_path / f"own{art[kind].suffix}"
    shutil.copy(art[kind], own)
    assert check_output(own, kind=output, force=True) == own
    with pytest.raises(InputError, match="pass --force"):
        check_output(own, kind=output)
    # another kind's tag on a file of this one's shape: not ours to replace as this kind
    if kind == "chrome-trace":
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"otherData": {"format": formats.tag("sim-summary")},
                                     "traceEvents": [], "displayTimeUnit": "ms"}))
    else:
        other = _retagged(art[kind], tmp_path / f"other{art[kind].suffix}",
                          formats.tag("sim-summary" if kind == "placement" else "placement"))
    with pytest.raises(InputError, match=f"exists and is not a {output} written by moeplace"):
        check_output(other, kind=output, force=True)


def test_force_recognises_the_previous_releases_untagged_outputs_of_the_expected_kind_only(art, tmp_path):
    plan = _untagged(art["memory-plan"], tmp_path / "plan.json")
    assert check_output(plan, kind=PLAN_REPORT, force=True) == plan
    with pytest.raises(InputError, match="is not a comparison report written by moeplace"):
        check_output(plan, kind=COMPARISON_REPORT, force=True)
    placement = _untagged(art["placement"], tmp_path / "placement.json")
    with pytest.raises(InputError, match="is not a placement JSON written by moeplace"):
        check_output(placement, kind=PLACEMENT_JSON, force=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).write_text('{"written_by": "place demo"}\n')  # the previous release's marker
    assert check_output(run, kind=RUN_DIRECTORY, replace_own=True) == run
    (run / RUN_MARKER).write_text(json.dumps({"format": formats.tag("placement")}))
    with pytest.raises(InputError, match="is not a demo run directory written by moeplace"):
        check_output(run, kind=RUN_DIRECTORY, replace_own=True)
    assert check_output(art["run"].parent, kind=RUN_DIRECTORY, replace_own=True) == art["run"].parent


def test_the_dashboard_classifies_json_files_by_their_tag_only(art, tmp_path):
    from moeplace.dashboard.data import scan_run_dir

    run = tmp_path / "run"
    run.mkdir()
    for kind in ("placement", "comparison", "memory-plan", "trace-stats", "sim-config"):
        shutil.copy(art[kind], run / f"{kind}.json")
    _untagged(art["comparison"], run / "old-comparison.json")  # keys of a comparison, no tag: not classified
    plan_keys = _doc(art["memory-plan"])  # a plan's keys under another kind's tag: not a plan
    (run / "stats-with-plan-keys.json").write_text(json.dumps({**plan_keys, "format": formats.tag("trace-stats")}))
    idx = scan_run_dir(run)
    assert [p.name for p in idx.placements] == ["placement.json"]
    assert [p.name for p in idx.comparisons] == ["comparison.json"]
    assert [p.name for p in idx.plans] == ["memory-plan.json"]
    assert not idx.notes
