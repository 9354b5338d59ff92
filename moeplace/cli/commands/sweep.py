"""``place sweep SPEC.yaml|toml [--ray ADDRESS|auto] [--local] [--out DIR] [--workers N]``: plan, optimize
and simulate every point of a design-space spec, on a local Ray instance (default), an existing Ray
cluster (``--ray``) or a local process pool (``--local``); stream the rows to ``OUT/points/*.parquet``,
write ``OUT/sweep.parquet`` and ``OUT/frontier.json``, print the Pareto frontier and the recommended
deployment's launch command. A rerun with the same ``--out`` resumes: finished points are not redone.
The work is :func:`moeplace.sweep.run_sweep`."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.sweep import format_frontier, load_spec, run_sweep
from moeplace.cli.sweep.spec import check_points, expand_points
from moeplace.foundation.cluster import load_gpu
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import (
    OutputError,
    WriteFailed,
    check_output,
    display,
    exclusive_lock,
    remove_empty_tree,
)
from moeplace.foundation.limits import MAX_SWEEP_POINTS
from moeplace.sim.calibrate import check_applies, load_calibration
from moeplace.sim.frontier import SWEEP_DIRECTORY

EXIT_NOTHING_FINISHED = 3  # as `place plan` when nothing fits: the inputs were valid, no deployment came out


def register(sub) -> None:
    p = sub.add_parser("sweep", help="design-space search: plan, optimize, simulate every point of a spec",
                       description="Plans, optimizes and simulates every point of a design-space spec on a "
                                   "local Ray instance (default), a Ray cluster (--ray) or a process pool "
                                   "(--local). Rows stream to OUT/points/; OUT/sweep.parquet and "
                                   "OUT/frontier.json are written at the end. Rerun with the same --out to "
                                   "resume: finished points are not redone.")
    p.add_argument("spec", help="sweep spec (.yaml/.yml/.toml): model, workloads, axes, settings")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ray", default=None, metavar="ADDRESS|auto",
                   help="attach to a running Ray cluster (ray.init(address=...)); default: start a local Ray "
                        "instance of --workers CPUs")
    g.add_argument("--local", action="store_true", help="run on a local process pool, without Ray")
    p.add_argument("--out", default=None, help="output directory (default: runs/sweep-<spec name>); an existing "
                   "one is resumed when it is a sweep directory and refused otherwise")
    p.add_argument("--workers", type=flags.positive_int, default=None,
                   help="worker processes / local Ray CPUs (default: the number of cores)")
    p.add_argument("--max-points", type=flags.positive_int, default=None, metavar="N",
                   help=f"run a spec of up to N points (default {MAX_SWEEP_POINTS:,}: more are refused before "
                        "any runs, with an estimate of the time they take)")
    p.add_argument("--quiet", action="store_true", help="no per-point progress lines on stderr")
    p.add_argument("--json", action="store_true", help="print the frontier report as JSON instead of text")
    p.add_argument("--calibration", default=None, metavar="CAL.json",
                   help="price every point with the constants place calibrate fitted on your measured points of "
                        "the spec's model and GPU; ranges become the within-deployment interval")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers must be >= 1, got {args.workers}")
    # resuming is what --out is for: an existing sweep directory is written into (finished points kept)
    if args.out:
        check_output(args.out, kind=SWEEP_DIRECTORY, inputs=[args.spec], replace_own=True)
    spec = load_spec(args.spec)
    cal = None
    if args.calibration:
        cal = load_calibration(args.calibration)
        for gpu in sorted({p.gpu for p in expand_points(spec)}):
            check_applies(cal, spec.model.name, load_gpu(gpu).name)
        spec = dataclasses.replace(spec, cost=dataclasses.asdict(cal.cost), ensemble=cal.ensemble())
    out = args.out or f"runs/sweep-{spec.name}"
    if not args.out:
        check_output(out, kind=SWEEP_DIRECTORY, inputs=[args.spec], replace_own=True)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_points(spec, args.max_points, args.workers or os.cpu_count() or 1)  # before the directory is made
    existed = Path(out).exists()
    try:
        # one sweep at a time per --out: a second one says who holds it (the first would redo its points)
        with exclusive_lock(out):
            res = run_sweep(spec, out, backend="local" if args.local else "ray", ray_address=args.ray,
                            workers=args.workers, log=log, max_points=args.max_points, calibration=cal)
    except WriteFailed as exc:  # disk full, file system gone read-only: no point is half-written
        if not existed and remove_empty_tree(Path(out)):
            raise OutputError(f"{exc}; the sweep wrote nothing, {out} was removed") from None
        parts = len(list((Path(out) / "points").glob("*.parquet")))
        raise OutputError(f"{exc}; {parts} finished point(s) are kept in {display(out)}: free space and run "
                          "the same command again to resume from them") from None
    if args.json:
        print(json.dumps(res.report, indent=1, default=str))
        return _none_finished(args.spec, res.table)
    print(format_frontier(res.report))
    print(res.report["fidelity"]["note"])
    for name, launch in res.report["recommended_launch"].items():
        if "error" in launch:
            print(f"\n{name}: {launch['error']}")
            continue
        print(f"\nlaunch ({name}, {launch['format']}; files in {launch['placement'].rsplit('/', 1)[0]}):")
        print(launch["command"], end="")
        for w in launch["warnings"]:
            print(f"place: warning: {w}", file=sys.stderr)
    print(f"\ntable {res.table_path} ({res.table.height} rows), frontier {res.frontier_path}; "
          f"{res.num_run} point(s) run, {res.num_resumed} resumed, {res.num_optimized} optimize task(s), "
          f"{res.num_placements_reused} cached placement(s); {res.backend}, {res.wall_s:.1f} s")
    return _none_finished(args.spec, res.table)


def _none_finished(spec_path: str, table) -> int:
    """0 when some point finished; else one line saying why none did, and :data:`EXIT_NOTHING_FINISHED`
    (a sweep whose every point is invalid, infeasible or failed is not a success)."""
    if table.height == 0 or (table["status"] == "ok").any():
        return 0
    counts = table["status"].value_counts(sort=True)
    tally = ", ".join(f"{n} {s}" for s, n in counts.iter_rows())
    first = table.sort("index").row(0, named=True) if "index" in table.columns else table.row(0, named=True)
    print(f"place: error: {spec_path}: no point of the sweep finished ({tally}); the first, #{first.get('index')}: "
          f"{first['status']} at {first.get('stage')}: {first.get('reason')}", file=sys.stderr)
    return EXIT_NOTHING_FINISHED
