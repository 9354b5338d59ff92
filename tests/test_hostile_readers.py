"""Hostile structure for every reader (issue 30 items 2, 4, 6): deeply nested JSON/YAML, integers past
Python's int-string limit, wrong types, duplicate YAML keys and special files (a FIFO where a file goes)
give the one-line error, exit 2, no traceback and no hang, in every command that reads JSON, JSONL or
YAML (the shared reader is ``moeplace.foundation.reading``); and the silent acceptances the issue lists are
refused or stated. Small inputs only: the whole file runs in seconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fuzzkit import TINY, assert_refused, assert_untouched, run_place, snapshot, trace_columns, write_columns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.record import Placement

HOSTILE = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Fail (instead of blocking the suite) when a reader opens a FIFO and waits for a writer."""
    def fire(signum, frame):
        raise TimeoutError(f"a reader blocked for {seconds} s (opened a FIFO?)")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny):
    """A tiny-model trace, a placement of it (2 GPUs) and a plan report: what the readers read besides
    the hostile file."""
    root = tmp_path_factory.mktemp("hostile")
    write_columns(root / "t.parquet", tiny, trace_columns())
    Placement.from_phy2log(np.tile(np.arange(8), (3, 1)), tiny, 2, 2, {"policy": "test"}).save(root / "pl.json")
    (root / "dump").mkdir()
    return root


# reader -> (hostile file's path in the work directory, its language, argv given the work directory)
READERS = {
    "import vllm-routed-experts": ("resp.json", "json", lambda w: [
        "trace", "import", "--format", "vllm-routed-experts", w / "resp.json", "--model", TINY, "--out", w / "o"]),
    "import moe-selection-json": ("query.json", "json", lambda w: [
        "trace", "import", "--format", "moe-selection-json", w / "query.json", "--model", TINY, "--out", w / "o"]),
    "import vllm-jsonl": ("route.jsonl", "jsonl", lambda w: [
        "trace", "import", "--format", "vllm-jsonl", w / "route.jsonl", "--model", TINY, "--out", w / "o"]),
    "import vllm-eplb": ("eplb.jsonl", "jsonl", lambda w: [
        "trace", "import", "--format", "vllm-eplb", w / "eplb.jsonl", "--model", TINY, "--out", w / "o.npz"]),
    "import sglang": ("dump.json", "json", lambda w: [
        "trace", "import", "--format", "sglang", w / "dump.json", "--model", TINY, "--out", w / "o.npz"]),
    "import trtllm-stats": ("dump/meta_info.json", "json", lambda w: [
        "trace", "import", "--format", "trtllm-stats", w / "dump", "--model", TINY, "--out", w / "o.npz"]),
    "import-placement trtllm": ("lb.yaml", "yaml", lambda w: [
        "import-placement", w / "lb.yaml", "--format", "trtllm", "--model", TINY, "--out", w / "p.json"]),
    "import-placement sglang": ("sg.json", "json", lambda w: [
        "import-placement", w / "sg.json", "--format", "sglang", "--model", TINY, "--gpus", "2", "--out",
        w / "p.json"]),
    "import-placement vllm-expert-map": ("map.json", "json", lambda w: [
        "import-placement", w / "map.json", "--format", "vllm-expert-map", "--model", TINY, "--gpus", "2", "--out",
        w / "p.json"]),
    "import-placement vllm-ascend": ("asc.json", "json", lambda w: [
        "import-placement", w / "asc.json", "--format", "vllm-ascend", "--model", TINY, "--gpus", "2", "--out",
        w / "p.json"]),
    "import-placement vllm-jsonl": ("v.jsonl", "jsonl", lambda w: [
        "import-placement", w / "v.jsonl", "--format", "vllm-jsonl", "--model", TINY, "--gpus", "2", "--out",
        w / "p.json"]),
    "evaluate (placement)": ("placement.json", "json", lambda w: ["evaluate", w / "placement.json", w / "t.parquet"]),
    "model show": ("model.json", "json", lambda w: ["model", "show", w / "model.json"]),
    "sweep (spec)": ("spec.yaml", "yaml", lambda w: ["sweep", w / "spec.yaml", "--local", "--quiet", "--out",
                                                      w / "sw"]),
    "export --plan": ("plan.json", "json", lambda w: [
        "export", w / "pl.json", "--format", "sglang", "--model", TINY, "--out", w / "e.json", "--flags",
        "--plan", w / "plan.json"]),
}


