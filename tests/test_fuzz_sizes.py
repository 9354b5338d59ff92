"""Hostile sizes (issue 36): absurd sizes are refused before allocation, against the memory the process may
really use (address-space, data and cgroup limits, not only the machine's free memory); cost that grows
with a size is bounded before it is paid; a sweep's points are counted before any runs and one sweep at a
time writes an ``--out``; a flipped byte inside a trace's Parquet pages is an error naming the file, not
data; ``--save-all`` on a full disk leaves nothing.

Refusals happen before the work, so each case takes milliseconds in-process; the address-space cases
run ``place`` in a child under ``setrlimit(RLIMIT_AS)`` (a few seconds each: the imports)."""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import time
import zipfile
from io import BytesIO
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from fuzzkit import assert_refused, assert_untouched, run_place, size_inputs, snapshot, work_copy
from simkit import linear_placement, mini_model

from moeplace.cli.sweep.spec import check_points, count_points, load_spec
from moeplace.foundation import files, limits
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import LOCK_NAME, exclusive_lock
from moeplace.placement import traffic
from moeplace.placement.rules import get_rule
from moeplace.traces.format import META_CHECKSUMS

GIB = 2**30
ROOT = Path(__file__).parent.parent
SMALL_SPEC = Path(__file__).parent / "data" / "sweep-small.yaml"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return size_inputs(tmp_path_factory.mktemp("sizes"))


@pytest.fixture
def work(inputs, tmp_path, monkeypatch):
    return work_copy(inputs, tmp_path, monkeypatch)


def refused(argv, capsys, root, *names) -> str:
    before = snapshot(root)
    t0 = time.perf_counter()
    line = assert_refused(run_place(argv, capsys), *names)
    assert time.perf_counter() - t0 < 10, "refused, but only after the work"
    assert_untouched(root, before)
    assert len(line) < 1000, line
    return line


def run_limited(argv: list[str], cwd: Path, address_space: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """``place argv`` in a child whose address space is limited to ``address_space`` bytes."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "moeplace.cli", *argv], cwd=cwd, capture_output=True, text=True, check=False,
                          preexec_fn=limit, timeout=timeout, env=env)


def one_line(res: subprocess.CompletedProcess, *names: str) -> str:
    errs = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("place: note:")]
    assert res.returncode in (1, 2), (res.returncode, res.stderr[-2000:])
    assert len(errs) == 1 and errs[0].startswith("place: error: "), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    for n in names:
        assert n in errs[0], (n, errs[0])
    return errs[0]


# ------------------------------------------------------------------ what the process may use
def test_headroom_follows_the_address_space_limit(tmp_path):
    """Under ``ulimit -v`` the figure is what the limit leaves, not the machine's free memory."""
    code = "from moeplace.foundation import limits; print(limits.memory_headroom())"
    limit = 2 * GIB

    def lim():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=lim, env=env,
                         check=True).stdout
    value, why = eval(out)  # our own tuple's repr
    assert 0 < value <= limit and "ulimit -v" in why


