"""Time `place optimize TRACE --gpus 32` (target: the baseline table in < 30 s).

Synthesizes the default K3 trace (traces/synth/ defaults: 100k tokens, 5 domains, drift) if it is not
there, then runs the CLI as a subprocess (imports included) a few times with the baseline policies
(linear, round_robin, eplb; add --with-moeplace for the optimizer), and separately times the stages
in-process: trace -> Loads, each policy's planning, evaluate() of plan and held-out parts.
Prints the figures and writes bench/results/optimize_table.json.

    .venv/bin/python bench/optimize_table.py [--trace data/k3-default] [--repeats 3]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from _timing import ROOT, rel, repeat, timed, write_result

BASELINES = ["linear", "round_robin", "eplb"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "data" / "k3-default"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-moeplace", action="store_true")
    args = ap.parse_args()

    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.model import load_model
    from moeplace.placement.compare import compare_policies
    from moeplace.placement.report import format_table
    from moeplace.placement.windows import routing_windows
    from moeplace.traces.synth import SynthConfig, synthesize

    trace = Path(args.trace)
    synth_s = None
    if not trace.exists():
        with timed() as t:
            synthesize(load_model("kimi-k3"), SynthConfig(), trace)
        synth_s = t.wall_s
        print(f"synthesized {trace} in {synth_s:.1f} s")
    policies = BASELINES + (["moeplace"] if args.with_moeplace else [])
    # the installed entry point, as a user runs it (Python start-up and imports included)
    place = str(Path(sys.executable).with_name("place"))
    cmd = [place, "optimize", str(trace), "--gpus", "32", "--no-out"]
    for p in policies:
        cmd += ["--policy", p]
    runs = repeat(lambda: subprocess.run(cmd, check=False, capture_output=True, text=True), args.repeats)
    if runs.result.returncode:
        print(runs.result.stderr, file=sys.stderr)
        return runs.result.returncode
    walls = runs.wall_s
    print(runs.result.stdout)
    print(f"`{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}`: "
          f"median {runs.wall_median:.2f} s over {len(walls)} runs {[round(w, 2) for w in walls]}")

    # stages, in-process
    with timed() as t:
        loads = routing_windows([trace])
    read_s = t.wall_s
    with timed() as t:
        cmp = compare_policies(loads, make_cluster(32), num_redundant=32, policies=policies)
    cmp_s = t.wall_s
    plan_s = {r.policy: r.seconds for r in cmp.results}
    print(f"stages: trace -> Loads {read_s:.2f} s ({loads.num_windows} windows); compare {cmp_s:.2f} s "
          f"(planning {', '.join(f'{k} {v:.2f}' for k, v in plan_s.items())}; the rest is evaluate)")
    out = {
        "trace": rel(trace), "synth_seconds": synth_s, "wall_seconds": walls,
        "command": [rel(c) if c == str(trace) else c for c in cmd[1:]],
        "median_wall_seconds": runs.wall_median, "cpu_seconds": runs.cpu_s, "target_seconds": 30.0,
        "read_seconds": read_s, "compare_seconds": cmp_s, "plan_seconds": plan_s,
        "rows": [r.row() for r in cmp.results], "table": format_table(cmp),
    }
    write_result("optimize_table", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
