"""Benchmark of reading a K3 trace: `place trace stats` (compute_stats), the optimizer's read (trace_loads)
and validation (the gate over every row, `place trace validate`'s checks), each against `np.bincount` over
as many int64 expert ids, timed in the same run, back to back. Target: the statistics at >= 0.5 x the
bincount's speed from a warm page cache (cold reported too); peak memory a constant times one row group;
<= 1.0 B per expert selection on disk.

    python bench/trace_stats.py [--tokens 100000] [--repeats 5] [--trace DIR] [--keep]

The trace is synthesized first (or ``--trace`` names one). Each repeat: ``np.bincount`` over N random int64
ids in [0, 896) in this process (N = the trace's selections), then one pass of each reader in a fresh child
process (its own peak RSS; no copy-on-write view of the ids array), warm; then a cold pass after the
trace's pages are dropped from the page cache (``posix_fadvise(DONTNEED)`` on its files only: other
processes' cache is left alone), a pass on one thread, and a pass without the compiled loops
(``MOEPLACE_JIT=0``: the numpy code they stand in for). The ratio of a repeat is the bincount's wall seconds
over the reader's; the figure is the median over repeats. The child imports what ``place`` imports before it
times the pass (numpy loads some of its modules on first use: ``numpy.ma`` alone is ~30 ms, which the
command has paid at start-up). The machine is often shared: the load average is
recorded, and CPU seconds per selection are reported beside wall figures (a reader on 2 threads against a
1-thread bincount: wall ratios fall when other processes hold the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from _timing import (
    RESULTS,
    ROOT,
    children_peak_rss_mb,
    cpu_seconds,
    loadavg,
    own_peak_rss_mb,
    peak_rss_mb,
    rel,
    write_result,
)

READERS = ("stats", "loads", "validate")


def drop_cache(trace: str) -> None:
    """Drop the trace's files from the page cache (flushed first: only clean pages can be dropped)."""
    os.sync()
    from moeplace.traces.format import trace_files

    for f in trace_files(trace):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(trace: str, reader: str, cold: bool, workers: int | None) -> dict:
    """One timed pass of ``reader`` (in a child process: its own peak RSS and its workers')."""

    import moeplace.cli.main  # noqa: F401  (what `place` imports before any pass: numpy's lazy modules among them)
    from moeplace.traces import scan
    from moeplace.traces.stats import compute_stats, trace_loads
    from moeplace.traces.validate import check_trace, open_trace

    tr = open_trace(trace)
    procs = scan.pass_workers(workers, len(tr.row_groups()), tr.num_rows * tr.model.top_k)
    if reader == "validate" and not hasattr(scan, "check_pass"):
        procs = 1  # an earlier release validates in one process

    if cold:
        drop_cache(trace)
    c0, w0 = cpu_seconds(), time.perf_counter()
    if reader == "stats":
        compute_stats(trace, workers=workers)
    elif reader == "loads":
        trace_loads(trace, workers=workers)
    else:
        check_trace(trace)
    wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
    native = getattr(scan.jit, "native", None) if hasattr(scan, "jit") else None  # earlier releases: no C loops
    compiled = native is not None and native() is not None
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": own_peak_rss_mb(), "workers": procs,
            "worker_peak_rss_mb": children_peak_rss_mb(), "compiled": compiled}


def run_child(trace: str, reader: str, cold: bool = False, workers: int | None = None, numpy: bool = False) -> dict:
    argv = [sys.executable, __file__, "--child", reader, "--trace", trace] + (["--cold"] if cold else []) + (
        ["--workers", str(workers)] if workers else [])
    env = {**os.environ, "MOEPLACE_JIT": "0"} if numpy else None
    out = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bincount_seconds(ids) -> tuple[float, float]:
    import numpy as np

    c0, w0 = cpu_seconds(), time.perf_counter()
    np.bincount(ids, minlength=896)
    return time.perf_counter() - w0, cpu_seconds() - c0


def row_group_bytes(trace: str) -> float:
    """Decoded bytes of the trace's largest row group (the unit the memory bound is stated in)."""
    import pyarrow.parquet as pq

    from moeplace.traces.format import trace_files

    best = 0
    for f in trace_files(trace):
        md = pq.ParquetFile(f).metadata
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            best = max(best, sum(rg.column(j).total_uncompressed_size for j in range(rg.num_columns)))
    return best / 1e6


