"""Bounded by design (issue 30): work that cannot fit is refused before it allocates, in one line naming
the flag (or spec field) and the estimate; every output path failure is one line and leaves nothing
half-made; two writers on one output without --force cannot both win; a short --time-limit still runs
the cheap baselines.

Every refusal here happens before the work, so each case takes milliseconds (the available memory is
fixed by monkeypatching :func:`moeplace.foundation.limits.available_memory`, so the cases do not depend
on the machine)."""
from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from fuzzkit import SIM, assert_refused, assert_untouched, run_place, size_inputs, snapshot, work_copy
from simkit import mini_model

from moeplace.cli.sweep.spec import load_spec
from moeplace.foundation import files, limits
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import TEMP_MARK, OutputExists, atomic_path, check_output
from moeplace.placement.compare import compare_policies
from moeplace.traces.loads import Loads
from moeplace.traces.synth import SynthConfig

GIB = 2**30
REAL_AVAILABLE = limits.available_memory


@pytest.fixture(autouse=True)
def sixteen_gib(monkeypatch):
    """Every case sees a machine with 16 GiB available (and 1 TiB of free disk)."""
    monkeypatch.setattr(limits, "available_memory", lambda: 16 * GIB)
    monkeypatch.setattr(limits, "free_disk", lambda path: 2**40)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return size_inputs(tmp_path_factory.mktemp("bounds"))


@pytest.fixture
def work(inputs, tmp_path, monkeypatch):
    return work_copy(inputs, tmp_path, monkeypatch)


def refused(argv, capsys, work, *names) -> str:
    before = snapshot(work)
    line = assert_refused(run_place(argv, capsys), *names)
    assert_untouched(work, before)
    return line


# ------------------------------------------------------------------ item 1: estimates before the work
@pytest.mark.parametrize("gpus, policy", [("1000000", None), ("100000", None), ("100000", "eplb"),
                                          ("100000", "linear"), ("100000", "round_robin"),
                                          ("100000", "moeplace")])
def test_optimize_huge_gpu_count_is_refused_with_its_memory_estimate(work, capsys, gpus, policy):
    pol = ["--policy", policy] if policy else []
    line = refused(["optimize", "k3.npz", "--gpus", gpus, *pol, "--no-shift", "--no-out"], capsys, work,
                   f"--gpus {gpus}", "of memory", "replica map", "16.0 GiB")
    assert ("4 placements" in line) == (policy is None)


def test_placement_estimate_matches_the_measured_replica_map():
    # tracemalloc, K3, one EPLB placement at G = 2048 (R = 1152): 385 MB
    est = limits.placement_estimate(92, 896, 2048, 1152)
    assert 0.9 * 385e6 < est.bytes < 1.1 * 385e6


def test_synth_drift_phases_and_tokens(work, capsys):
    refused(["trace", "synth", "--model", "model.json", "--drift-phases", "1000000000", "--out", "t"], capsys, work,
            "--drift-phases", "1000000000", "ceiling")
    refused(["trace", "synth", "--model", "model.json", "--tokens", str(10**12), "--out", "t"], capsys, work,
            "--tokens", "ceiling of 10000000000")


def test_synth_drift_phases_within_tokens_refused_by_memory(work, capsys):
    # 10^9 phases of 10^10 tokens pass the ceiling; their anchors need ~88 GB
    refused(["trace", "synth", "--model", "model.json", "--tokens", str(10**10), "--drift-phases", str(10**9),
             "--out", "t"], capsys, work, "--drift-phases 1000000000", "GiB of memory", "drift anchors")


def test_synth_tokens_refused_by_free_disk(work, capsys, monkeypatch):
    monkeypatch.setattr(limits, "free_disk", lambda path: 10 * GIB)
    refused(["trace", "synth", "--tokens", str(10**9), "--out", "t"], capsys, work,
            f"--tokens {10**9}", "GiB of disk", "days to generate", "10.0 GiB free")


@pytest.mark.parametrize("flags, names", [
    (["--concurrency", "1000000000"], ["--concurrency 1000000000", "simulated requests", "ceiling"]),
    (["--rate", "1000000000"], ["--rate 1000000000 x --duration 600", "ceiling"]),
    (["--rate", "1000000000", "--duration", "5"], ["--rate 1000000000 x --duration 5", "ceiling"]),
    (["--duration", "1e12"], ["--duration 1000000000000", "86400 simulated seconds"]),
    (["--concurrency", "50000000"], ["--concurrency 50000000", "GiB of memory", "requests in flight"]),
    (["--rate", "100000", "--duration", "1000"], ["--rate 100000 x --duration 1000", "GiB of memory"]),
])
def test_simulate_refuses_before_reading_the_trace(work, capsys, monkeypatch, flags, names):
    from moeplace.sim import runner

    def never(*a, **k):
        raise AssertionError("the trace was read before the bounds were checked")

    monkeypatch.setattr(runner, "load_trace_tokens", never)  # what place simulate reads the trace with
    sim = ["--gpus", "4", "--gpus-per-node", "2", "--attention-tp", "2", "--no-progress"]
    refused(["simulate", "trace", "--placement", "placement.json", *sim, *flags], capsys, work, *names)


