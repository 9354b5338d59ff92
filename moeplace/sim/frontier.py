"""The Pareto frontier of simulated deployments (cost in GPUs vs output throughput vs p99 TPOT) and the
recommended deployment. Pure functions over a table of simulation results (``place sweep`` writes it); the
frontier JSON is what the dashboard reads, so its schema lives here, below both.

A point *dominates* another when it uses no more GPUs, gives at least the throughput and at most the p99
TPOT, and is strictly better in one of the three. The frontier is the set of points no point dominates,
per workload (a deployment is judged on each workload separately). The recommendation is the frontier
point with the highest output throughput per GPU among those meeting the spec's ``objective`` limits
(p99 TPOT, p99 TTFT, minimum throughput); ties go to fewer GPUs, then lower p99 TPOT, then the lower
point index. Maximizing throughput per GPU over the frontier loses nothing: a point that dominates
another has at least its throughput per GPU and meets every limit the other meets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moeplace.foundation.files import OutputKind, register_kind
from moeplace.foundation.formats import tag

# A sweep directory (``place sweep --out``): the table of every point, the frontier report over it, the
# points' row files, the cache of traces and placements and the recommended deployments' launch files.
SWEEP_TABLE = "sweep.parquet"
FRONTIER_FILE = "frontier.json"
SWEEP_POINTS, SWEEP_CACHE, SWEEP_RECOMMENDED = "points", "cache", "recommended"


def _is_sweep_dir(p: Path) -> bool:
    names = {f.name for f in p.iterdir() if not f.name.startswith(".")}
    return bool(names) and names <= {SWEEP_TABLE, FRONTIER_FILE, SWEEP_POINTS, SWEEP_CACHE, SWEEP_RECOMMENDED}


SWEEP_DIRECTORY = register_kind(OutputKind("sweep directory", True, _is_sweep_dir))

# frontier.json names its schema by its format tag (moeplace.frontier/<N>); the previous release wrote no
# tag but a field "version" with this value, which a reader of such a file still checks
LEGACY_VERSION = 1
OBJECTIVES = ("gpus", "output_tok_s", "tpot_p99_s")
FRONTIER_COLUMNS = ("index", "point_hash", "label", "workload", "gpu", "gpus", "nodes", "gpus_per_node", "tp",
                    "dp", "ep", "num_redundant", "policy", "rebalance", "kv_dtype", "engine", "output_tok_s",
                    "output_tok_s_per_gpu", "tpot_p50_s", "tpot_p99_s", "ttft_p99_s", "requests_finished",
                    "held_out_balancedness", "placement_fingerprint", "optimize_key", "plan_context",
                    "rebalances", "output_tok_s_lo", "output_tok_s_hi", "tpot_p99_s_lo", "tpot_p99_s_hi",
                    "ensemble_near")
# An online point is recommended only when its rebalancer acted: at least this many rebalances in its run
# (a run shorter than a few intervals scores the starting placement, not the rebalancer)
MIN_REBALANCES = 5


def pareto_mask(gpus: np.ndarray, throughput: np.ndarray, tpot: np.ndarray) -> np.ndarray:
    """bool ``[N]``: the points no other point dominates (minimize ``gpus`` and ``tpot``, maximize
    ``throughput``; all float/int ``[N]``). Identical points do not dominate each other. O(N^2)."""
    g = np.asarray(gpus, dtype=np.float64)
    t = np.asarray(throughput, dtype=np.float64)
    p = np.asarray(tpot, dtype=np.float64)
    n = g.shape[0]
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        no_worse = (g <= g[i]) & (t >= t[i]) & (p <= p[i])
        better = (g < g[i]) | (t > t[i]) | (p < p[i])
        keep[i] = not (no_worse & better).any()
    return keep


def meets(row: dict[str, Any], objective: dict[str, Any]) -> list[str]:
    """The objective limits ``row`` misses (empty: it meets all of them)."""
    missed = []
    if objective.get("tpot_p99_ms") is not None and row["tpot_p99_s"] * 1e3 > objective["tpot_p99_ms"]:
        missed.append(f"p99 TPOT {row['tpot_p99_s'] * 1e3:.1f} ms > {objective['tpot_p99_ms']:g} ms")
    ttft = row.get("ttft_p99_s")
    if objective.get("ttft_p99_ms") is not None and (ttft is None or ttft * 1e3 > objective["ttft_p99_ms"]):
        shown = "-" if ttft is None else f"{ttft * 1e3:.1f}"
        missed.append(f"p99 TTFT {shown} ms > {objective['ttft_p99_ms']:g} ms")
    if objective.get("min_output_tok_s") is not None and row["output_tok_s"] < objective["min_output_tok_s"]:
        missed.append(f"{row['output_tok_s']:.0f} output tok/s < {objective['min_output_tok_s']:g}")
    return missed


def recommend(frontier: list[dict[str, Any]], objective: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``(row, why)``: the frontier row to deploy, or ``None`` and why none qualifies. An online point
    (``rebalance`` other than ``static``) whose run performed fewer than :data:`MIN_REBALANCES` rebalances
    is never recommended (its figure is the starting placement's, not the rebalancer's)."""
    idle = [r for r in frontier if r.get("rebalance", "static") != "static"
            and (r.get("rebalances") or 0) < MIN_REBALANCES]
    note = (f"; {len(idle)} online point(s) left out: fewer than {MIN_REBALANCES} rebalances in the run "
            "(lengthen simulate.duration to at least 5 rebalance intervals)" if idle else "")
    ok = [r for r in frontier if not meets(r, objective) and r not in idle]
    if not ok:
        if not frontier:
            return None, "no point finished its simulation with a p99 TPOT"
        if len(idle) == len(frontier):
            return None, "no frontier point qualifies" + note
        first = "; ".join(meets(frontier[0], objective))
        return None, f"no frontier point meets the objective (first point: {first})" + note
    best = min(ok, key=lambda r: (-r["output_tok_s_per_gpu"], r["gpus"], r["tpot_p99_s"], r["index"]))
    limits = ", ".join(f"{k} {v:g}" for k, v in objective.items() if v is not None)
    why = "highest output tok/s per GPU on the frontier" + (f" meeting {limits}" if limits else "") + note
    return best, why


