"""The scenarios of README.md and docs/ that run on the demo's artifacts: long context (8k prompts, then
5 % of 1 M-token prompts), co-locating experts against network traffic, the static-vs-online
rebalancing recommendation, and the engines' default layouts scored on the demo's Loads. Runs each documented ``place`` command as a user would,
in a directory holding the demo's ``data/k3-default`` and ``run/``, records what it printed and its
summary, and writes bench/results/scenarios.json; ``python bench/figures.py`` renders the docs' tables
and the sentences that read them from it.

    .venv/bin/python bench/scenarios.py [--run-dir DIR] [--only long_context,traffic,evaluate,recommend]

``--run-dir``: a directory left by ``bench/demo.py --keep DIR`` (or one where ``place demo --out run``
ran); without it, the demo runs first in a temporary directory (not recorded; ``--quick-demo``: its
20k-token smoke run). With ``--only``, the other scenarios keep what the results file has.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import RESULTS, ROOT, timed, write_result  # before any project import: sets sys.path
from demo import _run_demo

from moeplace.sim.results import read_summaries
from moeplace.traces.validate import read_trace_meta

LONG = ["simulate", "data/k3-default", "--placement", "run/placements/placement-eplb.json", "--duration", "900",
        "--concurrency", "256", "--output-len", "512", "--no-progress"]
SCENARIOS = {  # name -> {label: place argv (the documented command)}
    "long_context": {"8k": [*LONG, "--context-mix", "8k:1"], "1m": [*LONG, "--context-mix", "8k:0.95,1M:0.05"]},
    "traffic": {"traffic": ["optimize", "data/k3-default", "--gpus", "32", "--gpu", "h200", "--policy", "moeplace",
                            "--policy", "eplb", "--objective", "balance+traffic", "--traffic-weight", "10", "--out",
                            "run/placement-traffic.json", "--seed", "0", "--no-shift"]},
    "evaluate": {p: ["evaluate", f"run/placements/placement-{p}.json", "run/loads.npz", "--engine", "vllm"]
                 for p in ("linear", "round_robin", "moeplace")},
    "recommend": {"recommend": ["simulate", "data/k3-default", "--placement", "run/placements/placement-moeplace.json",
                                "--duration", "180", "--concurrency", "64", "--context-mix", "512:1", "--output-len",
                                "256", "--recommend", "--no-progress"]},
}


def _place(work: Path, argv: list[str], extra: list[str]) -> dict:
    """Run ``place ARGV EXTRA`` in ``work`` (EXTRA: where this bench collects the run's own JSON, not part
    of the documented command); the command, what it printed (stdout then stderr), wall and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with timed() as t:
        res = subprocess.run([sys.executable, "-m", "moeplace.cli", *argv, *extra], cwd=work, env=env,
                             capture_output=True, text=True, check=False)
    if res.returncode:
        sys.exit(f"place {' '.join(argv)} exited with {res.returncode}:\n{res.stderr[-4000:]}")
    print(f"$ place {' '.join(argv)}\n{res.stdout}{res.stderr}({t.wall_s:.1f} s)\n", flush=True)
    return {"command": "place " + " ".join(argv), "printed": res.stdout, "stderr": res.stderr, "wall_s": t.wall_s,
            "cpu_s": t.cpu_s}


def _flat(summary: dict) -> dict:
    """A simulation summary without its per-layer and per-window series (kept small)."""
    return {k: v for k, v in summary.items() if not isinstance(v, (list, dict)) or k == "recommendation"}


def run(work: Path, only: list[str], source: str) -> dict:
    """Every scenario of ``only`` in ``work``; each run records which demo run it read (``source``) and
    the size of its trace (``place demo --quick`` synthesizes 20k tokens instead of 100k)."""
    tokens = read_trace_meta(work / "data" / "k3-default")[1]["config"]["num_tokens"]
    out = {}
    for name in only:
        runs = {}
        for label, argv in SCENARIOS[name].items():
            with tempfile.TemporaryDirectory(prefix="bench-scenario-") as tmp:
                if argv[0] == "simulate":
                    r = _place(work, argv, ["--out", str(Path(tmp) / "sim")])
                    r["summary"] = [_flat(s) for s in read_summaries(Path(tmp) / "sim" / "summary.json")]
                elif argv[0] == "evaluate":
                    r = _place(work, argv, [])
                else:
                    r = _place(work, argv, ["--report", str(Path(tmp) / "report.json"), "--force"])
                    r["report"] = json.loads((Path(tmp) / "report.json").read_text())
            runs[label] = {"demo": source, "trace_tokens": tokens, **r}
        out[name] = runs
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", help="directory holding the demo's data/k3-default and run/")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    ap.add_argument("--quick-demo", action="store_true",
                    help="without --run-dir: run the demo with --quick first (a 20k-token trace)")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        sys.exit(f"--only: unknown scenario(s) {sorted(unknown)} (known: {', '.join(SCENARIOS)})")
    if args.run_dir:
        work = Path(args.run_dir)
        if not (work / "run" / "placements").is_dir() or not (work / "data" / "k3-default").is_dir():
            sys.exit(f"--run-dir {work}: no demo run there (run/placements/ and data/k3-default/)")
        results = run(work, only, "place demo (given run directory)")
    else:
        with tempfile.TemporaryDirectory(prefix="bench-scenarios-") as tmp:
            print(f"running the demo first (place demo --out run{' --quick' * args.quick_demo})", flush=True)
            _run_demo(Path(tmp), quick=args.quick_demo)
            results = run(Path(tmp), only, "place demo" + " --quick" * args.quick_demo)
    dest = RESULTS / "scenarios.json"
    if set(only) != set(SCENARIOS) and dest.exists():  # --only: the other scenarios keep their results
        before = json.loads(dest.read_text())
        kept = {k: v for k, v in before.items() if k in SCENARIOS and k not in results}
        for runs in kept.values():  # a file that named its demo run once, at the top
            for r in runs.values():
                r.setdefault("demo", before.get("demo", "unknown"))
        results = {**kept, **results}
    write_result("scenarios", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
