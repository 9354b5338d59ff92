"""Fuzz tests: corrupted files of every kind the CLI reads (trace, Loads, placement, engine files, model
spec, plan report, sweep spec) and hostile output paths for every command that writes. On bad input every
command exits 2 with one line that names the file (and field), prints no traceback, and leaves every file
that existed byte-identical with nothing new beside it. A corruption that leaves the input valid (a flipped
byte inside a value) may succeed instead.

Hypothesis draws the corruptions (few examples, derandomized: the suite is the same on every run and
takes well under a minute); a case the code does not handle yet is an explicit example marked
xfail(strict=True) with what is missing.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fuzzkit import (
    GPUS,
    SIM,
    TINY,
    assert_ok_or_refused,
    assert_refused,
    assert_untouched,
    corrupt,
    make_inputs,
    run_place,
    snapshot,
    trace_columns,
    write_columns,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.cli.sweep.spec import load_spec
from moeplace.foundation.errors import InputError

FUZZ = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "base"
    make_inputs(root)
    return root


def workdir(base: Path, tmp_path: Path) -> Path:
    """A fresh copy of the valid inputs (hypothesis reuses ``tmp_path`` across examples)."""
    w = tmp_path / "w"
    if w.exists():
        shutil.rmtree(w)
    shutil.copytree(base, w)
    return w


def part_file(w: Path) -> Path:
    return min((w / "trace").glob("*.parquet"))


corruptions = st.tuples(st.sampled_from(["empty", "truncate", "flip", "insert"]),
                        st.floats(0.0, 1.0), st.integers(0, 255))
json_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3), st.just({}), st.just("DEL"))


def set_field(d, path, value):
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    if value == "DEL" and isinstance(cur, dict):
        del cur[path[-1]]
    elif value != "DEL":
        cur[path[-1]] = value


# ------------------------------------------------------------------ traces
TRACE_READERS = {
    "stats": lambda w: ["trace", "stats", w / "trace"],
    "optimize": lambda w: ["optimize", w / "trace", *GPUS, "--policy", "eplb", "--no-out"],
}


@FUZZ
@given(c=corruptions, cmd=st.sampled_from(sorted(TRACE_READERS)))
def test_corrupt_trace(base, tmp_path, capsys, c, cmd):
    w = workdir(base, tmp_path)
    f = part_file(w)
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    res = run_place(TRACE_READERS[cmd](w), capsys)
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before)


@FUZZ
@given(c=corruptions)
def test_corrupt_trace_validate_reports_each_problem_on_one_line(base, tmp_path, capsys, c):
    w = workdir(base, tmp_path)
    f = part_file(w)
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    res = run_place(["trace", "validate", w / "trace"], capsys)
    assert res.rc in (0, 2) and "Traceback" not in res.err
    if res.rc == 2:
        assert all(line.startswith("place: error: ") for line in res.err.strip().splitlines())
    assert_untouched(w, before)


@pytest.mark.parametrize("cmd", ["evaluate", "simulate"])
def test_corrupt_trace_page_header_in_evaluate_and_simulate(base, tmp_path, capsys, cmd):
    w = workdir(base, tmp_path)
    f = part_file(w)
    f.write_bytes(corrupt(f.read_bytes(), "insert", 0.01, 255))
    argv = (["evaluate", w / "placement.json", w / "trace"] if cmd == "evaluate"
            else ["simulate", w / "trace", "--placement", w / "placement.json", *SIM])
    assert_refused(run_place(argv, capsys), f.name)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    """The tiny model and a placement of it (2 GPUs, one node) for the cell-level trace fuzz."""
    import numpy as np

    from moeplace.foundation.model import load_model
    from moeplace.placement.record import Placement
    root = tmp_path_factory.mktemp("cells")
    model = load_model(TINY)
    pl = root / "placement.json"
    Placement.from_phy2log(np.tile(np.arange(8), (3, 1)), model, 2, 2, {"policy": "test"}).save(pl)
    return model, pl


CELLS = {"step": (-2, 30), "layer": (0, 5), "expert_ids": (0, 9)}


def _one_cell(column: str, row: int, value: int, slot: int = 1) -> dict:
    cols = trace_columns()
    if column == "expert_ids":
        cols[column][row, slot] = value
    else:
        if value < 0:
            cols[column] = cols[column].astype(np.int64)
        cols[column][row] = value
    return cols


@settings(FUZZ, max_examples=6)  # four readers per example, the simulator among them
@given(column=st.sampled_from(sorted(CELLS)), row=st.integers(0, 23), data=st.data())
def test_one_bad_cell_every_reader_says_what_validate_says(tiny_inputs, tmp_path, capsys, column, row, data):
    """One cell of a valid trace changed (an expert id past the model's, a duplicate expert in a row, a
    layer that is not an MoE layer, a negative or out-of-order step): every reader's verdict is validate's,
    with validate's first line word for word."""
    lo, hi = CELLS[column]
    cols = _one_cell(column, row, data.draw(st.integers(lo, hi), label="value"),
                     data.draw(st.integers(0, 1), label="slot"))
    _every_reader_agrees_with_validate(tiny_inputs, tmp_path, capsys, cols)


