"""Speed of the discrete-event simulator. Targets: 10 simulated minutes of Kimi K3 on 32 H200 at
a load that keeps batches full in <= 60 s wall in `stat` mode; `replay` mode's speed; how wall time grows
with the GPU count (32 -> 1,024) and with simulated time. Prints the figures and writes
bench/results/sim.json.

    python bench/sim.py [--trace DIR] [--tokens 40000] [--quick]

Workload: closed loop with every DP rank's 256 sequence slots filled (attention TP8: G/8 ranks), prompts
2k tokens, outputs ~1k, routing from a synthetic K3 trace (`place trace synth`), linear placement (vLLM
default), vLLM replica rule. Wall-clock and CPU seconds are both reported: on a shared machine the wall
figures depend on the load (recorded as ``loadavg``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _timing import RESULTS, loadavg, rel, timed, write_result


def run_one(trace, gpus: int, duration: float, mode: str) -> dict:
    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.memory.config import next_valid_redundant
    from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.runner import resolve_placement, simulate

    cluster = make_cluster(gpus, "h200")
    R = next_valid_redundant(trace.model.num_experts, gpus)
    _, placement = resolve_placement("linear", trace, cluster, R, "vllm", 0)
    engine = EngineConfig(attention_tp=8, max_seqs=256, max_batched_tokens=8192)
    ranks = gpus // engine.attention_tp
    mix = LengthMix(components=((2048, 1.0),), sigma=0.3, output_mean=1024)
    cfg = SimConfig(duration=duration, mode=mode, engine=engine,
                    workload=WorkloadConfig(arrival="closed", concurrency=ranks * engine.max_seqs, lengths=mix))
    with timed() as t:
        res = simulate(trace, [("linear", placement)], cluster, cfg)[0]
    wall, cpu = t.wall_s, t.cpu_s
    s = res.summary
    out = {"gpus": gpus, "duration_s": duration, "mode": mode, "wall_s": wall, "cpu_s": cpu,
           "sim_wall_s": s["wall_s"], "route_wall_s": s["route_wall_s"], "iterations": s["iterations"],
           "sim_s_per_wall_s": duration / s["wall_s"], "wall_s_per_sim_s": s["wall_s"] / duration,
           "ms_per_iteration": s["wall_s"] / max(s["iterations"], 1) * 1e3,
           "tokens_per_wall_s": s["mean_batch_tokens"] * s["iterations"] / s["wall_s"],
           "tokens_per_cpu_s": s["mean_batch_tokens"] * s["iterations"] / max(cpu, 1e-9),
           "mean_decode_seqs": s["mean_decode_seqs"], "decode_slots": ranks * engine.max_seqs,
           "mean_batch_tokens": s["mean_batch_tokens"], "output_tok_s": s["output_tok_s"],
           "straggler_share": s["straggler_share"], "loadavg": loadavg()[0]}
    print(f"  {mode:6s} {gpus:4d} GPUs {duration:6.0f} sim s: {s['wall_s']:7.1f} s wall ({cpu:6.1f} s CPU), "
          f"{s['iterations']:6d} iterations, {out['ms_per_iteration']:6.2f} ms/iteration, "
          f"batch {s['mean_decode_seqs']:.0f}/{ranks * engine.max_seqs} decode seqs, "
          f"{s['output_tok_s']:,.0f} tok/s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(RESULTS / "k3-sim-trace"))
    ap.add_argument("--tokens", type=int, default=40_000, help="tokens of the synthesized trace")
    ap.add_argument("--quick", action="store_true", help="shorter runs (smoke test of the script)")
    args = ap.parse_args()
    from moeplace.foundation.model import load_model
    from moeplace.sim.workload import load_trace_tokens
    from moeplace.traces.synth import SynthConfig, synthesize

    trace_dir = Path(args.trace)
    if not trace_dir.exists():
        print(f"synthesizing a {args.tokens:,}-token K3 trace into {trace_dir}", flush=True)
        synthesize(load_model("kimi-k3"), SynthConfig(num_tokens=args.tokens), trace_dir)
    with timed() as t:
        trace = load_trace_tokens(trace_dir)
    load_s = t.wall_s
    print(f"trace: {trace.num_tokens:,} tokens, {trace.num_requests} requests, loaded in {load_s:.1f} s")
    q = 0.1 if args.quick else 1.0
    results: dict = {"quick": args.quick,
                     "trace": {"path": rel(trace_dir), "tokens": trace.num_tokens, "load_s": load_s}}
    print("headline: 10 simulated minutes, 32 x H200, stat mode")
    results["headline"] = run_one(trace, 32, 600 * q, "stat")
    print("simulated time scaling (32 GPUs, stat)")
    results["sim_time_scaling"] = [run_one(trace, 32, d * q, "stat") for d in (60, 150, 300)] + [results["headline"]]
    print("GPU scaling (120 simulated s, stat)")
    results["gpu_scaling"] = [run_one(trace, g, 120 * q, "stat") for g in (32, 64, 128, 256, 1024)]
    print("replay mode (32 GPUs)")
    results["replay"] = run_one(trace, 32, 30 * q, "replay")
    h, r = results["headline"], results["replay"]
    results["targets"] = {
        "stat_600s_32gpu_wall_s": h["sim_wall_s"], "stat_target_wall_s": 60.0,
        "stat_meets_target": h["sim_wall_s"] <= 60.0,
        "batches_full": h["mean_decode_seqs"] / h["decode_slots"],
        "replay_sim_s_per_wall_s": r["sim_s_per_wall_s"], "stat_sim_s_per_wall_s": h["sim_s_per_wall_s"],
        "replay_slowdown_vs_stat": h["sim_s_per_wall_s"] / r["sim_s_per_wall_s"],
        # wall seconds per simulated second in stat mode (targets: <= 0.05 at 32 GPUs, <= 0.2 at 1,024)
        "stat_wall_s_per_sim_s_32": h["wall_s_per_sim_s"],
        "stat_wall_s_per_sim_s_1024": results["gpu_scaling"][-1]["wall_s_per_sim_s"],
    }
    write_result("sim", results)
    t = results["targets"]
    print(f"stat: {h['duration_s']:g} simulated s in {t['stat_600s_32gpu_wall_s']:.1f} s wall (target <= 60 s: "
          f"{'met' if t['stat_meets_target'] else 'NOT met'}), decode slots {t['batches_full']:.0%} full; "
          f"replay {t['replay_sim_s_per_wall_s']:.2f} sim s per wall s ({t['replay_slowdown_vs_stat']:.0f}x slower "
          f"than stat)")
    print(f"stat wall s per simulated s: {t['stat_wall_s_per_sim_s_32']:.3f} at 32 GPUs (target <= 0.05), "
          f"{t['stat_wall_s_per_sim_s_1024']:.3f} at 1,024 GPUs (target <= 0.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