def frontier_report(table: pl.DataFrame, objective: dict[str, Any]) -> dict[str, Any]:
    """Per workload: every simulated point with its objectives and ``on_frontier`` flag, the frontier
    (sorted by GPUs, then throughput descending) and the recommendation. JSON-ready."""
    out: dict[str, Any] = {"format": tag("frontier"), "objectives": {"gpus": "min", "output_tok_s": "max",
                                                                     "tpot_p99_s": "min"},
                           "objective_limits": {k: v for k, v in objective.items() if v is not None},
                           "workloads": {}}
    for name in table["workload"].unique(maintain_order=True).to_list():
        part = table.filter(pl.col("workload") == name)
        ok = part.filter((pl.col("status") == "ok") & pl.col("tpot_p99_s").is_not_null()
                         & pl.col("output_tok_s").is_not_null()).sort("index")
        no_tpot = part.filter((pl.col("status") == "ok") & pl.col("tpot_p99_s").is_null()).height
        rows = ok.select(list(FRONTIER_COLUMNS)).to_dicts()
        mask = pareto_mask(*(ok[c].to_numpy() for c in OBJECTIVES)) if rows else np.zeros(0, dtype=bool)
        for r, m in zip(rows, mask, strict=True):
            r["on_frontier"] = bool(m)
        front = sorted((r for r in rows if r["on_frontier"]),
                       key=lambda r: (r["gpus"], -r["output_tok_s"], r["index"]))
        best, why = recommend(front, objective)
        counts = {s: int(n) for s, n in part.group_by("status").len().sort("status").iter_rows()}
        out["workloads"][name] = {"points": rows, "frontier": front, "recommended": best, "why": why,
                                  "status_counts": counts, "ok_without_tpot": no_tpot}
    return out


def range_text(r: dict[str, Any]) -> str:
    """A frontier row's 80 % intervals (``output_tok_s_range``, ``tpot_p99_s_range``: the shipped ensemble's,
    sim.ensemble.price_run), or what stands in their place."""
    if "output_tok_s_range" not in r:
        return "-"
    out, tpot = r["output_tok_s_range"], r.get("tpot_p99_s_range")
    if out is None:
        return "no interval (not priced by the ensemble)"
    text = f"{out[0]:,.0f}-{out[1]:,.0f}"
    return text + (f"; {tpot[0] * 1e3:.1f}-{tpot[1] * 1e3:.1f}ms" if tpot else "")


def format_frontier(report: dict[str, Any]) -> str:
    """The text the CLI prints: one frontier table per workload and its recommendation."""
    lines = []
    for name, w in report["workloads"].items():
        counts = ", ".join(f"{n} {s}" for s, n in w["status_counts"].items())
        lines.append(f"workload {name}: {counts}; Pareto frontier (GPUs vs output tok/s vs p99 TPOT):")
        head = (f"  {'#':>3} {'GPUs':>5} {'gpu':<12} {'TP':>3} {'DP':>3} {'R':>4} {'policy':<10} "
                f"{'rebal':<7} {'KV':<5} {'engine':<7} {'out tok/s':>10} {'tok/s/GPU':>10} {'TPOT p99':>9} "
                f"{'TTFT p99':>9}  range (out tok/s; TPOT p99)")
        lines.append(head)
        for r in w["frontier"]:
            ttft = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s'] * 1e3:.0f}ms"
            lines.append(f"  {r['index']:>3} {r['gpus']:>5} {r['gpu']:<12} {r['tp']:>3} {r['dp']:>3} "
                         f"{r['num_redundant']:>4} {r['policy']:<10} "
                         f"{'static' if r['rebalance'] == 'static' else 'online':<7} {r['kv_dtype']:<5} "
                         f"{r['engine']:<7} {r['output_tok_s']:>10,.0f} {r['output_tok_s_per_gpu']:>10,.1f} "
                         f"{r['tpot_p99_s'] * 1e3:>7.1f}ms {ttft:>9}  {range_text(r)}")
        if not w["frontier"]:
            lines.append("  (empty)")
        if w["ok_without_tpot"]:
            lines.append(f"  {w['ok_without_tpot']} simulated point(s) finished no request with more than "
                         "one output token (no TPOT): left off the frontier; lengthen simulate.duration")
        best = w["recommended"]
        if best is None:
            lines.append(f"  recommended: none ({w['why']})")
        else:
            lines.append(f"  recommended: #{best['index']} {best['label']} ({w['why']})")
    return "\n".join(lines)