def test_arrival_estimate_is_what_the_issue_saw():
    # --rate 1e9 --duration 5 made the arrival process allocate 44.7 GiB for its gaps alone
    est = limits.simulation_estimate(arrival="poisson", concurrency=0, rate=1e9, rate_end=None, duration=5.0,
                                     max_requests=None)
    gaps = 8 * (1.2 * 5e9 + 20 * np.sqrt(5e9 + 1) + 10)
    assert abs(gaps / GIB - 44.7) < 0.1 and est.bytes > 3 * gaps


def test_sweep_spec_meets_the_same_ceilings(work):
    base = "model: model.json\nworkloads:\n  - name: w\n    {w}\naxes:\n  gpus: 4\n{extra}"
    (work / "s1.yaml").write_text(base.format(w="trace: trace", extra="simulate: {duration: 1.0e+12}\n"))
    with pytest.raises(InputError, match=r"simulate.duration 1000000000000: more than the ceiling of 86400"):
        load_spec(work / "s1.yaml")
    for tokens, why in (("1000000000000", "ceiling of 10000000000"),
                        ("1.0e+12", "expected a whole number, got 1000000000000.0")):  # the typed check first
        (work / "s2.yaml").write_text(base.format(w=f"synth: {{num_tokens: {tokens}}}", extra=""))
        with pytest.raises(InputError, match=rf"workloads\[0\].synth.*num_tokens.*{why}"):
            load_spec(work / "s2.yaml")


def test_sweep_point_meets_the_concurrency_ceiling_before_any_task(work, capsys):
    (work / "s.yaml").write_text("model: model.json\nworkloads:\n  - name: w\n    trace: trace\n"
                                 "    concurrency: 1000000000\naxes:\n  gpus: 4\n  gpus_per_node: 2\n  tp: 2\n")
    # refused as the spec is read: its workloads' settings go through SimConfig's checks
    refused(["sweep", "s.yaml", "--local", "--workers", "1", "--quiet", "--out", "sw"], capsys, work, "s.yaml",
            "workload 'w'", "--concurrency 1000000000", "ceiling")


def test_yaml_1e12_is_a_string_and_said_so(work):
    # YAML 1.1 (PyYAML) reads 1e12 without a dot as a string: refused as what it is, not a TypeError
    base = "model: model.json\nworkloads:\n  - name: w\n    synth: {num_tokens: 1e12}\naxes:\n  gpus: 4\n"
    (work / "s3.yaml").write_text(base)
    with pytest.raises(InputError, match=r"num_tokens'?: expected a whole number, got '1e12'"):
        load_spec(work / "s3.yaml")


def test_one_check_for_flags_and_specs():
    with pytest.raises(InputError, match="--tokens"):
        SynthConfig(num_tokens=10**12)
    with pytest.raises(InputError, match="--drift-phases"):
        SynthConfig(num_tokens=1000, drift_phases=1001)
    SynthConfig(num_tokens=1000, drift_phases=1000)


def test_demo_quick_honours_tokens_and_refuses_before_touching_anything(work, capsys):
    from types import SimpleNamespace

    from moeplace.cli.commands.demo import demo_sizes

    assert demo_sizes(SimpleNamespace(tokens=None, duration=None, quick=True)) == (20_000, 60.0)
    assert demo_sizes(SimpleNamespace(tokens=5000, duration=None, quick=True)) == (5000, 60.0)
    assert demo_sizes(SimpleNamespace(tokens=None, duration=7.0, quick=False)) == (100_000, 7.0)
    refused(["demo", "--quick", "--tokens", str(10**12), "--out", "run", "--traces", "tr"], capsys, work,
            "--tokens", "ceiling")
    refused(["demo", "--quick", "--duration", "1e12", "--out", "run", "--traces", "tr"], capsys, work,
            "--duration", "ceiling")


