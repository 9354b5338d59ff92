"""Migration re-plan quality: balancedness gained per expert moved, on drifting traffic, with the decision's
time charged. Kimi K3 at 32 H200 (896 experts + 32 redundant slots, 92 MoE layers), a synthetic K3 trace whose
domain mix drifts, cut in ``--windows`` windows of Loads. The deployment starts from DeepSeek's EPLB placement
of window 0; at each later step t an online rebalancer has observed window t - 1 and re-plans, and the new
placement is scored on window t, which it has not seen (the traffic has drifted on). Three re-plans:

- ``none``: the placement is kept (static);
- ``eplb``: vLLM's EPLB re-plan (``--enable-eplb``: DeepSeek's EPLB, the project's reimplementation
  ``placement.policies`` "eplb", on the observed window), its GPUs renumbered to keep the most experts in
  place (``sim.rebalance.relabel_min_moves``, as the simulator's rebalancer does; EPLB's own numbering would
  move nearly every expert — reported too as ``eplb_raw_moves``);
- ``moeplace``: the optimizer's migration mode (``options={"from": current, "max_moves": K}``: at most K slots
  change per layer), under the rebalancer's time limit ``sim.rebalance.REPLAN_TIME_LIMIT``.

Per step and re-plan: the balancedness on the next window (``placement.evaluate``: mean over layers of mean /
max GPU load under vLLM's replica rule), the expert copies that must arrive (``sim.rebalance.moved_experts``),
the decision's wall and CPU seconds (charged: the smaller, as the simulator charges it). Summary per re-plan:
mean balancedness, balancedness gained over ``none`` per 1,000 experts moved, median decision seconds.

    .venv/bin/python bench/replan_quality.py [--tokens 60000] [--windows 6] [--moves 16]

Prints the table and writes bench/results/replan_quality.json.
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
from moeplace.sim.rebalance import REPLAN_TIME_LIMIT, moved_experts, relabel_min_moves
from moeplace.traces.stats import trace_loads
from moeplace.traces.synth import SynthConfig, synthesize

REPLANS = ("none", "eplb", "moeplace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--moves", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=REPLAN_TIME_LIMIT)
    args = ap.parse_args()
    model = load_model("kimi-k3")
    cluster = make_cluster(32, "h200")
    R = 32
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k3"
        synthesize(model, SynthConfig(num_tokens=args.tokens, seed=0), path)
        loads = trace_loads(path, args.tokens // args.windows)
    win = loads.counts.astype(np.float64)[: args.windows]
    start = get_policy("eplb")(PlacementProblem(win[0][None], model, cluster, R))
    current = dict.fromkeys(REPLANS, start)
    steps = []
    load0 = loadavg()
    for t in range(1, len(win)):
        observed, scored = win[t - 1], win[t]
        step = {"observed_window": t - 1, "scored_window": t}
        for name in REPLANS:
            old = current[name]
            t0, c0 = time.perf_counter(), cpu_seconds()
            raw = None
            if name == "none":
                new = old
            elif name == "eplb":
                fresh = get_policy("eplb")(PlacementProblem(observed[None], model, cluster, R))
                raw = int(moved_experts(old, fresh).sum())
                new = relabel_min_moves(old, fresh)
            else:
                new = get_policy("moeplace")(PlacementProblem(observed[None], model, cluster, R, seed=t,
                                                              time_limit=args.time_limit,
                                                              options={"from": old, "max_moves": args.moves}))
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            moved = int(moved_experts(old, new).sum())
            bal = evaluate(new, scored[None], model=model).balancedness
            step[name] = {"balancedness": bal, "experts_moved": moved, "decision_wall_s": wall,
                          "decision_cpu_s": cpu, "charged_s": min(wall, cpu)}
            if raw is not None:
                step[name]["eplb_raw_moves"] = raw
            current[name] = new
        steps.append(step)
        print(f"  step {t}: " + "; ".join(f"{n} {step[n]['balancedness']:.4f} ({step[n]['experts_moved']} moved, "
                                          f"{step[n]['charged_s']:.2f} s)" for n in REPLANS), flush=True)
    summary = {}
    base = np.array([s["none"]["balancedness"] for s in steps])
    for name in REPLANS:
        bal = np.array([s[name]["balancedness"] for s in steps])
        moved = sum(s[name]["experts_moved"] for s in steps)
        gain = float((bal - base).sum())
        summary[name] = {"mean_balancedness": float(bal.mean()), "experts_moved": moved,
                         "gain_over_none": float((bal - base).mean()),
                         "gain_per_1000_moved": gain / moved * 1000 if moved else None,
                         "decision_charged_median_s": statistics.median(s[name]["charged_s"] for s in steps),
                         "decision_wall_median_s": statistics.median(s[name]["decision_wall_s"] for s in steps)}
    print(f"K3 at 32 H200, {len(steps)} re-plans on drifting traffic (observe window t-1, score window t), "
          f"moeplace <= {args.moves} moves/layer in {args.time_limit:g} s:")
    print(f"  {'re-plan':<10} {'balancedness':>12} {'gain':>8} {'experts moved':>14} {'gain/1000 moved':>16} "
          f"{'decision s':>11}")
    for name, s in summary.items():
        per = "-" if s["gain_per_1000_moved"] is None else f"{s['gain_per_1000_moved']:+.4f}"
        print(f"  {name:<10} {s['mean_balancedness']:>12.4f} {s['gain_over_none']:>+8.4f} {s['experts_moved']:>14,} "
              f"{per:>16} {s['decision_charged_median_s']:>11.2f}")
    write_result("replan_quality", {"model": "kimi-k3", "gpus": 32, "redundant": R, "moves": args.moves,
                                    "time_limit": args.time_limit, "tokens": args.tokens, "windows": len(win),
                                    "steps": steps, "summary": summary, "loadavg_start": load0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
