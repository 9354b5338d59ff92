"""Simulator fidelity against published real-hardware results: the shipped ensemble of constants, its
held-out errors and the coverage of its intervals.

    python bench/fidelity.py [--cases bench/fidelity_cases.yaml] [--quick] [--workers 2] [--breakdown]
    python bench/fidelity.py --peer-only | --summary-only | --measured-only   # on --out's file

The cases (bench/fidelity_cases.yaml, read and checked by bench/fidelity_harness.py) are published kernel
tables (DeepGEMM, DeepEP) and end-to-end deployments (DeepSeek, LMSYS/SGLang, Mooncake, Alibaba RTP-LLM,
NVIDIA TensorRT-LLM, SGLang, vLLM), each with its source, publication date, configuration, figure, every
assumption made and its deployment ``group`` (one table, one build, one blog's sweep). The structure
(formulas, fitted constants and bounds, interval settings) is frozen in bench/fidelity_frozen.yaml with a
date and a publication cut-off.

1. Reference fit: the free constants (harness.FIT) by ``scipy.optimize.least_squares`` on the log-ratio
   simulated / published of every case published before the cut-off (kernel cases on the cost model's
   formulas, end-to-end cases on one steady engine iteration times the factor event simulation / steady
   iteration at the start constants, the CostConfig defaults), rounded to 4 significant digits. A fit that
   moves no constant by more than 1 % of its bounds' range (REFERENCE_TOL) keeps the start as the
   reference. The reference is the CostConfig defaults; the script says when they would change.
2. Reference runs: every end-to-end case by the discrete-event simulator (stat mode, steady state after
   the warm-up) with the reference constants, exactly as ``place simulate`` runs it, its steady iterations
   sampled: step 1's runs when the reference is the start (the committed state: one simulation per case),
   else a second pass, after which the reference is refitted from itself once to say whether a rerun from
   it (committed) would keep it.
3. The ensemble (bench/fidelity_ensemble.py): a group bootstrap of the cases before the cut-off, one fit
   per member (parallel, warm-started at the reference), every case priced by every member (end-to-end:
   its sampled iterations re-priced, as ``place simulate`` prices a run).
4. Held out: each case's out-of-bag median (members that never drew its group) is its grouped
   cross-validation figure; each end-to-end case's 80 % interval is the shipped procedure
   (sim.ensemble.speed_interval) with its group's members and residuals left out: coverage and median width,
   overall and by kind of run.
5. After the cut-off: cases published after it, never used to choose structure nor fitted, priced by the
   whole ensemble with the shipped intervals: scored once, in their own column.
6. TTFT / TPOT only on cases that publish them measured per request (``published_latency``: the source's median,
   or its mean where it prints means, against the same statistic of the simulated requests), each with the
   ensemble median and 80 % interval made as the throughput's (TTFT re-priced over the prompt iterations).
7. The measured cost source (``--cost-model measured``) per end-to-end case, and the peers: aiconfigurator
   0.12 (bench/peer_aiconfigurator.py) and aisimulate 0.13 (bench/peer_aisimulate.py, the same call), each
   joined per case and tallied by independent deployment, and the two releases compared on the cases both
   support (``peer_summary``, its ``aisimulate`` and ``aisimulate.versions``). ``--peer-only`` redoes this
   step alone on an existing results file (the peers run in their own environments, not in this script).
8. Anchored (bench/fidelity_anchored.py's steps on this run's ensemble): every group with at least two
   cases, each case predicted after ``place calibrate``'s reweight + refit on the group's other cases, from
   the members that never drew the group; median, max and the within-deployment interval's coverage,
   printed next to the uncalibrated figures (``anchored``).
Written to bench/results/fidelity.json; a full run writing that file also writes the shipped ensemble
(sim/cost_ensemble.json), the label's summary (sim/fidelity_summary.json), the anchored results
(bench/results/fidelity_anchored.json) and the calibration's summary (sim/anchored_summary.json);
``--ship-dir DIR`` writes those four into DIR instead (compare a run with what is shipped, changing nothing).
The event simulations (steps 1, 2, 7 and 8) and the member fits run in ``--workers`` processes (default
min(2, cores)); the event simulations in spawned ones (polars' thread pool hangs in a forked child), the
figures the same with any number of workers.
``--state`` keeps step 8 with the fitted state (a state saved without it runs it once and keeps it).
``--anchored-only`` joins bench/results/fidelity_anchored.json (bench/fidelity_anchored.py's run on the
shipped ensemble, which is the one a full run of this script wrote) into --out's file and prints it, running
nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and the peer, beside this script
import fidelity_anchored as fa
import fidelity_ensemble as fe
from fidelity_harness import (  # noqa: F401  (names the tests read from this script)
    CASES,
    E2E,
    ENGINES,
    FIT,
    FROZEN,
    METRICS,
    RESULTS,
    ROOT,
    Steady,
    _from_summary,
    after_cutoff,
    after_structure,
    case_engine,
    case_kv_tokens,
    case_setup,
    case_trace,
    fit,
    fmt,
    kernel_metric,
    latency_means,
    load_cases,
    load_frozen,
    measured_metric,
    publication_date,
    published_latency,
    sim_metric,
)
from fidelity_peer import compare_versions, join_peer, load_peer, peer_cell, peer_text, predict_summary

PEER = RESULTS / "peer_aiconfigurator.json"
PEER_AISIMULATE = RESULTS / "peer_aisimulate.json"
SIG = 4  # significant digits of the shipped constants
# a reference fit that moves no constant by more than this share of its bounds' range keeps its start (the
# CostConfig defaults): the fit from its own correction factors is not a contraction to the last digit, so
# an exact rule would move the committed constants (and run a second pass of simulations) on every rerun
REFERENCE_TOL = 0.01


def measured_summary(rows: list[dict]) -> dict:
    """Median and max |error| of the measured cost source over the end-to-end cases it covers, beside the
    ensemble's held-out error on the same cases."""
    cov = [r for r in rows if "simulated" in (r.get("measured") or {}) and r.get("cv_error") is not None]
    if not cov:
        return {"cases": 0}
    m = [abs(r["measured"]["error"]) for r in cov]
    ens = [abs(r["cv_error"]) for r in cov]
    return {"cases": len(cov), "median_abs_error": float(np.median(m)), "max_abs_error": float(np.max(m)),
            "ensemble_median_abs_error": float(np.median(ens)), "ensemble_max_abs_error": float(np.max(ens)),
            "ids": [r["id"] for r in cov]}