def test_available_memory_reads_meminfo_else_sysconf(monkeypatch):
    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    if "MemAvailable" not in text:
        pytest.skip("no /proc/meminfo MemAvailable here")
    kb = int(next(line for line in text.splitlines() if line.startswith("MemAvailable")).split()[1])
    got = REAL_AVAILABLE()
    assert abs(got - kb * 1024) < 0.25 * kb * 1024
    real_open = open

    def no_proc(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise OSError(errno.ENOENT, "no /proc")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", no_proc)
    fallback = REAL_AVAILABLE()
    assert fallback is None or fallback > 0


# ------------------------------------------------------------------ item 3: output path failures
def test_too_long_output_name_is_one_line(work, capsys):
    name = "a" * 300 + ".json"
    line = refused(["optimize", "trace", "--gpus", "4", "--gpus-per-node", "2", "--policy", "linear", "--no-shift",
                    "--out", name], capsys, work, "--out", "bytes long, more than the 255")
    assert len(line) < 600


def test_non_utf8_output_name_is_one_line(work, capsys):
    bad = os.fsdecode(b"sim\xff")
    refused(["simulate", "trace", "--placement", "placement.json", *SIM, "--out", bad], capsys, work,
            "--out sim\\xff", "not UTF-8 (byte 0xff)")
    refused(["trace", "stats", "trace", "--out", os.fsdecode(b"l\xfe.npz")], capsys, work, "byte 0xfe")


def test_disk_full_while_writing_a_file_is_one_line_and_leaves_nothing(work, capsys, monkeypatch):
    real = files.os.link

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(files.os, "link", full)
    before = snapshot(work)
    res = run_place(["trace", "stats", "trace", "--out", "l.npz"], capsys)
    monkeypatch.setattr(files.os, "link", real)
    lines = res.err.strip().splitlines()
    assert res.rc == 1 and len(lines) == 1 and "Traceback" not in res.err
    assert lines[0] == f"place: error: could not write l.npz ({os.strerror(errno.ENOSPC)}); the results above " \
                       "were not saved there"
    assert_untouched(work, before)


def test_polars_disk_full_becomes_write_failed(tmp_path):
    def polars_full(self, *a, **k):
        raise pl.exceptions.ComputeError("failed to write parquet: No space left on device (os error 28)")

    with pytest.raises(files.WriteFailed) as ei, pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl.DataFrame, "write_parquet", polars_full)
        with atomic_path(tmp_path / "x.parquet") as tmp:
            pl.DataFrame({"a": [1]}).write_parquet(tmp)
    assert ei.value.errno == errno.ENOSPC and "x.parquet" in str(ei.value)
    assert list(tmp_path.iterdir()) == []
    # an error that is not a write failure stays what it is
    with pytest.raises(ValueError), atomic_path(tmp_path / "y.json"):
        raise ValueError("a bug")
    assert list(tmp_path.iterdir()) == []


def test_demo_on_a_full_disk_is_one_line_and_leaves_no_run_directory(work, capsys, monkeypatch):
    from moeplace.cli.commands.demo import RUN_MARKER

    real = Path.write_text

    def full(self, *a, **k):
        if self.name == RUN_MARKER:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    before = snapshot(work)
    res = run_place(["demo", "--quick", "--out", "run", "--traces", "tr"], capsys)
    lines = res.err.strip().splitlines()
    assert res.rc == 1 and len(lines) == 1 and "No space left on device" in lines[0], res.err
    assert_untouched(work, before)


def _invalid_point_spec(work: Path) -> Path:
    # 3 GPUs on nodes of 2: the plan stage marks the point invalid, its row is written at once (no workers)
    spec = work / "s.yaml"
    spec.write_text("model: model.json\nworkloads:\n  - name: w\n    trace: trace\naxes:\n  gpus: 3\n"
                    "  gpus_per_node: 2\n")
    return spec


def test_sweep_on_a_full_disk_leaves_no_directory(work, capsys, monkeypatch):
    spec = _invalid_point_spec(work)

    def polars_full(self, *a, **k):
        raise pl.exceptions.ComputeError("failed to write parquet: No space left on device (os error 28)")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", polars_full)
    before = snapshot(work)
    res = run_place(["sweep", str(spec), "--local", "--workers", "1", "--quiet", "--out", "sw"], capsys)
    lines = res.err.strip().splitlines()
    assert res.rc == 1 and len(lines) == 1 and "Traceback" not in res.err, res.err
    assert "No space left on device" in lines[0] and "sw was removed" in lines[0]
    assert_untouched(work, before)