def encodings(trace: str, rows: int = 1 << 20) -> list[dict]:
    """The expert ids of the trace's first ``rows`` rows written in each candidate encoding (zstd level 1,
    page checksums): bytes per selection and the CPU seconds pyarrow takes to decode them (median of 5)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moeplace.traces.format import encode_expert_ids
    from moeplace.traces.validate import open_trace, read_expert_ids

    tr = open_trace(trace)
    k = tr.model.top_k
    ids = read_expert_ids(tr, np.arange(min(rows, tr.num_rows)))  # sorted sets
    n = len(ids)
    lo, hi, _ = encode_expert_ids(ids)
    deltas = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    shuffled = np.take_along_axis(ids, np.argsort(np.random.default_rng(0).random(ids.shape), axis=1), axis=1)

    def lists(a):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), k)

    def planes():
        return {c: pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), n, [None, pa.py_buffer(p)])
                for c, p in (("expert_delta_lo", lo), ("expert_delta_hi", hi))}

    cases = [
        ("version 1: ids in the router's order (here shuffled), list<uint16>, dictionary", {"e": lists(shuffled)}, {}),
        ("sorted ids, list<uint16>, dictionary", {"e": lists(ids)}, {}),
        ("sorted deltas, list<uint16>, dictionary", {"e": lists(deltas)}, {}),
        ("sorted deltas, list<uint16>, byte-stream split", {"e": lists(deltas)},
         {"use_dictionary": False, "use_byte_stream_split": True}),
        ("version 2: sorted deltas, two byte planes", planes(), {"use_dictionary": False}),
    ]
    out = []
    tmp = RESULTS / "encodings.parquet"
    for name, cols, kw in cases:
        pq.write_table(pa.table(cols), tmp, compression="zstd", compression_level=1, write_page_checksum=True,
                       row_group_size=rows, **kw)
        size = tmp.stat().st_size
        pf = pq.ParquetFile(tmp, memory_map=True, page_checksum_verification=True)
        secs = []
        for _ in range(5):
            c0 = cpu_seconds()
            pf.read_row_group(0, use_threads=False)
            secs.append(cpu_seconds() - c0)
        out.append({"encoding": name, "bytes_per_selection": size / (n * k),
                    "decode_selections_per_cpu_s": n * k / med(secs)})
    tmp.unlink()
    return out


def med(xs) -> float:
    return float(statistics.median(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=None, help="an existing K3 trace (default: synthesize one)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized trace")
    ap.add_argument("--workers", type=int, default=None, help="reader threads (default: the readers' own)")
    ap.add_argument("--child", choices=READERS, help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.trace, args.child, args.cold, args.workers)))
        return 0

    import numpy as np

    from moeplace.foundation.model import load_model
    from moeplace.traces.stats import compute_stats
    from moeplace.traces.synth import SynthConfig, synthesize

    load0 = loadavg()
    trace = args.trace or str(RESULTS / "k3-bench-trace")
    made = args.trace is None
    if made:
        synthesize(load_model("kimi-k3"), SynthConfig(num_tokens=args.tokens, seed=args.seed), trace)
    os.sync()  # the written trace's write-back must not compete with the timed passes
    st = compute_stats(trace, workers=1)  # also warms the page cache
    summary = st.summary()
    sel = summary["selections"]
    ids = np.random.default_rng(0).integers(0, 896, sel)  # int64, as many as the trace's selections
    runs: dict[str, list[dict]] = {r: [] for r in (*READERS, "stats_cold", "stats_1worker", "stats_numpy")}
    bc: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        for reader in READERS:
            bc.append(bincount_seconds(ids))
            runs[reader].append({**run_child(trace, reader, workers=args.workers), "bincount_wall_s": bc[-1][0]})
        bc.append(bincount_seconds(ids))
        runs["stats_cold"].append({**run_child(trace, "stats", cold=True, workers=args.workers),
                                   "bincount_wall_s": bc[-1][0]})
        runs["stats_1worker"].append({**run_child(trace, "stats", workers=1), "bincount_wall_s": bc[-1][0]})
        bc.append(bincount_seconds(ids))
        runs["stats_numpy"].append({**run_child(trace, "stats", workers=args.workers, numpy=True),
                                    "bincount_wall_s": bc[-1][0]})
    del ids
    bincount = {"wall_s_median": med(w for w, _ in bc), "cpu_s_median": med(c for _, c in bc), "runs": len(bc)}
    bincount["selections_per_s"] = sel / bincount["wall_s_median"]
    bincount["selections_per_cpu_s"] = sel / bincount["cpu_s_median"]
    readers = {}
    for name, rs in runs.items():
        readers[name] = {
            "wall_s": [r["wall_s"] for r in rs], "cpu_s": [r["cpu_s"] for r in rs],
            "ratios": [r["bincount_wall_s"] / r["wall_s"] for r in rs],
            "ratio_median": med(r["bincount_wall_s"] / r["wall_s"] for r in rs),
            "selections_per_s": sel / med(r["wall_s"] for r in rs),
            "selections_per_cpu_s": sel / med(r["cpu_s"] for r in rs),
            # CPU time against the bincount's: the wall ratio a quiet machine gives with every core free
            "cpu_ratio_per_core": (bincount["cpu_s_median"] / med(r["cpu_s"] for r in rs)) * rs[0]["workers"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "worker_peak_rss_mb": max(r["worker_peak_rss_mb"] for r in rs),
            "workers": rs[0]["workers"], "compiled": rs[0].get("compiled", False),
        }
    rg_mb = row_group_bytes(trace)
    try:
        encs = encodings(trace)
    except ImportError:  # an earlier release (the "before" figures) has no byte planes to compare
        encs = []
    result = {
        "model": "kimi-k3", "tokens": summary["tokens"], "selections": sel, "requests": summary["requests"],
        "trace": rel(trace), "synthesized": made, "repeats": args.repeats, "cores": os.cpu_count(),
        "loadavg_before": load0, "loadavg_after": loadavg(), "bytes": summary["bytes_on_disk"],
        "bytes_per_selection": summary["bytes_per_selection"], "row_group_decoded_mb": rg_mb,
        "bincount": bincount, "readers": readers,
        "realized": {k: summary[k] for k in ("skew_median", "cv_median", "affinity_lift_mean", "locality",
                                              "drift_corr_mean", "windows")},
        "stats_main_process_peak_rss_mb": peak_rss_mb(), "encodings": encs,
        "targets": {"ratio": 0.5, "bytes_per_selection": 1.0},
    }
    write_result("trace_stats", result)
    if made and not args.keep:
        shutil.rmtree(trace, ignore_errors=True)
    print(f"K3 trace: {summary['tokens']:,} tokens, {sel / 1e6:.0f} M selections, {summary['bytes_on_disk'] / 1e6:.0f} MB"
          f" = {summary['bytes_per_selection']:.3f} B/selection; load average {load0[0]:.1f} -> {loadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"np.bincount, {sel / 1e6:.0f} M int64 ids: {bincount['selections_per_s'] / 1e6:.0f} M/s wall (median of "
          f"{len(bc)}), {bincount['selections_per_cpu_s'] / 1e6:.0f} M per CPU-s")
    for name, r in readers.items():
        print(f"{name:14s}: {r['selections_per_s'] / 1e6:6.1f} M/s wall = {r['ratio_median']:.2f} x bincount (median "
              f"of {args.repeats}: {', '.join(f'{x:.2f}' for x in r['ratios'])}); {r['selections_per_cpu_s'] / 1e6:.0f} "
              f"M per CPU-s ({r['cpu_ratio_per_core']:.2f} x bincount with every worker on its own core); "
              f"{r['workers']} thread{'s' if r['workers'] != 1 else ''}, C loops {'on' if r['compiled'] else 'off'}; "
              f"peak RSS {max(r['peak_rss_mb'], r['worker_peak_rss_mb']):.0f} MB (row group {rg_mb:.0f} MB decoded)")
    for e in encs:
        print(f"  {e['encoding']}: {e['bytes_per_selection']:.3f} B/selection, decoded at "
              f"{e['decode_selections_per_cpu_s'] / 1e6:.0f} M selections per CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
