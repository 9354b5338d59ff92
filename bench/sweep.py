"""Wall time of ``place sweep`` on a spec (default: the 20-point K3 example), once on a local process pool
(``--local``) and once on a local Ray instance, each from an empty output directory; checks that both give
the same table (every column but the wall-clock ones) and that the code did not change during the runs.
Prints the figures and writes ``bench/results/sweep.json``.

    .venv/bin/python bench/sweep.py [--spec examples/sweep-k3.yaml] [--workers 2] [--only local|ray]

By default both sweeps run on a copy of the packages they use, taken at start (so edits to the tree while
they run cannot make their tables differ); ``--no-snapshot`` runs the tree as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from _timing import ROOT, rel, timed, write_result  # first: keeps bench/sim.py from shadowing sim

SNAPSHOT_ENV = "MOEPLACE_BENCH_SNAPSHOT"
PACKAGES = ("moeplace",)  # the one package the sweeps run


def _run_on_a_snapshot() -> None:
    """Re-run this script on a frozen copy of the packages a sweep runs (first on PYTHONPATH, which the
    process pool and the local Ray workers inherit), so edits made to the tree while the two sweeps run
    cannot make their tables differ."""
    if os.environ.get(SNAPSHOT_ENV) or "--no-snapshot" in sys.argv:
        return
    snap = Path(tempfile.mkdtemp(prefix="bench-sweep-code-"))
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, snap / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, SNAPSHOT_ENV: str(snap),
           "PYTHONPATH": os.pathsep.join([str(snap)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)


_run_on_a_snapshot()

import polars as pl

from moeplace.cli.sweep import comparable, load_spec, run_sweep


def source_hash() -> str:
    """sha256 over the sources the sweeps run (``PACKAGES`` of the snapshot)."""
    import moeplace

    base = Path(moeplace.__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for f in sorted((base / pkg).rglob("*.py")) + sorted((base / pkg).rglob("*.json")):
            h.update(str(f.relative_to(base)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "sweep-k3.yaml"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", choices=("local", "ray"), default=None)
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the tree as it is (edits during the runs count)")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    code_before = source_hash()
    runs = {}
    tables = {}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for backend in ("local", "ray"):
            if args.only and backend != args.only:
                continue
            with timed() as tm:
                res = run_sweep(spec, Path(tmp) / backend, backend=backend, workers=args.workers,
                                log=lambda m: print(m, file=sys.stderr, flush=True))
            wall = tm.wall_s
            t = res.table
            opt = t.unique("optimize_key")["wall_optimize_s"].drop_nulls()
            runs[backend] = {"wall_s": wall, "cpu_s": tm.cpu_s, "points": res.num_points, "optimize_tasks": res.num_optimized,
                             "statuses": dict(t.group_by("status").len().sort("status").iter_rows()),
                             "sum_simulate_s": float(t["wall_simulate_s"].sum() or 0.0),
                             "optimize_s": float(opt.sum())}
            tables[backend] = comparable(t)
            r = runs[backend]
            print(f"{backend}: {wall:.1f} s wall for {res.num_points} points ({r['statuses']}), "
                  f"{res.num_optimized} optimize tasks, simulate tasks {r['sum_simulate_s']:.1f} s, "
                  f"optimize tasks {r['optimize_s']:.1f} s")
    code_after = source_hash()
    same, diff = None, []
    if len(tables) == 2:
        same = tables["local"].equals(tables["ray"])
        if not same:
            diff = [c for c in tables["local"].columns
                    if not tables["local"][c].equals(tables["ray"][c], check_dtypes=True)]
            print(f"tables differ in columns: {diff}")
        unchanged = code_before == code_after
        print(f"same table (local vs ray): {same}; code unchanged during the runs: {unchanged}"
              f"; ray / local wall: {runs['ray']['wall_s'] / runs['local']['wall_s']:.2f}")
    out = {"spec": rel(args.spec), "snapshot": bool(os.environ.get(SNAPSHOT_ENV)), "workers": args.workers,
           "runs": runs, "same_table": same, "differing_columns": diff, "source_unchanged": code_before == code_after,
           "source_hash": code_before, "polars": pl.__version__}
    write_result("sweep", out)
    if os.environ.get(SNAPSHOT_ENV):
        shutil.rmtree(os.environ[SNAPSHOT_ENV], ignore_errors=True)
    return 0 if same in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