def _deep(lang: str, depth: int) -> str:
    if lang == "yaml" and depth <= 300:  # block style: indentation nests without a bracket
        return "".join(f"{' ' * i}a:\n" for i in range(depth)) + " " * depth + "1\n"
    if lang == "yaml":  # PyYAML's recursion ends near 500 levels (json's near 1000); its scanner is slow
        depth = min(depth, 600)
    return "[" * depth + "]" * depth + ("\n" if lang == "jsonl" else "")


def _huge_int(lang: str, digits: int) -> str:
    n = "1" + "0" * (digits - 1)
    return f"x: {n}\n" if lang == "yaml" else f'{{"x": {n}}}\n'


def _value(lang: str, value) -> str:
    return yaml.safe_dump(value) if lang == "yaml" else json.dumps(value) + "\n"


def _run_hostile(base: Path, tmp_path: Path, capsys, reader: str, write) -> str:
    """Copy the inputs, put the hostile file in place (``write(path)``), run the reader; the contract:
    exit 2, one line naming the file, no traceback, no hang, nothing changed or left behind."""
    import shutil
    w = tmp_path / "w"
    shutil.rmtree(w, ignore_errors=True)
    shutil.copytree(base, w)
    rel, lang, argv = READERS[reader]
    f = w / rel
    write(f, lang)
    before = snapshot(w) if not _is_fifo(f) else None
    with no_hang():
        res = run_place(argv(w), capsys)
    line = assert_refused(res, f.name)
    if before is not None:
        assert_untouched(w, before)
    return line


def _is_fifo(p: Path) -> bool:
    return p.exists() and not p.is_file() and not p.is_dir()


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("shape", ["deep-past-the-parser", "deep-under-the-parser", "huge-int", "fifo"])
def test_every_reader_refuses_hostile_structure_in_one_line(base, tmp_path, capsys, reader, shape):
    def write(f: Path, lang: str) -> None:
        if shape == "fifo":
            os.mkfifo(f)
        elif shape == "deep-past-the-parser":
            f.write_text(_deep(lang, 100_000))
        elif shape == "deep-under-the-parser":
            f.write_text(_deep(lang, 200))
        else:
            f.write_text(_huge_int(lang, 5000))
    line = _run_hostile(base, tmp_path, capsys, reader, write)
    want = {"fifo": "is a FIFO (named pipe), not a regular file", "huge-int": "an integer of more than 4300 digits",
            "deep-past-the-parser": "nested more than 64 levels", "deep-under-the-parser": "nested more than 64 levels"}
    assert want[shape] in line, line


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8)


@HOSTILE
@given(reader=st.sampled_from(sorted(READERS)), value=json_values,
       depth=st.integers(65, 3000), digits=st.integers(4301, 20000))
def test_every_reader_refuses_wrong_types_depths_and_sizes(base, tmp_path, capsys, reader, value, depth, digits):
    """A document of the wrong type (any JSON value: numbers, bools, strings, lists, objects), nesting
    of any depth past the limit and integers of any length past Python's limit: one line, exit 2."""
    for write in (lambda f, lang: f.write_text(_value(lang, value)),
                  lambda f, lang: f.write_text(_deep(lang, depth)),
                  lambda f, lang: f.write_text(_huge_int(lang, digits))):
        _run_hostile(base, tmp_path, capsys, reader, write)


@pytest.mark.parametrize("reader", [r for r in sorted(READERS) if READERS[r][1] == "yaml"])
def test_duplicate_yaml_keys_are_errors(base, tmp_path, capsys, reader):
    line = _run_hostile(base, tmp_path, capsys, reader,
                        lambda f, lang: f.write_text("model: kimi-k3\nseed: 1\nmodel: kimi-k3\n"))
    assert "line 3: key 'model' appears twice in one mapping (first at line 1); YAML keys must be unique" in line


