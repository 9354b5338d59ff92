"""Fuzz cases of the third hostile-input round: every one ends as one line and a non-zero exit for bad input
(or the right result for valid input), leaves no file it did not write and nothing half-written. Most run
in this process (``main([...])``); a subprocess only where the case is about the process itself (a signal,
standard output at a real full device, the open-file limit)."""
from __future__ import annotations

import errno
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuzzkit import GPUS, SIM, assert_refused, assert_untouched, make_inputs, run_place, snapshot

from moeplace.cli.main import main
from moeplace.cli.sweep.spec import load_spec
from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import TEMP_MARK

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("round3") / "base"
    make_inputs(root)
    return root


@pytest.fixture
def w(base, tmp_path, monkeypatch):
    """A fresh copy of the inputs, the working directory."""
    import shutil
    d = tmp_path / "w"
    shutil.copytree(base, d)
    monkeypatch.chdir(d)
    return d


def refused(argv, capsys, w: Path, *names: str) -> str:
    """``argv`` exits 2 with one line naming ``names`` and changes nothing under ``w``."""
    before = snapshot(w)
    line = assert_refused(run_place(argv, capsys), *names)
    assert_untouched(w, before)
    return line


def _gpu_spec(w: Path, **fields) -> Path:
    d = json.loads((ROOT / "moeplace/foundation/presets/gpus.json").read_text())["h200"]
    d.update(fields)
    p = w / "gpu.json"
    p.write_text(json.dumps(d))  # Python writes Infinity / NaN literals, as a hand-edited file may hold
    return p


# ------------------------------------------------------------------ tracebacks that were
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 0])
def test_gpu_spec_non_finite_or_non_positive_refused(w, capsys, value):
    gpu = _gpu_spec(w, hbm_bytes=value)
    line = refused(["plan", "--model", "model.json", "--gpus", "4", "--gpu", gpu], capsys, w, "gpu.json",
                   "'hbm_bytes'")
    assert "finite number > 0" in line


SPEC = "model: {model}\nworkloads:\n  - name: w\n    trace: trace\n{extra}axes:\n  gpus: 4\n{axes}"


