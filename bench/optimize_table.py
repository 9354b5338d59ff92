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
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINES = ["linear", "round_robin", "eplb"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "data" / "k3-default"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-moeplace", action="store_true")
    args = ap.parse_args()

    from foundation.cluster import make_cluster
    from foundation.model import load_model
    from placement.compare import compare_policies, format_table, routing_windows
    from traces.synth import SynthConfig, synthesize

    trace = Path(args.trace)
    synth_s = None
    if not trace.exists():
        t0 = time.perf_counter()
        synthesize(load_model("kimi-k3"), SynthConfig(), trace)
        synth_s = time.perf_counter() - t0
        print(f"synthesized {trace} in {synth_s:.1f} s")
    policies = BASELINES + (["moeplace"] if args.with_moeplace else [])
    place = str(Path(sys.executable).with_name("place"))
    cmd = [place, "optimize", str(trace), "--gpus", "32", "--no-out"]
    for p in policies:
        cmd += ["--policy", p]
    walls = []
    table = ""
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, check=False, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        table = res.stdout
    print(table)
    print(f"`{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}`: "
          f"median {statistics.median(walls):.2f} s over {len(walls)} runs {[round(w, 2) for w in walls]}")

    # stages, in-process
    t0 = time.perf_counter()
    loads = routing_windows([trace])
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cmp = compare_policies(loads, make_cluster(32), num_redundant=32, policies=policies)
    cmp_s = time.perf_counter() - t0
    plan_s = {r.policy: r.seconds for r in cmp.results}
    print(f"stages: trace -> Loads {read_s:.2f} s ({loads.num_windows} windows); compare {cmp_s:.2f} s "
          f"(planning {', '.join(f'{k} {v:.2f}' for k, v in plan_s.items())}; the rest is evaluate)")
    out = {
        "trace": str(trace), "synth_seconds": synth_s, "command": cmd[1:], "wall_seconds": walls,
        "median_wall_seconds": statistics.median(walls), "target_seconds": 30.0,
        "read_seconds": read_s, "compare_seconds": cmp_s, "plan_seconds": plan_s,
        "rows": [r.row() for r in cmp.results], "table": format_table(cmp),
    }
    dest = ROOT / "bench" / "results" / "optimize_table.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