def test_reader_module_refuses_each_shape_itself(tmp_path):
    """The shared reader directly: depth (both ways), huge integers, self-referencing YAML aliases, a FIFO
    (never opened), a directory; merge keys are not duplicates."""
    for text in ("[" * 100_000, "[" * 65 + "]" * 65):
        with pytest.raises(InputError, match="nested more than 64 levels"):
            reading.parse_json(text, "x")
    assert reading.parse_json("[" * 64 + "]" * 64, "x") is not None
    with pytest.raises(InputError, match="an integer of more than 4300 digits"):
        reading.parse_json("9" * 4301, "x")
    with pytest.raises(InputError, match="nested more than 64 levels"):
        reading.parse_yaml("a: &a [*a]\n", "y")
    assert reading.parse_yaml("b: &d {x: 1}\nc:\n  <<: *d\n  y: 2\n", "y") == {"b": {"x": 1}, "c": {"x": 1, "y": 2}}
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with no_hang(), pytest.raises(InputError, match=r"p.json: is a FIFO \(named pipe\), not a regular file"):
        reading.read_json(fifo)
    with pytest.raises(InputError, match="is a directory, not a regular file"):
        reading.read_json(tmp_path)
    assert not reading.is_int(True) and reading.is_int(np.int64(3)) and not reading.is_int(np.bool_(True))


# ------------------------------------------------------------------ the dashboard's scan
def test_dashboard_scan_never_opens_a_fifo_and_says_what_it_skipped(base, tmp_path):
    from moeplace.dashboard.data import scan_run_dir
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    write_columns(run / "traces" / "part-00001.parquet", load_model(TINY), trace_columns())
    os.mkfifo(run / "placement.json")
    os.mkfifo(run / "traces" / "part-00000.parquet")
    (run / "comparison.json").write_text("[" * 100_000)
    (run / "plan.json").write_text('{"format": "moeplace.memory-plan/1", "x": 1' + "0" * 5000 + "}")
    with no_hang():
        idx = scan_run_dir(run)
    notes = "\n".join(idx.notes)
    assert f"{run / 'placement.json'}: is a FIFO (named pipe), not a regular file; skipped" in idx.notes
    assert f"{run / 'traces' / 'part-00000.parquet'}: is a FIFO (named pipe), not a regular file; skipped" in idx.notes
    assert f"{run / 'comparison.json'}: arrays/objects nested more than 64 levels deep" in notes
    assert f"{run / 'plan.json'}: holds an integer of more than 4300 digits" in notes
    assert idx.traces == (run / "traces",) and not idx.placements and not idx.comparisons


def test_dashboard_shows_a_garbage_comparison_as_its_one_line_problem(base, tmp_path):
    """A comparison.json whose rows are garbage used to be hidden without a word on the Placement page."""
    from streamlit.testing.v1 import AppTest

    from moeplace.dashboard.data import read_comparison
    run = tmp_path / "run"
    run.mkdir()
    write_columns(run / "t.parquet", load_model(TINY), trace_columns(64))
    bad = run / "comparison.json"
    bad.write_text(json.dumps({"format": "moeplace.comparison/1", "rows": "garbage"}))
    with pytest.raises(InputError, match=r"comparison.json: field 'rows' is str, expected a list of policy rows"):
        read_comparison(bad)
    (run / "broken.json").write_text("{not json")
    app = Path(__file__).resolve().parent.parent / "moeplace" / "dashboard" / "app.py"
    at = AppTest.from_file(str(app), default_timeout=60)
    at.session_state["run_dir"] = str(run)
    at.run()
    at.switch_page("views/placement.py").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert any(f"{bad}: field 'rows' is str, expected a list of policy rows" in e for e in errors), errors
    warnings = [w.value for w in at.warning]
    assert any(str(run / "broken.json") in w and "not readable JSON" in w for w in warnings), warnings


# ------------------------------------------------------------------ silent acceptances, now refused or said
def test_trace_missing_a_moe_layer_is_refused_by_every_reader_alike(base, tmp_path, capsys, tiny):
    c = trace_columns()
    c = {k: v[c["layer"] != 2] for k, v in c.items()}
    f = write_columns(tmp_path / "t.parquet", tiny, c)
    want = (f"place: error: {f}: field 'layer': no rows for MoE layer 2 (1 of the 3 the model declares: 1-3); a "
            "trace holds every MoE layer of its model or declares the ones it holds (a capture that missed a layer is incomplete)")
    pl = base / "pl.json"
    for argv in (["trace", "validate", f], ["trace", "stats", f], ["evaluate", pl, f],
                 ["optimize", f, "--gpus", "2", "--gpus-per-node", "2", "--no-out", "--policy", "eplb"]):
        res = run_place(argv, capsys)
        assert res.rc == 2 and want in res.err.splitlines(), (argv[:2], res.err)
        assert "n/a" not in res.out