@pytest.mark.parametrize("column, row, value", [
    ("position", 0, 1), ("request_id", 0, 1), ("request_id", 0, -2),
    ("position", 23, 4),  # tokens with rows in only some of the MoE layers the trace holds
])
def test_token_identity_cells_every_reader_says_what_validate_says(tiny_inputs, tmp_path, capsys, column, row,
                                                                    value):
    _every_reader_agrees_with_validate(tiny_inputs, tmp_path, capsys, _one_cell(column, row, value))


def _every_reader_agrees_with_validate(tiny_inputs, tmp_path, capsys, cols) -> None:
    from moeplace.traces.validate import validate_report
    model, placement = tiny_inputs
    w = tmp_path / "w"
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir()
    path = write_columns(w / "t.parquet", model, cols)
    shutil.copy(placement, w / "placement.json")
    rep = validate_report(path)
    before = snapshot(w)
    readers = {
        "stats": ["trace", "stats", path],
        "optimize": ["optimize", path, "--gpus", "2", "--gpus-per-node", "2", "--no-out", "--policy", "eplb"],
        "evaluate": ["evaluate", w / "placement.json", path],
        "simulate": ["simulate", path, "--placement", w / "placement.json", "--gpus", "2", "--gpus-per-node", "2",
                     "--attention-tp", "1", "--duration", "0.1", "--concurrency", "2", "--no-progress"],
    }
    for name, argv in readers.items():
        res = run_place(argv, capsys)
        if rep.ok:
            assert res.rc == 0, (name, res.err)
        else:
            assert assert_refused(res) == f"place: error: {rep.first}", name
    assert_untouched(w, before)


# ------------------------------------------------------------------ Loads
@FUZZ
@given(c=st.tuples(st.sampled_from(["empty", "truncate"]), st.floats(0.0, 1.0), st.integers(0, 255)),
       cmd=st.sampled_from(["optimize", "evaluate"]))
def test_truncated_loads(base, tmp_path, capsys, c, cmd):
    w = workdir(base, tmp_path)
    f = w / "loads.npz"
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    argv = (["optimize", f, *GPUS, "--policy", "eplb", "--no-out"] if cmd == "optimize"
            else ["evaluate", w / "placement.json", f])
    assert_ok_or_refused(run_place(argv, capsys), f.name)
    assert_untouched(w, before)


LOADS_FIELDS = [("meta", "format"), ("meta", "model"), ("meta", "window_tokens"), ("meta", "labels"),
                ("meta", "provenance"), ("meta", "model", "num_experts"), ("meta", "model", "moe_layers"),
                ("counts",), ("samples",)]


@FUZZ
@given(path=st.sampled_from(LOADS_FIELDS), value=json_values, cmd=st.sampled_from(["optimize", "evaluate"]))
def test_loads_fields(base, tmp_path, capsys, path, value, cmd):
    """A Loads file whose meta field, counts or samples array is replaced (counts/samples by an array
    of the drawn value): every command that reads Loads refuses it through the Loads gate, or runs."""
    import numpy as np
    w = workdir(base, tmp_path)
    f = w / "loads.npz"
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    if path[0] == "meta":
        set_field(meta, path[1:], value)
        arrays["meta"] = np.array(json.dumps(meta))
    elif value == "DEL":
        arrays.pop(path[0])
    else:
        try:
            arrays[path[0]] = np.asarray(value)
        except (ValueError, OverflowError):
            arrays[path[0]] = np.asarray(str(value))
    np.savez(f, **arrays)
    before = snapshot(w)
    argv = (["optimize", f, *GPUS, "--policy", "eplb", "--no-out"] if cmd == "optimize"
            else ["evaluate", w / "placement.json", f])
    assert_ok_or_refused(run_place(argv, capsys), f.name)
    assert_untouched(w, before)


def test_loads_with_damaged_compressed_member(base, tmp_path, capsys):
    w = workdir(base, tmp_path)
    f = w / "loads.npz"
    f.write_bytes(corrupt(f.read_bytes(), "flip", 0.6, ord('"')))
    assert_refused(run_place(["optimize", f, *GPUS, "--policy", "eplb", "--no-out"], capsys), f.name)