@pytest.mark.parametrize("extra,axes,field", [
    ("    rate: .inf\n", "", "workloads[0].rate"),
    ("optimize:\n  time_limit: .inf\n", "", "optimize.time_limit"),
    ("objective:\n  tpot_p99_ms: .nan\n", "", "objective.tpot_p99_ms"),
    ("", '  redundant: "1000000000/gpu"\n', "axes.redundant[0]"),
    ("", "  redundant: 100000000000\n", "axes.redundant[0]"),
])
def test_sweep_spec_infinite_or_absurd_values_refused_before_any_point(w, capsys, extra, axes, field):
    spec = w / "s.yaml"
    spec.write_text(SPEC.format(model=w / "model.json", extra=extra, axes=axes))
    with pytest.raises(InputError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_spec(spec)
    refused(["sweep", spec, "--out", w / "sw", "--local"], capsys, w, "s.yaml", field)


def test_config_null_values_mean_the_flags_default(w, capsys):
    """A null in a --config file (what a settings record writes for an unset flag) is the flag's default,
    never a None that breaks the command later."""
    cfg = w / "c.yaml"
    cfg.write_text("gpus: null\nwindow_tokens: null\nout: null\nseed: null\n")
    res = run_place(["optimize", "trace", "--config", cfg, "--gpus", "4", "--gpus-per-node", "2", "--policy",
                     "linear", "--out", w / "p.json"], capsys)
    assert res.rc == 0, res.err
    assert json.loads((w / "p.json").read_text())["num_gpus"] == 4
    cfg.write_text("placement: null\nduration: null\n")
    refused(["simulate", "trace", "--config", cfg, *SIM], capsys, w, "--placement")


@pytest.mark.parametrize("flags", ["[1, 2]", "null", '"gpus=4"', "7"])
def test_config_settings_flags_not_a_mapping_refused(w, capsys, flags):
    cfg = w / "c.json"
    cfg.write_text(f'{{"settings": {{"flags": {flags}}}}}')
    refused(["optimize", "trace", "--config", cfg, "--gpus", "4"], capsys, w, "c.json", "settings.flags")


def test_out_symlink_loop_refused(w, capsys):
    names = sorted(os.listdir(w))
    (w / "self.json").symlink_to("self.json")
    assert_refused(run_place(["optimize", "trace", *GPUS, "--policy", "linear", "--out", "self.json"], capsys),
                   "self.json", "loop of symbolic links")
    assert os.readlink(w / "self.json") == "self.json" and sorted(os.listdir(w)) == sorted([*names, "self.json"])


@pytest.mark.parametrize("cmd", [["optimize", "trace", *GPUS, "--policy", "linear"],
                                 ["trace", "synth", "--model", "model.json", "--tokens", "8"]])
def test_out_path_past_path_max_refused(w, capsys, cmd):
    long = "/".join(["d" * 200] * 21) + "/o.json"
    line = refused([*cmd, "--out", long], capsys, w, "4095")
    assert "bytes long" in line


def test_sglang_pt_on_a_full_disk_is_one_line_and_leaves_nothing(w, capsys, monkeypatch):
    pytest.importorskip("torch")

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    before = snapshot(w)
    res = run_place(["export", "placement.json", "--format", "sglang-pt", "--model", "model.json", "--out",
                     "p.pt"], capsys)
    assert res.rc == 1 and "Traceback" not in res.err
    assert res.err.strip().splitlines()[-1] == ("place: error: could not write p.pt (No space left on device); "
                                                 "the results above were not saved there")
    assert_untouched(w, before)


def test_json_failure_after_results_is_still_one_object(w, capsys, monkeypatch):
    """--json and a write that fails after the results were printed: the command's object carries ok false,
    the error and the exit code (a script reads one object, never two)."""
    pytest.importorskip("torch")

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    res = run_place(["export", "placement.json", "--format", "sglang-pt", "--model", "model.json", "--out",
                     "p.pt", "--json"], capsys)
    doc = json.loads(res.out)
    assert res.rc == 1 and doc["ok"] is False and doc["exit_code"] == 1 and doc["format"] == "sglang-pt"
    assert doc["error"].startswith("could not write p.pt (No space left on device)")


class _FullDevice(io.TextIOWrapper):
    """A text stream whose device is full (what ``> /dev/full`` gives)."""

    def __init__(self):
        super().__init__(io.BytesIO(), encoding="utf-8")

    def write(self, s):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("argv", [["plan", "--model", "model.json", "--gpus", "4"],
                                  ["optimize", "trace", *GPUS, "--policy", "linear", "--no-out", "--json"]])
def test_stdout_on_a_full_device_is_one_line(w, capsys, monkeypatch, argv):
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _FullDevice())
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip().splitlines()[-1] == ("place: error: could not write to standard output (No space left "
                                            "on device); what the command printed there is lost"), err


def test_stdout_at_dev_full_in_a_real_process(base):
    """The interpreter's own flush at exit must not fail again (no 'Exception ignored' after the line)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "moeplace.cli", "plan", "--model", str(base / "model.json"),
                            "--gpus", "4"], stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120,
                           check=False)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [("place: error: could not write to standard output (No space left "
                                              "on device); what the command printed there is lost")], p.stderr


def test_stdout_closed_refused(w, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when fd 1 is closed (`place ... >&-`)
    before = snapshot(w)
    rc = main(["plan", "--model", "model.json", "--gpus", "4"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("place: error: standard output is closed (>&-); redirect it to "
                                               "/dev/null to discard what the command prints")
    assert_untouched(w, before)


def test_ascii_stdout_prints_escapes_instead_of_failing(w, capsys, monkeypatch):
    """PYTHONIOENCODING=ascii: the '—' of a summary and a path in another script become escapes; the
    command still succeeds (it used to fail after writing --out)."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stream)
    rc = main(["optimize", "trace", *GPUS, "--policy", "linear", "--out", "pé—.json"])
    stream.flush()
    assert rc == 0 and (w / "pé—.json").exists()
    (w / "trâce").symlink_to(w / "trace")
    assert main(["trace", "validate", "trâce"]) == 0
    stream.flush()
    assert "tr\\xe2ce: OK" in raw.getvalue().decode("ascii")


