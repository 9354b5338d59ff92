"""The online-rebalancing scenario of README.md and docs/simulate.md: replay mode on the demo's default
trace (its domain mix drifts), 64 requests of 512-token prompts, 20 simulated seconds, a static vLLM
`linear` placement with 32 redundant slots, then the same with EPLB every 100 iterations and with the
optimizer's migration mode (at most 16 new replicas per layer per rebalance).

Runs the three `place simulate` commands, prints their tables and writes bench/results/rebalance.json
(the commands, their printed output and the summaries); `python bench/figures.py` renders the docs'
tables from that file.

    .venv/bin/python bench/rebalance.py [--trace data/k3-default]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

from _timing import timed, write_result  # before any project import: sets sys.path

from moeplace.cli.main import main
from moeplace.sim.results import read_summaries

SCENARIO = ["--placement", "linear", "--redundant", "32", "--mode", "replay", "--duration", "20",
            "--concurrency", "64", "--context-mix", "512:1", "--output-len", "256", "--no-progress"]
RUNS = {  # label -> extra flags
    "static": [],
    "eplb": ["--rebalance", "every=100,window=100,policy=eplb"],
    "moeplace": ["--rebalance", "every=100,window=100,moves=16,policy=moeplace,time=10"],
}


def _place(argv: list[str]) -> str:
    """Run ``place ARGV`` in-process; its stdout (a non-zero exit stops the benchmark)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        sys.exit(f"place {' '.join(argv)} exited with {rc}")
    return buf.getvalue()


def main_(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="data/k3-default",
                    help="the demo's default trace (synthesized with the demo's settings when missing)")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        _place(["trace", "synth", "--model", "kimi-k3", "--tokens", "100000", "--out", args.trace, "--seed", "0"])
    runs = {}
    for label, extra in RUNS.items():
        with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as tmp:
            cmd = ["simulate", args.trace, *SCENARIO, *extra]
            with timed() as t:
                printed = _place([*cmd, "--out", str(Path(tmp) / "sim")])
            wall = t.wall_s
            summary = read_summaries(Path(tmp) / "sim" / "summary.json")[0]
        print(f"$ place {' '.join(cmd)}\n{printed}({wall:.1f} s)\n", flush=True)
        runs[label] = {"command": "place " + " ".join(cmd), "printed": printed, "wall_s": wall,
                       "summary": {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}}
    write_result("rebalance", {"trace": args.trace, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main_())
