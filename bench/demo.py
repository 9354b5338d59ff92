"""The worked example of README.md: ``make demo`` (= ``place demo --out run``) in an empty directory, so
every stage runs (the trace is synthesized, not reused). Records what it printed and the figures README
quotes from its artifacts (run/plan.json, run/comparison.json, run/sim/summary.json) and writes
bench/results/demo.json; ``python bench/figures.py`` renders README's transcript and its reading from it.

    .venv/bin/python bench/demo.py [--quick] [--keep DIR]

The demo runs as a subprocess with the repository's packages; the absolute path of its directory, which
the launch lines of steps 5 and 6 contain, is shown as ``/home/user/moeplace`` (a user's checkout).
``--keep DIR`` runs it in DIR (which must not exist or be empty) and leaves the run there, e.g. for
bench/scenarios.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import ROOT, timed, write_result  # before any project import: sets sys.path

from moeplace.sim.results import read_summaries

SHOWN_HOME = "/home/user/moeplace"


def _run_demo(work: Path, quick: bool) -> tuple[str, float, float]:
    """Run ``place demo --out run`` in ``work``; (printed output with work's path replaced, wall s, CPU s)."""
    argv = [sys.executable, "-m", "moeplace.cli", "demo", "--out", "run", *(["--quick"] if quick else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with timed() as t:
        # stderr into the same stream, in order, as a terminal shows the demo's warnings
        res = subprocess.run(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             check=False)
    if res.returncode:
        sys.exit(f"place demo exited with {res.returncode}:\n{res.stdout[-4000:]}")
    printed = res.stdout
    for form in {str(work), str(work.resolve())}:
        printed = printed.replace(form, SHOWN_HOME)
    return printed, t.wall_s, t.cpu_s


def _figures(run: Path) -> dict:
    """What README reads off the run: the memory plan's verdict, every policy's scores, the simulation."""
    plan = json.loads((run / "plan.json").read_text())
    cmp = json.loads((run / "comparison.json").read_text())
    sims = read_summaries(run / "sim" / "summary.json")
    policies = {}
    for row in cmp["rows"]:
        held = row["held_out"]
        policies[row["policy"]] = {
            "seconds": row["seconds"], "plan_balancedness": row["plan"]["balancedness"],
            "held_balancedness": held["balancedness"], "held_worst": held["worst_window_balancedness"],
            "held_max_over_mean": held["max_over_mean"], "held_nodes_per_token": held["remote_per_token"]["node"],
            "duplicate_on_gpu_layers": row["duplicate_on_gpu_layers"],
            "shift_mean": cmp["shift"][row["policy"]]["mean"], "shift_worst": cmp["shift"][row["policy"]]["worst"]}
    keep = ("output_tok_s", "straggler_share", "straggler_s", "mean_imbalance", "tpot_p50_s", "duration_s", "wall_s")
    return {
        "plan": {"fits": plan["fits"], "layout": plan["layout"], "cluster": plan["cluster"],
                 "cache_pool_bytes": plan["pools"]["pool_bytes"], "context": plan["context"],
                 "concurrency": plan["concurrency"], "concurrency_ceiling": plan["concurrency_ceiling"],
                 "mix_concurrency": plan["mix_concurrency"], "mix_ceiling": plan["mix_ceiling"]},
        "optimize": {"tokens": cmp["tokens"], "plan_windows": cmp["plan_windows"],
                     "held_out_windows": cmp["held_out_windows"], "shift_scenarios": cmp["shift_scenarios"],
                     "policies": policies},
        "simulate": {s["label"]: {k: s[k] for k in keep} for s in sims},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="place demo --quick (a 20k-token smoke run)")
    ap.add_argument("--keep", help="run in this directory (absent or empty) and keep the run")
    args = ap.parse_args()
    if args.keep:
        work = Path(args.keep)
        if work.exists() and any(work.iterdir()):
            sys.exit(f"--keep {work}: not empty")
        work.mkdir(parents=True, exist_ok=True)
        printed, wall, cpu = _run_demo(work, args.quick)
        figures = _figures(work / "run")
    else:
        with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
            printed, wall, cpu = _run_demo(Path(tmp), args.quick)
            figures = _figures(Path(tmp) / "run")
    print(printed)
    write_result("demo", {"command": "make demo" if not args.quick else "place demo --out run --quick",
                          "quick": args.quick, "printed": printed, "wall_s": wall, "cpu_s": cpu, **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