def test_impossible_loads_counts_are_refused(base, tmp_path, capsys, tiny):
    from moeplace.traces.loads import Loads
    counts = np.zeros((1, 3, 8), np.int64)
    counts[0, 0, 0] = 2**62
    path = tmp_path / "l.npz"
    meta = {"format": "moeplace.loads/1", "model": tiny.to_dict(), "window_tokens": 0, "labels": [],
            "provenance": {}}
    np.savez(path, counts=counts, meta=np.array(json.dumps(meta)))
    line = assert_refused(run_place(["optimize", path, "--gpus", "2", "--gpus-per-node", "2", "--no-out",
                                     "--policy", "eplb"], capsys), "l.npz")
    assert "field 'counts': window 0, MoE layer 1 counts 4.612e+18 expert selections, more than the ceiling" in line
    counts[0, 0, 0] = 1000  # a file of windows of 100 tokens, top-2: at most 202 selections per layer
    meta["window_tokens"] = 100
    np.savez(path, counts=counts, meta=np.array(json.dumps(meta)))
    line = assert_refused(run_place(["evaluate", base / "pl.json", path], capsys), "l.npz")
    assert "MoE layer 1 counts 1000 expert selections, more than 100 tokens per window x top-2 allow (202)" in line
    Loads(counts, tiny, 500).check_window_tokens()  # possible: 1000 <= 501 x 2


def test_synth_says_which_targets_it_did_not_reach(base, tmp_path, capsys):
    res = run_place(["trace", "synth", "--model", TINY, "--tokens", "64", "--skew", "1000", "--out",
                     tmp_path / "s"], capsys)
    assert res.rc == 0, res.err
    line = next(x for x in res.err.splitlines() if "--skew" in x)
    assert line.startswith("place: warning: --skew 1000 not reached: the pilot batch's median layer skew is ")
    reached = float(line.split("median layer skew is ")[1].split()[0])
    assert 1.0 < reached <= 4.0  # 8 experts, top-2: no skew can pass 4
    assert "num_experts / top_k = 4" in line


def _sweep_spec(w: Path, model: str, trace: Path, extra: str = "") -> Path:
    p = w / "spec.yaml"
    p.write_text(f"model: {model}\nworkloads:\n  - name: w\n    trace: {trace}\naxes:\n  gpus: 2\n{extra}")
    return p


def test_sweep_refuses_a_trace_of_another_model_and_fails_when_nothing_finished(base, tmp_path, capsys):
    spec = _sweep_spec(tmp_path, "kimi-k3", base / "t.parquet")
    line = assert_refused(run_place(["sweep", spec, "--local", "--quiet", "--out", tmp_path / "sw"], capsys),
                          "spec.yaml", "workloads[0].trace")
    assert "routes model 'tiny-moe' (3 MoE layers x 8 experts, top-2), but the spec's model is 'kimi-k3'" in line
    assert not (tmp_path / "sw").exists()
    spec = _sweep_spec(tmp_path, TINY, base / "t.parquet")  # TP 8 (the default) does not divide 2 GPUs
    res = run_place(["sweep", spec, "--local", "--quiet", "--out", tmp_path / "sw2"], capsys)
    errors = [x for x in res.err.splitlines() if x.startswith("place: error:")]
    want = (f"place: error: {spec}: no point of the sweep finished (1 invalid); the first, #0: invalid at plan: "
            "--tp 8 does not divide 2 GPUs")
    assert res.rc == 3 and errors == [want], res.err


