"""Regenerate the figures in README.md and docs/*.md from the committed bench outputs (bench/results/*.json).

A figure sits between ``<!-- figure: NAME -->`` and ``<!-- /figure -->`` in a Markdown file; NAME picks a
renderer below, which reads one results file. ``python bench/figures.py`` rewrites every figure from the
results; ``--check`` changes nothing and exits 1 when a figure differs from what its results give (the
test suite runs it, so a figure edited by hand or a result re-measured without regenerating fails).

A renderer formats numbers only from its results file, never from a constant, so the prose around a
figure carries no measured number of its own; each names the bench command that wrote its file.
One file past 600 lines on purpose: every renderer is a short, independent function, and one registry
in one file is what the test walks to prove each figure in the docs has its renderer and results.

    .venv/bin/python bench/figures.py [--check]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before bench/, where sim.py would shadow the sim package
sys.path.append(str(ROOT / "bench"))  # the fidelity helpers beside this script (after the packages)

from fidelity_ensemble import COVERAGE_RESAMPLES, coverage_misses
from fidelity_harness import E2E
from fidelity_harness import fmt as _fmt_figure
from fidelity_peer import PEERS, peer_cell

from moeplace.sim.results import format_table

RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figure: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure -->)", re.DOTALL)


def _results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


# ---------------------------------------------------------------------------- online rebalancing
REBALANCE_COLUMNS = {"static": "static `linear`", "eplb": "+ EPLB every 100 iterations",
                     "moeplace": "+ moeplace migration, 16 moves/layer"}


def _num(v, fmt: str, scale: float) -> str:
    """``v * scale`` formatted; a dash for a figure the run does not have (no rebalancing)."""
    if not v:
        return "–"
    return format(int(v) if fmt == "d" else v * scale, fmt)


def rebalance_summary() -> str:
    """README: the three runs' key figures, one column each, and the sentence that reads them."""
    runs = {k: r["summary"] for k, r in _results("rebalance")["runs"].items()}
    rows = [("output tok/s", "output_tok_s", ",.0f", 1), ("TPOT p50 (ms)", "tpot_p50_s", ".1f", 1e3),
            ("MoE max/mean tokens", "mean_imbalance", ".3f", 1), ("straggler total (s)", "straggler_s", ".2f", 1),
            ("rebalances", "rebalances", "d", 1), ("expert weights moved (GB)", "moved_bytes", ",.1f", 1e-9),
            ("stall: decision + transfer (s)", "stall_s", ".2f", 1)]
    lines = ["| | " + " | ".join(REBALANCE_COLUMNS[k] for k in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for name, key, fmt, scale in rows:
        vals = [_num(s.get(key), fmt, scale) for s in runs.values()]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    st, ep, mo = runs["static"], runs["eplb"], runs["moeplace"]
    sentence = (f"EPLB moves {ep['moved_bytes'] / 1e12:.1f} TB of MXFP4 weights in {ep['rebalances']} rebalances "
                f"and stalls the cluster for {ep['stall_s']:.2f} of the 20 s: output tok/s "
                f"{_change(ep['output_tok_s'], st['output_tok_s'])} against static. The migration mode moves "
                f"{mo['moved_bytes'] / 1e9:,.0f} GB ({mo['stall_s']:.2f} s of stall) for max/mean "
                f"{mo['mean_imbalance']:.3f} (EPLB {ep['mean_imbalance']:.3f}, static "
                f"{st['mean_imbalance']:.3f}): output tok/s {_change(mo['output_tok_s'], st['output_tok_s'])}.")
    lines += ["", sentence]
    return "\n".join(lines) + "\n"


def _change(new: float, old: float) -> str:
    pct = (new / old - 1) * 100
    return f"{'+' if pct >= 0 else '−'}{abs(pct):.1f} %"


def rebalance_tables() -> str:
    """docs/simulate.md: the three commands and the `place simulate` table of the three runs."""
    res = _results("rebalance")
    runs = res["runs"]
    labels = {"static": "static", "eplb": "EPLB", "moeplace": "moeplace 16 moves"}
    header = next(line for line in runs["static"]["printed"].splitlines() if " simulated s, " in line)
    table = format_table([SimpleNamespace(label=labels[k], summary=r["summary"]) for k, r in runs.items()])
    cmds = "\n".join(r["command"] for r in runs.values())
    return (f"```\n{cmds}\n```\n```\n{header}\n{table}\n```\n"
            f"(`bench/rebalance.py` runs these and writes `bench/results/rebalance.json`; wall time "
            + ", ".join(f"{labels[k]} {r['wall_s']:.0f} s" for k, r in runs.items())
            + f" on {(res.get('machine') or res)['cpus']} shared cores.)\n")


def _machine(res: dict) -> str:
    """'N cores at load average L' of a results file (files written before bench/_timing.py keep cpus /
    load_avg at the top, or nothing)."""
    m = res.get("machine") or {"cpus": res.get("cpus"), "loadavg": res.get("load_avg")}
    load = m.get("loadavg")
    if not m.get("cpus"):
        return "machine and load not recorded"
    return f"{m['cpus']} cores" + (f" at load average {load[0]:.1f}" if load else "")


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


# ---------------------------------------------------------------------------- trace pipeline
def trace_stats() -> str:
    """docs/traces.md: reading a K3 trace (stats, Loads, validation) against np.bincount in the same run,
    warm and cold; bytes per selection; peak memory per row group (bench/trace_stats.py)."""
    r = _results("trace_stats")
    b, rd, t = r["bincount"], r["readers"], r["targets"]
    names = {"stats": "`place trace stats` (all statistics)", "loads": "Loads only (the optimizer's read)",
             "validate": "validation (`check_trace`, the gate)", "stats_cold": "statistics, cold page cache",
             "stats_1worker": "statistics, 1 thread", "stats_numpy": "statistics, numpy only (`MOEPLACE_JIT=0`)"}
    rows = [(names[k], f"{v['workers']}", f"{v['selections_per_s'] / 1e6:,.1f}", f"**{v['ratio_median']:.2f}**",
             ", ".join(f"{x:.2f}" for x in v["ratios"]), f"{v['selections_per_cpu_s'] / 1e6:,.0f}",
             f"{v['cpu_ratio_per_core']:.2f}", f"{max(v['peak_rss_mb'], v['worker_peak_rss_mb']):,.0f}")
            for k, v in rd.items()]
    head = (f"`python bench/trace_stats.py --tokens {r['tokens']}`: a {r['tokens']:,}-token K3 trace "
            f"({r['selections'] / 1e6:,.0f} M selections), {r['bytes'] / 1e6:,.1f} MB = "
            f"**{r['bytes_per_selection']:.3f} B/selection** (target <= {t['bytes_per_selection']:g}: "
            f"{_met(r['bytes_per_selection'] <= t['bytes_per_selection'])}); `np.bincount` over "
            f"{r['selections'] / 1e6:,.0f} M int64 ids in the same run: {b['selections_per_s'] / 1e6:,.0f} M/s wall, "
            f"{b['selections_per_cpu_s'] / 1e6:,.0f} M per CPU-second (median of {b['runs']}); "
            f"{r['cores']} cores shared with other work, load average {r['loadavg_before'][0]:.1f} before and "
            f"{r['loadavg_after'][0]:.1f} after; the largest row group decodes to {r['row_group_decoded_mb']:,.0f} MB "
            f"(`bench/results/trace_stats.json`):\n\n")
    table = _table(["read", "threads", "M selections/s (wall)", "x bincount (median)", "x bincount per repeat",
                    "M per CPU-s", "x bincount, CPU-time on free cores", "peak RSS (MB)"], rows)
    enc = _table(["expert ids of the trace's first 1 M rows as", "B/selection", "decoded, M selections per CPU-s"],
                 [(e["encoding"], f"{e['bytes_per_selection']:.3f}", f"{e['decode_selections_per_cpu_s'] / 1e6:,.0f}")
                  for e in r["encodings"]])
    return head + table + "\n" + enc


def trace_synth() -> str:
    """docs/traces.md: `place trace synth` on K3 with 1 and N sampling workers against np.bincount in the
    same run; the same bytes whatever the workers (bench/trace_synth.py)."""
    r = _results("trace_synth")
    b, t = r["bincount"], r["targets"]
    rows = []
    compiled = r.get("compiled", False)
    for key, label in (("workers", "{w}" + (" (compiled loops)" if compiled else "")),
                       ("first_run", "{w} (first run on a machine: numba compiles)"),
                       ("numpy_only", "{w} (numpy only, `MOEPLACE_JIT=0`)")):
        for w, v in r.get(key, {}).items():
            rows.append((label.format(w=w), f"{v['selections_per_s'] / 1e6:,.1f}", f"{_median(v['plan_s']):.1f}",
                         f"{v['selections_per_s_after_plan'] / 1e6:,.1f}", f"{v['ratio_median']:.3f}",
                         f"{v['selections_per_cpu_s'] / 1e6:,.1f}",
                         _met(v["selections_per_s"] >= t["selections_per_s"])))
    head = (f"`python bench/trace_synth.py --tokens {r['tokens']}` (K3, {r['selections'] / 1e6:,.0f} M selections, "
            f"median of {r['repeats']} runs per worker count, one run each for the first-run and numpy rows; "
            f"`np.bincount` of as many int64 ids in the same run: "
            f"{b['selections_per_s'] / 1e6:,.0f} M/s; {r['cores']} shared cores, load average "
            f"{r['loadavg_before'][0]:.1f} before and {r['loadavg_after'][0]:.1f} after); the files are "
            f"{'byte-identical' if r['same_bytes_across_workers'] else '**not** identical'} across worker counts"
            f"{' and with or without the compiled loops' if compiled else ''}, "
            f"{r['bytes_per_selection']:.3f} B/selection (`bench/results/trace_synth.json`):\n\n")
    return head + _table(["sampling workers", "M selections/s (whole command)", "planning s",
                          "M selections/s after planning", "x bincount", "M per CPU-s",
                          f"target {t['selections_per_s'] / 1e6:g} M/s"], rows)


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _table(head: list[str], rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def import_throughput() -> str:
    """docs/traces.md: import and validation speed per engine format (bench/import_throughput.py)."""
    r = _results("import_throughput")
    rows = [(x["format"], x["model"], f"{x['records']:,}", f"{x['rows_written']:,}" if "rows_written" in x else "–",
             f"{x['seconds']:.2f}", f"{x['selections_per_s'] / 1e6:.2f}") for x in r["results"]]
    head = (f"`python bench/import_throughput.py --scale {r['scale']:g}` (inputs generated in each format, shaped "
            f"like the named model's dumps; {_machine(r)}; peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB):\n\n")
    return head + _table(["input", "model", "records", "trace rows", "s", "M selections/s"], rows)


def capture_overhead() -> str:
    """docs/traces.md: generate() speed with and without the routing hooks (bench/capture_overhead.py)."""
    r = _results("capture_overhead")
    rows = []
    for fam, x in r["families"].items():
        tps, pair = x["generated_tokens_per_s"], x["paired_overhead_vs_plain"]
        rows.append((fam, f"{tps['plain']:,.1f}", f"{tps['hooks']:,.1f} ({100 * pair['hooks']:+.1f} %)",
                     f"{tps['hooks+trace']:,.1f} ({100 * pair['hooks+trace']:+.1f} %)",
                     f"{100 * x['hook_time_share']:.2f} %", f"{x['rows_per_run']:,}"))
    head = (f"`python bench/capture_overhead.py{' --quick' if r.get('quick') else ''}` (random-weight 4-layer "
            f"models, 32 experts top-4; batch {r['batch']}, {r['new_tokens']} new tokens, median of "
            f"{r['repeats']} interleaved runs; {r['device']}, {r['threads']} torch threads, {_machine(r)}; "
            f"overheads paired with the plain run made just before):\n\n")
    return head + _table(["model", "plain gen tok/s", "hooks", "hooks + trace on disk", "time inside hooks",
                          "rows/run"], rows)


# ---------------------------------------------------------------------------- simulator speed
def sim_speed() -> str:
    """docs/simulate.md: wall and CPU time of the simulator by simulated time and GPU count (bench/sim.py)."""
    r = _results("sim")
    rows = []
    runs = sorted(r["sim_time_scaling"], key=lambda x: x["duration_s"]) + r["gpu_scaling"] + [r["replay"]]
    for x in runs:
        rows.append((x["mode"], x["gpus"], f"{x['duration_s']:g}", f"{x['sim_wall_s']:.1f}", f"{x['cpu_s']:.1f}",
                     f"{x['wall_s_per_sim_s']:.3f}", f"{x['iterations']:,}",
                     f"{x['mean_decode_seqs']:,.0f} / {x['decode_slots']:,}"))
    h, rp, t = r["headline"], r["replay"], r["targets"]
    quick = (" (`--quick`: a tenth of the full bench's simulated times, so the targets, set for the full "
             "run, are not judged)") if r.get("quick") else ""
    text = (f"`python bench/sim.py{' --quick' if r.get('quick') else ''}` on a {r['trace']['tokens']:,}-token "
            f"synthetic K3 trace, {_machine(r)}{quick}:\n\n")
    text += _table(["mode", "GPUs", "simulated s", "wall s", "CPU s", "wall s per simulated s", "iterations",
                    "mean decode seqs / slots"], rows)
    text += (f"\n{h['duration_s']:g} simulated s of K3 on {h['gpus']} H200 with decode slots "
             f"{t['batches_full']:.0%} busy take {h['sim_wall_s']:.1f} s wall ({h['cpu_s']:.1f} s CPU)")
    if not r.get("quick"):
        text += (f": target <= {t['stat_target_wall_s']:g} s {_met(t['stat_meets_target'])}; wall s per simulated "
                 f"s {t['stat_wall_s_per_sim_s_32']:.3f} at 32 GPUs (target <= 0.05: "
                 f"{_met(t['stat_wall_s_per_sim_s_32'] <= 0.05)})")
    text += (f". Replay routes every token exactly: {rp['tokens_per_cpu_s']:,.0f} tokens per CPU second on K3 in "
             f"the closed loop's prefill burst, {t['replay_slowdown_vs_stat']:.0f}x slower than stat per simulated "
             f"second there.\n")
    steady = r.get("steady")
    if steady:
        text += ("\nSteady state, the targets (replay <= 1.0 wall s per simulated s at 32 GPUs, stat <= 0.2 at 1,024; "
                 "from the first simulated second whose iteration fills 90 % of the decode slots to the run's end):\n\n")
        rows = []
        for x in steady.values():
            judged = x["window_ok"]
            rows.append((x["mode"], f"{x['gpus']:,}", f"{x['steady_from_s']:.0f}-{x['steady_from_s'] + x['steady_sim_s']:.0f}",
                         f"{x['steady_iterations']:,}", f"{x['mean_batch_tokens']:,.0f}",
                         f"{x['wall_s_per_sim_s']:.3f}", f"{x['cpu_s_per_sim_s']:.3f}",
                         f"{x['ms_per_iteration']:.1f} / {x['cpu_ms_per_iteration']:.1f}", f"{x['loadavg_mean']:.1f}",
                         f"<= {x['target_wall_s_per_sim_s']:g}",
                         (f"wall {_met(x['meets_target_wall'])}, CPU {_met(x['meets_target_cpu'])}" if judged
                          else "not judged (window < 600 s)")))
        text += _table(["mode", "GPUs", "steady simulated s", "iterations", "tokens / iteration",
                        "wall s per simulated s", "CPU s per simulated s", "ms per iteration (wall / CPU)",
                        "load average", "target", "verdict"], rows)
    return text


# ---------------------------------------------------------------------------- optimizer
def _pct(x: float) -> str:
    return f"{'+' if x >= 0 else '−'}{abs(x) * 100:.1f} %"


def optimize() -> str:
    """docs/placement.md: the optimizer against EPLB on planned and held-out windows, per domain, on
    traffic, and its run time by GPU count (bench/optimize.py)."""
    r = _results("optimize")
    w = r["windows"]
    skips = "".join(f" --skip-{k}" for k in r.get("skipped", []))
    text = (f"`python bench/optimize.py --tokens {r['tokens']}{skips}` ({_machine(r)}; {r['tokens']:,}-token synthetic "
            f"K3 trace, {w['plan'] + w['held_out']} windows of {w['window_tokens']} tokens, {w['plan']} planned / "
            f"{w['held_out']} held out; 32 x H200 = 4 x 8, R = 32; vLLM rule):\n\n")
    rows = [(name, f"{x['seconds']:.1f} s", f"{x['plan_balancedness']:.4f}", f"{x['plan_gap_budget']:.4%}",
             f"{x['held_out_mean']:.4f}", f"{x['held_out_worst']:.4f}", x["duplicates_on_gpu"])
            for name, x in r["balance"].items()]
    text += _table(["policy", "time", "plan (sum) bal", "gap to bound", "held-out mean", "held-out worst window",
                    "dup GPUs"], rows)
    if r.get("robust_domains"):
        rob = r["robust_domains"]
        text += (f"\nRobust over the {len(w['domains'])} domains (scored per domain; in-sample, the domains it "
                 f"planned on), worst domain: "
                 + ", ".join(f"{name} {x['worst_domain']:.4f}" for name, x in rob.items())
                 + (" (`moeplace --robust` per domain "
                    + ", ".join(f"{b:.4f}" for b in rob["moeplace --robust"]["domain_balancedness"]) + ")"
                    if "moeplace --robust" in rob else "") + ".\n")
    if "traffic" in r:
        text += _optimize_traffic(r)
    if "scaling" in r:
        sc = r["scaling"]
        text += ("\nWhole model (92 layers), moeplace default: "
                 + ", ".join(f"{g} GPUs {x['seconds']:.1f} s" for g, x in sc.items())
                 + " (R = " + ", ".join(str(x["redundant"]) for x in sc.values()) + "; plan balancedness "
                 + ", ".join(f"{x['balancedness']:.4f}" for x in sc.values()) + ").\n")
    return text + f"\nSame seed, same input → same placement: {str(r['deterministic']).lower()}.\n"


def _optimize_traffic(r: dict) -> str:
    tr = r["traffic"]
    eplb, bal_only = tr["eplb"], tr["moeplace"]
    t, bt = tr["moeplace --objective traffic"], tr["moeplace --objective balance+traffic"]
    return (f"\nTraffic (planned on {r['traffic_samples']:,} sampled tokens of the first half; exact replay of "
            f"the held-out half's tokens; other nodes a token is sent to per MoE layer): EPLB "
            f"{eplb['remote_nodes_per_token']:.4f}, balance-only moeplace {bal_only['remote_nodes_per_token']:.4f}, "
            f"`--objective traffic` (floor = EPLB's balancedness − 0.01) **{t['remote_nodes_per_token']:.4f} "
            f"({_pct(t['remote_nodes_vs_eplb'])}) at plan balancedness {t['plan_balancedness']:.4f}**, "
            f"`balance+traffic --traffic-weight 10` **{bt['remote_nodes_per_token']:.4f} "
            f"({_pct(bt['remote_nodes_vs_eplb'])}) at {bt['plan_balancedness']:.4f}** (EPLB "
            f"{eplb['plan_balancedness']:.4f}); {t['seconds']:.0f} / {bt['seconds']:.0f} s under the bench's "
            f"{r['traffic_time_limit_s']:g} s time limit. The planned frontier (layers "
            f"{', '.join(map(str, r['pareto_layers']))}; mean nodes touched per sampled token): "
            + ", ".join(f"{p['span_nodes_per_token']:.3f} at balancedness {p['balancedness']:.4f}"
                        for p in tr["pareto"]) + ".\n")


def optimize_table() -> str:
    """docs/placement.md: wall time of `place optimize` with the baseline policies (bench/optimize_table.py)."""
    r = _results("optimize_table")
    walls = ", ".join(f"{w:.1f}" for w in r["wall_seconds"])
    plans = ", ".join(f"{k} {v:.2f}" for k, v in r["plan_seconds"].items())
    ok = r["median_wall_seconds"] < r["target_seconds"]
    return (f"`python bench/optimize_table.py` ({_machine(r)}): `place {' '.join(r['command'])}` takes "
            f"{r['median_wall_seconds']:.1f} s, the median of {len(r['wall_seconds'])} "
            f"run{'s' if len(r['wall_seconds']) > 1 else ''} ({walls} s; Python "
            f"start-up, the trace pass and the shift estimate included; target < {r['target_seconds']:g} s: "
            f"{_met(ok)}). In-process: trace → Loads {r['read_seconds']:.1f} s, planning {plans} s, and "
            f"{r['compare_seconds'] - sum(r['plan_seconds'].values()):.1f} s of scoring.\n")


SHIFT_LABELS = {"eplb": "eplb", "moeplace": "moeplace", "robust": "moeplace --robust",
                "robust+envelope": "moeplace --robust --envelope",
                "robust+jackknife": "moeplace --robust --dilate jackknife",
                "robust+auto": "moeplace --robust --dilate auto",
                "robust+spread": "moeplace --robust --spread √(2 ln G)",
                "robust+spread-auto": "moeplace --robust --spread auto"}
SHIFT_DATA = {"synthetic": "Synthetic", "captured": "Captured", "captured-seed1": "Captured, seed 1",
              "captured-seed2": "Captured, seed 2",
              "synthetic-window-tag": "Synthetic, leaky split by each window's dominant tag"}


def _shift_table(data: dict) -> str:
    eplb = data["variants"]["eplb"]["realized_worst"]
    rows = [(label, f"{v['in_sample_mean']:.4f}", f"{v['estimate_mean']:.4f} / {v['estimate_worst_mean']:.4f}",
             f"{v['realized_mean']:.4f} / {v['realized_worst']:.4f}",
             "" if key == "eplb" else _signed(v["realized_worst"] - eplb))
            for key, label in SHIFT_LABELS.items() if key in data["variants"] for v in [data["variants"][key]]]
    return _table(["policy", "in-sample", "shift estimate mean / worst", "realized unseen mean / worst",
                   "worst vs EPLB"], rows)


def _signed(x: float) -> str:
    return f"{'+' if x >= 0 else '−'}{abs(x):.3f}"


def _shift_context(d: dict) -> str:
    """The oracle ceilings and the domains' distances of one dataset, as two sentences."""
    out = []
    eplb = d["variants"]["eplb"]["realized_worst"]
    if "oracle" in d:
        o = d["oracle"]
        out.append(f"Oracle ceilings (they see the unseen domain): `--robust` planned on the unseen domain itself "
                   f"keeps {o['self']['mean']:.4f} mean / {o['self']['worst']:.4f} worst "
                   f"({_signed(o['self']['worst'] - eplb)} over EPLB's worst); one `--robust` placement planned on "
                   f"all {len(d['scenarios'])} domains {o['all']['mean']:.4f} / {o['all']['worst']:.4f} "
                   f"({_signed(o['all']['worst'] - eplb)}).")
    if "domains" in d:
        dm = d["domains"]
        out.append("Distance between a domain's expert shares and the other domains' (total variation, mean over "
                   "layers): " + ", ".join(f"{k} {x['tv_rest']:.2f}" for k, x in dm.items())
                   + "; between a window and its own domain: " + ", ".join(f"{x['tv_window']:.2f}" for x in dm.values())
                   + ".")
        if all("corr_rest" in x for x in dm.values()):
            out.append("Correlation of a domain's expert loads with the other domains': "
                       + ", ".join(f"{x['corr_rest']:.2f}" for x in dm.values())
                       + "; coldest of its 4 hottest experts (per layer) in the other domains' loads: rank "
                       + ", ".join(str(x["hot_rank_max"]) for x in dm.values())
                       + (f" of {d['experts']}" if "experts" in d else "") + " (0 = hottest).")
        if all("hot_hits" in x for x in dm.values()):
            hh = [x["hot_hits"] for x in dm.values()]

            def pct(key):
                return ", ".join(f"{100 * h[key]:.0f}" for h in hh) + " %"
            out.append(f"Which of an unseen domain's hottest experts the planning domains point to (its top R per "
                       f"layer, R = the redundant slots a plan can give them, found among the planning domains' top "
                       f"R): ranked by the planning domains' mean load {pct('mean')}; by their maximum (hot in any "
                       f"domain) {pct('max')}; by their spread across domains {pct('sd')}; by chance "
                       f"{100 * hh[0]['random']:.1f} %"
                       + (f"; the domain's own other half of windows {pct('own_half')}"
                          if all("own_half" in h for h in hh) else "") + ".")
    if "coactivation" in d:
        co = d["coactivation"]
        out.append("Do an unseen domain's hottest experts fire together in the planning domains' tokens "
                   "(co-activation lift P(i, j) / P(i) P(j) over pairs of its top R per layer, 1 = independent): "
                   + ", ".join(f"{k} {x['hot']:.2f}" for k, x in co.items()) + "; random sets of R "
                   + ", ".join(f"{x['random']:.2f}" for x in co.values()) + ".")
    return ("\n" + "\n".join(out) + "\n") if out else ""


def _shift_hedges(datasets: dict) -> str:
    """What ``--robust`` keeps over EPLB on each dataset, and what each hedge adds to plain ``--robust``."""
    def worst(d, k):
        return d["variants"][k]["realized_worst"]

    names = {"synthetic": "synthetic", "captured": "captured", "captured-seed1": "captured seed 1",
             "captured-seed2": "captured seed 2"}
    datasets = {k: d for k, d in datasets.items() if k in names}  # the leaky split is not a held-out figure
    rob = ", ".join(f"{_signed(worst(d, 'robust') - worst(d, 'eplb'))} ({names[k]})" for k, d in datasets.items())
    parts = []
    for h, label in (("robust+envelope", "`--envelope`"), ("robust+jackknife", "`--dilate jackknife`"),
                     ("robust+auto", "`--dilate auto`"), ("robust+spread", "`--spread √(2 ln G)`"),
                     ("robust+spread-auto", "`--spread auto`")):
        have = {k: d for k, d in datasets.items() if h in d["variants"]}
        if have:
            parts.append(f"{label} " + ", ".join(f"{_signed(worst(d, h) - worst(d, 'robust'))}" for d in have.values()))
    return (f"Worst unseen domain, `--robust` against EPLB: {rob}. Each hedge against plain `--robust` (same "
            f"order): " + "; ".join(parts) + ".\n\n")


def shift_lodo() -> str:
    """docs/placement.md: the shift estimate against the balancedness realized on an unseen domain, on
    synthetic and on captured routing, each hedge's worst unseen domain against EPLB's, and the oracle
    ceilings (bench/shift_lodo.py)."""
    r = _results("shift_lodo")
    datasets = {k: r[k] for k in SHIFT_DATA if k in r}
    kept = [d["variants"][k] for d in datasets.values() for k in SHIFT_LABELS if k in d["variants"]]
    over = [v["in_sample_mean"] - v["realized_mean"] for v in kept]
    est = [abs(v["estimate_mean"] - v["realized_mean"]) for v in kept]
    per = [v["estimate_abs_error_mean"] for v in kept]
    text = f"Recorded with the results: {r['note']}.\n\n"
    for key, title in SHIFT_DATA.items():
        if key not in datasets:
            continue
        d = datasets[key]
        loads = [x for k in SHIFT_LABELS if k in d["variants"] for x in d["variants"][k].get("loadavg", [])]
        text += (f"{title} ({len(d['scenarios'])} domains: {', '.join(d['scenarios'])}"
                 + (f"; load average {min(loads):.0f}-{max(loads):.0f}" if loads else "")
                 + "):\n\n" + _shift_table(d) + _shift_context(d) + "\n")
    text += _shift_hedges(datasets)
    text += (f"The in-sample figure overstates what unseen traffic gets by {min(over):.2f}-{max(over):.2f}; the shift "
             f"estimate lands within {min(est):.3f}-{max(est):.3f} of the realized mean (per held-out domain "
             f"{min(per):.3f}-{max(per):.3f} off on average).")
    return text + "\n"


def time_limit() -> str:
    """docs/placement.md: how far over `--time-limit` the whole command ends (bench/time_limit.py)."""
    r = _results("time_limit")
    runs = [x for x in r["runs"] if x["case"] != "eplb"]  # EPLB alone ends long before any limit
    top = max(x["limit_s"] for x in runs)
    over_top = [x["over_limit_s"] for x in runs if x["limit_s"] == top]
    over_low = [x["over_limit_s"] for x in runs if x["limit_s"] < top]
    lims = sorted({x["limit_s"] for x in runs if x["limit_s"] < top})
    eplb = [x["wall_s"] for x in r["runs"] if x["case"] == "eplb"]
    def span(over):  # signed seconds past the limit: a run that needs less time ends before it
        def at(x):
            return f"{abs(x):.1f} s {'after' if x >= 0 else 'before'}"
        return f"{at(min(over))} and {at(max(over))}" if min(over) < 0 else \
            f"{min(over):.1f} and {max(over):.1f} s after"

    return (f"On K3 ({r['gpus']} GPUs, a {r['tokens']:,}-token trace) `bench/time_limit.py` measured the whole "
            f"command (every policy, and moeplace with the traffic objective) ending between {span(over_top)} a "
            f"{top:g} s limit and between {span(over_low)} limits of {lims[0]:g}-{lims[-1]:g} s ({_machine(r)}; "
            f"`bench/results/time_limit.json`); Python "
            f"start-up and one validation pass of the trace alone take {r['startup_and_one_pass_s']:.1f} s, and "
            f"`--policy eplb` ends in {min(eplb):.1f}-{max(eplb):.1f} s whatever the limit."
            + _time_limit_cases(r["runs"]) + "\n")


def _time_limit_cases(runs: list[dict]) -> str:
    """What the smallest limits left out, from the runs' own notes and exit codes."""
    greedy = sorted(x["limit_s"] for x in runs if x["case"] == "all policies"
                    and ((x["time_limited"] or {}).get("skipped") or {}).get("local search + CP-SAT") == 92)
    refused = sorted(x["limit_s"] for x in runs if x["case"] == "eplb" and x["exit_code"] == 2)
    text = ""
    if greedy:
        text += (f" At {' and '.join(f'{v:g}' for v in greedy)} s every layer keeps its greedy start (local search "
                 f"skipped on all 92 layers)")
    if refused:
        text += (("; " if text else " ") + f"`--policy eplb --time-limit {refused[-1]:g}` leaves EPLB out, so "
                 f"nothing is written (exit 2)")
    return text + "." if text else ""


# ---------------------------------------------------------------------------- kernels
def kernels() -> str:
    """docs/kernels.md: measured vs predicted MoE layer times of `place kernels bench` (bench/kernels.py)."""
    r = _results("kernels")
    return (f"`python bench/kernels.py` = `{r['command']}` ({r['device']}, {r['dtype']}, {_machine(r)}; "
            f"{r['wall_s']:.0f} s in all):\n\n```\n{r['printed'].rstrip()}\n```\n\n"
            f"Fitted contention of the {r['validation']['shared_cores']} shared cores: "
            f"{r['validation']['contention']:.2f}.\n")


# ---------------------------------------------------------------------------- sweep
def sweep() -> str:
    """docs/sweep.md: the example spec on a local process pool and on a local Ray instance (bench/sweep.py)."""
    r = _results("sweep")
    parts = []
    for backend, x in r["runs"].items():
        statuses = ", ".join(f"{n} {k}" for k, n in x["statuses"].items())
        parts.append(f"{'a local process pool (`--local`)' if backend == 'local' else 'a local Ray instance'} "
                     f"{x['wall_s']:.0f} s wall for {x['points']} points ({statuses}; {x['optimize_tasks']} optimize "
                     f"tasks, {x['optimize_s']:.0f} s of them; simulate tasks {x['sum_simulate_s']:.0f} s)")
    text = (f"`python bench/sweep.py` (`{r['spec']}`, {r['workers']} workers, {_machine(r)}): "
            + "; ".join(parts) + ".")
    if r["same_table"] is not None:
        differ = f": {', '.join(r['differing_columns'])} differ" if r.get("differing_columns") else ""
        text += (f" The two tables are {'identical' if r['same_table'] else '**not** identical'} (every column "
                 f"but the wall-clock ones{differ}), the code {'unchanged' if r['source_unchanged'] else 'changed'} "
                 f"during the runs.")
    return text + "\n"


# ---------------------------------------------------------------------------- README worked example
CEILING = {"kv": "the MLA KV cache, not the KDA state,", "state": "the KDA state, not the MLA KV cache,",
           "max_num_seqs": "the engine's sequence limit (--max-num-seqs)"}


def _context(tokens: int) -> str:
    return "1 M" if tokens == 2**20 else f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def demo_transcript() -> str:
    """README: what `make demo` printed, from a fresh directory (bench/demo.py)."""
    r = _results("demo")
    return (f"Real output (`python bench/demo.py{' --quick' if r['quick'] else ''}`: a fresh run in an empty "
            f"directory, {_machine(r)}, {r['wall_s'] / 60:.1f} minutes in all; the run directory's absolute path "
            f"shown as a user's checkout):\n\n```\n$ {r['command']}\n{r['printed'].rstrip()}\n```\n")


def _stage(printed: str, command: str) -> tuple[list[str], float]:
    """A demo stage's printed lines, from its ``$ place COMMAND`` line up to the ``(N s)`` line it ends with,
    and that N."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ place {command} "))
    end = next(i for i in range(start, len(lines)) if re.fullmatch(r"\(\d+\.\d s\)", lines[i]))
    return lines[start:end], float(lines[end][1:-3])


def demo_optimize() -> str:
    """docs/placement.md: step 4 of the demo, `place optimize` on the default trace (bench/demo.py)."""
    r = _results("demo")
    return (f"Default synthetic K3 trace ({r['optimize']['tokens']:,} tokens, a domain mix that drifts), 4 x 8 H200, vLLM "
            f"rule (real output: step 4 of `python bench/demo.py{' --quick' if r['quick'] else ''}`, "
            f"{_machine(r)}):\n\n```\n" + "\n".join(_stage(r["printed"], "optimize")[0]) + "\n```\n")


def demo_summary() -> str:
    """README: what the demo's output says, read off its artifacts (bench/demo.py)."""
    r = _results("demo")
    pl, opt, sims = r["plan"], r["optimize"], r["simulate"]
    lay, cl = pl["layout"], pl["cluster"]
    pol = opt["policies"]
    li, ep, mo = pol["linear"], pol["eplb"], pol["moeplace"]
    s_li, s_ep, s_mo = (sims[f"placement-{k}"] for k in ("linear", "eplb", "moeplace"))
    held = opt["held_out_windows"]
    n_dom = len(opt["shift_scenarios"])
    fits = "fits" if pl["fits"] else "does not fit"
    return (
        f"K3 {fits} on {cl['num_nodes']} x {cl['gpus_per_node']} {cl['gpu'].upper()} (attention TP{lay['tp']} x "
        f"DP{lay['dp']}, EP{lay['ep']}, "
        + (f"with the placement's {lay['num_redundant']} redundant slots" if lay["num_redundant"]
           else "replica-free, the plan K3's engines can serve")
        + ") with "
        f"{pl['cache_pool_bytes'] / 1e9:.0f} GB per GPU left for caches, and {CEILING[pl['concurrency_ceiling']]} "
        f"is the ceiling: {pl['concurrency']} concurrent {_context(pl['context'])}-token sequences, "
        f"{pl['mix_concurrency']} at the 8k/128k/1M mix. On the held-out part of the trace (windows "
        f"{held[0]}-{held[-1]}, never seen by planning, token sample included), vLLM's `linear` layout leaves the "
        f"hottest GPU with {li['held_max_over_mean']:.2f}x the mean GPU's tokens at every MoE layer (balancedness "
        f"{li['held_balancedness']:.2f}); DeepSeek's EPLB reaches {ep['held_balancedness']:.2f} (worst window "
        f"{ep['held_worst']:.2f}"
        + (f", and two replicas of one expert on one GPU in {ep['duplicate_on_gpu_layers']} layers"
           if ep["duplicate_on_gpu_layers"] else "")
        + f"); the moeplace placement {mo['held_balancedness']:.2f} (worst {mo['held_worst']:.2f}). On traffic "
        f"*unlike* the planning data expect less: planned on all but one of the planning part's {n_dom} domains "
        f"and scored on the one left out, moeplace keeps {mo['shift_mean']:.2f} (worst domain "
        f"{mo['shift_worst']:.2f}), EPLB {ep['shift_mean']:.2f}, `linear` {li['shift_mean']:.2f} — the shift "
        f"estimate under the table, the figure to plan a changing workload with"
        + (" (an optimistic one here, as its line says: this trace's windows mix domains, so plan with one "
           "input per workload for a clean estimate)" if "optimistic: windows mix domains" in r["printed"] else "")
        + f". The simulation routes only the "
        f"held-out part (its first line says so): the straggler GPU costs `linear` "
        f"{s_li['straggler_share']:.1%} of every step ({s_li['straggler_s']:.0f} s in all); moeplace changes output "
        f"tokens/s by {_change(s_mo['output_tok_s'], s_li['output_tok_s'])} against `linear` and by "
        f"{_change(s_mo['output_tok_s'], s_ep['output_tok_s'])} against EPLB"
        + (" — ratios to trust more than the absolute tok/s, which the line under the table labels as model "
           "estimates with the simulator's validation error" if "absolute figures are model estimates" in r["printed"]
           else "")
        + ". The run took "
        f"{r['wall_s'] / 60:.1f} minutes, {_stage(r['printed'], 'optimize')[1] / r['wall_s']:.0%} of it "
        f"step 4, the optimizer and its shift estimate (one more plan per domain).\n")



def demo_simulate() -> str:
    """docs/simulate.md: step 7 of the demo, the three placements simulated side by side (bench/demo.py)."""
    r = _results("demo")
    sims = r["simulate"]
    li, ep, mo = (sims[f"placement-{k}"] for k in ("linear", "eplb", "moeplace"))
    lines, _secs = _stage(r["printed"], "simulate")
    return (f"Real output (step 7 of `python bench/demo.py{' --quick' if r['quick'] else ''}`, {_machine(r)}):\n\n"
            "```\n" + "\n".join(lines) + "\n```\n\n"
            f"The linear placement's hottest GPU gets {li['mean_imbalance']:.2f}x the mean GPU's tokens at every MoE "
            f"layer; waiting for it costs {li['straggler_s']:.0f} s of the {li['duration_s']:g} simulated s "
            f"({li['straggler_share']:.1%} of every step: dispatch, expert GEMMs and combine all wait) and "
            f"{_change(li['output_tok_s'], mo['output_tok_s'])} output tok/s against the moeplace placement "
            f"({li['output_tok_s']:,.0f} vs {mo['output_tok_s']:,.0f}; EPLB {ep['output_tok_s']:,.0f}; TPOT p50 "
            f"{_ms(li['tpot_p50_s'])} vs {_ms(mo['tpot_p50_s'])}).\n")


def _ms(seconds: float | None) -> str:
    """Milliseconds below a second, else seconds; a dash for a latency the run has none of (too short)."""
    if seconds is None:
        return "–"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ---------------------------------------------------------------------------- README scenarios
def _scenario(name: str) -> dict:
    return _results("scenarios")[name]


def _source(run: dict) -> str:
    """Which demo run a scenario read: said when it is not the default 100k-token one (`--quick`)."""
    tokens = run.get("trace_tokens")
    if tokens is not None and tokens != 100_000:
        return f", on the artifacts of a demo run with a {tokens:,}-token trace"
    return ", on the artifacts of `place demo --quick`" if "--quick" in run.get("demo", "") else ""


def _header(printed: str) -> str:
    return next(line for line in printed.splitlines() if " simulated s, " in line)


def long_context() -> str:
    """README and docs/simulate.md: 8k prompts only, then 5 % of 1 M-token prompts (bench/scenarios.py)."""
    runs = _scenario("long_context")
    short, long_ = runs["8k"]["summary"][0], runs["1m"]["summary"][0]
    table = format_table([SimpleNamespace(label="8k prompts", summary=short),
                          SimpleNamespace(label="+ 5 % 1M-token prompts", summary=long_)])
    cmds = "\n".join(f"$ {x['command']}" for x in runs.values())
    return (f"```\n{cmds}\n```\n\nThe two tables side by side{_source(runs['8k'])} (header line of both: "
            f"`{_header(runs['8k']['printed'])}`):\n\n```\n{table}\n```\n\n"
            f"Output falls from {short['output_tok_s']:,.0f} to {long_['output_tok_s']:,.0f} tok/s, TPOT p50 rises "
            f"from {_ms(short['tpot_p50_s'])} to {_ms(long_['tpot_p50_s'])} for everybody, and the MLA KV pool peaks "
            f"at {long_['kv_peak']:.0%} (8k prompts only: {short['kv_peak']:.0%}); {long_['requests_rejected']} "
            f"prompts longer than the model's context were rejected.\n")


def traffic() -> str:
    """README: `place optimize --objective balance+traffic` against EPLB on held-out tokens (bench/scenarios.py)."""
    run = _scenario("traffic")["traffic"]
    rows = {row["policy"]: row for row in run["report"]["rows"]}
    mo, _ep = rows["moeplace"], rows["eplb"]
    node = {k: v["held_out"]["remote_per_token"]["node"] for k, v in rows.items()}
    kib = {k: v["held_out"]["dispatch_bytes_per_token"]["node"] / 1024 for k, v in rows.items()}
    m = re.search(r"nodes touched per token of its planning sample \(in-sample\) ([\d.]+) -> ([\d.]+)", run["printed"])
    b = {k: (v["plan"]["balancedness"], v["held_out"]["balancedness"]) for k, v in rows.items()}
    as_well = b["moeplace"][0] >= b["eplb"][0] and b["moeplace"][1] >= b["eplb"][1]
    return (f"```\n$ {run['command']}\n{run['printed'].rstrip()}\n```\n\n"
            f"On held-out tokens each token now goes to {node['moeplace']:.2f} other nodes per MoE layer instead of "
            f"EPLB's {node['eplb']:.2f} — {kib['moeplace']:,.0f} instead of {kib['eplb']:,.0f} KiB of inter-node "
            f"dispatch per token ({_change(kib['moeplace'], kib['eplb'])}"
            + (f"; in-sample, on the tokens it planned on, the optimizer's own count is {m[1]} -> {m[2]} nodes "
               f"touched, which is why the held-out figure is the one to quote" if m else "")
            + f") — and the placement balances {'at least as well as' if as_well else 'less well than'} EPLB "
            f"(plan / held-out {b['moeplace'][0]:.4f} / {b['moeplace'][1]:.4f} vs {b['eplb'][0]:.4f} / "
            f"{b['eplb'][1]:.4f}). The command took {run['wall_s']:.0f} s "
            f"({_machine(_results('scenarios'))}{_source(run)}), "
            f"the optimizer {mo['seconds']:.0f} s of it.\n")


def evaluate_defaults() -> str:
    """docs/export.md: the engines' default layouts and the moeplace placement scored on the demo's Loads
    (bench/scenarios.py)."""
    runs = _scenario("evaluate")
    lines, ratio = [], {}
    for label, run in runs.items():
        bal = next(line for line in run["printed"].splitlines() if line.startswith("balancedness"))
        lines += [f"$ {run['command']}", bal]
        ratio[label] = float(re.search(r"max/mean ([\d.]+)", bal)[1])
    return (f"Real output{_source(next(iter(runs.values())))}:\n\n```\n" + "\n".join(lines) + "\n```\n\n"
            f"`linear` with `[i % E]` redundant slots is exactly where vLLM's online EPLB starts: until its first "
            f"rearrangement (every `step_interval` steps) the hottest GPU carries {ratio['linear']:.2f}x the mean "
            f"GPU's tokens at every MoE layer; the moeplace placement (planned on the first half of the trace) "
            f"carries {ratio['moeplace']:.2f}x.\n")


# a row of the table: config, tok/s, [gain (interval),] straggler %, rebalances, stall s
REC_ROW = re.compile(r"^  (?P<config>\S.*?)\s{2,}(?P<tok>[\d,]+)\s+(?:[+-][\d.]+%\s+\([^)]*\)\s+)?[\d.]+%\s+"
                     r"(?P<n>\d+)\s+(?P<stall>[\d.]+)\s")


def recommend() -> str:
    """README: `place simulate --recommend`, static vs the engines' online rebalancers (bench/scenarios.py);
    the sentence reads the comparison table the command printed."""
    run = _scenario("recommend")["recommend"]
    lines = run["printed"].rstrip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("static vs online rebalancing"))
    rows = [m for line in lines[start + 1:] if (m := REC_ROW.match(line))]
    base = float(rows[0]["tok"].replace(",", ""))
    parts = [f"{m['config']} rebalances {m['n']} time{'s' if m['n'] != '1' else ''} ({m['stall']} s of stall) and "
             f"changes tok/s by {_change(float(m['tok'].replace(',', '')), base)}" for m in rows[1:]]
    # the comparison's own runs (the protocol sizes them to let every rebalancer act), not the table's run
    runs = re.search(r"runs of ([\d,.]+) simulated s", lines[start])
    within = (f"In the comparison's own runs ({runs[1]} simulated s each, on traffic the rebalancers had not "
              f"observed{_source(run)})" if runs else f"In the comparison's runs{_source(run)}")
    return (f"```\n$ {run['command']}\n{lines[0]}\n...\n" + "\n".join(lines[start:]) + "\n```\n\n"
            f"{within}: " + "; ".join(parts) + ".\n")


# ---------------------------------------------------------------------------- fidelity
def fidelity_constants() -> str:
    """docs/simulate.md: the fitted constants across the shipped ensemble's members (10th-90th percentile,
    median), the reference fit (the CostConfig defaults), the bounds and how many members sit on one
    (bench/fidelity.py)."""
    res = _results("fidelity")
    ens = res["ensemble"]
    lines = [("| fitted constant | bounds | reference (the default) | members: median | 10th - 90th percentile | "
             "members on a bound |"), "|---|---|---:|---:|---|---|"]
    for f in ens["bounds"]:
        lo, hi = f["bounds"]
        on = f"{f['at_lower']} low, {f['at_upper']} high of {f['members']}" + (" **(pushed)**" if f["pushed"] else "")
        lines.append(f"| `{f['name']}` | {lo:.4g} - {hi:.4g} | {ens['reference'][f['name']]:.4g} | {f['median']:.4g} | "
                     f"{f['p10']:.4g} - {f['p90']:.4g} | {on} |")
    return "\n".join(lines) + "\n"


def _err_row(name: str, s: dict) -> str:
    if not s.get("cases"):
        return f"| {name} | 0 | 0 | - | - | - |"
    return (f"| {name} | {s['cases']} | {s['groups']} | {s['median']:.1%} | {s['max']:.1%} | "
            f"{s['worst_case']} {s['worst_error']:+.1%} |")


def fidelity_cv() -> str:
    """docs/simulate.md: the shipped ensemble held out by group (bench/fidelity.py): errors and interval
    coverage / width, overall and by kind of run; the after-the-cut-off column; TTFT / TPOT on their own
    cases; both peers."""
    res = _results("fidelity")
    cv, cov, ens = res["cv"], res["coverage"], res["ensemble"]
    lines = ["| held out by group (out of bag) | cases | groups | median abs error | max abs error | worst case |",
             "|---|---:|---:|---:|---:|---|", _err_row("**end-to-end, all**", cv["all"])]
    lines += [_err_row(f"kind: {k}", v) for k, v in cv["by_kind"].items()]
    lines += [_err_row("kernel tables", cv["kernel_tables"]), ""]
    lines += [("| 80 % interval, held out by group | cases | groups | covered | coverage | 5-95 % over group resamples "
               "| each group alike | median width | median nearness (groups) |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, v in cov.items():
        if v.get("cases"):
            lo, hi = v["coverage_range"]
            lines.append(f"| {'**all end-to-end**' if k == 'all' else 'kind: ' + k} | {v['cases']} | {v['groups']} | "
                         f"{v['covered']} | {v['coverage']:.1%} | {lo:.0%} - {hi:.0%} | {v['group_coverage']:.0%} | "
                         f"{v['median_width']:.0%} | {v['median_near']:.2f} |")
    missed = coverage_misses(cov)
    target = (f"**not met** ({', '.join(missed)})" if missed or not cov["all"].get("cases")
              else "met overall and for every kind of run")
    lines += ["", (f"Coverage target (70-90 % of held-out cases inside their nominal 80 % interval, overall and by kind "
              f"of run): {target}. The 5-95 % column is how precisely so few groups measure a coverage "
              f"({COVERAGE_RESAMPLES:,} resamples of whole groups, a group's cases missing or holding together); it is not "
              "a range of any simulated figure. Width: (hi - lo) / median, as figures. Members: "
              f"{ens['members']}, a group bootstrap of {len(ens['groups'])} groups.")]
    a = res["after_cutoff"]
    if a["cases"]:
        e = a["errors"]
        lines += ["", (f"After the cut-off ({a['cutoff']}; never used to choose structure nor fitted, scored once): "
                  f"{a['cases']} case(s) ({', '.join(a['ids'])}): median abs error {e['median']:.1%}, max "
                  f"{e['max']:.1%}; the interval held {a['coverage'].get('covered', 0)} of {a['coverage']['cases']}.")]
    else:
        lines += ["", f"After the cut-off ({a['cutoff']}): no case yet."]
    st = res.get("after_structure")
    if st and st["cases"]:
        e = st["errors"]
        lines += ["", (f"Fitted, but published after the newest case the structure was chosen on ({st['structure_cutoff']}; "
                       f"never used to choose it), held out by group: {st['cases']} case(s) in {e['groups']} groups: "
                       f"median abs error {e['median']:.1%}, max {e['max']:.1%} ({e['worst_case']} "
                       f"{e['worst_error']:+.1%}); the interval held {st['coverage'].get('covered', 0)} of "
                       f"{st['coverage']['cases']}; {st['too_slow']} simulated slower than published, "
                       f"{st['cases'] - st['too_slow']} faster.")]
    lat = res["latency"]
    lines += ["", "| own-data check | case | published (ms) | ensemble (ms) | error | 80 % interval (ms) |",
              "|---|---|---:|---:|---:|---|"]
    for k in ("tpot", "ttft"):
        for r in lat[k]["cases"]:
            what = f"{k.upper()} {r.get('statistic', 'p50')}"  # the source's statistic: its median, or its mean
            if not r.get("comparable", True):
                lines.append(f"| {what} | {r['id']} | {r['published_ms']:,.1f} | - | not comparable: {r['why']} | - |")
            elif "interval_ms" in r:
                lines.append(f"| {what} | {r['id']} | {r['published_ms']:,.1f} | {r['simulated_ms']:,.1f} | "
                             f"{r['error']:+.1%} | {r['interval_ms'][0]:,.1f} - {r['interval_ms'][1]:,.1f}"
                             f"{'' if r['covered'] else ' (missed)'} |")
            else:  # a result written before TTFT had its interval: the reference run's own
                lines.append(f"| {what} | {r['id']} | {r['published_ms']:,.1f} | {r['simulated_ms']:,.1f} | "
                             f"{r['error']:+.1%} | none (the reference run) |")
    lines += ["", f"Unchecked: {lat['unchecked']}."]
    lines += _peer_lines(res.get("peer_summary") or {})
    return "\n".join(lines) + "\n"


def _peer_lines(ps: dict) -> list[str]:
    """fidelity-cv's peer part: by independent deployment, moeplace held out against aiconfigurator 0.12 and
    aisimulate 0.13 (each on the cases it supports), then the two releases compared on the cases both run."""
    ind = ps.get("independent")
    ais = ps.get("aisimulate") or {}
    ran = bool(ais.get("run"))
    lines = []
    if ind:
        lines += ["", (f"The peer by independent deployment (one vote per case group, moeplace held out against "
                       f"aiconfigurator {ps['version']}'s own): moeplace at least as close on "
                       f"{ind['moeplace_as_close']} of {ind['deployments']}; median over the groups of the "
                       f"median abs error moeplace {ind['median_abs_error']['moeplace']:.1%}, aiconfigurator "
                       f"{ind['median_abs_error']['aiconfigurator']:.1%}.")]
        aind = (ais.get("independent") or {}) if ran else {}
        if aind:
            lines.append(f"aisimulate {ais['version']} the same way: moeplace at least as close on "
                         f"{aind['moeplace_as_close']} of {aind['deployments']}; median over the groups moeplace "
                         f"{aind['median_abs_error']['moeplace']:.1%}, aisimulate "
                         f"{aind['median_abs_error']['aisimulate']:.1%}.")
        theirs = {d["group"]: d for d in aind.get("by_deployment", [])}
        lines += ["", "| deployment group | cases | moeplace (held out) | aiconfigurator |"
                  + (" aisimulate |" if ran else ""), "|---|---:|---:|---:|" + ("---:|" if ran else "")]
        for d in ind["by_deployment"]:
            t = theirs.get(d["group"])
            cell = "" if not ran else (" n/a |" if t is None else f" {t['aisimulate_median_abs_error']:.1%}"
                                       f"{'' if t['moeplace_as_close'] else ' (closer)'}"
                                       f"{'' if t['cases'] == d['cases'] else ' (' + str(len(t['cases'])) + ' cases)'} |")
            lines.append(f"| {d['group']} | {len(d['cases'])} | {d['moeplace_cv_median_abs_error']:.1%} | "
                         f"{d['aiconfigurator_median_abs_error']:.1%}{'' if d['moeplace_as_close'] else ' (closer)'} |"
                         + cell)
        lines += [f"| {g} | {len(t['cases'])} | {t['moeplace_cv_median_abs_error']:.1%} | n/a | "
                  f"{t['aisimulate_median_abs_error']:.1%}{'' if t['moeplace_as_close'] else ' (closer)'} |"
                  for g, t in theirs.items() if g not in {d["group"] for d in ind["by_deployment"]}]
    if not ais:
        return lines
    if not ran:
        return lines + ["", f"aisimulate {ais.get('version')}: {ais.get('why', '')}"]
    lines += ["", (f"aisimulate {ais['version']} ({ais['index']}; called through `{ais['api']}`, the same call as "
              f"aiconfigurator 0.12's): {ais['shared_cases']} end-to-end cases supported; moeplace (held out) at "
              f"least as close on {ais['moeplace_at_least_as_close']}; median abs error moeplace "
              f"{ais['median_abs_error']['moeplace']:.1%}, aisimulate {ais['median_abs_error']['aisimulate']:.1%}.")]
    v = ais.get("versions")
    m = (v or {}).get("median_abs_error")
    if m:
        old, new = v["old"].split()[0], v["new"].split()[0]
        ac = v.get("after_cutoff")
        lines += ["", (f"The two releases ({v['old']}, {v['new']}) on the {v['shared_cases']} cases both support "
                       f"({v['same_call']} with the identical call): median abs error moeplace (held out) "
                       f"{m['moeplace']:.1%}, {old} {m[old]:.1%}, {new} {m[new]:.1%}"
                       + "".join(f"; {label} ({k['cases']} cases): moeplace {k['moeplace']:.1%}, {old} {k[old]:.1%}, "
                                 f"{new} {k[new]:.1%}"
                                 for label, k in [("after the cut-off", ac), *v.get("by_kind", {}).items()] if k)
                       + f". Estimates more than {v['threshold']:.0%} apart, or supported by one only:")]
        if v["disagree"]:
            lines += ["", f"| case | {old} | {new} | {new} / {old} |", "|---|---:|---:|---:|"]
            for d in v["disagree"]:
                if "ratio" in d:
                    lines.append(f"| {d['id']} | {d[f'{old}_error']:+.1%} | {d[f'{new}_error']:+.1%} | "
                                 f"{d['ratio'] - 1:+.1%}{'' if d['same_call'] else ' (another call)'} |")
                else:
                    lines.append(f"| {d['id']} | only {d['supported_by']} | | {d['reason'][:80]} |")
        else:
            lines.append("none.")
    return lines + _predict_lines(ais.get("predict"))


def _predict_lines(pm: dict | None) -> list[str]:
    """fidelity-cv: aisimulate's own ``predict`` (its traffic replay) on the serving cases, beside its
    estimate and moeplace held out."""
    if not pm or not pm.get("median_abs_error"):
        return []
    m, ac = pm["median_abs_error"], pm.get("after_cutoff")
    out = ["", (f"aisimulate's own `predict` (a replay of the case's closed loop through its engine, the command its "
                f"README leads with) on the {m['cases']} serving cases it ran: median abs error moeplace (held out) "
                f"{m['moeplace']:.1%}, aisimulate's estimate {m['estimate']:.1%}, predict {m['predict']:.1%}"
                + (f"; after the cut-off ({ac['cases']} cases): moeplace {ac['moeplace']:.1%}, estimate "
                   f"{ac['estimate']:.1%}, predict {ac['predict']:.1%}" if ac else "")
                + (f". Not run: {', '.join(r['id'] + ' (' + r['reason'].split(': ', 1)[-1][:100] + ')' for r in pm['not_run'])}."
                   if pm["not_run"] else ".")),
           "", "| serving case | moeplace (held out) | aisimulate estimate | aisimulate predict |", "|---|---:|---:|---:|"]
    out += [f"| {r['id']}{' (after the cut-off)' if r['after_cutoff'] else ''} | {r['moeplace_error']:+.1%} | "
            f"{'n/a' if r['estimate_error'] is None else format(r['estimate_error'], '+.1%')} | {r['predict_error']:+.1%} |"
            for r in pm["cases"]]
    return out


def fidelity_peers() -> str:
    """README: the peer in one paragraph: aiconfigurator 0.12 and aisimulate 0.13 against moeplace (held out) on
    the end-to-end cases both releases estimate, overall and after the cut-off (bench/fidelity.py's
    ``peer_summary``)."""
    ps = _results("fidelity")["peer_summary"]
    ais = ps.get("aisimulate") or {}
    v = ais.get("versions") or {}
    m = v.get("median_abs_error")
    if not (ais.get("run") and m):
        return (f"The peer, NVIDIA's aiconfigurator {ps['version']}, on the {ps['shared_cases']} cases it estimates: "
                f"median abs error moeplace {ps['median_abs_error']['moeplace']:.1%} (held out), aiconfigurator "
                f"{ps['median_abs_error']['aiconfigurator']:.1%}; aisimulate: {ais.get('why', 'not run')}.\n")
    subsets = [("published after moeplace's cut-off", v.get("after_cutoff")),
               *[(f"{k} runs", x) for k, x in v.get("by_kind", {}).items()]]
    return (f"Against the peer, NVIDIA's aiconfigurator {ps['version']} and its successor aisimulate {ais['version']} "
            f"(the newest build installable from PyPI: the 0.13.0 release there is a placeholder that fetches from "
            f"NVIDIA's own index), given each case the same way: on the {m['cases']} published deployments both "
            f"estimate, median abs error moeplace {m['moeplace']:.1%} (held out), aiconfigurator "
            f"{m['aiconfigurator']:.1%}, aisimulate {m['aisimulate']:.1%}"
            + "".join(f"; on the {x['cases']} {label}, moeplace {x['moeplace']:.1%}, aiconfigurator "
                      f"{x['aiconfigurator']:.1%}, aisimulate {x['aisimulate']:.1%}"
                      + (f" ({min(('moeplace', 'aiconfigurator', 'aisimulate'), key=x.get)} the closest)")
                      for label, x in subsets if x)
            + _predict_clause(ais.get("predict"))
            + f". {_not_both(_results('fidelity')['cases'])}: [docs/simulate.md]"
            "(docs/simulate.md#fidelity-against-published-results-benchfidelitypy--benchresultsfidelityjson).\n")


def _predict_clause(pm: dict | None) -> str:
    m = (pm or {}).get("median_abs_error")
    if not m:
        return ""
    return (f". aisimulate's own `predict` (its traffic replay) on the {m['cases']} serving cases: median abs error "
            f"{m['predict']:.1%}, against moeplace's {m['moeplace']:.1%} on the same cases")


def _not_both(rows: list[dict]) -> str:
    """The end-to-end cases the two peer releases do not both estimate, counted by aisimulate's reason."""
    why: dict[str, int] = {}
    for r in rows:
        p = r.get("peer") or {}
        if r["kind"] in E2E and not all("simulated" in p.get(n, {}) for n in PEERS):
            reason = p.get("aisimulate", {}).get("reason", "not run")
            key = ("no H800 tables" if "no H800" in reason else
                   "cross-node expert parallelism without DeepEP tables" if "Cross-node EP" in reason else
                   "supported by one release only" if "simulated" in p.get("aisimulate", {}) else
                   "another missing table")
            why[key] = why.get(key, 0) + 1
    n = sum(why.values())
    return (f"The other {n} end-to-end cases are not estimated by both ("
            + "; ".join(f"{k}: {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])) + ")")


def fidelity_cases() -> str:
    """docs/simulate.md: one row per published case: its publication date, the reference run, the
    ensemble's held-out figure and interval, the measured cost source and the peer."""
    res = _results("fidelity")
    lines = [("| group | case | source | published on | configuration | metric | published | reference run | "
              "held out | error | 80 % interval | measured (error) | aiconfigurator (error) | aisimulate (error) |"),
             "|---|---|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in res["cases"]:
        peer_cells = " | ".join(peer_cell(r, name) for name in PEERS)
        iv = r.get("interval")
        ivc = "" if not iv else (f"{_fmt_figure(iv[0])} - {_fmt_figure(iv[1])}" + ("" if r["covered"] else " (missed)"))
        when = r["published_on"] + (" **(after the cut-off)**" if r["after_cutoff"] else "")
        lines.append(f"| {r['group']} | {r['id']} | [{r['source']['org']}]({r['source']['url']}) | {when} "
                     f"| {r['gpu']}, {r['config']} | {r['metric']} | {_fmt_figure(r['published'])} | "
                     f"{_fmt_figure(r['simulated'])} | {_fmt_figure(r['cv_simulated'])} | {r['cv_error']:+.1%} | {ivc} | "
                     f"{_measured_cell(r)} | {peer_cells} |")
    ms = res.get("measured_summary")
    if ms and ms.get("cases"):
        lines += ["", (f"Measured column: the same simulation with `--cost-model measured` (aiconfigurator's tables for "
                       f"the case's GPU and engine, the reference constants elsewhere; n/a: not covered, the reason in "
                       f"the results file): {ms['cases']} cases covered, median abs error {ms['median_abs_error']:.1%}, "
                       f"max {ms['max_abs_error']:.1%} (the ensemble held out on the same cases: median "
                       f"{ms['ensemble_median_abs_error']:.1%}, max {ms['ensemble_max_abs_error']:.1%}).")]
    return "\n".join(lines) + "\n"


def _measured_cell(r: dict) -> str:
    m = r.get("measured")
    if not m:
        return ""
    if "simulated" not in m:
        return "n/a"
    return f"{_fmt_figure(m['simulated'])} ({m['error']:+.1%})"


def fidelity_label() -> str:
    """docs/simulate.md: the line ``place simulate`` prints under its table, from the committed results."""
    from moeplace.sim.fidelity import fidelity_note, summarize_results

    return f"```\n{fidelity_note(summarize_results(_results('fidelity')))}\n```\n"


def replan_quality() -> str:
    """docs/simulate.md: balancedness gained per expert moved, moeplace's bounded re-plan vs EPLB vs none
    (bench/replan_quality.py)."""
    r = _results("replan_quality")
    s = r["summary"]
    lines = [("| re-plan | balancedness on the next window | gain over none | experts moved | gain per 1,000 moved "
              "| decision s (median, charged) |"), "|---|---:|---:|---:|---:|---:|"]
    names = {"none": "none (static)", "eplb": "EPLB (vLLM's re-plan), GPUs renumbered to keep experts",
             "moeplace": f"moeplace migration, <= {r['moves']} moves/layer"}
    for k, v in s.items():
        per = "–" if v["gain_per_1000_moved"] is None else f"{v['gain_per_1000_moved']:+.4f}"
        lines.append(f"| {names[k]} | {v['mean_balancedness']:.4f} | {v['gain_over_none']:+.4f} | "
                     f"{v['experts_moved']:,} | {per} | {v['decision_charged_median_s']:.2f} |")
    e, m = s["eplb"], s["moeplace"]
    return ("\n".join(lines) + f"\n\n(`python bench/replan_quality.py`: Kimi K3 at {r['gpus']} H200, "
            f"{r['redundant']} redundant slots, a {r['tokens']:,}-token synthetic trace in {r['windows']} windows, "
            f"{len(r['steps'])} re-plans, each observing window t - 1 and scored on window t; load average "
            f"{r['loadavg_start'][0]:.1f} on 2 shared cores.) EPLB gains {e['gain_over_none']:+.4f} balancedness but "
            f"moves {e['experts_moved'] / len(r['steps']):,.0f} expert copies per re-plan; the bounded re-plan gains "
            f"{m['gain_over_none']:+.4f} moving {m['experts_moved'] / len(r['steps']):,.0f}: "
            f"{m['gain_per_1000_moved'] / e['gain_per_1000_moved']:.0f}x the balancedness per expert moved.\n")


def pools() -> str:
    """docs/placement.md: per-pool placements against EPLB, the engines' defaults and one shared placement:
    the decode figure (and simulated TPOT) at 4-256 sequences per DP rank, the prefill pool's balance and
    bytes (bench/pools.py)."""
    r = _results("pools")
    out = []
    for name, what in (("k3", "K3-shaped synthetic trace (8 of 92 MoE layers)"),
                       ("captured", "tiny random OLMoE-style model captured on CPU (64 experts, top-8)")):
        d = r[name]["decode"]
        sim = any("sim" in e for e in d["batches"].values())
        head = ["seqs / DP rank", "policy", "act max", "vs EPLB", "act max/mean", "tok max/mean"]
        head += ["TPOT p50 ms", "vs EPLB", "decode batch"] if sim else []
        rows = []
        for b, e in d["batches"].items():
            ref = e["rows"]["eplb"]["active_max"]
            srows = e.get("sim", {}).get("rows", {})
            for pol, x in e["rows"].items():
                cells = [b, pol, f"{x['active_max']:.2f}", f"{x['active_max'] / ref - 1:+.1%}",
                         f"{x['active_max_over_mean']:.4f}", f"{x['token_max_over_mean']:.4f}"]
                if sim:
                    t = srows.get(pol)
                    base = srows.get("eplb", {}).get("tpot_p50_s")
                    cells += ([f"{t['tpot_p50_s'] * 1e3:.2f}", f"{t['tpot_p50_s'] / base - 1:+.1%}",
                               f"{t['mean_decode_seqs']:.0f} of {d['gpus'] * int(b)}"]
                              if t and t.get("tpot_p50_s") and base else ["", "", ""])
                rows.append(cells)
        t = d["tokens"]
        secs = {b: e["sim"].get("duration_s") for b, e in d["batches"].items() if "sim" in e}
        runs = (", each run until one request per running slot had finished ("
                + ", ".join(f"{v:g}" for v in secs.values()) + f" simulated s at {'/'.join(secs)} per rank)"
                if secs and all(secs.values()) else "")
        out.append(f"Decode pool DEP{d['gpus']}, {what}: {t['decode_planning']:,} planning and {t['decode_held_out']:,} "
                   f"held-out decode tokens ({t['requests_held_out']:,} held-out requests); act = slots the busiest "
                   "GPU reads per held-out step" + ("; TPOT: `place simulate --phase decode` on GB300, replay routing "
                   f"of the held-out requests, the decode batch it reached{runs}" if sim else "") + ":\n")
        out.append(_table(head, rows))
        pre = r[name]["prefill"]
        prow = []
        for label, pols in pre["pools"].items():
            for pol, x in pols.items():
                prow.append([label, pol, f"{x['balancedness']:.4f}", f"{x['max_over_mean']:.4f}",
                             f"{x['nodes_per_token']:.3f}", f"{x['remote_node_kib_per_token']:.1f}"])
        out.append(f"\nPrefill pool, same input ({pre['tokens']['prefill_held_out']:,} held-out prompt tokens):\n")
        out.append(_table(["pool", "policy", "balancedness", "max/mean", "nodes/tok", "KiB/tok"], prow))
        out.append("")
    return ("\n".join(out) + f"\n(`python bench/pools.py`, vLLM's replica rule; {r['wall_s'] / 60:.0f} min on 2 shared "
            f"cores at load average {r['loadavg'][0]:.1f}.)\n")


def relabel_speed() -> str:
    """docs/export.md: relabelling against cp, the reflink share and the K3 projections (bench/relabel.py)."""
    r = _results("relabel")
    d, x, p = r["disk"], r["reflink"], r["projected_k3_s"]
    mins = lambda s: f"{s / 60:,.0f} min" if s >= 600 else f"{s / 60:.1f} min"
    text = (f"`python bench/relabel.py` (a K3-shaped checkpoint: {r['tensors']:,} tensors, K3's names, in "
            f"{r['shards']} shards, {r['checkpoint_bytes'] / 1e9:.2f} GB, on one disk of 2 shared cores at load "
            f"average {r['load_average']:.1f}; medians of {r['repeats']} repeats, each run from an evicted source to "
            f"an fsynced copy): relabelling took {d['median_relabel_s']:.0f} s against {d['median_cp_s']:.0f} s for "
            f"`cp -r` of the same checkpoint -- ratio {d['median_ratio']:.2f}, target <= 1.1 {_met(r['ratio_met'])}. "
            + (f"CPU: {d['median_relabel_cpu_s']:.0f} s for the relabelling, {d['median_cp_cpu_s']:.0f} s for `cp` (the "
               "copy in the kernel is CPU work on this machine; the relabelling drops each source shard from the page "
               "cache once copied, `cp` keeps them, and the kernel's reclaim of memory during the copy is part of "
               "`cp`'s time here). " if "median_cp_cpu_s" in d else "")
            + f"Reading, checking and planning K3's headers takes {d['median_fixed_s']:.0f} s on its own (a "
            f"`--dry-run`: {d['median_fixed_cpu_s']:.1f} CPU s; it does not shrink with the bytes)"
            + (", which the write runs alongside the copy (each shard planned while the one before it is copied). "
               if "median_cp_cpu_s" in d else ". "))
    if "newly_allocated_share" in x:
        text += (f"On a loop-mounted XFS image with reflink it newly allocated {x['newly_allocated_share']:.2%} of "
                 f"the checkpoint's bytes (target <= 2 % {_met(r['reflink_met'])}), nearly all of it the headers and "
                 f"the index ({(x['header_bytes'] + x['index_bytes']) / 1e6:,.0f} MB: K3's names, which do not "
                 f"shrink with the bytes); at K3's 1.56 TB about {x['projected_k3_share']:.3%} (an estimate: those "
                 "plus K3's router rows). ")
    else:
        text += f"The reflink measurement did not run: {x.get('blocked', x.get('skipped'))}. "
    text += (f"Projected for K3's 1.56 TB: {mins(p['this_disk'])} on this disk (`cp`: {mins(p['this_disk_cp'])}), "
             f"{mins(p['nvme_3gb_s'])} on a 3 GB/s NVMe"
             + (f", {mins(p['nvme_3gb_s_reflink'])} there with reflink" if p.get("nvme_3gb_s_reflink") else "")
             + ".\n")
    return text


def _cov(c: dict | None) -> str:
    if not c or c["coverage"] is None:
        return "no range" if c else "–"
    return f"{c['coverage']:.0%} ({c['inside']}/{c['with_range']}), {c['median_width']:.2f}"


def _seeds(seed) -> str:
    seeds = seed if isinstance(seed, list) else [seed]
    return " and ".join(str(x) for x in seeds)


def shift_coverage() -> str:
    """docs/placement.md: coverage and median width of the shift estimate's 80 % ranges per mode, policy and
    kind of new workload (bench/shift_coverage.py): before issue 45's estimate, its previous form (the
    floored spread) and the current one (the pivot), each on the committed data sets and on fresh draws made
    after it was chosen."""
    before, prev = _results("shift_coverage_before"), _results("shift_coverage_floored")
    prev_fresh, now = _results("shift_coverage_fresh"), _results("shift_coverage_fresh67")
    now0 = _results("shift_coverage")
    keys = list(dict.fromkeys([*now["summary"], *before["summary"]]))
    lines = [("| inputs | policy | new | before issue 45 | previous (floored spread) | previous, fresh draws "
              f"{_seeds(prev_fresh['data_seed'])} | now (pivot) | now, fresh draws {_seeds(now['data_seed'])} | now, "
              "fresh, per data set |"), "|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        mode, policy, target = key.split(" | ")
        a = now["summary"].get(key)
        per = "; ".join(f"{d} {_cov(v)}" for d, v in (a or {}).get("by_data", {}).items())
        lines.append(f"| {mode} | {policy} | {'dataset' if target == 'dataset' else 'language'} | "
                     f"{_cov(before['summary'].get(key))} | {_cov(prev['summary'].get(key))} | "
                     f"{_cov(prev_fresh['summary'].get(key))} | {_cov(now0['summary'].get(key))} | {_cov(a)} | {per} |")
    rank = []
    for k, v in now["ranking"].items():
        rank.append(f"{k.replace(' | ', ', ')}: estimated sign right in {v['sign_right']} of {v['splits']} splits, "
                    f"range excludes 0 in {v['decisive']} (right in {v['decisive_right']})")

    def how(r: dict) -> str:
        return (", ".join(f"{d} {n} splits" for d, n in r["splits"].items()) +
                f"; load average {r['loadavg_start'][0]:.1f} at the start")

    def sure(r: dict) -> str:
        return "; ".join(f"{k.split(' | ')[1]} {v['coverage']['value']:.0%} [{v['coverage']['interval'][0]:.0%}, "
                         f"{v['coverage']['interval'][1]:.0%}]" for k, v in r["calibration"].items()
                         if k.startswith("tagged") and k.endswith("dataset"))
    every = _results("shift_coverage_all_layers")
    all_cells = "; ".join(f"{k.split(' | ')[1]} {_cov(v)}" for k, v in every["summary"].items()
                          if k.startswith("tagged") and k.endswith("dataset"))
    return ("\n".join(lines) + f"\n\n`python bench/shift_coverage.py` on the committed data sets (now: {how(now0)}; "
            f"previous: {how(prev)}; before: the same bench on the estimate before issue 45, {how(before)}) and with "
            f"`--data-seed` (fresh draws of every construction, each made after the estimate it checks was settled; "
            f"previous: {how(prev_fresh)}; now: {how(now)}). Each cell: the share of realized figures inside their "
            "printed range (nominal 80 %), of the points that had a range, and the ranges' median width. How sure "
            "the fresh coverage figures are (90 % intervals, splits bootstrapped), tagged, a new dataset: now "
            f"{sure(now)}; previous {sure(prev_fresh)}. Moeplace against EPLB on the fresh draws, now: "
            + "; ".join(rank) + ". The synthetic set with every layer in the estimate (`--shift-layers all`: no "
            f"layer sample, the same range before and now; {how(every)}), tagged, a new dataset: {all_cells}.\n")


# ---------------------------------------------------------------------------- calibration (place calibrate)
def _share(x: float) -> str:
    return f"{x * 100:.1f} %"


def fidelity_anchored() -> str:
    """docs/simulate.md: calibrated on the other cases of a published group, each case predicted
    (bench/fidelity_anchored.py, from the group's out-of-bag ensemble members), next to the uncalibrated
    figure from the same start and one ratio per group."""
    r = _results("fidelity_anchored")
    s = r["summary"]
    rows = []
    for part, name in (("end_to_end", "end-to-end"), ("kernel_tables", "kernel tables")):
        for key, label in (("anchored", "calibrated on the rest of its group (place calibrate)"),
                           ("uncalibrated", "uncalibrated (the out-of-bag members it starts from)"),
                           ("one_ratio", "one ratio from the rest of its group"),
                           ("anchored_member", "calibrated, weighted median member alone (the previous rule)")):
            st = s[part].get(key)
            if st and st["cases"]:
                rows.append([name, label, f"{st['cases']} in {st['groups']}", _share(st["median"]), _share(st["max"]),
                             f"{st['worst_case']} ({st['worst_error']:+.0%})"])
    out = _table(["cases", "prediction", "cases in groups", "median abs error", "max", "worst"], rows)
    c = s["coverage"]
    cm = s.get("coverage_member")
    out += (f"\nNominal 80 % within-deployment interval: it held the published figure in {c['coverage']:.0%} of "
            f"{c['cases']} end-to-end cases (median width {c['median_width']:.0%}; each case's interval its own "
            "calibrated members' spread plus the other groups' errors"
            + (f"; the previous rule, the median member's figure and the other groups' errors alone: "
               f"{cm['coverage']:.0%}, width {cm['median_width']:.0%}" if cm else "")
            + f"). Target: median <= {s['target']['median']:.0%}, coverage "
            f"{s['target']['coverage'][0]:.0%}-{s['target']['coverage'][1]:.0%}: "
            + ("met" if s["target_met"] else "not met") + ". Per group (anchored / uncalibrated median):\n\n")
    grows = [[g, str(v["anchored"]["cases"]), _share(v["anchored"]["median"]), _share(v["uncalibrated"]["median"]),
              _share(v["one_ratio"]["median"])] for g, v in s["by_group"].items()]
    return out + _table(["group", "cases", "anchored", "uncalibrated", "one ratio"], grows) + "\n"


def calibrate_example() -> str:
    """docs/simulate.md: calibrated on one published point, the rest of its table predicted
    (bench/fidelity_anchored.py --example)."""
    ex = _results("fidelity_anchored")["example"]
    rows = [[("**" + r["id"] + "** (calibrated on)") if r["anchor"] else r["id"], f"{r['published']:,.1f}",
             f"{r['uncalibrated']:,.1f} ({r['uncalibrated_error']:+.1%})",
             f"{r['calibrated']:,.1f} ({r['calibrated_error']:+.1%})"] for r in ex["rows"]]
    moved = ", ".join(f"`{n}` {v['from']:.4g} -> {v['to']:.4g}" + (" (bound)" if v["bound"] else "")
                      for n, v in ex["moved"].items()) or "nothing"
    how = ""
    if ex.get("members", 1) > 1:
        how = (f"The group's {ex['members']} out-of-bag members were reweighted by the one point (effective sample "
               f"size {ex['ess']:.1f}) and the {ex['refitted']} that kept weight refitted; the predictions are "
               f"their weighted median (one event simulation on their weighted median member, {ex['priced_by']}, "
               "re-priced by every one of them); uncalibrated: every out-of-bag member, as place simulate prices "
               "a run. ")
    return (_table(["case", "published", "uncalibrated", "calibrated on one point"], rows)
            + f"\n{how}What the one point moved in it: {moved}.\n")


def k3_step() -> str:
    """docs/simulate.md: K3's decode step before and after its own kernel list (bench/k3_step.py)."""
    r = _results("k3_step")
    rows = [[x["deployment"], str(x["batch_per_rank"]), f"{x['before']['step_ms']:.1f}", f"{x['after']['step_ms']:.1f}",
             f"{x['after']['step_ms'] / x['before']['step_ms'] - 1:+.0%}", f"{x['before']['kernels']:,.0f}",
             f"{x['after']['kernels']:,.0f}"] for x in r["rows"]]
    out = _table(["deployment", "batch / rank", "step ms before", "after", "change", "kernels before", "after"], rows)
    srows = [[str(x["concurrency"]), f"{x['before']['output_tok_s']:,.0f}", f"{x['after']['output_tok_s']:,.0f}",
              f"{x['after']['output_tok_s'] / x['before']['output_tok_s'] - 1:+.1%}",
              f"{x['before']['tpot_p50_ms']:.1f}", f"{x['after']['tpot_p50_ms']:.1f}"] for x in r.get("serving", [])]
    if srows:
        out += ("\nServing on the README demo's cluster (32 H200, attention TP8, event simulator, ISL 2,048 / OSL 256, "
                "150 simulated s):\n\n" + _table(["concurrency", "output tok/s before", "after", "change",
                                                  "TPOT p50 ms before", "after"], srows))
    return out + "\n"


def memory_fidelity() -> str:
    """docs/simulate.md: the memory plan's KV pool against published engine start-up pools
    (bench/memory_fidelity.py), sized from the device-reported GPU memory and from the marketing figure."""
    r = _results("memory_fidelity")
    bases = r["bases"]
    rows = []
    for c in r["cases"]:
        pub = c["published"]
        row = [c["id"], f"{c['engine']}, {c['gpus']} x {c['gpu']}", f"{pub['kv_tokens']:,}"]
        for b in bases:
            p = c["planned"][b]
            row += [f"{p['kv_tokens']:,}", f"{p['kv_tokens_error']:+.1%}"]
        rows.append(row)
        if "kv_gib" in pub:
            row = ["", "pool GiB", f"{pub['kv_gib']:.2f}"]
            for b in bases:
                p = c["planned"][b]
                row += [f"{p['kv_gib']:.2f}", f"{p['kv_gib_error']:+.1%}"]
            rows.append(row)
    head = ["case", "engine, GPUs", "published"]
    for b in bases:
        head += [f"plan ({'device-reported memory' if b == 'device' else 'marketing memory'})", "error"]
    out = _table(head, rows)
    for b in bases:
        s = r["figures"][b]["kv_tokens"]
        out += (f"\n{'Device-reported' if b == 'device' else 'Marketing'} memory: {s['n']} case(s), median |error| "
                f"{s['median_abs']:.1%}, max {s['max_abs']:.1%}, signed median {s['signed_median']:+.1%}.")
    return out + "\n"


RENDERERS = {"memory-fidelity": memory_fidelity, "shift-coverage": shift_coverage, "pools": pools, "relabel-speed": relabel_speed, "replan-quality": replan_quality,
             "rebalance-summary": rebalance_summary, "rebalance-tables": rebalance_tables,
             "trace-stats": trace_stats, "trace-synth": trace_synth, "import-throughput": import_throughput,
             "capture-overhead": capture_overhead, "time-limit": time_limit, "shift-lodo": shift_lodo,
             "demo-transcript": demo_transcript, "demo-summary": demo_summary, "demo-optimize": demo_optimize,
             "demo-simulate": demo_simulate, "sim-speed": sim_speed, "kernels": kernels,
             "optimize-table": optimize_table, "optimize": optimize, "evaluate-defaults": evaluate_defaults,
             "long-context": long_context, "traffic": traffic, "recommend": recommend, "sweep": sweep,
             "fidelity-constants": fidelity_constants, "fidelity-cases": fidelity_cases, "fidelity-cv": fidelity_cv,
             "fidelity-label": fidelity_label, "fidelity-peers": fidelity_peers, "fidelity-anchored": fidelity_anchored,
             "calibrate-example": calibrate_example, "k3-step": k3_step}


def render(text: str) -> str:
    """``text`` with every figure block re-rendered (an unknown figure name is an error)."""
    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise SystemExit(f"unknown figure '{name}' (known: {', '.join(RENDERERS)})")
        return m.group(1) + RENDERERS[name]() + m.group(4)
    return BLOCK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report figures that differ; change nothing")
    args = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = render(text)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    verb = "differ from bench/results" if args.check else "regenerated"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "figures match bench/results")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
