"""Is moeplace's own re-plan fast enough to be an online rebalancer? A migration-budgeted K3 re-plan at 32
GPUs (896 experts + 32 redundant slots, 92 MoE layers): the current placement is EPLB's on the first window
of a synthetic K3 trace, the new loads are a later window (the trace drifts), at most ``--moves`` slots per
layer change, under the time limit ``place simulate --rebalance ...,policy=moeplace`` and ``--recommend``
give each decision (``moeplace.sim.rebalance.REPLAN_TIME_LIMIT``). Measures the decision's wall and CPU
seconds (what the simulator charges: the smaller of the two), how many slots moved and the balancedness on
the new loads before and after; target: decides in <= 2 s.

    .venv/bin/python bench/replan.py [--tokens 40000] [--moves 16] [--repeats 3]

Prints the figures and writes bench/results/replan.json (with the load average: 2 shared cores).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _timing import cpu_seconds, loadavg, write_result  # before any project import: sets sys.path

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import load_model
from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.sim.rebalance import REPLAN_TIME_LIMIT
from moeplace.traces.stats import trace_loads
from moeplace.traces.synth import SynthConfig, synthesize

TARGET_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--moves", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=REPLAN_TIME_LIMIT)
    args = ap.parse_args()
    model = load_model("kimi-k3")
    cluster = make_cluster(32, "h200")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k3"
        synthesize(model, SynthConfig(num_tokens=args.tokens, seed=0), path)
        loads = trace_loads(path, args.tokens // 4)
    first, later = loads.counts[0].astype(np.float64), loads.counts[-1].astype(np.float64)
    R = 32
    current = get_policy("eplb")(PlacementProblem(first[None], model, cluster, R))
    before = evaluate(current, later[None], model=model).balancedness
    runs = []
    load0 = loadavg()
    for i in range(args.repeats):
        problem = PlacementProblem(later[None], model, cluster, R, seed=i, time_limit=args.time_limit,
                                   options={"from": current, "max_moves": args.moves})
        t0, c0 = time.perf_counter(), cpu_seconds()
        new = get_policy("moeplace")(problem)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        moved = int((new.phy2log != current.phy2log).sum(axis=1).max())
        after = evaluate(new, later[None], model=model).balancedness
        runs.append({"wall_s": wall, "cpu_s": cpu, "charged_s": min(wall, cpu), "max_moves_used": moved,
                     "balancedness_after": after})
        print(f"  run {i}: wall {wall:.2f} s, cpu {cpu:.2f} s, charged {min(wall, cpu):.2f} s; at most {moved} slots "
              f"moved per layer; balancedness on the new loads {before:.4f} -> {after:.4f}", flush=True)
    med = statistics.median(r["charged_s"] for r in runs)
    print(f"K3 re-plan at 32 GPUs, <= {args.moves} moves per layer, time limit {args.time_limit:g} s: decision "
          f"{med:.2f} s charged (median of {args.repeats}; wall median "
          f"{statistics.median(r['wall_s'] for r in runs):.2f} s); target <= {TARGET_S:g} s: "
          f"{'met' if med <= TARGET_S else 'NOT met'}")
    write_result("replan", {"model": "kimi-k3", "gpus": 32, "redundant": R, "moves": args.moves,
                            "time_limit": args.time_limit, "tokens": args.tokens, "balancedness_before": before,
                            "runs": runs, "charged_median_s": med, "target_s": TARGET_S, "met": med <= TARGET_S,
                            "loadavg_start": load0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