@pytest.mark.parametrize("name", ["a/../../escaped", "../x", "..", "/abs", 7])
def test_sweep_name_cannot_leave_runs(base, tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    spec = _sweep_spec(tmp_path, TINY, base / "t.parquet", f"name: {json.dumps(name)}\n")
    line = assert_refused(run_place(["sweep", spec, "--local", "--quiet"], capsys), "spec.yaml", "field 'name'")
    assert "expected a name of letters, digits" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_trtllm_stats_with_all_zero_counts_is_refused(tmp_path, capsys):
    from safetensors.numpy import save_file
    d = tmp_path / "dump"
    d.mkdir()
    (d / "meta_info.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_token": 2}))
    save_file({f"100_{layer}": np.zeros(8, np.int64) for layer in (1, 2, 3)}, str(d / "rank0.safetensors"))
    line = assert_refused(run_place(["trace", "import", "--format", "trtllm-stats", d, "--model", TINY, "--out",
                                     tmp_path / "o.npz"], capsys), "dump")
    assert "every count in the rank*.safetensors files is zero (1 iteration(s) x 3 MoE layer(s), 1 rank(s))" in line
    assert not (tmp_path / "o.npz").exists()


def _flame_dir(tmp_path: Path, layers=("layer_02", "layer_03", "layer_04"), samples=4, rows=4) -> Path:
    root = tmp_path / "flame"
    (root / "samples").mkdir(parents=True)
    pq.write_table(pa.table({"token_id": pa.array(np.arange(samples), pa.int32())}), root / "samples" / "000.parquet")
    it = root / "actives" / "iter_0010"
    it.mkdir(parents=True)
    for name in layers:
        idx = np.stack([np.arange(rows) % 8, (np.arange(rows) + 1) % 8], axis=1).astype(np.int16)
        pq.write_table(pa.table({"scores": pa.array([[0.6, 0.4]] * rows, pa.list_(pa.float16(), 2)),
                                 "indices": pa.array(idx.tolist(), pa.list_(pa.int16(), 2))}), it / f"{name}.parquet")
    return root


def _flame(root: Path, tmp_path: Path, capsys):
    return run_place(["trace", "import", "--format", "flame-moe", root, "--model", TINY, "--out", tmp_path / "o"],
                     capsys)


def test_flame_unrecognised_layer_file_and_extra_sample_rows_are_refused(tmp_path, capsys):
    assert _flame(_flame_dir(tmp_path / "ok"), tmp_path / "ok", capsys).rc == 0
    root = _flame_dir(tmp_path / "a", layers=("layer_02", "layer_3", "layer_04"))
    (root / "actives" / "iter_0010" / "layer_3.parquet").rename(root / "actives" / "iter_0010" / "layer-03.parquet")
    line = assert_refused(_flame(root, tmp_path / "a", capsys), "layer-03.parquet")
    assert "not a FLAME-MoE layer file name (expected layer_NN.parquet" in line
    root = _flame_dir(tmp_path / "b", layers=("layer_02", "layer_04"))
    line = assert_refused(_flame(root, tmp_path / "b", capsys), "iter_0010")
    assert "no layer_03.parquet: MoE layer 2 of 'tiny-moe' is missing" in line
    root = _flame_dir(tmp_path / "c", samples=6, rows=4)
    line = assert_refused(_flame(root, tmp_path / "c", capsys), "samples")
    assert "6 token rows, more than the 4 rows of the actives files" in line


@pytest.mark.parametrize("doc, where", [
    ([[[1, True], [2, 3], [4, 5]]], "[0][0][1] is true"),
    ([[[False, True], [2, 3], [4, 5]]], "[0][0][0] is false"),
    ({"experts": [[[1, 2], [2, 3], [4, True]]], "prompt": "hi"}, "field 'experts': [0][2][1] is true"),
])
def test_moe_selection_json_refuses_booleans_as_expert_ids(tmp_path, capsys, doc, where):
    f = tmp_path / "q.json"
    f.write_text(json.dumps(doc))
    line = assert_refused(run_place(["trace", "import", "--format", "moe-selection-json", f, "--model", TINY,
                                     "--out", tmp_path / "o"], capsys), "q.json")
    assert where in line and "expected an integer expert id" in line


def _trtllm_yaml(base: Path, tmp_path: Path, capsys) -> Path:
    out = tmp_path / "lb.yaml"
    assert run_place(["export", base / "pl.json", "--format", "trtllm", "--model", TINY, "--out", out],
                     capsys).rc == 0
    return out


