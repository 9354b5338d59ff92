"""What every benchmark under bench/ shares: where results go, how time is measured and what is recorded
about the machine with them.

A benchmark script imports this module first: it moves bench/ (a script's own directory, first on
``sys.path``) to the end, where bench/sim.py no longer shadows the ``sim`` package, and puts the
repository root first unless ``PYTHONPATH`` already says where the packages come from (bench/sweep.py
runs on a snapshot of them that way).

Conventions: wall seconds from ``time.perf_counter``; CPU seconds include finished child processes
(worker pools, forked writers, subprocesses), since several stages do their work there; a figure
measured more than once is the median of its repeats; every results file records the load average
(the machine is often shared, and wall figures depend on it) and is written atomically as
``bench/results/<name>.json``, which ``bench/figures.py`` renders into README.md and docs/.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))
sys.path.append(str(BENCH))

from moeplace.foundation.files import write_text_atomic


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished, waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def own_peak_rss_mb() -> float:
    """This process's peak RSS since it started its program (``VmHWM``: unlike ``ru_maxrss`` it does not
    carry the parent's footprint across the fork and exec that started it)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return peak_rss_mb()


def children_peak_rss_mb() -> float:
    """Largest peak RSS of the finished child processes, MB."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


@dataclass
class Timing:
    """Wall and CPU seconds of one ``timed()`` block (filled when the block ends)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0


@contextmanager
def timed() -> Iterator[Timing]:
    """``with timed() as t: ...`` then ``t.wall_s``, ``t.cpu_s`` (children included)."""
    t = Timing()
    c0, w0 = cpu_seconds(), time.perf_counter()
    try:
        yield t
    finally:
        t.wall_s, t.cpu_s = time.perf_counter() - w0, cpu_seconds() - c0


@dataclass
class Repeats:
    """``repeats`` runs of one call: the last result, every run's wall and CPU seconds, their medians."""

    result: object
    wall_s: list[float]
    cpu_s: list[float]

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_s)


def repeat(fn: Callable[[], object], repeats: int) -> Repeats:
    """Call ``fn`` ``repeats`` (>= 1) times back to back, timing each call."""
    walls, cpus, result = [], [], None
    for _ in range(max(1, repeats)):
        with timed() as t:
            result = fn()
        walls.append(t.wall_s)
        cpus.append(t.cpu_s)
    return Repeats(result, walls, cpus)


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when it lies inside it (results files name no machine's
    directories)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """What a results file records about where it was measured."""
    return {"cpus": os.cpu_count(), "loadavg": loadavg(), "python": platform.python_version(),
            "machine": platform.machine()}


def write_result(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write ``payload`` as ``bench/results/<name>.json`` (or ``path``), tagged with the bench's name and
    the machine (load average taken now, at the end of the run); returns the path."""
    dest = Path(path) if path is not None else RESULTS / f"{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": f"moeplace.bench.{name}/1", "bench": name, "machine": machine(), **payload}
    write_text_atomic(dest, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}", flush=True)
    return dest