def measured_text(ms: dict) -> str:
    if not ms.get("cases"):
        return "measured cost source: no case covered"
    return (f"measured cost source (aiconfigurator tables, --cost-model measured, reference constants elsewhere): "
            f"{ms['cases']} cases covered, median |error| {ms['median_abs_error']:.1%}, max {ms['max_abs_error']:.1%} "
            f"(the ensemble, held out, on the same cases: median {ms['ensemble_median_abs_error']:.1%}, max "
            f"{ms['ensemble_max_abs_error']:.1%})")


def _read_results(path: str | Path) -> dict | None:
    from moeplace.foundation.files import read_json

    res = read_json(path)
    if not isinstance(res, dict) or not isinstance(res.get("cases"), list):
        print(f"error: {path}: field 'cases' missing, expected bench/fidelity.py results", file=sys.stderr)
        return None
    return res


def measured_only(results: str | Path, cases_path: str | Path, quick: bool) -> int:
    """``--measured-only``: add the measured cost source's figure of every case to a results file, with the
    constants it was written with; nothing else is refitted."""
    from moeplace.foundation.files import write_text_atomic
    from moeplace.sim.config import CostConfig

    res = _read_results(results)
    if res is None:
        return 2
    cfg = CostConfig(**res["cost_config"]) if res.get("cost_config") else CostConfig()
    cases = {c["id"]: c for c in load_cases(Path(cases_path))}
    for row in res["cases"]:
        if row["id"] in cases:
            row["measured"] = measured_metric(cases[row["id"]], cfg, quick)
            print_measured(row)
    res["measured_summary"] = measured_summary(res["cases"])
    print(measured_text(res["measured_summary"]))
    write_text_atomic(results, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {results}")
    return 0


def print_measured(row: dict) -> None:
    m = row.get("measured") or {}
    if "simulated" in m:
        print(f"      measured {fmt(m['simulated']):>9s}  {m['error']:+7.1%}  (roofline for "
              f"{', '.join(m['roofline_terms']) or 'nothing'})", flush=True)


def peer_summary_of(rows: list[dict], peer: dict | None, aisim: dict) -> dict | None:
    """Both peers: aiconfigurator 0.12 joined per case (:func:`fidelity_peer.join_peer`) and aisimulate 0.13
    (``aisim``: bench/peer_aisimulate.py's file, see :func:`aisimulate_status`): joined the same way, beside
    its run's own details, the comparison of the two releases on the cases both support
    (:func:`fidelity_peer.compare_versions`) and aisimulate's own ``predict`` on the serving cases
    (:func:`fidelity_peer.predict_summary`); a record saying why when it was not run."""
    ps = join_peer(rows, peer)
    if ps is None:
        ps = {"peer": "aiconfigurator", "version": None, "shared_cases": 0, "note": "peer file absent"}
    if aisim.get("run") and "cases" in aisim:
        joined = join_peer(rows, aisim)
        joined.update({k: aisim[k] for k in ("run", "api", "index", "database_mode") if k in aisim})
        if peer is not None:
            joined["versions"] = compare_versions(rows, peer, aisim)
        joined["predict"] = predict_summary(rows, aisim)
        aisim = joined
    ps["aisimulate"] = aisim
    return ps


def aisimulate_status(path: Path = PEER_AISIMULATE) -> dict:
    """aisimulate 0.13's file (bench/peer_aisimulate.py: its per-case records, ``"run": true``) when it
    exists, else why it was not run."""
    from moeplace.foundation.files import read_json

    if path.exists():
        return read_json(path)
    return {"peer": "aisimulate", "version": None, "run": False,
            "why": (f"not run: {path} is absent (bench/peer_aisimulate.py writes it, in its own environment: see its "
                    "docstring)")}


def peer_only(results: str | Path, peer_path: str | Path, aisimulate_path: str | Path = PEER_AISIMULATE) -> int:
    """``--peer-only``: join the peer files into an existing results file, nothing simulated."""
    from moeplace.foundation.errors import InputError
    from moeplace.foundation.files import write_text_atomic

    res = _read_results(results)
    if res is None:
        return 2
    peer = load_peer(peer_path)
    if peer is None:
        raise InputError(f"{peer_path}: no peer results (run bench/peer_aiconfigurator.py where aiconfigurator is "
                         "installed)")
    res["peer_summary"] = peer_summary_of(res["cases"], peer, aisimulate_status(Path(aisimulate_path)))
    for line in peer_text(res["peer_summary"]):
        print(line)
    write_text_atomic(results, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {results}")
    return 0


# ---------------------------------------------------------------------------- report
def config_text(case: dict) -> str:
    c = case["config"]
    if case["kind"] == "gemm":
        return f"{c['groups']}x{c['m']} rows, N{c['n']} K{c['k']}"
    if case["kind"] in ("deepep_normal", "deepep_ll"):
        return f"EP{c['ep']} {c['tokens']} tok {c['op']}"
    parts = [f"{case['model']} {c['gpus']} GPU", f"TP{c.get('attention_tp', 1)}"]
    if c.get("moe_tp", 1) > 1:
        parts.append(f"TEP{c['moe_tp']}")
    if case["kind"] == "prefill":
        parts.append(f"{c['tokens_per_rank']} tok/GPU ISL {c['isl']}")
    else:
        parts.append(f"bs {c['batch_per_rank']} ISL/OSL {c['isl']}/{c['osl']}")
    if c.get("mtp"):
        d, a = c["mtp"]
        acc = "/".join(f"{x:g}" for x in a) if isinstance(a, (list, tuple)) else f"{a:g}"
        parts.append(f"MTP{d}@{acc}")
    if c.get("dbo"):
        parts.append("TBO")
    return ", ".join(parts)


def breakdown_text(b: dict) -> str:
    """One line of :meth:`Steady.breakdown` (microseconds per MoE layer unless marked)."""
    parts = [f"{b['mode']}{' TBO' if b['dbo'] else ''}{' graph' if b['graph'] else ''}",
             f"busiest/mean {b['busiest_over_mean_selections']:.2f}x",
             f"attn+trunk {b['attention_trunk_us']:.0f}",
             f"experts {b['experts_busiest_us']:.0f} (mean {b['experts_mean_us']:.0f})"]
    for op in ("dispatch", "combine"):
        if f"{op}_slowest_us" in b:
            parts.append(f"{op} {b[f'{op}_slowest_us']:.0f} (mean {b[f'{op}_mean_us']:.0f})")
    if "overlap_compute_us" in b:
        parts.append(f"overlap compute {b['overlap_compute_us']:.0f} / comm {b['overlap_comm_us']:.0f}")
    parts.append(f"layer {b['layer_us']:.0f} + gaps {b['kernel_gaps_us']:.0f} us")
    parts.append(f"iteration {b['iteration_ms']:.1f} ms (overheads {b['overhead_ms']:.1f}, drafting "
                 f"{b['drafting_ms']:.1f})")
    return "; ".join(parts)


def markdown(rows: list[dict]) -> str:
    """The table docs/simulate.md shows (one row per case)."""
    head = ("| case | source | published on | configuration | metric | published | ensemble (held out) | error | "
            "80 % interval | aiconfigurator | aisimulate |")
    lines = [head, "|---|---|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        iv = r.get("interval")
        cell = f"{fmt(iv[0])} - {fmt(iv[1])}" if iv else ""
        lines.append(f"| {r['id']} | [{r['source']['org']}]({r['source']['url']}) | {r['published_on']} | "
                     f"{r['gpu']}, {r['config']} | {r['metric']} | {fmt(r['published'])} | {fmt(r['cv_simulated'])} | "
                     f"{r['cv_error']:+.1%} | {cell} | {peer_cell(r)} | {peer_cell(r, 'aisimulate')} |")
    return "\n".join(lines)


def summary_target(out: str | Path, quick: bool) -> Path | None:
    """Where a run's label summary goes: the package's committed one (sim/fidelity_summary.json) when the
    run writes the committed results file and is a full run; None otherwise (a --quick smoke run, or
    results written elsewhere, leave the committed summary and ensemble as they are)."""
    from moeplace.sim.fidelity import SUMMARY_PATH

    if quick or Path(out).resolve() != (RESULTS / "fidelity.json").resolve():
        return None
    return SUMMARY_PATH


def shipped_paths(args) -> dict[str, Path] | None:
    """Where a full run writes what the package ships besides --out: the ensemble (sim/cost_ensemble.json),
    the label's summary (sim/fidelity_summary.json), the anchored results (bench/results/fidelity_anchored.json)
    and the calibration's summary (sim/anchored_summary.json). Those committed files when the run writes the
    committed results file; into ``--ship-dir`` (same names) when given, to compare a run with what is
    shipped without changing it; else nowhere (None; also for --quick)."""
    from moeplace.sim.calibrate import ANCHORED_PATH
    from moeplace.sim.ensemble import ENSEMBLE_PATH

    target = summary_target(args.out, args.quick)
    paths = {"ensemble": ENSEMBLE_PATH, "summary": target, "anchored": fa.OUT, "anchored_summary": ANCHORED_PATH}
    if args.quick or (args.ship_dir is None and target is None):
        return None
    if args.ship_dir is not None:
        from moeplace.sim.fidelity import SUMMARY_PATH

        paths["summary"] = SUMMARY_PATH
        Path(args.ship_dir).mkdir(parents=True, exist_ok=True)
        return {k: Path(args.ship_dir) / p.name for k, p in paths.items()}
    return paths


def write_summary(res: dict, path: Path) -> None:
    from moeplace.foundation.files import write_text_atomic
    from moeplace.sim.fidelity import fidelity_note, summarize_results

    s = summarize_results(res)
    write_text_atomic(path, json.dumps(s, indent=1) + "\n")
    print(f"wrote {path}: {fidelity_note(s)}")


def summary_only(results: str | Path) -> int:
    """``--summary-only``: the committed summary from a results file of a full run, nothing simulated."""
    res = _read_results(results)
    if res is None:
        return 2
    if res.get("quick"):
        print(f"error: {results}: a --quick run's results; the summary comes from a full run", file=sys.stderr)
        return 2
    target = summary_target(results, False)
    if target is None:
        print(f"error: {results}: the summary is written from {RESULTS / 'fidelity.json'} only", file=sys.stderr)
        return 2
    write_summary(res, target)
    return 0


def anchored_only(results: str | Path, anchored: str | Path) -> int:
    """``--anchored-only``: bench/fidelity_anchored.py's results (a full run, on the shipped ensemble) as
    the results file's ``anchored`` block, printed; nothing simulated."""
    from moeplace.foundation.files import read_json, write_text_atomic

    res = _read_results(results)
    if res is None:
        return 2
    an = read_json(anchored)
    if not isinstance(an, dict) or "summary" not in an or "rows" not in an:
        print(f"error: {anchored}: no anchored results (expected bench/fidelity_anchored.py's output)", file=sys.stderr)
        return 2
    if an.get("quick") or an.get("groups_only"):
        print(f"error: {anchored}: a --quick or --groups run's results; the anchored block comes from a full run",
              file=sys.stderr)
        return 2
    src = Path(anchored).resolve()
    res["anchored"] = {**an, "from": str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else src.name}
    print(err_line("end-to-end, uncalibrated", res["cv"]["all"]) + "  (grouped cross-validation, out of bag)")
    for line in fa.text(an["summary"]):
        print(line)
    write_text_atomic(results, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {results} (anchored block from {anchored})")
    return 0


def drift(a, b) -> dict[str, list[float]]:
    """The fitted constants of ``b`` that differ from ``a``'s by more than :data:`REFERENCE_TOL` of their
    bounds' range: ``{name: [a, b]}``."""
    return {n: [getattr(a, n), getattr(b, n)] for n, lo, hi in FIT
            if abs(getattr(b, n) - getattr(a, n)) > REFERENCE_TOL * (hi - lo)}


def rounded(cfg, names) -> object:
    """``cfg`` with the fitted constants at :data:`SIG` significant digits (the shipped values)."""
    return cfg.replace(**{n: float(f"{getattr(cfg, n):.{SIG}g}") for n in names})


def coverage_text(cov: dict, what: str) -> list[str]:
    out = []
    for k, v in cov.items():
        if not v["cases"]:
            out.append(f"  {what} {k:8s}:  0 cases")
            continue
        out.append(f"  {what} {k:8s}: {v['cases']:2d} cases in {v['groups']:2d} groups: 80 % interval covers "
                   f"{v['covered']}/{v['cases']} = {v['coverage']:.1%} (5-95 % over resamples of the groups: "
                   f"{v['coverage_range'][0]:.0%}-{v['coverage_range'][1]:.0%}; each group weighed alike: "
                   f"{v['group_coverage']:.0%}), median width {v['median_width']:.0%} of the "
                   f"figure, median nearness {v['median_near']:.2f} groups")
    missed = fe.coverage_misses(cov)
    out.append(f"  {what} coverage target (70-90 %, overall and by kind of run): "
               + (f"NOT MET ({', '.join(missed)})" if missed else "met"))
    return out


def date_column(ids: set, cv_pairs: list, iv_pairs: list, rows: list[dict]) -> dict:
    """One column of cases picked by publication date (``ids``): their count, held-out errors, the interval's
    coverage and how many were simulated slower than published (sim.fidelity.too_slow)."""
    from moeplace.sim.fidelity import too_slow

    return {"cases": len(ids), "ids": [r["id"] for r in rows if r["id"] in ids],
            "errors": fe.error_stats([(c, e) for c, e, _ in cv_pairs if c["id"] in ids]),
            "coverage": fe.coverage_stats([(c, iv) for c, iv, _ in iv_pairs if c["id"] in ids])["all"],
            "too_slow": sum(too_slow(r) for r in rows if r["id"] in ids)}


def date_column_text(col: dict) -> str:
    return f"{col['cases']} cases" + ("" if not col["cases"] else (
        ": " + err_line("", col["errors"]).strip() + f"; interval covers {col['coverage'].get('covered', 0)}/"
        f"{col['coverage']['cases']}; {col['too_slow']} simulated slower than published"))


def err_line(name: str, s: dict) -> str:
    if not s["cases"]:
        return f"  {name:26s}  0 cases"
    return (f"  {name:26s} {s['cases']:2d} cases in {s['groups']:2d} groups: median |error| {s['median']:6.1%}, "
            f"max {s['max']:6.1%} (worst {s['worst_case']} {s['worst_error']:+.1%})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--quick", action="store_true", help="shorter simulations, fewer members (smoke test)")
    ap.add_argument("--out", default=str(RESULTS / "fidelity.json"))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes for the event simulations and the member fits (default min(2, cores))")
    ap.add_argument("--ship-dir", default=None,
                    help="write the files a full run ships (sim/cost_ensemble.json, sim/fidelity_summary.json, "
                         "sim/anchored_summary.json, bench/results/fidelity_anchored.json) into this folder, "
                         "same names, instead of the package's (a run to compare with them, changing nothing)")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each end-to-end case's steady-iteration breakdown (every run stores it)")
    ap.add_argument("--summary-only", action="store_true",
                    help="only rewrite sim/fidelity_summary.json from the results file (--out), running nothing")
    ap.add_argument("--peer", default=str(PEER),
                    help="aiconfigurator's estimates (bench/peer_aiconfigurator.py); left out when absent")
    ap.add_argument("--peer-aisimulate", default=str(PEER_AISIMULATE),
                    help="aisimulate 0.13's estimates (bench/peer_aisimulate.py); the summary says so when absent")
    ap.add_argument("--peer-only", action="store_true",
                    help="only join --peer and --peer-aisimulate into the results file (--out), running nothing")
    ap.add_argument("--state", default=None,
                    help="save the fitted state (reference runs, members, every case's figure per member) to this "
                         "file, or when it exists report from it without simulating or fitting")
    ap.add_argument("--anchored-only", action="store_true",
                    help="only join the anchored results (bench/fidelity_anchored.py's file, --anchored) into the "
                         "results file (--out) and print them, running nothing")
    ap.add_argument("--anchored", default=str(fa.OUT),
                    help="bench/fidelity_anchored.py's results, for --anchored-only")
    ap.add_argument("--measured-only", action="store_true",
                    help="only add the measured cost source's figures (--cost-model measured) to the results file "
                         "(--out), with its constants; nothing refitted")
    args = ap.parse_args()
    from moeplace.foundation.errors import MoeplaceError

    steps = [(args.measured_only, lambda: measured_only(args.out, args.cases, args.quick)),
             (args.summary_only, lambda: summary_only(args.out)),
             (args.peer_only, lambda: peer_only(args.out, args.peer, args.peer_aisimulate)),
             (args.anchored_only, lambda: anchored_only(args.out, args.anchored))]
    step = next((run for chosen, run in steps if chosen), None)
    try:
        return step() if step is not None else run(args)
    except MoeplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


class Clock:
    """Wall and CPU seconds of each step (CPU: this process and its worker processes, counted once they have
    ended; every pool here ends with its step) and the load average when the run started."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.t0, self.c0 = time.perf_counter(), self.cpu_now()
        self.load = os.getloadavg()

    @staticmethod
    def cpu_now() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @contextlib.contextmanager
    def step(self, name: str):
        w, c = time.perf_counter(), self.cpu_now()
        yield
        self.wall[name] = time.perf_counter() - w
        self.cpu[name] = self.cpu_now() - c

    def skip(self, name: str) -> None:
        self.wall[name] = self.cpu[name] = 0.0

    def totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """(wall, CPU) seconds by step, with the whole run's as ``total``."""
        return ({**self.wall, "total": time.perf_counter() - self.t0},
                {**self.cpu, "total": self.cpu_now() - self.c0})


_G: dict = {}  # what the worker processes read (set before each fork; a spawned worker's by _set)


def _set(state: dict) -> None:
    _G.update(state)


def _reference_run(c: dict):
    return fe.reference_run(c, _G["cfg"], _G["quick"])


def _speeds(c: dict) -> dict:
    return fe.member_speeds(c, _G["runs"].get(c["id"]), _G["configs"], _G["cfg"])


def _measured(c: dict) -> dict:
    return measured_metric(c, _G["cfg"], _G["quick"])


def _anchored_group(task: tuple) -> list[dict]:
    cases, members, quick, reference, runs = task
    return fa.anchored_group(cases, members, quick, reference=reference, runs=runs)


def compute(args, cases, before, e2e, frozen, names, B, groups, clock: Clock) -> tuple[dict, dict]:
    """Steps 1-3: the reference fit, the reference runs, the members and every case's figure under every
    member (what ``--state`` saves), and the steady evaluators (:class:`Steady`, by case id)."""
    from moeplace.sim.config import CostConfig

    # 1. the end-to-end cases simulated at the start constants (the CostConfig defaults), iterations sampled:
    # the fit's correction factors, and the reference runs themselves when the fit lands on the start
    start = CostConfig()
    pre_e2e = [c for c in e2e if not after_cutoff(c, frozen)]
    with clock.step("steady_evaluators"):  # the routing traces synthesized, the placements, the steady batches
        steady = {c["id"]: Steady(c, args.quick) for c in e2e}
        for c in pre_e2e:  # the steady batches, built once here (before the workers fork)
            steady[c["id"]].metric(start)
    print("event simulation of the end-to-end cases at the start constants (the CostConfig defaults) ...", flush=True)
    with clock.step("start_runs"):  # in spawned workers (polars' pool, started here, hangs in a forked child)
        runs = dict(zip([c["id"] for c in e2e], fe.spawn_map(_reference_run, e2e, args.workers, _set,
                                                             {"cfg": start, "quick": args.quick})))
    walls = [runs[c["id"]].detail["wall_s"] for c in e2e]  # the later passes hand out the longest runs first
    corr = {c["id"]: runs[c["id"]].simulated / steady[c["id"]].metric(start) for c in pre_e2e}
    print(f"reference fit on the {len(before)} cases before the cut-off ...", flush=True)
    with clock.step("reference_fit"):
        fitted, ref_info = fit(before, args.quick, start=start, steady=steady, correction=corr)
    fitted = rounded(fitted, names)
    print(f"  rms log error {ref_info['residual_rms_log']:.3f} after {ref_info['nfev']} evaluations "
          f"({ref_info['seconds']:.0f} s)")
    for n in names:
        v, d = getattr(fitted, n), getattr(start, n)
        print(f"  {n:22s} {v:.4g}" + ("" if math.isclose(v, d, rel_tol=1e-9) else f"   (CostConfig default {d:.4g})"))
    moved = drift(start, fitted)
    ref_info["moved_from_start"] = moved

    # 2. reference runs, sampled: those of step 1 when the refit stays at the start (within REFERENCE_TOL of
    # every bound range: the reference is then the start, and a rerun from committed defaults simulates
    # once), else again with the refitted constants
    if not moved:
        print(f"reference: the start (the refit moves no constant by more than {REFERENCE_TOL:.0%} of its bounds' "
              "range); reference runs: the start's")
        ref_cfg = run_cfg = start  # the constants the reference runs were simulated with
        clock.skip("reference_runs")
    else:
        ref_cfg = fitted
        print("reference runs (event simulation with the reference constants, iterations sampled; the refit moved "
              + ", ".join(f"{n} {a:.4g} -> {b:.4g}" for n, (a, b) in moved.items()) + ") ...", flush=True)
        with clock.step("reference_runs"):
            runs = dict(zip([c["id"] for c in e2e], fe.spawn_map(_reference_run, e2e, args.workers, _set,
                                                                 {"cfg": ref_cfg, "quick": args.quick}, walls)))
        run_cfg = ref_cfg
        for c in pre_e2e:
            corr[c["id"]] = runs[c["id"]].simulated / steady[c["id"]].metric(ref_cfg)
        # would the reference, committed as the defaults, be kept by a rerun? Refitted from itself with its own
        # runs' factors (one step of the fixed-point iteration; reported, not iterated: each step costs a pass)
        with clock.step("fixed_point_check"):
            again, again_info = fit(before, args.quick, start=ref_cfg, steady=steady, correction=corr)
        again_moved = drift(ref_cfg, rounded(again, names))
        ref_info["refit_from_reference"] = {"stays": not again_moved, "moved": again_moved,
                                            "residual_rms_log": again_info["residual_rms_log"]}
        print("  refitted from the reference with its own runs' factors: " + (
            f"stays within {REFERENCE_TOL:.0%} of every bound range (committed as the CostConfig defaults, a rerun "
            "keeps them and simulates once)" if not again_moved else
            "moves again (committed as the defaults, a rerun would move them and simulate twice): "
            + ", ".join(f"{n} {a:.4g} -> {b:.4g}" for n, (a, b) in again_moved.items())), flush=True)

    # 3. the ensemble
    ez = frozen["ensemble"]
    bags = fe.bootstrap_bags(groups, B, int(ez["seed"]))
    print(f"ensemble: {B} members, each a group bootstrap of the {len(groups)} groups before the cut-off, fitted "
          f"in {args.workers} process(es) from the reference ...", flush=True)
    with clock.step("member_fits"):
        params, cost = fe.fit_members(before, groups, bags, ref_cfg, steady, corr, args.quick, args.workers)
    params = np.array([[float(f"{v:.{SIG}g}") for v in row] for row in params])
    print(f"  {B} fits in {cost['seconds']:.0f} s wall ({cost['workers']} processes; median "
          f"{np.median(cost['fit_seconds']):.1f} s and {np.median(cost['evaluations']):.0f} evaluations per fit)")
    configs = fe.member_configs(params, ref_cfg)
    _G.update(runs=runs, configs=configs, cfg=run_cfg)
    with clock.step("repricing"):
        speeds = dict(zip([c["id"] for c in cases], fe.parallel_map(_speeds, cases, args.workers)))
    return {"runs": runs, "speeds": speeds, "params": params, "bags": bags, "ref_cfg": ref_cfg,
            "ref_info": ref_info, "cost": cost, "secs": dict(clock.wall), "cpu": dict(clock.cpu)}, steady


def run(args) -> int:
    from moeplace.foundation.files import write_text_atomic
    from moeplace.sim import ensemble as ens_mod
    from moeplace.sim.config import CostConfig

    clock = Clock()
    frozen = load_frozen()
    cases = load_cases(Path(args.cases))
    peer = load_peer(args.peer)
    names = [n for n, _, _ in FIT]
    before = [c for c in cases if not after_cutoff(c, frozen)]
    after = [c for c in cases if after_cutoff(c, frozen)]
    e2e = [c for c in cases if c["kind"] in E2E]
    print(f"{len(cases)} cases ({len(e2e)} end-to-end) from {len({c['source']['org'] for c in cases})} source "
          f"organisations; structure frozen on {frozen['frozen_on']} (bench/fidelity_frozen.yaml), cut-off "
          f"{frozen['cutoff']}: {len(before)} cases on or before it, {len(after)} after")

    ez = frozen["ensemble"]
    B = 16 if args.quick else int(ez["members"])
    groups = list(dict.fromkeys(c["group"] for c in before))
    if args.state and Path(args.state).exists():
        import pickle

        with open(args.state, "rb") as f:
            st = pickle.load(f)
        print(f"fitted state read from {args.state} (nothing simulated or fitted)")
        steady = {c["id"]: Steady(c, args.quick) for c in e2e}
    else:
        st, steady = compute(args, cases, before, e2e, frozen, names, B, groups, clock)
        if args.state:
            import pickle

            with open(args.state, "wb") as f:
                pickle.dump(st, f)
    runs, speeds, params, bags, ref_cfg, ref_info, cost = (st[k] for k in (
        "runs", "speeds", "params", "bags", "ref_cfg", "ref_info", "cost"))
    clock.wall.update(st["secs"])
    clock.cpu.update(st.get("cpu", {}))
    features = {cid: r.features for cid, r in runs.items()}

    # 4. held out
    it = frozen["interval"]
    scales, level, prior = dict(it["scales"]), float(it["level"]), float(it["prior_groups"])
    recs, residuals = fe.held_out(before, speeds, features, groups, bags, scales, level, prior)
    by_id = dict(zip([c["id"] for c in before], recs))
    ens = fe.interval_ensemble(groups, bags, residuals, scales, level, prior, params,
                               {n: getattr(ref_cfg, n) for n in names})
    rows, cv_pairs, iv_pairs = [], [], []
    for c in cases:
        run_c = runs.get(c["id"])
        pub_speed = fe.speed(c, c["published"])
        row = {"id": c["id"], "group": c["group"], "kind": c["kind"], "regime": c["regime"], "split": c["split"],
               "source": c["source"], "published_on": str(c["published_on"]), "after_cutoff": after_cutoff(c, frozen),
               "gpu": c["gpu"], "model": c.get("model"), "engine": case_engine(c), "config": config_text(c),
               "config_full": c["config"], "metric": c["metric"], "published": c["published"],
               **({"published_latency": c["published_latency"]} if c.get("published_latency") else {}),
               "assumptions": c["assumptions"]}
        if run_c is not None:
            row["simulated"] = run_c.simulated
            row["error"] = run_c.simulated / c["published"] - 1
            row["detail"] = run_c.detail
            row["features"] = run_c.features
            row["breakdown"] = steady[c["id"]].breakdown(ref_cfg)
        else:
            row["simulated"] = kernel_metric(c, ref_cfg)
            row["error"] = row["simulated"] / c["published"] - 1
        z = speeds[c["id"]]["figure"]
        if c["id"] in by_id:  # before the cut-off: held out = out of bag
            rec = by_id[c["id"]]
            held = rec["oob_log_speed"]
            iv = rec.get("interval")
        else:  # after the cut-off: no member saw it; the shipped interval
            held = ens_mod.weighted_quantile(z, np.ones(len(z)), 0.5)
            iv = ens_mod.speed_interval(ens, z, features[c["id"]]) if c["kind"] in E2E else None
        row["cv_simulated"] = fe._figure(c, held)
        row["cv_error"] = row["cv_simulated"] / c["published"] - 1
        row["members"] = {"p10": fe._figure(c, float(np.quantile(z, 0.1))),
                          "p90": fe._figure(c, float(np.quantile(z, 0.9)))}
        if iv is not None:
            lo, hi = sorted((fe._figure(c, iv.lo), fe._figure(c, iv.hi)))
            row["interval"] = [lo, hi]
            row["near"] = iv.near
            row["covered"] = bool(iv.lo <= math.log(pub_speed) <= iv.hi)
            iv_pairs.append((c, iv, row["after_cutoff"]))
        cv_pairs.append((c, row["cv_error"], row["after_cutoff"]))
        join_peer([row], peer)
        rows.append(row)
        cell = peer_cell(row)
        ivs = f"  [{fmt(row['interval'][0])} - {fmt(row['interval'][1])}]{'' if row['covered'] else ' MISSED'}" \
            if "interval" in row else ""
        print(f"  {'after' if row['after_cutoff'] else 'held '} {c['id']:38s} {c['metric']:22s} published "
              f"{fmt(c['published']):>9s}  ensemble {fmt(row['cv_simulated']):>9s} {row['cv_error']:+7.1%}{ivs}"
              + (f"  aiconfigurator {cell}" if cell else ""), flush=True)
        if args.breakdown and row.get("breakdown"):
            print("      " + breakdown_text(row["breakdown"]), flush=True)

    # 5. the summaries
    pre_e2e = [(c, e) for c, e, a in cv_pairs if not a and c["kind"] in E2E]
    cv = {"basis": "each case predicted by the members that never drew its group (out of bag)",
          "all": fe.error_stats(pre_e2e),
          "by_kind": {k: fe.error_stats([(c, e) for c, e in pre_e2e if c["kind"] == k]) for k in fe.KINDS_OF_RUN},
          "kernel_tables": fe.error_stats([(c, e) for c, e, a in cv_pairs if not a and c["kind"] not in E2E])}
    coverage = fe.coverage_stats([(c, iv) for c, iv, a in iv_pairs if not a])
    width = {k: v.get("median_width") for k, v in coverage.items()}
    after_ids = {c["id"] for c, _, a in cv_pairs if a}
    after_summary = {"cutoff": str(frozen["cutoff"]), **date_column(after_ids, cv_pairs, iv_pairs, rows),
                     "note": ("published after the cut-off, never used to choose structure nor fitted: each priced by "
                              "the whole ensemble with the shipped interval, scored once")}
    # the fitted cases published after the structure's own choices (a refit moved the cut-off past them):
    # held out by group like every fitted case, and never used to choose the structure
    late_ids = {c["id"] for c, _ in pre_e2e if after_structure(c, frozen)}
    structure_summary = None if frozen.get("structure_cutoff") is None else {
        "structure_cutoff": str(frozen["structure_cutoff"]), **date_column(late_ids, cv_pairs, iv_pairs, rows),
        "note": ("fitted cases published after the newest case the structure was chosen on: each predicted by the "
                 "members that never drew its group, with its group's residuals left out of its interval")}
    # 8. anchored: place calibrate's leave-one-out within each group, from its out-of-bag members
    if st.get("anchored") is None:
        print("anchored (each case of a group with >= 2 predicted after place calibrate on the rest of it, from the "
              "members that never drew the group):", flush=True)
        wall = {cid: r.detail["wall_s"] for cid, r in runs.items()}  # longest groups first (orders the work only)

        def map_groups(todo):
            return fe.spawn_map(_anchored_group, todo, args.workers, _set, {},
                                [sum(wall.get(c["id"], 0.0) for c in t[0]) for t in todo])
        # an uncalibrated figure's event simulation is the case's reference run where the ensemble's reference is
        # this run's (the same deterministic run, so the same rows): handed over rather than simulated again
        same = ens.reference_config() == ref_cfg
        with clock.step("anchored"):
            st["anchored"] = fa.anchored_all(cases, ens, args.quick, None if args.quick else fa.EXAMPLE,
                                             source="this run's ensemble", report=False, map_groups=map_groups,
                                             runs=runs if same else None)
        if args.state:  # kept with the fitted state: a re-report prints it without recomputing
            import pickle

            with open(args.state, "wb") as f:
                pickle.dump(st, f)
    anchored = st["anchored"]
    findings = fe.bound_findings(params)
    latency = latency_checks(cases, runs, speeds, ens, features, frozen)
    walls = [runs[c["id"]].detail["wall_s"] for c in e2e]  # longest first (orders the work only)
    with clock.step("measured_runs"):
        for row, m in zip([r for r in rows if r["kind"] in E2E],
                          fe.spawn_map(_measured, e2e, args.workers, _set, {"cfg": ref_cfg, "quick": args.quick},
                                       walls)):
            row["measured"] = m
    measured = measured_summary(rows)
    peer_summary = peer_summary_of(rows, peer, aisimulate_status(Path(args.peer_aisimulate)))
    secs, cpu = clock.totals()

    # 6. print
    print(f"grouped cross-validation of the ensemble (out of bag: each case by the members that never drew its "
          f"group; {B} members):")
    print(err_line("end-to-end, all", cv["all"]))
    for k, v in cv["by_kind"].items():
        print(err_line(f"  {k}", v))
    print(err_line("kernel tables", cv["kernel_tables"]))
    for line in fa.text(anchored["summary"]):
        print(line)
    print("80 % intervals, grouped cross-validation (each case's group left out: its members and its residuals):")
    for line in coverage_text(coverage, "held out"):
        print(line)
    if structure_summary is not None:
        print(f"fitted, published after the structure's cases ({structure_summary['structure_cutoff']}; never used to "
              f"choose it), held out by group: {date_column_text(structure_summary)}")
    print(f"after the cut-off ({frozen['cutoff']}): {date_column_text(after_summary)}")
    for line in latency_text(latency):
        print(line)
    print("constants across the members (10th-90th percentile; on a bound = within 1 % of its range):")
    for f in findings:
        flag = "  <- pushed against a bound in most members (a finding, not a value)" if f["pushed"] else ""
        print(f"  {f['name']:22s} {f['p10']:.4g} - {f['p90']:.4g} (bounds {f['bounds'][0]:.4g} - {f['bounds'][1]:.4g}; "
              f"{f['at_lower']} at the lower, {f['at_upper']} at the upper of {f['members']}){flag}")
    print(measured_text(measured))
    for line in peer_text(peer_summary):
        print(line)
    print(f"cost: {secs['total']:.0f} s wall, {cpu['total']:.0f} CPU s in {args.workers} worker process(es) (load "
          f"average {clock.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} now; by step, wall / CPU: "
          + ", ".join(f"{k} {v:.0f} / {cpu.get(k, float('nan')):.0f} s" for k, v in secs.items() if k != "total") + ")")

    reference = {n: getattr(ref_cfg, n) for n in names}
    out = {"frozen": {"frozen_on": str(frozen["frozen_on"]), "cutoff": str(frozen["cutoff"]),
                      **({"structure_cutoff": str(frozen["structure_cutoff"])}
                         if frozen.get("structure_cutoff") is not None else {}),
                      "code_commit": frozen.get("code_commit")},
           "cases": rows, "cv": cv, "coverage": coverage, "width": width, "after_cutoff": after_summary,
           **({"after_structure": structure_summary} if structure_summary is not None else {}),
           "latency": latency,
           "ensemble": {"members": B, "groups": groups, "seed": int(ez["seed"]), "reference": reference,
                        "reference_fit": {k: ref_info[k] for k in ("residual_rms_log", "nfev", "seconds", "moved_from_start",
                                                                  "refit_from_reference") if k in ref_info},
                        "bounds": findings, "cost": {**{k: v for k, v in cost.items()}, "seconds_by_step": secs,
                                 "cpu_seconds_by_step": cpu, "run_workers": args.workers,
                                 "load_average": [clock.load[0], os.getloadavg()[0]]},
                        "level": level, "scales": scales, "prior_groups": prior,
                        "sample_iterations": ens_mod.SAMPLE_ITERATIONS},
           "measured_summary": measured, "peer_summary": peer_summary, "anchored": anchored,
           "cost_config": dataclasses.asdict(ref_cfg), "quick": args.quick,
           "note": "end-to-end cases: discrete-event simulation, stat mode, steady state after the warm-up, re-priced "
                   "per member over a sample of its steady iterations; kernel cases: the cost model's formulas"}
    write_text_atomic(args.out, json.dumps(out, indent=1, default=float) + "\n")
    shipped = shipped_paths(args)
    if shipped is not None:
        doc = ens_mod.ensemble_doc(
            names, reference, params, np.full(B, 1.0 / B), groups, bags, residuals, scales, level,
            {"made": f"bench/fidelity.py on {time.strftime('%Y-%m-%d')}",
             "frozen_on": str(frozen["frozen_on"]), "cutoff": str(frozen["cutoff"]),
             "method": (f"group bootstrap: {B} members, each {len(groups)} draws with replacement from the "
                        f"{len(groups)} case groups published on or before the cut-off, one least-squares fit per "
                        "member started from the reference fit"),
             "cases": len(before), "seed": int(ez["seed"]),
             "residuals": "log(published / out-of-bag median) of each end-to-end case, speed-like",
             "coverage": coverage["all"].get("coverage"), "median_width": coverage["all"].get("median_width")},
            prior)
        write_text_atomic(shipped["ensemble"], json.dumps(doc, indent=1) + "\n")
        print(f"wrote {shipped['ensemble']}")
        write_summary(out, shipped["summary"])
        write_text_atomic(shipped["anchored"], json.dumps(anchored, indent=1, default=float) + "\n")
        write_text_atomic(shipped["anchored_summary"], json.dumps(fa.package_summary(anchored), indent=1) + "\n")
        print(f"wrote {shipped['anchored']} and {shipped['anchored_summary']}")
    changed = {n: v for n, v in reference.items() if not math.isclose(getattr(CostConfig(), n), v, rel_tol=1e-9)}
    if changed:  # said by every run, whatever it wrote: the shipped constants would change
        print("note: the reference differs from the CostConfig defaults (sim/config.py): "
              + ", ".join(f"{n} {getattr(CostConfig(), n):.4g} -> {v:.4g}" for n, v in changed.items())
              + "; shipping this run means setting them to " + ", ".join(f"{n}={v!r}" for n, v in reference.items()))
    if args.markdown:
        print(markdown(rows))
    print(f"wrote {args.out}")
    return 0


def latency_checks(cases, runs, speeds, ens, features, frozen) -> dict:
    """TTFT and TPOT on the cases that publish them measured per request (``published_latency``), each the
    same way (:func:`latency_record`): the ensemble's held-out median (out of bag, or every member after the
    cut-off) with its 80 % interval. A TPOT is re-priced per member over the decode-weighted sampled
    iterations, a TTFT over the sampled iterations that compute prompt tokens (fidelity_ensemble.ttft_ratio).
    Every other case's TTFT / TPOT is not checked."""
    tpot, ttft = [], []
    for c in cases:
        lat = c.get("published_latency")
        if not lat or c["id"] not in runs:
            continue
        run_c = runs[c["id"]]
        a = after_cutoff(c, frozen)
        pub = published_latency(c, "tpot")
        if pub and "tpot" in speeds[c["id"]]:
            tpot.append({**latency_record(c, pub[0], speeds[c["id"]]["tpot"], ens, features[c["id"]], a),
                         "statistic": pub[1]})
        pub = published_latency(c, "ttft")
        if pub:
            ttft_s = run_c.detail.get(f"ttft_{pub[1]}_s")
            z = speeds[c["id"]].get("ttft")
            if ttft_s is not None and z is not None:
                rec = latency_record(c, pub[0], z, ens, features[c["id"]], a)
                rec["reference_ms"] = 1e3 * ttft_s
                rec["prefill_iterations"] = fe.prefill_iterations(run_c)
            else:  # the run finished no request's first token in its window (or a state saved without TTFT speeds)
                rec = {"id": c["id"], "group": c["group"], "published_ms": pub[0],
                       "simulated_ms": None if ttft_s is None else 1e3 * ttft_s, "after_cutoff": a}
                rec["error"] = None if ttft_s is None else rec["simulated_ms"] / pub[0] - 1
            rec["statistic"] = pub[1]
            rec["comparable"] = bool(lat.get("ttft_comparable", True)) and rec["simulated_ms"] is not None
            if not rec["comparable"]:
                rec["why"] = lat.get("why") or "the run finished no request's first token in its window"
            ttft.append(rec)
    return {"tpot": {**latency_stats(tpot), "cases": tpot}, "ttft": {**latency_stats(ttft), "cases": ttft},
            "basis": "TPOT / TTFT printed by the source's benchmark (bench_serving / vllm bench serve / "
                     "InferenceX), measured per request, not derived from its throughput: its median, or its mean "
                     "where the source prints means (InferenceX's tables), against the same statistic of the "
                     "simulated requests",
            "unchecked": ("TPOT and TTFT of every other case (their sources print no per-request latency; a TPOT "
                          "derived from a published throughput is the throughput re-expressed); TTFT of every case "
                          "after the cut-off that prints none; a TTFT's queueing is the reference run's schedule, "
                          "re-priced by each member's prompt-iteration time (not re-simulated)")}


def latency_record(c: dict, published_ms: float, z, ens, x: dict, after: bool) -> dict:
    """One per-request latency figure (TPOT or TTFT) of a case against its published one: ``z`` ``[B]`` is
    each member's log speed of it (minus its log time); before the cut-off the members that never drew the
    case's group give the median and the interval leaves the group out (grouped cross-validation), after it
    every member and the shipped interval (sim.ensemble.speed_interval, as the case's throughput)."""
    from moeplace.sim import ensemble as ens_mod

    z = np.asarray(z, dtype=np.float64)
    gi = {g: i for i, g in enumerate(ens.groups)}
    mask = np.ones(len(z), dtype=bool) if after else fe.oob_mask(ens.bags, gi, c["group"])
    med = fe.wmedian(z, mask)
    iv = ens_mod.speed_interval(ens, z, x, exclude_group=None if after else c["group"])
    sim_ms = 1e3 * math.exp(-med)
    lo, hi = 1e3 * math.exp(-iv.hi), 1e3 * math.exp(-iv.lo)
    return {"id": c["id"], "group": c["group"], "published_ms": published_ms, "simulated_ms": sim_ms,
            "error": sim_ms / published_ms - 1, "interval_ms": [lo, hi], "covered": bool(lo <= published_ms <= hi),
            "after_cutoff": after}


def latency_stats(rs: list[dict]) -> dict:
    """Median and max |error| over the comparable records, and how many of those with an interval it covers."""
    rs = [r for r in rs if r.get("comparable", True)]
    if not rs:
        return {"n": 0}
    out = {"n": len(rs), "median_abs_error": float(np.median([abs(r["error"]) for r in rs])),
           "max_abs_error": float(max(abs(r["error"]) for r in rs))}
    with_iv = [r for r in rs if "covered" in r]
    if with_iv:
        out.update(covered=int(sum(r["covered"] for r in with_iv)), with_interval=len(with_iv))
    return out


def latency_text(lat: dict) -> list[str]:
    out = [f"TPOT / TTFT on the cases that publish them per request ({lat['basis']}):"]
    for k in ("tpot", "ttft"):
        for r in lat[k]["cases"]:
            if not r.get("comparable", True):
                out.append(f"  {k.upper()} {r['id']:38s} published {r['published_ms']:8.1f} ms  not comparable: "
                           f"{r['why']}")
            elif "interval_ms" in r:
                out.append(f"  {k.upper()}{' mean' if r.get('statistic') == 'mean' else ''} {r['id']:38s} "
                           f"published {r['published_ms']:8.1f} ms  ensemble "
                           f"{r['simulated_ms']:8.1f} ms {r['error']:+7.1%}  [{r['interval_ms'][0]:.1f} - "
                           f"{r['interval_ms'][1]:.1f}]" + ("" if r["covered"] else " MISSED")
                           + ("  (after the cut-off)" if r["after_cutoff"] else ""))
            else:
                out.append(f"  {k.upper()} {r['id']:38s} published {r['published_ms']:8.1f} ms  simulated "
                           f"{r['simulated_ms']:8.1f} ms {r['error']:+7.1%} (the reference run; no interval)")
    for k in ("tpot", "ttft"):
        s = lat[k]
        if s["n"]:
            out.append(f"  {k.upper()}: {s['n']} comparable cases, median |error| {s['median_abs_error']:.1%}, max "
                       f"{s['max_abs_error']:.1%}" + (f"; interval covers {s['covered']}/{s['with_interval']}"
                                                      if "covered" in s else ""))
        else:
            out.append(f"  {k.upper()}: no comparable case")
    out.append(f"  unchecked: {lat['unchecked']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
