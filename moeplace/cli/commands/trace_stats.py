"""``place trace stats PATH``: streaming statistics of a trace and its Loads ``[windows, L, E]``."""
from __future__ import annotations

import json
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force, add_progress
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs, write_text_atomic
from moeplace.foundation.formats import tagged
from moeplace.traces.loads import LOADS_FILE
from moeplace.traces.stats import DEFAULT_SAMPLE_TOKENS, DEFAULT_WINDOW_TOKENS, TRACE_STATS, compute_stats

GROUP = "trace"


def register(sub) -> None:
    p = sub.add_parser(
        "stats", help="per-window expert loads, skew, drift, affinity, locality and a token sample",
        description="One streaming pass over the trace (memory bounded by a row group, not the trace). "
                    "--out FILE.npz writes the Loads [windows, MoE layers, experts] with the token sample "
                    "(the input of `place optimize`); --out FILE.json writes the statistics as JSON.")
    p.add_argument("path", metavar="PATH", help="trace file or directory")
    p.add_argument("--window-tokens", type=flags.positive_int, default=DEFAULT_WINDOW_TOKENS,
                   help=f"tokens per load window (default {DEFAULT_WINDOW_TOKENS})")
    p.add_argument("--sample-tokens", type=flags.nonneg_int, default=DEFAULT_SAMPLE_TOKENS,
                   help=f"tokens kept for co-activation objectives (default {DEFAULT_SAMPLE_TOKENS})")
    p.add_argument("--seed", type=flags.seed, default=0, help="seed of the token sample")
    p.add_argument("--workers", type=flags.positive_int, default=None,
                   help="reader threads (default: one per core for large traces; results are identical); "
                        "with --ray local: the local Ray instance's CPUs")
    p.add_argument("--ray", default=None, metavar="ADDRESS|local",
                   help="reduce the row groups as tasks on a Ray cluster (ray.init(address=...); every node reads "
                        "PATH at the same path, e.g. a shared file system) or, with 'local', on a local Ray "
                        "instance; the Loads and statistics are the single-process ones")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.add_argument("--out", metavar="FILE", help="write Loads (.npz) or the statistics (.json)")
    add_force(p)
    add_progress(p)
    p.set_defaults(func=run)


def table(s: dict) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    rows = [
        ("trace", f"{s['path']}  (model {s['model']}"
                  + (f"; {s['layers']}: every figure is over the MoE layers it holds)" if "layers" in s else ")")),
        ("tokens", f"{s['tokens']:,} ({s['rows']:,} rows, {s['selections']:,} expert selections)"),
        ("requests", f"{s['requests']:,}"),
        ("domains", ", ".join(s["domains"]) or "none tagged"),
        ("windows", f"{s['windows']} x {s['window_tokens']:,} tokens"),
        ("skew (max/mean)", (f"median layer {num(s['skew_median'], '.2f')}, max layer {num(s['skew_max'], '.2f')}; "
                            f"CV median {num(s['cv_median'], '.2f')}")),
        ("drift", (f"consecutive windows: correlation {num(s['drift_corr_mean'], '.3f')}, "
                  f"JS divergence {num(s['drift_js_mean'], '.4f')}")),
        ("affinity lift", (f"{num(s['affinity_lift_mean'], '.2f')} x popularity (next-"
                          f"{'held-' if 'layers' in s else ''}layer top-k prediction); "
                          f"top-20% pairs cover {num(s['affinity_top20_coverage_mean'], '.1%')} "
                          f"(permuted {num(s['affinity_top20_coverage_permuted_mean'], '.1%')})")),
        ("locality", (f"top-k overlap of consecutive tokens {num(s['locality'], '.3f')} "
                     f"({s['locality_pairs']:,} sampled pairs)")),
        ("sample", f"{s['sample_tokens']:,} tokens"),
        ("on disk", f"{s['bytes_on_disk'] / 1e6:.1f} MB = {s['bytes_per_selection']:.2f} B/selection"),
        ("read", f"{s['seconds']:.2f} s = {s['selections_per_s'] / 1e6:.1f} M selections/s"),
    ]
    mix = s["domain_mix_per_window"]
    if s["domains"] and mix:
        first, last = mix[0], mix[-1]
        rows.append(("domain mix", "first window " + " ".join(f"{d}:{x:.2f}" for d, x in zip(s["domains"], first))
                     + "; last " + " ".join(f"{d}:{x:.2f}" for d, x in zip(s["domains"], last))))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run(args) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix not in (".npz", ".json"):
        raise InputError(f"--out {out}: expected a .npz (Loads) or .json (statistics) file name")
    outs = Outputs(inputs=[args.path], force=args.force)
    outs.add(out, LOADS_FILE if out is not None and out.suffix == ".npz" else TRACE_STATS)
    st = compute_stats(args.path, window_tokens=args.window_tokens, sample_tokens=args.sample_tokens,
                       seed=args.seed, workers=args.workers, ray=args.ray)
    s = st.summary()
    if out is not None and out.suffix == ".npz":
        outs.write(out, lambda: st.loads.save(out))
    doc = json.dumps(tagged("trace-stats", s), indent=1)
    if out is not None and out.suffix == ".json":
        outs.write(out, lambda: write_text_atomic(out, doc))
    print(doc if args.json else table(s))
    outs.finish()
    return 0