def test_deleted_working_directory_is_one_line(tmp_path, capsys, monkeypatch, base):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    res = run_place(["plan", "--model", base / "model.json", "--gpus", "4", "--json"], capsys)
    assert res.rc == 2 and res.err.strip() == ("place: error: the current directory no longer exists (deleted "
                                               "while the shell was in it?); cd to an existing directory")
    assert json.loads(res.out)["ok"] is False


def test_open_file_limit_is_one_line(base, tmp_path):
    """``ulimit -n 16`` and a 2-worker sweep: one line naming the limit (was an EMFILE traceback)."""
    spec = tmp_path / "sw.yaml"
    spec.write_text(f"model: {base / 'model.json'}\nworkloads:\n  - name: w\n    trace: {base / 'trace'}\n"
                    "axes:\n  gpus: 4\n  gpus_per_node: 2\n  tp: [1, 2]\nsimulate:\n  duration: 0.002\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))

    p = subprocess.run([sys.executable, "-m", "moeplace.cli", "sweep", str(spec), "--out", str(tmp_path / "o"),
                        "--local", "--workers", "2", "--quiet"], capture_output=True, text=True, env=ENV,
                       preexec_fn=limit, timeout=300, check=False)
    if p.returncode == 0:
        pytest.skip("the sweep fitted in 16 descriptors here")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("place: error: Too many open files; the limit is 16: raise the "
                                                 "limit (ulimit -n 4096) or use fewer --workers")


# ------------------------------------------------------------------ silent acceptances that were
@pytest.mark.parametrize("extra,names", [
    (["--isl", "1000000000000", "--osl", "10"], ("--isl", "maximum context")),
    (["--isl", "1000", "--osl", "1048576"], ("--osl", "maximum context")),
    (["--context-mix", "8k:1", "--output-len", "1000000000000"], ("--output-len", "maximum context")),
    (["--mtp", "1000000:0.9"], ("--mtp", "draft tokens")),
    (["--rebalance", "every=10,every=20"], ("--rebalance", "'every' given twice")),
    (["--rebalance", "every=10,time=inf"], ("--rebalance", "finite")),
])
def test_simulate_lengths_and_knobs_out_of_reason_refused(w, capsys, extra, names):
    refused(["simulate", "trace", "--placement", "placement.json", *SIM, *extra], capsys, w, *names)


def _dup_key(text: str, key: str) -> str:
    """``text`` (a JSON object) with ``"key": <junk>`` added in front of its first key, so the key appears
    twice and the later (the real) value would win."""
    return text.replace("{", f'{{"{key}": 0, ', 1)


@pytest.mark.parametrize("name,key,argv", [
    ("placement.json", "num_gpus", ["export", "placement.json", "--format", "sglang", "--out", "x.json"]),
    ("c.json", "gpus", ["optimize", "trace", "--config", "c.json", "--policy", "linear", "--no-out"]),
    ("ascend.json", "moe_layer_count", ["import-placement", "ascend.json", "--format", "vllm-ascend", "--model",
                                        "model.json", "--out", "x.json"]),
])
def test_json_duplicate_keys_refused(w, capsys, name, key, argv):
    if name == "c.json":
        (w / name).write_text('{"gpus": 4, "gpus_per_node": 2}')
    p = w / name
    p.write_text(_dup_key(p.read_text(), key))
    refused(argv, capsys, w, name, f"'{key}' appears twice")


def test_jsonl_duplicate_keys_refused_on_the_fast_path(w, capsys):
    src = w / "log.jsonl"
    src.write_text('{"type": "meta", "top_k": 2, "top_k": 4}\n')
    refused(["trace", "import", "--format", "vllm-jsonl", src, "--model", "model.json", "--out", "t"], capsys,
            w, "log.jsonl", "'top_k' appears twice")


def _laughs(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_refused_fast_with_a_short_message(w, capsys):
    t = time.monotonic()
    with pytest.raises(InputError) as exc:
        reading.parse_yaml(_laughs(), "bomb.yaml")
    assert time.monotonic() - t < 2
    assert "alias" in str(exc.value) and len(str(exc.value)) < 200
    spec = w / "s.yaml"  # under a sweep axis, and as a --config file
    spec.write_text(f"model: {w / 'model.json'}\nworkloads:\n  - name: w\n    trace: trace\n"
                    + _laughs().replace("a0:", "x0:").replace("\na", "\nx") + "axes:\n  gpus: *a8\n")
    line = refused(["sweep", spec, "--out", "sw", "--local"], capsys, w, "s.yaml")
    assert len(line) < 300
    cfg = w / "c.yaml"
    cfg.write_text(_laughs() + "gpus: 4\n")
    line = refused(["optimize", "trace", "--config", cfg, "--no-out"], capsys, w, "c.yaml", "alias")
    assert len(line) < 300


def test_a_small_alias_tree_under_an_axis_is_quoted_briefly(w, capsys):
    spec = w / "s.yaml"
    spec.write_text(f"model: {w / 'model.json'}\nworkloads:\n  - name: w\n    trace: trace\n"
                    "axes:\n  gpus: [[&x0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], *x0, *x0, *x0, *x0, *x0, *x0, *x0]]\n")
    line = refused(["sweep", spec, "--out", "sw", "--local"], capsys, w, "s.yaml", "axes.gpus[0]")
    assert len(line) < 300


def test_true_as_an_expert_id_refused(w, capsys):
    d = json.loads((w / "placement.json").read_text())
    d["phy2log"][1][2] = True
    (w / "placement.json").write_text(json.dumps(d))
    refused(["export", "placement.json", "--format", "sglang", "--out", "x.json"], capsys, w, "placement.json",
            "layer 1 slot 2", "got true")


def test_plan_with_stdout_closed_in_a_real_process(base):
    p = subprocess.run([sys.executable, "-m", "moeplace.cli", "plan", "--model", str(base / "model.json"),
                        "--gpus", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                       timeout=120, check=False, preexec_fn=lambda: os.close(1))
    assert p.returncode == 2
    assert p.stderr.strip().startswith("place: error: standard output is closed")


@pytest.mark.parametrize("edit,names", [
    (('"step":0', '"step":NaN'), ("field 'step'", "nan")),
    (('"expert_load":[[', '"expert_load":[[1.5,'), ("field 'expert_load'", "1.5 is not an integer")),
    (('"expert_load":[[', '"expert_load":[[NaN,'), ("field 'expert_load'", "nan is not an integer")),
])
def test_vllm_load_stats_nan_and_fractions_refused(w, capsys, edit, names):
    assert main(["export", "placement.json", "--format", "vllm-jsonl", "--loads", "loads.npz", "--model",
                 "model.json", "--out", "el.jsonl"]) == 0
    text = (w / "el.jsonl").read_text()
    first, rest = text.split("\n", 1)
    if edit[0].startswith('"expert_load"'):  # drop the first value, so the row keeps its length
        head, tail = first.split(edit[0], 1)
        first = head + edit[1] + tail.split(",", 1)[1]
    else:
        first = first.replace(edit[0], edit[1])
    (w / "el.jsonl").write_text(first + "\n" + rest)
    refused(["import-placement", "el.jsonl", "--format", "vllm-jsonl", "--model", "model.json", "--out",
             "o.npz"], capsys, w, "el.jsonl", "line 1", *names)


def test_flame_moe_iteration_directory_not_numbered_refused(w, capsys):
    src = w / "flame"
    for d in ("actives/iter_10", "actives/iter_abc", "samples"):
        (src / d).mkdir(parents=True)
    refused(["trace", "import", "--format", "flame-moe", src, "--model", "model.json", "--out", "t"], capsys, w,
            "actives", "iter_abc")


def test_out_with_a_trailing_slash_refused_for_a_file(w, capsys):
    refused(["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p.json/"], capsys, w, "p.json/",
            "drop the '/'")


# ------------------------------------------------------------------ regression
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_synth_of_fewer_tokens_than_the_default_phases(w, capsys, tokens):
    res = run_place(["trace", "synth", "--model", "model.json", "--tokens", str(tokens), "--out", "t"], capsys)
    assert res.rc == 0, res.err
    assert main(["trace", "validate", "t"]) == 0


def test_synth_explicit_phases_still_checked(w, capsys):
    refused(["trace", "synth", "--model", "model.json", "--tokens", "3", "--drift-phases", "4", "--out", "t"],
            capsys, w, "drift_phases", "ceiling of 3")


# ------------------------------------------------------------------ signals
def _default_stop_signals() -> None:
    # SIGINT as an interactive shell leaves it (a background job of a script would ignore it), SIGHUP as a
    # terminal's job has it (a suite run under nohup would pass its ignored SIGHUP on, which the CLI keeps)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start(argv, cwd):
    return subprocess.Popen([sys.executable, "-m", "moeplace.cli", *map(str, argv)], cwd=cwd, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_stop_signals)  # noqa: PLW1509


def test_sighup_during_synth_cleans_up_like_sigterm(tmp_path, base):
    out = tmp_path / "t"
    proc = _start(["trace", "synth", "--model", base / "model.json", "--tokens", "50000000", "--out", out],
                  tmp_path)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f".{out.name}{TEMP_MARK}*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == 129
    assert proc.stderr.read().strip().splitlines()[-1] == "place: terminated (SIGHUP)"
    assert list(tmp_path.iterdir()) == []


def test_sigint_stops_optimize_as_promptly_as_sigterm(tmp_path, base):
    """CP-SAT's own SIGINT handler used to end one search and let the run go on (9.7 s, or the whole
    budget); now Ctrl-C ends the command, and the pool's workers with it."""
    took = {}
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        out = tmp_path / f"p{sig}.json"
        proc = _start(["optimize", base / "trace", *GPUS, "--policy", "moeplace", "--time-limit", "60",
                       "--workers", "2",
                       "--no-progress", "--out", out], tmp_path)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 90
        while not (children.exists() and children.read_text().strip()):  # the search's worker pool is up
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(1.0)  # inside the search
        t = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code, proc.stderr.read()
        took[sig] = time.monotonic() - t
        assert not out.exists() and not list(tmp_path.glob(f"*{TEMP_MARK}*"))
    assert took[signal.SIGINT] < max(5.0, 2 * took[signal.SIGTERM]), took


# ------------------------------------------------------------------ --json on failure
JSON_FAILURES = [
    ["export", "missing.json", "--format", "sglang", "--out", "x.json"],
    ["import-placement", "missing.json", "--format", "sglang", "--model", "model.json", "--out", "x.json"],
    ["evaluate", "missing.json", "trace"],
    ["optimize", "missing", *GPUS, "--no-out"],
    ["plan", "--model", "missing.json"],
    ["calibrate", "missing.json", "--model", "kimi-k2", "--gpu", "h200", "--gpus", "8", "--out", "cal.json"],
    ["rebalance", "missing", *GPUS],
    ["simulate", "missing", "--placement", "linear", *SIM],
    ["sweep", "missing.yaml"],
    ["trace", "stats", "missing"],
    ["trace", "synth", "--model", "missing.json", "--out", "t"],
    ["trace", "import", "--format", "vllm-jsonl", "missing.jsonl", "--model", "model.json", "--out", "t"],
    ["trace", "capture", "--hf-config", "model.json", "--prompts", "model.json", "--max-new-tokens", "2",
     "--out", "placement.json"],  # refused before torch is imported
    ["model", "show", "missing"],
    ["engines", "--model", "missing.json"],
    ["plan", "--gpus", "x"],  # a bad flag: argparse's line
]


@pytest.mark.parametrize("argv", JSON_FAILURES, ids=lambda a: " ".join(a[:2]))
def test_json_failure_prints_one_json_object(w, capsys, argv):
    before = snapshot(w)
    res = run_place([*argv, "--json"], capsys)
    line = assert_refused(res)
    doc = json.loads(res.out)  # one object, nothing else on stdout
    assert doc == {"ok": False, "error": line.removeprefix("place: error: "), "exit_code": 2}
    assert_untouched(w, before)


def test_every_json_command_is_covered():
    """A command that gains --json joins JSON_FAILURES (trace validate prints its own report)."""
    from moeplace.cli.main import build_parser
    covered = {" ".join(a[:2]) if a[0] in ("trace", "model") else a[0] for a in JSON_FAILURES}
    parser = build_parser()
    found = set()

    def walk(p, prefix):
        for a in p._actions:
            if isinstance(a, __import__("argparse")._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, [*prefix, name])
            elif "--json" in a.option_strings:
                found.add(" ".join(prefix))
    walk(parser, [])
    assert found - {"trace validate"} <= covered, found - covered