# ------------------------------------------------------------------ placement JSON
PLACEMENT_FIELDS = [("format",), ("model",), ("num_experts",), ("moe_layers",), ("num_gpus",), ("gpus_per_node",),
                    ("num_slots",), ("provenance",), ("phy2log",), ("phy2log", 0), ("phy2log", 0, 0), ("moe_layers", 0)]
PLACEMENT_READERS = {
    "evaluate": lambda w: ["evaluate", w / "placement.json", w / "loads.npz"],
    "export": lambda w: ["export", w / "placement.json", "--format", "sglang", "--out", w / "out.json",
                         "--model", w / "model.json"],
    "simulate": lambda w: ["simulate", w / "trace", "--placement", w / "placement.json", *SIM],
}


@FUZZ
@given(path=st.sampled_from(PLACEMENT_FIELDS), value=json_values, cmd=st.sampled_from(sorted(PLACEMENT_READERS)))
def test_placement_fields(base, tmp_path, capsys, path, value, cmd):
    w = workdir(base, tmp_path)
    f = w / "placement.json"
    d = json.loads(f.read_text())
    set_field(d, path, value)
    f.write_text(json.dumps(d))
    before = snapshot(w)
    res = run_place(PLACEMENT_READERS[cmd](w), capsys)
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before, *(("out.json",) if res.rc == 0 else ()))


@FUZZ
@given(c=corruptions)
def test_corrupt_placement_bytes(base, tmp_path, capsys, c):
    w = workdir(base, tmp_path)
    f = w / "placement.json"
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    assert_ok_or_refused(run_place(PLACEMENT_READERS["evaluate"](w), capsys), f.name)
    assert_untouched(w, before)


# ------------------------------------------------------------------ engine files
ENGINE_FILES = {"sglang": "sglang.json", "vllm-expert-map": "vllm-map.json", "vllm-ascend": "ascend.json",
                "vllm-jsonl": "eplb.jsonl"}


@FUZZ
@given(fmt=st.sampled_from(sorted(ENGINE_FILES)), c=corruptions)
def test_corrupt_engine_file(base, tmp_path, capsys, fmt, c):
    w = workdir(base, tmp_path)
    f = w / ENGINE_FILES[fmt]
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    res = run_place(["import-placement", f, "--format", fmt, "--model", w / "model.json", *GPUS,
                     "--out", w / "imported.json"], capsys)
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before, *(("imported.json",) if res.rc == 0 else ()))


@FUZZ
@given(fmt=st.sampled_from(["sglang", "vllm-expert-map", "vllm-ascend"]), value=json_values,
       where=st.sampled_from(["top", "row", "cell"]))
def test_engine_file_fields(base, tmp_path, capsys, fmt, value, where):
    w = workdir(base, tmp_path)
    f = w / ENGINE_FILES[fmt]
    d = json.loads(f.read_text())
    root = (next(iter(d)),) if isinstance(d, dict) else ()
    path = {"top": root, "row": (*root, 0), "cell": (*root, 0, 0)}[where]
    try:
        if path:
            set_field(d, path, value)
        else:
            d = None if value == "DEL" else value
    except (TypeError, IndexError, KeyError):  # this format nests differently here: replace the document
        d = value
    f.write_text(json.dumps(d))
    before = snapshot(w)
    res = run_place(["import-placement", f, "--format", fmt, "--model", w / "model.json", *GPUS,
                     "--out", w / "imported.json"], capsys)
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before, *(("imported.json",) if res.rc == 0 else ()))


# ------------------------------------------------------------------ model spec, plan report, sweep spec
MODEL_FIELDS = [("num_layers",), ("moe_layers",), ("num_experts",), ("top_k",), ("hidden_size",),
                ("max_context",), ("attention",), ("expert_dtype",), ("mla", "num_heads"), ("kda", "head_dim"),
                ("kda", "state_dtype"), ("tie_word_embeddings",), ("name",)]


@FUZZ
@given(path=st.sampled_from(MODEL_FIELDS), value=json_values, cmd=st.sampled_from(["show", "plan"]))
def test_model_spec_fields(base, tmp_path, capsys, path, value, cmd):
    w = workdir(base, tmp_path)
    f = w / "model.json"
    d = json.loads(f.read_text())
    d["source"] = ""  # messages then name the file itself
    set_field(d, path, value)
    f.write_text(json.dumps(d))
    before = snapshot(w)
    argv = ["model", "show", f] if cmd == "show" else ["plan", "--model", f, *GPUS]
    res = run_place(argv, capsys)
    if res.rc == 3:  # plan: a valid spec that does not fit
        res.rc = 0
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before)


