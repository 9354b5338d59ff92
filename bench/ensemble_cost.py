"""What pricing a run by the shipped ensemble costs: `place simulate`'s demo run (Kimi K3 on 32 H200,
attention TP8, 1,024 concurrent requests, 2k:0.9,16k:0.1 prompts, 1,024-token outputs, 600 simulated s) with
the ensemble (every throughput and TPOT its members' median with an 80 % interval, sim.ensemble) and without
it (the reference constants alone: what `place simulate` did before the ensemble), back to back. Target
(issue 40): the ensemble run within 2x the wall time of the run without it. Prints the figures and writes
bench/results/ensemble_cost.json.

    python bench/ensemble_cost.py [--trace DIR] [--tokens 100000] [--repeats 3] [--quick]

Each repeat runs both, alternating (so a change of machine load hits both alike); the figures are the
medians of the repeats' wall and CPU seconds of `sim.runner.simulate` (the simulation and, with the
ensemble, the re-pricing of its sampled iterations by every member) and their ratio. The trace is
synthesized when none is given (`place trace synth`, K3, seed 0), the placement is EPLB's on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from _timing import loadavg, rel, timed, write_result


def setup(trace_dir: str | None, tokens: int, duration: float):
    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.model import load_model
    from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.runner import resolve_placement
    from moeplace.sim.workload import load_trace_tokens
    from moeplace.traces.synth import SynthConfig, synthesize

    if trace_dir is None:
        trace_dir = str(Path(tempfile.mkdtemp(prefix="ensemble-cost-")) / "k3")
        synthesize(load_model("kimi-k3"), SynthConfig(num_tokens=tokens, seed=0), Path(trace_dir))
    trace = load_trace_tokens(trace_dir)
    cluster = make_cluster(32, "h200")
    _, placement = resolve_placement("eplb", trace, cluster, None, "vllm", 0)
    engine = EngineConfig(attention_tp=8)
    mix = LengthMix(components=((2048, 0.9), (16384, 0.1)), output_mean=1024)
    cfg = SimConfig(duration=duration, mode="stat", seed=0, engine=engine,
                    workload=WorkloadConfig(arrival="closed", concurrency=1024, lengths=mix))
    return trace, trace_dir, placement, cluster, cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="a K3 trace directory (default: synthesize one)")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="120 simulated s, 1 repeat (smoke test)")
    args = ap.parse_args()
    from moeplace.sim.runner import simulate

    duration = 120.0 if args.quick else 600.0
    trace, trace_dir, placement, cluster, cfg = setup(args.trace, args.tokens, duration)
    runs = {"without": dataclasses.replace(cfg, ensemble=False), "with": cfg}
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    load = [loadavg()]
    summary = {}
    for rep in range(1 if args.quick else args.repeats):
        for name, c in runs.items():
            with timed() as t:
                res = simulate(trace, [("eplb", placement)], cluster, c)[0]
            wall[name].append(t.wall_s)
            cpu[name].append(t.cpu_s)
            summary[name] = res.summary
            print(f"  repeat {rep + 1}: {name:7s} ensemble {t.wall_s:6.1f} s wall, {t.cpu_s:6.1f} s CPU", flush=True)
        load.append(loadavg())
    med = {k: {"wall_s": statistics.median(v), "cpu_s": statistics.median(cpu[k])} for k, v in wall.items()}
    ratio_wall = med["with"]["wall_s"] / med["without"]["wall_s"]
    ratio_cpu = med["with"]["cpu_s"] / med["without"]["cpu_s"]
    s = summary["with"]
    ens = s["ensemble"]
    print(f"demo run, 600 simulated s: without the ensemble {med['without']['wall_s']:.1f} s wall "
          f"({med['without']['cpu_s']:.1f} s CPU), with it {med['with']['wall_s']:.1f} s ({med['with']['cpu_s']:.1f} s "
          f"CPU): {ratio_wall:.2f}x wall, {ratio_cpu:.2f}x CPU (target <= 2x); {ens['members']} members re-priced "
          f"{sum(ens['sampled_iterations'].values())} of {sum(ens['iterations'].values())} steady iterations")
    print(f"  output tok/s {s['output_tok_s']:,.0f} [{s['output_tok_s_range'][0]:,.0f}-{s['output_tok_s_range'][1]:,.0f}] "
          f"(reference constants alone: {summary['without']['output_tok_s']:,.0f}); near {ens['near']:.2f} groups")
    write_result("ensemble_cost", {
        "trace": rel(trace_dir), "duration_s": duration, "repeats": len(wall["with"]), "quick": args.quick,
        "wall_s": wall, "cpu_s": cpu, "median": med, "ratio_wall": ratio_wall, "ratio_cpu": ratio_cpu,
        "target_ratio": 2.0, "target_met": ratio_wall <= 2.0, "loadavg_during": load,
        "members": ens["members"], "sampled_iterations": ens["sampled_iterations"], "iterations": ens["iterations"],
        "output_tok_s": {"with": s["output_tok_s"], "range": s["output_tok_s_range"],
                         "without": summary["without"]["output_tok_s"]},
        "near": ens["near"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