def test_sweep_on_a_full_disk_after_some_points_says_how_to_resume(work, capsys, monkeypatch):
    spec = _invalid_point_spec(work)
    real = pl.DataFrame.write_parquet

    def full_for_the_table(self, path, *a, **k):
        if Path(path).name.startswith(".sweep.parquet"):
            raise pl.exceptions.ComputeError("No space left on device (os error 28)")
        return real(self, path, *a, **k)

    monkeypatch.setattr(pl.DataFrame, "write_parquet", full_for_the_table)
    res = run_place(["sweep", str(spec), "--local", "--workers", "1", "--quiet", "--out", "sw"], capsys)
    lines = res.err.strip().splitlines()
    assert res.rc == 1 and len(lines) == 1, res.err
    assert "1 finished point(s) are kept" in lines[0] and "run the same command again to resume" in lines[0]
    assert not list((work / "sw").rglob(f"*{TEMP_MARK}*"))


# ------------------------------------------------------------------ item 5: no lost update
def _race(path: Path, directory: bool, force: bool) -> list:
    """Two writers of ``path`` that both checked it while it was absent, then claim it at the same time."""
    checked, barrier = threading.Barrier(2), threading.Barrier(2)
    results: list = [None, None]

    def writer(i: int) -> None:
        check_output(path, kind="simulation output directory" if directory else "placement JSON", force=force)
        checked.wait()  # both checked before either wrote
        try:
            with atomic_path(path, directory=directory) as tmp:
                if directory:
                    (tmp / "summary.json").write_text(str(i))
                else:
                    tmp.write_text(str(i))
                barrier.wait()  # both finished writing: now both rename
            results[i] = "ok"
        except OutputExists as exc:
            results[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("directory", [False, True])
def test_two_writers_without_force_exactly_one_wins(tmp_path, directory):
    path = tmp_path / ("out" if directory else "p.json")
    results = _race(path, directory, force=False)
    assert sorted(r == "ok" for r in results) == [False, True], results
    loser = next(r for r in results if r != "ok")
    winner = results.index("ok")
    assert f"{path}" in str(loser) and "created by another run" in str(loser) and "--force" in str(loser)
    assert "\n" not in str(loser)
    got = (path / "summary.json" if directory else path).read_text()
    assert got == str(winner)  # the winner's output, not replaced by the loser
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


def test_two_writers_with_force_keep_replace_semantics(tmp_path):
    path = tmp_path / "p.json"
    assert _race(path, False, force=True) == ["ok", "ok"]
    assert path.read_text() in ("0", "1")


def test_two_processes_racing_on_one_out(work, capsys):
    """The CLI contract end to end: two `place export` runs on one --out, the second finding the first's
    output only at its rename, exits 1 with one line and leaves the first's file."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])}
    code = ("import sys, os; sys.argv = ['place']\n"
            "from moeplace.foundation import files\n"
            "real = files._claim_file\n"
            "def slow(tmp, path):\n"
            "    import time\n"
            "    while not os.path.exists(os.environ['GO']): time.sleep(0.01)\n"
            "    real(tmp, path)\n"
            "files._claim_file = slow\n"
            "from moeplace.cli.main import main\n"
            "sys.exit(main(['export', 'placement.json', '--format', 'sglang', '--out', 'x.json', '--model', "
            "'model.json']))\n")
    go = work / ".go"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=work, env={**env, "GO": str(go)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    import time

    deadline = time.monotonic() + 60
    while len(list(work.glob(f".x.json{TEMP_MARK}*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # both have checked --out and written their temporaries
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    rcs = sorted(p.returncode for p in procs)
    assert rcs == [0, 1], outs
    err = next(e for p, (_, e) in zip(procs, outs, strict=True) if p.returncode == 1).strip().splitlines()
    assert len(err) == 1 and "created by another run" in err[0], err
    assert (work / "x.json").is_file() and not list(work.glob(f"*{TEMP_MARK}*"))


# ------------------------------------------------------------------ item 4 (issue's last bullet)
def test_short_time_limit_still_runs_the_cheap_baselines():
    from moeplace.foundation.cluster import make_cluster

    m = mini_model()
    counts = np.random.default_rng(1).integers(1, 100, size=(4, m.num_moe_layers, m.num_experts))
    loads = Loads(counts=counts, model=m, window_tokens=64, labels=("a", "b", "c", "d"))
    # 0.75 s: less than the scoring reserve of all four policies (4 x 0.2 s), more than the baselines need
    cmp = compare_policies(loads, make_cluster(4, "h200", 2), num_redundant=4, time_limit=0.75)
    ran = {r.policy for r in cmp.results}
    assert {"eplb", "linear", "round_robin"} <= ran, cmp.notes
