"""Speed of the discrete-event simulator. Targets (issue 27): at steady state, over >= 600 simulated
seconds, replay mode <= 1.0 wall s per simulated s on 32 H200 and stat mode <= 0.2 on 1,024 H200; and
10 simulated minutes of Kimi K3 on 32 H200 in <= 60 s wall in `stat` mode. Also how wall time grows with
the GPU count (32 -> 1,024) and with simulated time. Prints the figures and writes
bench/results/sim.json.

    python bench/sim.py [--trace DIR] [--tokens 40000] [--quick]

Workload: closed loop with every DP rank's 256 sequence slots filled (attention TP8: G/8 ranks), prompts
2k tokens, outputs ~1k, routing from a synthetic K3 trace (`place trace synth`), linear placement (vLLM
default), vLLM replica rule. Wall-clock and CPU seconds are both reported: on a shared machine the wall
figures depend on the load (recorded as ``loadavg``), CPU seconds much less.

Steady state (``targets``, ``steady``): one run per target, long enough that >= 600 simulated s follow
the warm-up. ``simulate(on_advance=...)`` records wall and CPU (this process) time at every whole
simulated second; the warm-up ends at the first iteration whose decoding sequences fill >= 90 % of the
decode slots (the closed loop's first prompts are prefilled), and the steady figures are the wall / CPU
seconds from that simulated second to the end divided by the simulated seconds between them
(``wall_s_per_sim_s``, ``cpu_s_per_sim_s``), and per iteration (``ms_per_iteration``). The load average
is sampled at every simulated second of that window (``loadavg_mean``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _timing import RESULTS, loadavg, rel, timed, write_result

STEADY_S = 600.0  # simulated seconds measured after the warm-up
FULL = 0.9  # the warm-up ends when decoding sequences fill this share of the decode slots
# per target: (mode, GPUs, run's simulated s, target wall s per simulated s); the runs leave >= STEADY_S after
# the warm-up (about 45 simulated s at 32 GPUs, 240 at 1,024: every slot's first prompt prefilled)
TARGETS = {"replay_32": ("replay", 32, 700.0, 1.0), "stat_1024": ("stat", 1024, 900.0, 0.2)}


def _setup(trace, gpus: int, duration: float, mode: str):
    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.memory.config import next_valid_redundant
    from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.runner import resolve_placement

    cluster = make_cluster(gpus, "h200")
    R = next_valid_redundant(trace.model.num_experts, gpus)
    _, placement = resolve_placement("linear", trace, cluster, R, "vllm", 0)
    engine = EngineConfig(attention_tp=8, max_seqs=256, max_batched_tokens=8192)
    ranks = gpus // engine.attention_tp
    mix = LengthMix(components=((2048, 1.0),), sigma=0.3, output_mean=1024)
    cfg = SimConfig(duration=duration, mode=mode, engine=engine,
                    workload=WorkloadConfig(arrival="closed", concurrency=ranks * engine.max_seqs, lengths=mix))
    return cluster, placement, cfg, ranks * engine.max_seqs


def run_steady(trace, name: str, quick: bool) -> dict:
    """One target's run: wall and CPU seconds per simulated second after the warm-up (module docstring)."""
    import numpy as np

    from moeplace.sim.runner import simulate

    mode, gpus, duration, target = TARGETS[name]
    if quick:
        duration /= 10
    cluster, placement, cfg, slots = _setup(trace, gpus, duration, mode)
    marks: list[tuple[float, float, float, float]] = []  # (simulated s, wall, CPU, 1-min load average)
    nxt = [0.0]

    def mark(now: float) -> None:
        if now >= nxt[0]:
            marks.append((now, time.perf_counter(), time.process_time(), os.getloadavg()[0]))
            nxt[0] = float(int(now) + 1)

    with timed() as t:
        res = simulate(trace, [("linear", placement)], cluster, cfg, on_advance=mark)[0]
    m = np.asarray(marks)
    ts = res.timeseries
    times, dec = ts["time"].to_numpy(), ts["decode_seqs"].to_numpy()
    full = np.flatnonzero(dec >= FULL * slots)
    fill = float(times[full[0]]) if len(full) else float("nan")
    i0 = int(np.searchsorted(m[:, 0], fill)) if len(full) else len(m) - 1
    i0 = min(i0, len(m) - 2)
    sim_s = float(m[-1, 0] - m[i0, 0])
    wall, cpu = float(m[-1, 1] - m[i0, 1]), float(m[-1, 2] - m[i0, 2])
    steady = times >= m[i0, 0]
    iters = int(steady.sum())
    out = {"mode": mode, "gpus": gpus, "duration_s": duration, "warmup_end_s": fill, "steady_from_s": float(m[i0, 0]),
           "steady_sim_s": sim_s, "steady_wall_s": wall, "steady_cpu_s": cpu, "steady_iterations": iters,
           "wall_s_per_sim_s": wall / sim_s, "cpu_s_per_sim_s": cpu / sim_s,
           "ms_per_iteration": wall / max(iters, 1) * 1e3, "cpu_ms_per_iteration": cpu / max(iters, 1) * 1e3,
           "mean_batch_tokens": float(ts["batch_tokens"].to_numpy()[steady].mean()) if iters else 0.0,
           "mean_decode_seqs": float(dec[steady].mean()) if iters else 0.0, "decode_slots": slots,
           "target_wall_s_per_sim_s": target, "window_ok": bool(len(full)) and sim_s >= STEADY_S * (0.1 if quick else 1),
           "loadavg_mean": float(m[i0:, 3].mean()), "run_wall_s": t.wall_s, "run_cpu_s": t.cpu_s,
           "iterations": res.summary["iterations"]}
    out["meets_target_wall"] = out["window_ok"] and out["wall_s_per_sim_s"] <= target
    out["meets_target_cpu"] = out["window_ok"] and out["cpu_s_per_sim_s"] <= target
    print(f"  {mode:6s} {gpus:4d} GPUs: steady {sim_s:5.0f} sim s (from {m[i0, 0]:.0f} s): "
          f"{out['wall_s_per_sim_s']:.3f} wall s / {out['cpu_s_per_sim_s']:.3f} CPU s per sim s (target <= {target:g}: "
          f"{_verdict(out)}), "
          f"{out['ms_per_iteration']:.1f} ms ({out['cpu_ms_per_iteration']:.1f} CPU ms) per iteration of "
          f"{out['mean_batch_tokens']:,.0f} tokens, load average {out['loadavg_mean']:.1f}", flush=True)
    return out


