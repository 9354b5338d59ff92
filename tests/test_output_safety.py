"""Output safety of every command that writes (foundation.files.check_output / Outputs / atomic_path): a path
that is not moeplace's own output of the same kind is never replaced, --force replaces only that, every
output is checked before any work, temporaries never outlive the run (SIGTERM included), and a write that
fails after the work still prints the results."""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from simkit import linear_placement, mini_model, write_trace

from moeplace.cli.commands.demo import RUN_DIRECTORY
from moeplace.cli.commands.plan import PLAN_REPORT
from moeplace.cli.main import main
from moeplace.foundation import files
from moeplace.foundation.files import TEMP_MARK, Outputs, check_output, clean_stale_temps
from moeplace.placement.record import PLACEMENT_JSON
from moeplace.traces.format import TRACE_DIRECTORY

ROOT = Path(__file__).resolve().parents[1]
SIM = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--duration", "0.1", "--concurrency", "8",
       "--no-progress"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (hidden ones too) with the hash of its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Real inputs of every kind, made once: a model spec, a trace, Loads, a placement and an SGLang file."""
    d = tmp_path_factory.mktemp("inputs")
    model = mini_model()
    (d / "model.json").write_text(model.to_json())
    write_trace(d / "trace", model, num_requests=6, prompt=32, output=8, skew=1.2)
    assert main(["trace", "stats", str(d / "trace"), "--window-tokens", "64", "--out", str(d / "loads.npz")]) == 0
    linear_placement(model, 4, 2).save(d / "placement.json")
    assert main(["export", str(d / "placement.json"), "--format", "sglang", "--model", str(d / "model.json"),
                 "--out", str(d / "sglang.json")]) == 0
    (d / "spec.yaml").write_text("name: x\n")
    return d


@pytest.fixture
def work(inputs, tmp_path, monkeypatch):
    """A working directory (the cwd) holding copies of the inputs, an unrelated non-empty directory and an
    unrelated regular file."""
    import shutil

    for p in inputs.iterdir():
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp_path / p.name)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("do not lose me\n")
    (tmp_path / "thesis.json").write_text('{"chapter": 1}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


# Each command that writes, as argv with OUT where the output path goes, and the input it reads (the
# "input itself" case). File outputs get an existing directory as the "unrelated" case, directory
# outputs an existing regular file and an unrelated non-empty directory.
COMMANDS = {
    "trace synth": (["trace", "synth", "--model", "model.json", "--tokens", "200", "--out", "OUT"], "model.json",
                    True),
    "trace import": (["trace", "import", "--format", "vllm-jsonl", "log.jsonl", "--model", "model.json",
                      "--out", "OUT"], "log.jsonl", True),
    "trace stats": (["trace", "stats", "trace", "--out", "OUT"], "trace", False),
    "optimize --out": (["optimize", "trace", "--gpus", "4", "--window-tokens", "64", "--out", "OUT"], "trace",
                       False),
    "optimize --report": (["optimize", "loads.npz", "--gpus", "4", "--no-out", "--report", "OUT"], "loads.npz",
                          False),
    "optimize --save-all": (["optimize", "loads.npz", "--gpus", "4", "--no-out", "--policy", "linear",
                             "--save-all", "OUT"], "loads.npz", "save-all"),
    "simulate --out": (["simulate", "trace", "--placement", "placement.json", *SIM, "--out", "OUT"],
                       "placement.json", True),
    "simulate --chrome-trace": (["simulate", "trace", "--placement", "placement.json", *SIM, "--chrome-trace",
                                 "OUT"], "placement.json", False),
    "export": (["export", "placement.json", "--format", "sglang", "--model", "model.json", "--out", "OUT"],
               "placement.json", False),
    "import-placement": (["import-placement", "sglang.json", "--format", "sglang", "--model", "model.json",
                          "--gpus", "4", "--out", "OUT"], "sglang.json", False),
    "plan --report": (["plan", "--model", "model.json", "--gpus", "4", "--report", "OUT"], "model.json", False),
    "sweep": (["sweep", "spec.yaml", "--local", "--out", "OUT"], "spec.yaml", True),
    "demo": (["demo", "--quick", "--traces", "demo-trace", "--out", "OUT"], None, True),
    "kernels bench": (["kernels", "bench", "--out", "OUT"], None, False),
}


def _argv(cmd: str, out: str, force: bool) -> list[str]:
    argv = [out if a == "OUT" else a for a in COMMANDS[cmd][0]]
    return argv + (["--force"] if force and cmd not in ("sweep", "demo") else [])


def _cases():
    for cmd, (_args, inp, kind) in COMMANDS.items():
        # an unrelated non-empty directory (for a file output: an existing directory where the file goes),
        # an unrelated regular file, the current directory, the command's own input
        bad = ["notes", "thesis.json", "."] if kind != "save-all" else ["thesis.json"]
        if inp is not None:
            bad.append(inp)
        for b in bad:
            for force in (False, True):
                yield pytest.param(cmd, b, force, id=f"{cmd}-{b}-{'force' if force else 'plain'}")


@pytest.mark.parametrize("cmd,out,force", list(_cases()))
def test_refused_output_is_one_line_and_touches_nothing(work, cmd, out, force, capsys):
    (work / "log.jsonl").write_text('{"record_type": "meta"}\n')
    before = snapshot(work)
    t0 = time.perf_counter()
    rc = main(_argv(cmd, out, force))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("place: error: "), err
    assert "Traceback" not in err
    assert snapshot(work) == before
    assert time.perf_counter() - t0 < 20  # refused before any work (kernels bench, demo, optimize run minutes)


def test_the_issue_cases_by_name(work, capsys):
    """The reported data losses: an engine log as the trace output, a Loads input as --report, a placement
    exported over itself, an engine file imported over itself, `trace synth --out .`."""
    (work / "log.jsonl").write_text('{"record_type": "meta"}\n')
    before = snapshot(work)
    assert main(["trace", "import", "--format", "vllm-jsonl", "log.jsonl", "--out", "log.jsonl"]) == 2
    assert "is the input log.jsonl" in capsys.readouterr().err
    assert main(["optimize", "loads.npz", "--gpus", "4", "--report", "loads.npz", "--no-out"]) == 2
    assert "--report loads.npz: is the input loads.npz" in capsys.readouterr().err
    assert main(["export", "placement.json", "--format", "sglang", "--out", "placement.json"]) == 2
    assert main(["import-placement", "sglang.json", "--format", "sglang", "--out", "sglang.json"]) == 2
    assert main(["trace", "synth", "--model", "model.json", "--out", "."]) == 2
    assert "is the current directory" in capsys.readouterr().err
    assert main(["trace", "synth", "--model", "model.json", "--out", "trace/sub"]) == 2  # lands inside a trace
    assert main(["trace", "synth", "--model", "model.json", "--out", str(work.parent)]) == 2  # contains cwd
    assert main(["plan", "--model", "model.json", "--gpus", "4", "--sweep", "--report", "p.json"]) == 2
    assert "--report writes one plan" in capsys.readouterr().err
    # a single-file trace does not make its directory a trace: outputs may sit next to it
    import shutil

    shutil.copy(next((work / "trace").glob("*.parquet")), work / "notes" / "one.parquet")
    assert main(["trace", "stats", "notes/one.parquet", "--window-tokens", "64", "--out", "notes/l.npz"]) == 0
    (work / "notes" / "l.npz").unlink()
    (work / "notes" / "one.parquet").unlink()
    assert snapshot(work) == before


def test_force_replaces_only_own_output_of_the_same_kind(work, capsys):
    m = ["--model", "model.json", "--tokens", "300"]
    assert main(["trace", "synth", *m, "--out", "t"]) == 0
    first = snapshot(work / "t")
    assert main(["trace", "synth", *m, "--out", "t", "--seed", "1"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert snapshot(work / "t") == first
    assert main(["trace", "synth", *m, "--out", "t", "--seed", "1", "--force"]) == 0
    assert snapshot(work / "t") != first
    # own output, but of another kind: a trace directory is not a simulation output directory
    before = snapshot(work)
    assert main(["simulate", "trace", "--placement", "placement.json", *SIM, "--out", "t", "--force"]) == 2
    assert "is not a simulation output directory" in capsys.readouterr().err
    assert main(["trace", "stats", "trace", "--out", "placement.json", "--force"]) == 2  # a placement, not stats
    assert snapshot(work) == before
    # file kinds: a placement over a placement, Loads over Loads, an engine file over an engine file
    assert main(["optimize", "loads.npz", "--gpus", "4", "--policy", "linear", "--out", "p.json"]) == 0
    assert main(["optimize", "loads.npz", "--gpus", "4", "--policy", "linear", "--out", "p.json"]) == 2
    assert main(["optimize", "loads.npz", "--gpus", "4", "--policy", "linear", "--out", "p.json", "--force"]) == 0
    assert main(["trace", "stats", "trace", "--window-tokens", "64", "--out", "l2.npz"]) == 0
    assert main(["trace", "stats", "trace", "--window-tokens", "32", "--out", "l2.npz", "--force"]) == 0
    exp = ["export", "placement.json", "--format", "sglang", "--model", "model.json", "--out", "s2.json"]
    assert main(exp) == 0
    assert main(exp) == 2
    assert main([*exp, "--force"]) == 0
    sim = ["simulate", "trace", "--placement", "placement.json", *SIM, "--out", "sim"]
    assert main(sim) == 0
    assert main(sim) == 2
    assert main([*sim, "--force"]) == 0
    capsys.readouterr()


def test_an_empty_directory_may_become_the_output(work):
    (work / "empty").mkdir()
    assert main(["trace", "synth", "--model", "model.json", "--tokens", "200", "--out", "empty"]) == 0
    assert any((work / "empty").glob("*.parquet"))


def test_outputs_of_one_command_may_not_coincide_or_nest(work, capsys):
    assert main(["optimize", "loads.npz", "--gpus", "4", "--out", "a.json", "--report", "a.json"]) == 2
    assert "is also --out" in capsys.readouterr().err
    assert main(["simulate", "trace", "--placement", "placement.json", *SIM, "--out", "d", "--chrome-trace",
                 "d/c.json"]) == 2
    assert "replaced as a whole" in capsys.readouterr().err
    assert main(["demo", "--out", "r", "--traces", "r/trace"]) == 2
    assert not (work / "r").exists()


def _forbid(monkeypatch, target: str) -> None:
    def boom(*a, **k):
        raise AssertionError(f"{target} ran although an output was refused")
    monkeypatch.setattr(target, boom)


def test_unwritable_output_is_refused_before_any_work(work, monkeypatch, capsys):
    _forbid(monkeypatch, "moeplace.cli.commands.optimize.compare_policies")
    _forbid(monkeypatch, "moeplace.cli.commands.trace_synth.synthesize")
    _forbid(monkeypatch, "moeplace.cli.commands.trace_stats.compute_stats")
    # /proc takes no new files, for root too (permission bits alone do not stop root)
    assert main(["optimize", "trace", "--gpus", "4", "--out", "/proc/moeplace/p.json"]) == 2
    assert "cannot write in /proc" in capsys.readouterr().err
    assert main(["trace", "synth", "--model", "model.json", "--out", "/proc/t"]) == 2
    assert main(["trace", "stats", "trace", "--out", "thesis.json/x.json"]) == 2  # a file as a parent
    assert "is not a directory" in capsys.readouterr().err
    if os.geteuid() != 0:
        ro = work / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            assert main(["optimize", "trace", "--gpus", "4", "--out", "ro/p.json"]) == 2
            assert "cannot write in" in capsys.readouterr().err
        finally:
            ro.chmod(0o755)


def test_write_failure_after_the_work_still_prints_the_results(work, monkeypatch, capsys):
    real_replace = os.replace

    def disk_full(src, dst):
        if Path(dst).name in ("p.json", "r.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real_replace(src, dst)

    real_link = os.link

    def disk_full_link(src, dst):  # a new output is claimed by link(2) (files.atomic_path)
        if Path(dst).name in ("p.json", "r.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real_link(src, dst)

    monkeypatch.setattr(files.os, "replace", disk_full)
    monkeypatch.setattr(files.os, "link", disk_full_link)
    rc = main(["optimize", "loads.npz", "--gpus", "4", "--policy", "linear", "--policy", "eplb", "--out", "p.json",
               "--report", "r.json", "--save-all", "all"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "linear" in out and "eplb" in out and "wrote p.json" not in out  # the table, not a false claim
    full = os.strerror(errno.ENOSPC)
    assert err.strip().splitlines() == [
        f"place: error: could not write p.json ({full}); r.json ({full}); the results above were not saved there"]
    assert sorted(p.name for p in (work / "all").iterdir()) == ["placement-eplb.json", "placement-linear.json"]
    assert not (work / "p.json").exists() and not list(work.glob(f"*{TEMP_MARK}*"))


def test_stale_temporaries_of_dead_runs_are_removed_and_reported(work, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_dir = work / f".t{TEMP_MARK}{dead.pid}-0123abcd"
    stale_dir.mkdir()
    (stale_dir / "part-00000.parquet").write_bytes(b"x" * 100)
    stale_old = work / f".t{TEMP_MARK}{dead.pid}-0123abce-old"
    stale_old.write_text("x")
    live = work / f".t{TEMP_MARK}{os.getpid()}-0123abcd"  # a running process's: left alone
    live.mkdir()
    foreign = [work / ".t.0123.tmp", work / f".u{TEMP_MARK}{dead.pid}-0123abcd", work / f".t{TEMP_MARK}x",
               work / ".t.ab_12cd9.tmp"]  # the last: an earlier version's temporary, reported only
    for f in foreign:
        f.write_text("not ours")
    assert main(["trace", "synth", "--model", "model.json", "--tokens", "200", "--out", "t"]) == 0
    err = capsys.readouterr().err
    assert not stale_dir.exists() and not stale_old.exists()
    assert f"place: note: removed {stale_dir.name}, left by an interrupted run (process {dead.pid})" in err
    assert live.exists() and all(f.read_text() == "not ours" for f in foreign)
    assert "place: note: .t.ab_12cd9.tmp looks like a temporary of an interrupted run of an earlier" in err


def test_sigterm_during_synth_leaves_no_temporary(tmp_path):
    """SIGTERM to the command (and, second run, to its whole process group, the forked Parquet writer
    included) removes the temporary trace directory; the exit code is 143."""
    model = tmp_path / "model.json"
    model.write_text(mini_model(num_experts=64, top_k=8).to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for group in (False, True):
        out = tmp_path / f"t{int(group)}"
        proc = subprocess.Popen([sys.executable, "-m", "moeplace.cli", "trace", "synth", "--model", str(model),
                                 "--tokens", "50000000", "--out", str(out)], env=env, cwd=tmp_path,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f".{out.name}{TEMP_MARK}*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)  # some parts written
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert proc.stderr.read().strip().splitlines()[-1] == "place: terminated"
        time.sleep(0.2)  # the writer child exits after the parent when only the parent was signalled
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json"]


def test_demo_refuses_bad_gpus_before_writing_anything(work, capsys):
    assert main(["demo", "--gpus", "0", "--out", "run", "--traces", "dt"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (work / "run").exists() and not (work / "dt").exists()


def test_demo_run_directory_is_all_or_nothing(work):
    from moeplace.cli.commands.demo import _run_in

    out = work / "run"

    def ok():
        (out / "a.txt").write_text("first")
        return 0

    assert _run_in(out, ok) == 0
    before = snapshot(out)

    def fails():
        (out / "b.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run_in(out, fails)
    assert snapshot(out) == before  # the earlier run is back, the partial one gone
    assert sorted(p.name for p in work.iterdir() if TEMP_MARK in p.name) == []
    # a run directory is recognised by its marker: replaced by a later demo, and nothing else is
    check_output(out, kind=RUN_DIRECTORY, replace_own=True)
    with pytest.raises(Exception, match="not a demo run directory"):
        check_output(work / "notes", kind=RUN_DIRECTORY, replace_own=True)


def test_check_output_rules(work):
    from moeplace.foundation.errors import InputError

    os.symlink("placement.json", work / "link.json")
    with pytest.raises(InputError, match="symbolic link"):
        check_output("link.json", kind=PLACEMENT_JSON, force=True)
    os.link(work / "placement.json", work / "hard.json")
    with pytest.raises(InputError, match="is the input"):
        check_output("hard.json", kind=PLACEMENT_JSON, inputs=["placement.json"], force=True)
    (work / "d").mkdir()
    (work / "d" / "in.json").write_text("{}")
    with pytest.raises(InputError, match="contains the input d/in.json"):
        check_output("d", kind=TRACE_DIRECTORY, inputs=["d/in.json"], force=True)
    with pytest.raises(InputError, match="^--report: empty path"):
        check_output("", kind="plan report", flag="--report")
    assert check_output("new/dir/p.json", kind=PLACEMENT_JSON) == Path("new/dir/p.json")
    assert not (work / "new").exists()  # checking creates nothing
    assert not list(work.glob(f"*{TEMP_MARK}*"))
    outs = Outputs(inputs=["trace"])
    outs.add("x.json", PLACEMENT_JSON)
    with pytest.raises(InputError, match="is also --out"):
        outs.add("x.json", PLAN_REPORT, "--report")
    assert clean_stale_temps(work / "x.json") == []


def test_sigterm_during_import_removes_the_temporary(tmp_path, monkeypatch, capsys):
    """SIGTERM arriving while an import writes its trace: exit 143 and nothing left next to --out."""
    from moeplace.foundation.files import Terminated
    from moeplace.traces.format import TraceWriter

    data = Path(__file__).parent / "data"
    real_write = TraceWriter.write

    def write_then_terminated(self, **cols):
        real_write(self, **cols)
        assert list(tmp_path.glob(f".t{TEMP_MARK}*")), "the temporary exists while writing"
        raise Terminated()

    monkeypatch.setattr(TraceWriter, "write", write_then_terminated)
    rc = main(["trace", "import", "--format", "vllm-jsonl", str(data / "vllm_routes.jsonl"), "--model",
               str(data / "tiny-moe-2layers-config.json"), "--out", str(tmp_path / "t")])
    assert rc == 143 and capsys.readouterr().err.strip() == "place: terminated"
    assert list(tmp_path.iterdir()) == []


def test_simulation_results_printed_when_its_directory_cannot_be_written(work, monkeypatch, capsys):
    real_replace = os.replace

    def disk_full(src, dst):
        if Path(dst).name == "sim":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", disk_full)
    monkeypatch.setattr(files.os, "rename", disk_full)  # a new directory is claimed by rename(2)
    rc = main(["simulate", "trace", "--placement", "placement.json", *SIM, "--out", "sim", "--chrome-trace", "c.json"])
    out, err = capsys.readouterr()
    assert rc == 1 and "placement" in out and "metric" in out  # the side-by-side table
    assert err.strip().splitlines()[-1] == (f"place: error: could not write sim ({os.strerror(errno.ENOSPC)}); "
                                            "the results above were not saved there")
    assert (work / "c.json").is_file() and not (work / "sim").exists()
    assert not list(work.glob(f"*{TEMP_MARK}*"))
