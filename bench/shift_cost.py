"""What the shift estimate adds to ``place optimize``: the comparison ``place optimize`` runs
(``placement.compare.compare_policies``, every policy) without the estimate and with it, back to back in
one process on the same Loads (reading the trace, common to both, is timed once and reported apart), and
with ``--full`` also the estimate on every MoE layer, to show what the layer sample changes.

Default input: the demo's trace (``place demo`` writes data/k3-default; or any trace/Loads given). Prints
the wall and CPU seconds of each, the estimate's share, and writes ``bench/results/shift_cost.json``.

    .venv/bin/python bench/shift_cost.py [TRACE] [--gpus 32] [--full] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys

from _timing import ROOT, loadavg, rel, timed, write_result

sys.path.insert(0, str(ROOT))

from moeplace.foundation.cluster import make_cluster
from moeplace.placement.compare import compare_policies
from moeplace.placement.windows import default_redundant, routing_windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", default=str(ROOT / "data" / "k3-default"))
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--full", action="store_true", help="also the estimate on every MoE layer (slow)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/shift_cost.json)")
    args = ap.parse_args()
    load0 = loadavg()
    with timed() as t_read:
        loads = routing_windows([args.trace])
    cluster = make_cluster(args.gpus, "h200")
    red = default_redundant(loads.model.num_experts, cluster.num_gpus)
    runs = {}
    for name, kw in (("no_shift", {"shift": False}), ("shift", {"shift": True}),
                     *((("shift_all_layers", {"shift": True, "shift_sample": "all"}),) if args.full else ())):
        with timed() as t:
            cmp = compare_policies(loads, cluster, num_redundant=red, **kw)
        runs[name] = {"wall_s": t.wall_s, "cpu_s": t.cpu_s,
                      "shift": {r.policy: r.shift for r in cmp.results if r.shift},
                      "shift_method": cmp.shift_method}
        print(f"{name:17s} wall {t.wall_s:7.1f} s  CPU {t.cpu_s:7.1f} s  loadavg {loadavg()}", flush=True)
    base, est = runs["no_shift"], runs["shift"]
    # the command also reads the routing once (common to both)
    share = {k: (est[k] - base[k]) / (base[k] + (t_read.wall_s if k == "wall_s" else t_read.cpu_s))
             for k in ("wall_s", "cpu_s")}
    print(f"reading the routing: wall {t_read.wall_s:.1f} s, CPU {t_read.cpu_s:.1f} s")
    print(f"the shift estimate adds {share['wall_s']:+.1%} wall and {share['cpu_s']:+.1%} CPU to the "
          f"comparison with reading ({est['shift_method']})")
    for pol, sh in est["shift"].items():
        full = runs.get("shift_all_layers", {}).get("shift", {}).get(pol)
        vs = f"; every layer: mean {full['mean']:.4f}, worst {full['worst']:.4f}" if full else ""
        print(f"  {pol}: mean {sh['mean']:.4f} ± {sh['layer_sample_se']:.4f}, worst {sh['worst']:.4f}{vs}")
    write_result("shift_cost", {"input": rel(args.trace), "gpus": args.gpus, "loadavg_start": load0,
                                "read": {"wall_s": t_read.wall_s, "cpu_s": t_read.cpu_s}, "runs": runs,
                                "added_share": share}, args.out)


if __name__ == "__main__":
    main()