def _verdict(st: dict) -> str:
    if not st["window_ok"]:
        return "not judged (no full steady window: --quick, or the slots never filled)"
    return (f"wall {'met' if st['meets_target_wall'] else 'NOT met'}, "
            f"CPU {'met' if st['meets_target_cpu'] else 'NOT met'}")


def run_one(trace, gpus: int, duration: float, mode: str) -> dict:
    from moeplace.sim.runner import simulate

    cluster, placement, cfg, slots = _setup(trace, gpus, duration, mode)
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
           "mean_decode_seqs": s["mean_decode_seqs"], "decode_slots": slots,
           "mean_batch_tokens": s["mean_batch_tokens"], "output_tok_s": s["output_tok_s"],
           "straggler_share": s["straggler_share"], "loadavg": loadavg()[0]}
    print(f"  {mode:6s} {gpus:4d} GPUs {duration:6.0f} sim s: {s['wall_s']:7.1f} s wall ({cpu:6.1f} s CPU), "
          f"{s['iterations']:6d} iterations, {out['ms_per_iteration']:6.2f} ms/iteration, "
          f"batch {s['mean_decode_seqs']:.0f}/{slots} decode seqs, "
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
    print("replay mode (32 GPUs, the closed loop's prefill burst)")
    results["replay"] = run_one(trace, 32, 30 * q, "replay")
    print(f"steady state ({STEADY_S:g} simulated s after the warm-up{', a tenth with --quick' if args.quick else ''})")
    results["steady"] = {name: run_steady(trace, name, args.quick) for name in TARGETS}
    h, r = results["headline"], results["replay"]
    rs, s1k = results["steady"]["replay_32"], results["steady"]["stat_1024"]
    results["targets"] = {
        "stat_600s_32gpu_wall_s": h["sim_wall_s"], "stat_target_wall_s": 60.0,
        "stat_meets_target": h["sim_wall_s"] <= 60.0,
        "batches_full": h["mean_decode_seqs"] / h["decode_slots"],
        "replay_sim_s_per_wall_s": r["sim_s_per_wall_s"], "stat_sim_s_per_wall_s": h["sim_s_per_wall_s"],
        "replay_slowdown_vs_stat": h["sim_s_per_wall_s"] / r["sim_s_per_wall_s"],
        # wall seconds per simulated second in stat mode at 32 GPUs over the whole 600 s run (target <= 0.05)
        "stat_wall_s_per_sim_s_32": h["wall_s_per_sim_s"],
        # issue 27's targets, at steady state over >= 600 simulated s (see the module docstring): replay <= 1.0
        # at 32 GPUs, stat <= 0.2 at 1,024; wall and CPU (this process) seconds per simulated second
        "measured": "steady state: from the first simulated second whose iteration fills >= 90 % of the decode "
                    "slots to the run's end; wall and CPU seconds over simulated seconds",
        "replay_wall_s_per_sim_s_32": rs["wall_s_per_sim_s"], "replay_cpu_s_per_sim_s_32": rs["cpu_s_per_sim_s"],
        "replay_target_wall_s_per_sim_s": rs["target_wall_s_per_sim_s"], "replay_steady_sim_s": rs["steady_sim_s"],
        "replay_meets_target": rs["meets_target_wall"], "replay_meets_target_cpu": rs["meets_target_cpu"],
        "stat_wall_s_per_sim_s_1024": s1k["wall_s_per_sim_s"], "stat_cpu_s_per_sim_s_1024": s1k["cpu_s_per_sim_s"],
        "stat_target_wall_s_per_sim_s_1024": s1k["target_wall_s_per_sim_s"], "stat_steady_sim_s_1024": s1k["steady_sim_s"],
        "stat_1024_meets_target": s1k["meets_target_wall"], "stat_1024_meets_target_cpu": s1k["meets_target_cpu"],
        "loadavg_mean": {"replay_32": rs["loadavg_mean"], "stat_1024": s1k["loadavg_mean"]},
    }
    write_result("sim", results)
    t = results["targets"]
    print(f"stat: {h['duration_s']:g} simulated s in {t['stat_600s_32gpu_wall_s']:.1f} s wall (target <= 60 s: "
          f"{'met' if t['stat_meets_target'] else 'NOT met'}), decode slots {t['batches_full']:.0%} full; "
          f"replay {t['replay_sim_s_per_wall_s']:.2f} sim s per wall s ({t['replay_slowdown_vs_stat']:.0f}x slower "
          f"than stat)")
    print(f"stat wall s per simulated s at 32 GPUs (600 s): {t['stat_wall_s_per_sim_s_32']:.3f} (target <= 0.05)")
    for label, st in (("replay, 32 GPUs", rs), ("stat, 1,024 GPUs", s1k)):
        print(f"{label}, steady {st['steady_sim_s']:.0f} simulated s: {st['wall_s_per_sim_s']:.3f} wall s "
              f"({st['cpu_s_per_sim_s']:.3f} CPU s) per simulated s at load average {st['loadavg_mean']:.1f}; target "
              f"<= {st['target_wall_s_per_sim_s']:g}: {_verdict(st)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