PLAN_FIELDS = [("model",), ("cluster",), ("cluster", "num_gpus"), ("cluster", "gpu"), ("cluster", "gpus_per_node"),
               ("config",), ("config", "tp"), ("config", "kv_dtype"), ("config", "context"), ("config", "dcp"),
               ("config", "pool_param"), ("config", "gpu_memory_utilization"), ("layout",), ("layout", "tp"),
               ("layout", "dp")]


@FUZZ
@given(path=st.sampled_from(PLAN_FIELDS), value=json_values)
def test_plan_report_fields(base, tmp_path, capsys, path, value):
    w = workdir(base, tmp_path)
    f = w / "plan.json"
    d = json.loads(f.read_text())
    set_field(d, path, value)
    f.write_text(json.dumps(d))
    before = snapshot(w)
    res = run_place(["export", w / "placement.json", "--format", "sglang", "--out", w / "out.json",
                     "--model", w / "model.json", "--flags", "--plan", f], capsys)
    assert_ok_or_refused(res, f.name)
    assert_untouched(w, before, *(("out.json",) if res.rc == 0 else ()))


@FUZZ
@given(c=corruptions)
def test_corrupt_sweep_spec(base, tmp_path, c):
    """The spec reader (running a sweep that a corruption left valid would take minutes)."""
    w = workdir(base, tmp_path)
    f = w / "sweep.yaml"
    f.write_bytes(corrupt(f.read_bytes(), *c))
    before = snapshot(w)
    try:
        load_spec(f)
    except InputError as exc:
        assert str(f) in str(exc) and "\n" not in str(exc)
    assert_untouched(w, before)


# ------------------------------------------------------------------ output paths
def _out_cases(w: Path) -> dict[str, tuple[list, str]]:
    """command -> (argv with {OUT}, suffix its output needs)."""
    opt = ["optimize", w / "trace", *GPUS, "--policy", "eplb"]
    sim = ["simulate", w / "trace", "--placement", "linear", *SIM]
    return {
        "trace synth --out": (["trace", "synth", "--model", w / "model.json", "--tokens", "64", "--out", "{OUT}"], ""),
        "trace stats --out": (["trace", "stats", w / "trace", "--out", "{OUT}"], ".npz"),
        "optimize --out": ([*opt, "--out", "{OUT}"], ".json"),
        "optimize --report": ([*opt, "--no-out", "--report", "{OUT}"], ".json"),
        "optimize --save-all": ([*opt, "--no-out", "--save-all", "{OUT}"], ""),
        "export --out": (["export", w / "placement.json", "--format", "sglang", "--model", w / "model.json",
                          "--out", "{OUT}"], ".json"),
        "import-placement --out": (["import-placement", w / "sglang.json", "--format", "sglang", "--model",
                                    w / "model.json", *GPUS, "--out", "{OUT}"], ".json"),
        "plan --report": (["plan", "--report", "{OUT}"], ".json"),
        "simulate --out": ([*sim, "--out", "{OUT}"], ""),
        "simulate --chrome-trace": ([*sim, "--chrome-trace", "{OUT}"], ".json"),
    }


# Outputs that are directories of files: writing new files into an existing directory destroys nothing, as
# long as what was there stays (replacing the directory would not).
INTO_DIRECTORY = {"optimize --save-all", "simulate --out", "trace synth --out"}
OUT_CASES = [(c, t) for c in ["trace synth --out", "trace stats --out", "optimize --out", "optimize --report",
                               "optimize --save-all", "export --out", "import-placement --out", "plan --report",
                               "simulate --out", "simulate --chrome-trace"]
             for t in ("file", "dir")] + [("export --out", "input"), ("import-placement --out", "input")]


@pytest.mark.parametrize("case, target", OUT_CASES)
def test_output_path_never_destroys_what_is_there(base, tmp_path, capsys, case, target):
    """An output path naming an unrelated file, a non-empty directory or an input is refused before any
    work: exit 2, one line naming the path, everything that was there untouched (a command that writes a
    directory of files may instead add its files to an existing directory)."""
    w = workdir(base, tmp_path)
    argv, suffix = _out_cases(w)[case]
    if target == "file":
        out = w / f"notes{suffix or '.txt'}"
        out.write_text('{"mine": "not written by moeplace"}\n')
    elif target == "dir":
        out = w / f"mine{suffix}"
        out.mkdir()
        (out / "keep.txt").write_text("mine\n")
    else:  # the command's own input
        inputs = {"export --out": w / "placement.json", "import-placement --out": w / "sglang.json"}
        out = inputs[case]
    before = snapshot(w)
    res = run_place([str(out) if a == "{OUT}" else a for a in argv], capsys)
    if target == "dir" and case in INTO_DIRECTORY and res.rc == 0:  # adding files beside the user's is fine
        assert_untouched(w, before, out.name)
        return
    assert_refused(res, out.name)
    assert_untouched(w, before)