@pytest.mark.parametrize("value, gpus, want", [
    (7, "2", "field 'moe_expert_parallel_size' is 7, but --gpus is 2"),
    ("'8'", "2", "field 'moe_expert_parallel_size': expected an integer, got '8'"),
    ("'8'", None, "field 'moe_expert_parallel_size': expected an integer, got '8'"),
    (0, None, "field 'moe_expert_parallel_size' is 0, expected >= 1"),
])
def test_trtllm_yaml_ep_size_is_checked_against_gpus(base, tmp_path, capsys, value, gpus, want):
    f = _trtllm_yaml(base, tmp_path, capsys)
    doc = yaml.safe_load(f.read_text())
    doc.pop("moe_expert_parallel_size", None)
    f.write_text(yaml.safe_dump(doc) + f"moe_expert_parallel_size: {value}\n")
    argv = ["import-placement", f, "--format", "trtllm", "--model", TINY, "--out", tmp_path / "p.json"]
    line = assert_refused(run_place(argv + (["--gpus", gpus] if gpus else []), capsys), "lb.yaml")
    assert want in line, line
    f.write_text(yaml.safe_dump(doc) + "moe_expert_parallel_size: 2\n")  # agreeing: imported
    assert run_place(argv + ["--gpus", "2"], capsys).rc == 0


def _sglang_per_token(tmp_path: Path, mode) -> Path:
    ids = np.full((4, 2, 8), -1, np.int32)  # 4 decoder layers (0 dense), 2 tokens, SGLang's 8 columns
    for layer in (1, 2, 3):
        ids[layer, :, :2] = [[layer, layer + 1], [layer + 2, layer + 3]]
    rec = {"forward_pass_id": 0, "rank": 0, "input_ids": [5, 6], "positions": [0, 1], "extend_seq_lens": [2],
           "forward_mode": mode, "topk_ids_of_layer": ids.tolist()}
    f = tmp_path / "dump.json"
    f.write_text(json.dumps({"records": [rec], "last_physical_to_logical_map": [list(range(8))] * 4}))
    return f


@pytest.mark.parametrize("mode, phase", [("extend", 0), ("EXTEND", 0), ("ForwardMode.DECODE", 1), (2, 1), (1, 0)])
def test_sglang_forward_mode_by_value_or_name(tmp_path, capsys, mode, phase):
    import polars as pl
    f = _sglang_per_token(tmp_path, mode)
    res = run_place(["trace", "import", "--format", "sglang", f, "--model", TINY, "--out", tmp_path / "o"], capsys)
    assert res.rc == 0, res.err
    assert pl.read_parquet(tmp_path / "o")["phase"].unique().to_list() == [phase]


@pytest.mark.parametrize("mode", ["prefill-ish", True, 1.5, -1, [1]])
def test_sglang_forward_mode_garbage_is_one_line(tmp_path, capsys, mode):
    f = _sglang_per_token(tmp_path, mode)
    line = assert_refused(run_place(["trace", "import", "--format", "sglang", f, "--model", TINY, "--out",
                                     tmp_path / "o"], capsys), "dump.json", "record 0", "field 'forward_mode'")
    assert "expected SGLang's ForwardMode" in line


ROUTING_READERS = {
    "validate": lambda base, src: ["trace", "validate", src],
    "stats": lambda base, src: ["trace", "stats", src],
    "evaluate": lambda base, src: ["evaluate", base / "pl.json", src],
    "optimize": lambda base, src: ["optimize", src, "--gpus", "2", "--gpus-per-node", "2", "--no-out", "--policy",
                                   "eplb"],
}


@pytest.mark.parametrize("reader", sorted(ROUTING_READERS))
def test_a_fifo_among_trace_parts_or_as_loads_is_refused_unopened(base, tmp_path, capsys, reader):
    d = tmp_path / "trace"
    d.mkdir()
    write_columns(d / "part-00000.parquet", load_model(TINY), trace_columns())
    os.mkfifo(d / "part-00001.parquet")
    os.mkfifo(tmp_path / "loads.npz")
    sources = [(d, "part-00001.parquet")] + ([(tmp_path / "loads.npz", "loads.npz")]
                                              if reader in ("evaluate", "optimize") else [])
    for src, name in sources:
        with no_hang():
            line = assert_refused(run_place(ROUTING_READERS[reader](base, src), capsys), name)
        assert "is a FIFO (named pipe), not a regular file" in line
