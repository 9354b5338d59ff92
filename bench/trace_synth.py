"""Benchmark of `place trace synth` on Kimi K3 (896 experts, top-16, 92 MoE layers): selections per second
with 1 and with N sampling workers, against `np.bincount` over as many int64 expert ids timed in the same
run; the files' bytes compared across the worker counts and with / without the compiled loops (they must be
equal); bytes per selection. Targets: >= 30 M selections/s; <= 1.0 B/selection.

    python bench/trace_synth.py [--tokens 100000] [--repeats 3] [--workers 1 2]

Each repeat synthesizes the trace once per worker count, in a fresh child process (its own peak RSS and CPU
seconds, the writer and sampling processes included), after a bincount in this process. The figure is the
whole command's rate (planning included: a fixed ~2 s of CPU for K3 that does not grow with the tokens)
and, beside it, the sampling-and-writing rate after planning. With numba installed (the [fast] extra) the
sampler's compiled loops run: each child pays numba's import and the load of the loops from its on-disk
cache (as every `place trace synth` does); one extra run per worker count starts from an empty cache
(``NUMBA_CACHE_DIR`` a fresh directory: the first run on a machine, which compiles them), and one runs the
numpy code alone (``MOEPLACE_JIT=0``). The machine is often shared: the load average is recorded and CPU
seconds per selection are reported with the wall figures.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _timing import (
    RESULTS,
    ROOT,
    children_peak_rss_mb,
    cpu_seconds,
    loadavg,
    own_peak_rss_mb,
    write_result,
)


def child(out: str, tokens: int, seed: int, workers: int) -> dict:

    from moeplace.foundation.model import load_model
    from moeplace.traces.synth import SynthConfig, synthesize

    model = load_model("kimi-k3")
    c0 = cpu_seconds()
    import inspect

    # an earlier release (the "before" figures) samples in one process and takes no workers
    kw = {"workers": workers} if "workers" in inspect.signature(synthesize).parameters else {}
    s = synthesize(model, SynthConfig(num_tokens=tokens, seed=seed), out, **kw)
    try:
        from moeplace.traces import jit
        compiled = jit.loaded("dedup") is not None  # what this run used
    except ImportError:  # an earlier release has no compiled loops
        compiled = False
    files = sorted(Path(out).glob("*.parquet"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return {"wall_s": s["seconds"], "plan_s": s["plan_seconds"], "cpu_s": cpu_seconds() - c0,
            "selections": s["selections"], "tokens": s["tokens"], "requests": s["requests"], "bytes": s["bytes"],
            "bytes_per_selection": s["bytes_per_selection"], "sample_workers": s.get("sample_workers", 1),
            "sha256": digest.hexdigest(), "peak_rss_mb": own_peak_rss_mb(), "compiled": compiled,
            "children_peak_rss_mb": children_peak_rss_mb()}


def med(xs) -> float:
    return float(statistics.median(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out, tokens, seed, workers = args.child
        print(json.dumps(child(out, int(tokens), int(seed), int(workers))))
        return 0

    import tempfile

    import numpy as np

    load0 = loadavg()
    counts = sorted(set(args.workers))
    # (variant, workers) -> runs; "compiled": the default install's run (numba's cache warm when numba is
    # there), "first": an empty numba cache (compiles), "numpy": MOEPLACE_JIT=0
    runs: dict[tuple[str, int], list[dict]] = {}
    ids = None
    cache = tempfile.TemporaryDirectory(prefix="moeplace-numba-cache-")

    def one(variant: str, w: int) -> None:
        nonlocal ids
        out = RESULTS / f"k3-synth-bench-{w}"
        shutil.rmtree(out, ignore_errors=True)
        env = dict(os.environ)
        if variant == "numpy":
            env["MOEPLACE_JIT"] = "0"
        elif variant == "first":
            env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(dir=cache.name)
        proc = subprocess.run([sys.executable, __file__, "--child", str(out), str(args.tokens), str(args.seed),
                               str(w)], check=True, capture_output=True, text=True, cwd=ROOT, env=env)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.rmtree(out, ignore_errors=True)
        if ids is None:
            ids = np.random.default_rng(0).integers(0, 896, r["selections"])
        c0, w0 = cpu_seconds(), time.perf_counter()
        np.bincount(ids, minlength=896)
        r["bincount_wall_s"], r["bincount_cpu_s"] = time.perf_counter() - w0, cpu_seconds() - c0
        runs.setdefault((variant, w), []).append(r)

    one("compiled", counts[0])  # numba's cache filled before the timed runs
    runs.clear()
    for _ in range(args.repeats):
        for w in counts:
            one("compiled", w)
    compiled = runs[("compiled", counts[0])][0]["compiled"]
    if compiled:
        for w in counts:
            one("first", w)
            one("numpy", w)
    cache.cleanup()
    sel = runs[("compiled", counts[0])][0]["selections"]
    digests = {r["sha256"] for rs in runs.values() for r in rs}
    bincount_wall = med(r["bincount_wall_s"] for rs in runs.values() for r in rs)
    bincount_cpu = med(r["bincount_cpu_s"] for rs in runs.values() for r in rs)

    def figures(rs: list[dict]) -> dict:
        wall, plan = med(r["wall_s"] for r in rs), med(r["plan_s"] for r in rs)
        return {
            "sample_workers": rs[0]["sample_workers"], "compiled": rs[0]["compiled"], "wall_s": [r["wall_s"] for r in rs],
            "plan_s": [r["plan_s"] for r in rs], "cpu_s": [r["cpu_s"] for r in rs],
            "selections_per_s": sel / wall, "selections_per_s_after_plan": sel / max(wall - plan, 1e-9),
            "selections_per_cpu_s": sel / med(r["cpu_s"] for r in rs),
            "ratio_to_bincount": [r["bincount_wall_s"] / r["wall_s"] for r in rs],
            "ratio_median": med(r["bincount_wall_s"] / r["wall_s"] for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "children_peak_rss_mb": max(r["children_peak_rss_mb"] for r in rs),
        }

    variants = {v: {str(w): figures(rs) for (v2, w), rs in runs.items() if v2 == v} for v in ("compiled", "first", "numpy")}
    first = runs[("compiled", counts[0])][0]
    result = {"model": "kimi-k3", "tokens": first["tokens"], "selections": sel, "requests": first["requests"],
              "repeats": args.repeats, "cores": os.cpu_count(), "loadavg_before": load0,
              "loadavg_after": loadavg(), "bytes": first["bytes"], "bytes_per_selection": first["bytes_per_selection"],
              "same_bytes_across_workers": len(digests) == 1, "sha256": sorted(digests), "compiled": compiled,
              "bincount": {"wall_s_median": bincount_wall, "cpu_s_median": bincount_cpu,
                           "selections_per_s": sel / bincount_wall, "selections_per_cpu_s": sel / max(bincount_cpu, 1e-9)},
              "workers": variants["compiled"], "first_run": variants["first"], "numpy_only": variants["numpy"],
              "targets": {"selections_per_s": 30e6, "bytes_per_selection": 1.0}}
    write_result("trace_synth", result)
    print(f"K3 synthesis, {first['tokens']:,} tokens = {sel / 1e6:.0f} M selections, {first['requests']} requests; "
          f"{first['bytes_per_selection']:.3f} B/selection; the same bytes with {', '.join(map(str, counts))} "
          f"workers{' and without the compiled loops' if compiled else ''}: {'yes' if len(digests) == 1 else 'NO'}; "
          f"load average {load0[0]:.1f} -> {loadavg()[0]:.1f}")
    print(f"np.bincount of {sel / 1e6:.0f} M int64 ids: {sel / bincount_wall / 1e6:.0f} M/s (median)")
    labels = {"compiled": "compiled loops" if compiled else "numpy (numba not installed)",
              "first": "compiled, first run (empty numba cache: compiles)", "numpy": "numpy only (MOEPLACE_JIT=0)"}
    for v, by_workers in variants.items():
        for w, r in by_workers.items():
            print(f"{labels[v]}, {w} worker(s): {r['selections_per_s'] / 1e6:.1f} M selections/s wall (planning "
                  f"{med(r['plan_s']):.1f} s; {r['selections_per_s_after_plan'] / 1e6:.1f} M/s after it) = "
                  f"{r['ratio_median']:.3f} x bincount; {r['selections_per_cpu_s'] / 1e6:.1f} M per CPU-s; peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB, other processes <= {r['children_peak_rss_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
