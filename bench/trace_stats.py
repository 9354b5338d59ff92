"""Benchmark of the trace pipeline on a synthetic Kimi K3 trace. Targets:
synthesis >= 20 M selections/s, stats ingestion >= 100 M selections/s on 2 cores, <= 2.5 B/selection
on disk; peak RSS reported. Prints the figures and writes bench/results/trace_stats.json.

    python bench/trace_stats.py [--tokens 200000] [--repeats 3] [--keep]

Stats run in a child process so that its peak RSS is its own. Wall-clock and CPU seconds are both
reported: on a shared machine the wall figures depend on the load (recorded as ``loadavg``). Both stages
use worker processes (stats: one per core decoding row groups; synth: a writer process encoding
Parquet): CPU seconds include those children, and their largest peak RSS is reported separately.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from _timing import RESULTS, ROOT, children_peak_rss_mb, cpu_seconds, peak_rss_mb, repeat, write_result


def stats_child(trace: str, repeats: int) -> dict:
    from moeplace.traces.stats import compute_stats

    runs = repeat(lambda: compute_stats(trace), repeats)
    summary = runs.result.summary()
    sel = summary["selections"]
    return {"selections": sel, "wall_s": runs.wall_s, "cpu_s": runs.cpu_s, "wall_s_median": runs.wall_median,
            "selections_per_s": sel / runs.wall_median,
            "selections_per_cpu_s": sel / runs.cpu_median, "peak_rss_mb": peak_rss_mb(),
            "workers": summary.get("workers"), "worker_peak_rss_mb": children_peak_rss_mb(),
            "skew_median": summary["skew_median"], "cv_median": summary["cv_median"],
            "affinity_lift_mean": summary["affinity_lift_mean"], "locality": summary["locality"],
            "drift_corr_mean": summary["drift_corr_mean"], "windows": summary["windows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=str(RESULTS / "k3-bench-trace"))
    ap.add_argument("--keep", action="store_true", help="keep the trace directory")
    ap.add_argument("--stats-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stats_child:
        print(json.dumps(stats_child(args.stats_child, args.repeats)))
        return 0

    from moeplace.foundation.model import load_model
    from moeplace.traces.synth import SynthConfig, synthesize

    model = load_model("kimi-k3")
    load0 = os.getloadavg()
    c0 = cpu_seconds()
    s = synthesize(model, SynthConfig(num_tokens=args.tokens, seed=args.seed), args.trace)
    synth_cpu = cpu_seconds() - c0
    synth = {"tokens": s["tokens"], "selections": s["selections"], "requests": s["requests"],
             "wall_s": s["seconds"], "plan_s": s["plan_seconds"], "cpu_s": synth_cpu,
             "selections_per_s": s["selections_per_s"], "selections_per_cpu_s": s["selections"] / synth_cpu,
             "bytes": s["bytes"], "bytes_per_selection": s["bytes_per_selection"], "peak_rss_mb": peak_rss_mb(),
             "writer_peak_rss_mb": children_peak_rss_mb()}
    # Flush the trace just written before timing its ingestion: otherwise the kernel's write-back of
    # ~370 MB competes with the stats pass and the figure measures the synth's disk flush too.
    os.sync()
    out = subprocess.run([sys.executable, __file__, "--stats-child", args.trace, "--repeats", str(args.repeats)],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"model": "kimi-k3", "tokens": args.tokens, "cores": os.cpu_count(), "loadavg_before": load0,
              "loadavg_after": os.getloadavg(), "synth": synth, "stats": stats,
              "targets": {"synth_selections_per_s": 20e6, "stats_selections_per_s": 100e6,
                          "bytes_per_selection": 2.5}}
    write_result("trace_stats", result)
    if not args.keep:
        shutil.rmtree(args.trace, ignore_errors=True)
    print(f"K3 synthetic trace: {synth['tokens']:,} tokens, {synth['selections'] / 1e6:.0f} M selections, "
          f"{synth['requests']} requests (load average {load0[0]:.1f} on {os.cpu_count()} cores)")
    print(f"synth : {synth['wall_s']:.1f} s wall ({synth['plan_s']:.1f} s planning) = "
          f"{synth['selections_per_s'] / 1e6:.1f} M sel/s wall, {synth['selections_per_cpu_s'] / 1e6:.1f} M sel "
          f"per CPU-s; peak RSS {synth['peak_rss_mb']:.0f} MB (writer process {synth['writer_peak_rss_mb']:.0f} MB)")
    print(f"disk  : {synth['bytes'] / 1e6:.0f} MB = {synth['bytes_per_selection']:.3f} B/selection")
    print(f"stats : median {stats['wall_s_median']:.2f} s of {args.repeats} = "
          f"{stats['selections_per_s'] / 1e6:.1f} M sel/s wall, {stats['selections_per_cpu_s'] / 1e6:.1f} M sel per "
          f"CPU-s on {stats['workers']} worker processes; peak RSS {stats['peak_rss_mb']:.0f} MB (workers "
          f"{stats['worker_peak_rss_mb']:.0f} MB)")
    print(f"trace : skew median {stats['skew_median']:.2f}, CV {stats['cv_median']:.2f}, affinity lift "
          f"{stats['affinity_lift_mean']:.2f}, locality {stats['locality']:.3f}, window drift corr "
          f"{stats['drift_corr_mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