def test_cgroup_limits_v2_and_v1(tmp_path):
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    (root / "job").mkdir(parents=True)
    proc.write_text("0::/job\n")
    (root / "job" / "memory.max").write_text(f"{4 * GIB}\n")
    (root / "job" / "memory.current").write_text(f"{3 * GIB}\n")
    (root / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 2}\n")
    # 4 GiB limit, 3 GiB used of which 0.5 GiB reclaimable page cache: 1.5 GiB left
    assert limits._cgroup_headroom(str(proc), str(root)) == 4 * GIB - (3 * GIB - GIB // 2)
    (root / "job" / "memory.max").write_text("max\n")
    assert limits._cgroup_headroom(str(proc), str(root)) is None
    proc.write_text("4:memory:/c1\n")
    (root / "memory" / "c1").mkdir(parents=True)
    (root / "memory" / "c1" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (root / "memory" / "c1" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert limits._cgroup_headroom(str(proc), str(root)) == GIB
    (root / "memory" / "c1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert limits._cgroup_headroom(str(proc), str(root)) is None


def test_refusal_names_what_bounds_the_memory(monkeypatch):
    monkeypatch.setattr(limits, "memory_headroom", lambda: (GIB, "the memory cgroup's limit (the container's) leaves"))
    with pytest.raises(InputError, match=r"needs about 2.0 GiB .* more than the 1.0 GiB the memory cgroup's limit"):
        limits.require_memory(limits.Estimate("--x 1", 2 * GIB, "d"))


def test_optimize_many_gpus_refused_under_the_process_limit(work):
    """K3 on 16,384 GPUs needs ~5 GiB of replica maps: fine on a large machine, refused under a 4 GiB
    address space before any is allocated (the machine's free memory alone let 10^5 GPUs through)."""
    res = run_limited(["optimize", "k3.npz", "--gpus", "16384", "--policy", "linear", "--no-shift", "--no-out"],
                      work, 4 * GIB)
    one_line(res, "--gpus 16384", "ulimit -v")
    assert res.returncode == 2


def test_trace_stats_under_a_small_address_space_is_one_line(work):
    res = run_limited(["trace", "stats", "trace"], work, 1_000_000 * 1024)
    one_line(res)


# ------------------------------------------------------------------ estimates before allocation
@pytest.fixture
def sixteen_gib(monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda: 16 * GIB)


def test_gpus_100000_refused_by_the_estimate(work, capsys, sixteen_gib):
    line = refused(["optimize", "k3.npz", "--gpus", "100000", "--policy", "linear", "--window-tokens", "256",
                    "--no-out"], capsys, work, "--gpus 100000", "GiB of memory")
    assert "scoring 2 windows" in line


def test_tiny_windows_refused_before_the_counts(work, capsys, monkeypatch):
    """``--window-tokens 1``: one [L, E] count array per token, refused from the window count."""
    monkeypatch.setattr(limits, "available_memory", lambda: 260 * 2**20)
    refused(["optimize", "trace", "--gpus", "4", "--gpus-per-node", "2", "--window-tokens", "1", "--no-out"],
            capsys, work, "trace at --window-tokens 1", "windows", "--window-tokens")
    est = limits.stats_estimate(num_windows=20_000, num_layers=92, num_experts=896, workers=2, mapped_bytes=0,
                                what="x")
    assert est.bytes > 40 * GIB  # what --window-tokens 1 on 20,000 K3 tokens would have allocated


def _npz_declaring(path: Path, shape: tuple[int, ...]) -> Path:
    """A compressed ``.npz`` whose ``counts`` header declares ``shape`` (a few KB on disk)."""
    head = BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<i8", "fortran_order": False, "shape": shape})
    meta = BytesIO()
    np.save(meta, np.array(json.dumps({"format": "moeplace.loads/1"})))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("counts.npy", head.getvalue() + bytes(1 << 16))
        z.writestr("meta.npy", meta.getvalue())
    return path


@pytest.mark.parametrize("shape", [(200_000, 48, 128), (10**7, 48, 128), (10**12, 10**12, 10**12)])
def test_npz_declared_shape_checked_before_loading(work, capsys, sixteen_gib, shape):
    _npz_declaring(work / "bomb.npz", shape)
    line = refused(["optimize", "bomb.npz", "--no-out"], capsys, work, "bomb.npz", "declare", "GiB")
    assert f"{shape[0]:,}" in line


def test_npz_with_a_broken_header_is_one_line(work, capsys):
    with zipfile.ZipFile(work / "bad.npz", "w") as z:
        z.writestr("counts.npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': <<<   \n")
    refused(["optimize", "bad.npz", "--no-out"], capsys, work, "bad.npz")


def test_traffic_sums_without_the_gpu_square():
    """The source-independent rules' traffic in [L, G] equals the [L, G, G] sums it replaced."""
    m = mini_model()
    for G, gpn in ((4, 2), (8, 4), (16, 4)):
        pl = linear_placement(m, G, gpn)
        w = np.random.default_rng(G).integers(0, 30, size=(m.num_moe_layers, m.num_experts)).astype(float)
        w[0] = 0
        for name in ("vllm", "trtllm", "ideal"):
            rule = get_rule(name)
            gl = rule.expected_gpu_loads(pl, w, rule.dispatch_state(pl))
            fast = traffic.traffic_from_loads(pl, w, rule, m.top_k, None, gl)
            type(rule).source_dependent_shares = True
            try:
                slow = traffic.traffic_from_loads(pl, w, rule, m.top_k, None, gl)
            finally:
                type(rule).source_dependent_shares = False
            assert fast[0] == pytest.approx(slow[0])
            assert fast[1] == pytest.approx(slow[1])


# ------------------------------------------------------------------ runaways
@pytest.mark.parametrize("gpus", ["1000000000", "1000000000000", "1000000000000000000"])
def test_plan_many_gpus_refused_at_once(work, capsys, gpus):
    refused(["plan", "--gpus", gpus], capsys, work, "--gpus", "ceiling of 1048576 GPUs")


def test_plan_search_is_bounded_at_the_ceiling(work, capsys):
    """The suggestion searches walk divisors and valid redundant counts, at most 64 plans each."""
    t0 = time.perf_counter()
    res = run_place(["plan", "--gpus", "1048576", "--redundant", str(1048576 - 896)], capsys)
    assert res.rc in (0, 3) and "Traceback" not in res.err
    assert time.perf_counter() - t0 < 30


def _spec(tmp_path: Path, axes: str = "", points: str = "") -> Path:
    text = SMALL_SPEC.read_text().split("axes:")[0]
    p = tmp_path / "spec.yaml"
    p.write_text(text + "axes:\n  gpu: h100\n" + axes + (f"points:\n{points}" if points else "") +
                 "plan: {context: 32k, min_seqs: 8}\nsimulate: {duration: 0.5, mode: stat, max_trace_tokens: 3000}\n")
    return p


def test_sweep_grid_is_counted_before_expansion(work, capsys):
    axes = (f"  gpus: {list(range(1, 501))}\n  tp: {list(range(1, 51))}\n  ep: {list(range(1, 101))}\n"
            f"  redundant: {list(range(100))}\n")
    spec = _spec(work, axes)
    assert count_points(load_spec(spec)) == 250_000_000
    line = refused(["sweep", str(spec), "--local", "--out", "o"], capsys, work, "250,000,000 points",
                   "--max-points", "ceiling of 1,000")
    assert "500 gpus x 50 tp x 100 ep x 100 redundant" in line and not (work / "o").exists()


def test_sweep_of_many_explicit_points_needs_max_points(work, capsys):
    """The finding had 10,000 (they started at once); past the ceiling of 1,000 they need --max-points."""
    pts = "".join(f"  - {{gpus: {g}}}\n" for g in range(2, 1_002))
    spec = _spec(work, "  gpus: 1\n", pts)
    line = refused(["sweep", str(spec), "--local", "--workers", "2", "--out", "o"], capsys, work,
                   "1,001 points", "a grid of 1 point plus 1,000 explicit points", "hours", "--max-points")
    assert "on 2 worker(s)" in line and not (work / "o").exists()
    assert check_points(load_spec(spec), max_points=2_000) == 1_001


def test_sweep_error_quotes_a_bounded_value(work, capsys):
    """An alias tree under an axis: the error quotes at most a short prefix (it formatted all of it)."""
    tree = ", ".join(["&a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)])  # 9^9 leaves: gigabytes as a repr
    spec = work / "bomb.yaml"
    spec.write_text(SMALL_SPEC.read_text().split("axes:")[0] + f"axes:\n  gpus: [[{tree}]]\n")
    line = refused(["sweep", str(spec), "--local", "--out", "o"], capsys, work, "bomb.yaml")
    assert len(line) < 400


# ------------------------------------------------------------------ one sweep per --out
def _infeasible_spec(tmp_path: Path) -> Path:
    """Two points that do not fit: the sweep records them without starting a worker (fast)."""
    text = SMALL_SPEC.read_text().replace("gpus: [1, 8]", "gpus: [1]").split("points:")[0]
    text += "plan: {context: 32k, min_seqs: 8}\nsimulate: {duration: 0.5, mode: stat, max_trace_tokens: 3000}\n"
    p = tmp_path / "infeasible.yaml"
    p.write_text(text)
    return p


def test_second_sweep_on_one_out_says_who_holds_it(work, capsys):
    spec = _infeasible_spec(work)
    with exclusive_lock(work / "o"):
        res = run_place(["sweep", str(spec), "--local", "--quiet", "--out", "o"], capsys)
        assert res.rc == 1, res.err
        lines = res.err.strip().splitlines()
        assert len(lines) == 1 and f"another run (process {os.getpid()}, started " in lines[0]
        assert "--out o" in lines[0]
        assert not (work / "o" / "points").exists()  # it ran nothing
    assert not (work / "o").exists()  # the lock's directory, made for it and left empty, is gone


def test_stale_lock_of_a_dead_process_is_taken_over(work, capsys):
    spec = _infeasible_spec(work)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (work / "o").mkdir()
    (work / "o" / LOCK_NAME).write_text(f"{dead.pid} 2026-01-01T00:00:00\n")
    res = run_place(["sweep", str(spec), "--local", "--quiet", "--out", "o"], capsys)
    assert res.rc == 3, res.err  # every point infeasible: exit 3, as before
    assert f"took over the lock left by process {dead.pid}" in res.err
    assert (work / "o" / "sweep.parquet").exists() and not (work / "o" / LOCK_NAME).exists()


# ------------------------------------------------------------------ page checksums
def _pages(trace: Path) -> tuple[Path, int, int]:
    f = min(trace.glob("*.parquet"))
    rg = pq.read_metadata(f).row_group(0)
    col = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema == "expert_delta_lo")
    return f, col.data_page_offset, col.total_compressed_size


@pytest.mark.parametrize("flips", [1, 2, 3, 5])
def test_flipped_bytes_in_pages_are_an_error_naming_the_file(work, capsys, flips):
    f, start, size = _pages(work / "trace")
    data = bytearray(f.read_bytes())
    rng = np.random.default_rng(flips)
    # inside the page data (past its header: the checksum covers the page's bytes, not its header)
    for i in rng.choice(np.arange(start + size // 4, start + size - 8), size=flips, replace=False):
        data[int(i)] ^= 1 << int(rng.integers(8))
    f.write_bytes(bytes(data))
    for argv in (["trace", "validate", "trace"], ["trace", "stats", "trace"],
                 ["evaluate", "placement.json", "trace"],
                 ["simulate", "trace", "--placement", "placement.json", "--gpus", "4", "--gpus-per-node", "2",
                  "--attention-tp", "2", "--duration", "0.1", "--concurrency", "4", "--no-progress"]):
        res = run_place(argv, capsys)
        assert res.rc == 2, (argv, res.rc, res.err[-500:])
        line = res.err.strip().splitlines()[-1]
        assert str(Path("trace") / f.name) in line and ("checksum" in line or "corrupt" in line), (argv, line)


def test_traces_carry_checksums_and_old_ones_read_with_a_note(work, capsys):
    f = min((work / "trace").glob("*.parquet"))
    assert META_CHECKSUMS in pq.read_schema(f).metadata
    # a trace of an earlier release: no checksums, no key; read as before, with one note
    t = pq.read_table(f)
    meta = {k: v for k, v in t.schema.metadata.items() if k != META_CHECKSUMS}
    (work / "old").mkdir()
    pq.write_table(t.replace_schema_metadata(meta), work / "old" / f.name)
    res = run_place(["trace", "validate", "old"], capsys)
    assert res.rc == 0 and res.err.count("written without page checksums") == 1, res.err


# ------------------------------------------------------------------ --save-all on a full disk
def test_save_all_on_a_full_disk_leaves_nothing(work, capsys, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a[0]))

    monkeypatch.setattr(files.os, "link", full)
    monkeypatch.setattr(files.os, "replace", full)
    monkeypatch.setattr(files.os, "rename", full)
    before = snapshot(work)
    res = run_place(["optimize", "trace", "--gpus", "4", "--gpus-per-node", "2", "--policy", "linear",
                     "--policy", "eplb", "--no-shift", "--no-out", "--save-all", "all/placements"], capsys)
    assert res.rc == 1 and "could not write all/placements" in res.err and "Traceback" not in res.err
    assert_untouched(work, before)  # neither the directory nor the parent made for it remains
    assert not (work / "all").exists()


def test_save_all_writes_a_new_directory_whole(work, capsys):
    res = run_place(["optimize", "trace", "--gpus", "4", "--gpus-per-node", "2", "--policy", "linear",
                     "--policy", "eplb", "--no-shift", "--no-out", "--save-all", "all"], capsys)
    assert res.rc == 0, res.err
    assert sorted(p.name for p in (work / "all").iterdir()) == ["placement-eplb.json", "placement-linear.json"]
