"""Simulator fidelity against published real-hardware results: the split, and grouped cross-validation.

    python bench/fidelity.py [--cases bench/fidelity_cases.yaml] [--quick] [--no-fit] [--no-cv] [--breakdown]
    python bench/fidelity.py --cv-only | --peer-only | --summary-only | --measured-only   # on --out's file

The cases (bench/fidelity_cases.yaml, read and checked by bench/fidelity_harness.py) are published kernel
tables (DeepGEMM, DeepEP) and end-to-end deployments (DeepSeek, LMSYS/SGLang, Mooncake, Alibaba RTP-LLM,
NVIDIA TensorRT-LLM, SGLang, vLLM), each with its source, configuration, figure, every assumption made,
its ``split`` (calibration / validation, fixed before any fitting), its deployment ``group`` (one table,
one build, one blog's sweep) and its ``regime`` (the label's rule).

1. Split fit: the cost model's free constants (harness.FIT) fitted by ``scipy.optimize.least_squares`` on
   the log-ratio simulated / published of the calibration cases only (kernel cases on the cost model's
   formulas, end-to-end cases on one steady engine iteration, harness.Steady). They are the CostConfig
   defaults; the script says when they drift from a fresh fit.
2. Evaluate: every case with the split's constants; end-to-end cases by the discrete-event simulator
   itself (stat mode, steady state after the warm-up), exactly as ``place simulate`` runs them.
3. Grouped cross-validation (:func:`cross_validate`, the figure the docs and the label quote): per group,
   the constants fitted on every case outside it and the group's cases predicted as in 2.
4. Report: per case the split's and the cross-validated error; per split, per regime and overall the
   median and maximum |error|. Written to bench/results/fidelity.json (committed); a full run writing that
   file also writes the summary ``place simulate`` prints and takes its ranges from
   (sim/fidelity_summary.json, :func:`sim.fidelity.summarize_cases`).
5. The peer (bench/fidelity_peer.py): NVIDIA aiconfigurator's own estimate of every case it supports
   (bench/peer_aiconfigurator.py -> bench/results/peer_aiconfigurator.json) joined per case and tallied:
   per case on the split's errors, and fairly, by independent deployment (group) on cross-validated
   errors (``peer_summary.independent``).
6. The measured cost source: every end-to-end case again with ``--cost-model measured`` (aiconfigurator's
   tables for the case's GPU and engine), stored per case as ``"measured"``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and the peer, beside this script
from fidelity_harness import (  # noqa: F401  (names the tests read from this script)
    CASES,
    E2E,
    ENGINES,
    METRICS,
    RESULTS,
    ROOT,
    Steady,
    _from_summary,
    case_engine,
    case_kv_tokens,
    case_setup,
    case_trace,
    fit,
    fmt,
    kernel_metric,
    load_cases,
    measured_metric,
    sim_metric,
)
from fidelity_peer import join_peer, load_peer, peer_cell, peer_text

PEER = RESULTS / "peer_aiconfigurator.json"

def measured_summary(rows: list[dict]) -> dict:
    """Median and max |error| of the measured cost source over the validation cases it covers, beside the
    roofline's on the same cases."""
    cov = [r for r in rows if r["split"] == "validation" and "simulated" in (r.get("measured") or {})]
    if not cov:
        return {"validation_cases": 0}
    m = [abs(r["measured"]["error"]) for r in cov]
    roof = [abs(r["error"]) for r in cov]
    return {"validation_cases": len(cov), "median_abs_error": float(np.median(m)), "max_abs_error": float(np.max(m)),
            "roofline_median_abs_error": float(np.median(roof)), "roofline_max_abs_error": float(np.max(roof)),
            "cases": [r["id"] for r in cov]}


def measured_text(ms: dict) -> str:
    if not ms["validation_cases"]:
        return "measured cost source: no validation case covered"
    return (f"measured cost source (aiconfigurator tables, --cost-model measured): {ms['validation_cases']} validation "
            f"cases covered, median |error| {ms['median_abs_error']:.1%}, max {ms['max_abs_error']:.1%} (roofline on "
            f"the same cases: median {ms['roofline_median_abs_error']:.1%}, max {ms['roofline_max_abs_error']:.1%})")


def measured_only(results: str | Path, cases_path: str | Path, quick: bool) -> int:
    """``--measured-only``: add the measured cost source's figure of every case to a results file, with the
    constants it was written with; the roofline figures and the fit are left as they are."""
    from moeplace.foundation.files import read_json, write_text_atomic
    from moeplace.sim.config import CostConfig

    res = read_json(results)
    if not isinstance(res, dict) or not isinstance(res.get("cases"), list):
        print(f"error: {results}: field 'cases' missing, expected bench/fidelity.py results", file=sys.stderr)
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

def peer_only(results: str | Path, peer_path: str | Path) -> int:
    """``--peer-only``: join the peer file into an existing results file, nothing simulated."""
    from moeplace.foundation.files import read_json, write_text_atomic

    res = read_json(results)
    if not isinstance(res, dict) or not isinstance(res.get("cases"), list):
        print(f"error: {results}: field 'cases' missing, expected bench/fidelity.py results", file=sys.stderr)
        return 2
    peer = load_peer(peer_path)
    if peer is None:
        print(f"error: {peer_path}: no peer results (run bench/peer_aiconfigurator.py where aiconfigurator is "
              "installed)", file=sys.stderr)
        return 2
    res["peer_summary"] = join_peer(res["cases"], peer)
    for line in peer_text(res["peer_summary"]):
        print(line)
    write_text_atomic(results, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {results}")
    return 0


# ---------------------------------------------------------------------------- grouped cross-validation
CV_TARGET = (0.10, 0.30)  # median and max |error| the grouped cross-validation aims at


def cross_validate(cases: list[dict], rows: list[dict], start, quick: bool, steady: dict | None = None,
                   log=print) -> dict:
    """Grouped cross-validation. For each group (``group``: one table, one build, one blog's sweep): the
    constants fitted on every case outside it, calibration and validation alike (:func:`harness.fit`), then
    its cases predicted as the split evaluates them (kernel formulas; the event simulator for end-to-end
    cases). Each row gets ``group``, ``cv_simulated`` and ``cv_error``; returns :func:`cv_summary` with the
    fit on all cases and each fold's constants.

    The fits minimize the steady-iteration proxy times the factor event simulation / steady iteration each
    end-to-end case had in ``rows`` (the split's evaluation): the proxy alone leaves out a co-located
    case's prefills, the factor puts the simulator's own answer there. Every fold starts from the fit on
    all cases (itself started from ``start``), which only shortens the search."""
    by_id = {r["id"]: r for r in rows}
    steady = {} if steady is None else steady
    corr = {r["id"]: r["simulated"] / r["steady_state_estimate"] for r in rows
            if r["kind"] in E2E and r.get("steady_state_estimate")}
    log(f"grouped cross-validation: fitting on all {len(cases)} cases, then once per group without it ...")
    full_cfg, full_info = fit(cases, quick, start=start, steady=steady, correction=corr)
    log(f"  all cases: rms log error {full_info['residual_rms_log']:.3f} ({full_info['seconds']:.0f} s)")
    groups = list(dict.fromkeys(c["group"] for c in cases))
    folds = {}
    for g in groups:
        held = [c for c in cases if c["group"] == g]
        cfg, info = fit([c for c in cases if c["group"] != g], quick, start=full_cfg, steady=steady, correction=corr)
        folds[g] = {"params": info["params"], "residual_rms_log": info["residual_rms_log"], "nfev": info["nfev"],
                    "seconds": info["seconds"], "cases": [c["id"] for c in held]}
        for c in held:
            row = by_id[c["id"]]
            if c["kind"] in E2E:
                sim, detail = sim_metric(c, cfg, quick)
                row.update(tpot_pair(c, sim, detail, prefix="cv_"))
            else:
                sim = kernel_metric(c, cfg)
            row["cv_simulated"], row["cv_error"] = sim, sim / c["published"] - 1
            log(f"  {g:30s} {c['id']:36s} published {fmt(c['published']):>9s}  cv {fmt(sim):>9s}  "
                f"{row['cv_error']:+7.1%}  (split {row['error']:+7.1%})")
    out = cv_summary(rows)
    out["full_fit"] = {"params": full_info["params"], "residual_rms_log": full_info["residual_rms_log"],
                       "seconds": full_info["seconds"]}
    out["folds"] = folds
    return out


def _stats(rows: list[dict], key: str = "cv_error") -> dict:
    errs = [r[key] for r in rows]
    if not errs:
        return {"cases": 0}
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"cases": len(errs), "groups": len({r["group"] for r in rows}),
            "median": float(np.median(np.abs(errs))), "max": float(np.max(np.abs(errs))),
            "worst_case": worst["id"], "worst_error": float(worst[key])}


def cv_summary(rows: list[dict]) -> dict:
    """``{"groups", "cases", "median", "max", "by_regime", "kernel_tables", "tpot", "target", "target_met"}``:
    |cross-validated error| over the end-to-end cases (the deployments; kernel tables apart, they are
    component benchmarks), per regime (sim.fidelity's rule) and of the decode cases' time per output
    token."""
    from moeplace.sim.fidelity import case_regime

    done = [r for r in rows if r.get("cv_error") is not None]
    e2e = [r for r in done if r["kind"] in E2E]
    by_regime = {}
    for r in e2e:
        by_regime.setdefault(case_regime(r), []).append(r)
    med_max = _stats(e2e)
    met = bool(e2e) and med_max["median"] <= CV_TARGET[0] and med_max["max"] <= CV_TARGET[1]
    # "groups", "cases", "median", "max": over the end-to-end cases (kernel tables apart)
    return {"groups": 0, **med_max,
            "by_regime": {k: _stats(v) for k, v in sorted(by_regime.items())},
            "kernel_tables": _stats([r for r in done if r["kind"] not in E2E]),
            "tpot": _stats([r for r in e2e if "cv_tpot_error" in r], "cv_tpot_error"),
            "target": {"median": CV_TARGET[0], "max": CV_TARGET[1]}, "target_met": met}


def cv_text(cv: dict) -> list[str]:
    """The printed cross-validation table: overall, per regime, kernel tables, TPOT."""
    def line(name, s):
        if not s["cases"]:
            return f"  {name:22s}  0 cases"
        return (f"  {name:22s} {s['cases']:2d} cases in {s['groups']:2d} groups: median |error| {s['median']:6.1%}, "
                f"max {s['max']:6.1%} (worst {s['worst_case']} {s['worst_error']:+.1%})")
    out = [f"grouped cross-validation ({cv['groups']} groups; each predicted by constants fitted without it):",
           line("end-to-end, all", cv)]
    out += [line(k, v) for k, v in cv["by_regime"].items()]
    out += [line("kernel tables", cv["kernel_tables"]), line("TPOT (decode cases)", cv["tpot"])]
    t = cv["target"]
    out.append(f"cross-validation target (median <= {t['median']:.0%}, max <= {t['max']:.0%}, end-to-end): "
               + ("met" if cv["target_met"] else f"NOT met (median {cv['median']:.1%}, max {cv['max']:.1%})"))
    return out


def cv_only(results: str | Path, cases_path: str | Path, quick: bool) -> int:
    """``--cv-only``: the grouped cross-validation on an existing results file (its split fit and evaluation
    as the start and the proxy's factors), written back with the peer tally; the split columns untouched."""
    from moeplace.foundation.files import read_json, write_text_atomic
    from moeplace.sim.config import CostConfig

    res = read_json(results)
    if not isinstance(res, dict) or not isinstance(res.get("cases"), list):
        print(f"error: {results}: field 'cases' missing, expected bench/fidelity.py results", file=sys.stderr)
        return 2
    cases = load_cases(Path(cases_path))
    if [c["id"] for c in cases] != [r["id"] for r in res["cases"]]:
        print(f"error: {results}: its cases are not those of {cases_path} (run bench/fidelity.py)", file=sys.stderr)
        return 2
    for c, r in zip(cases, res["cases"]):
        r["group"], r["regime"] = c["group"], c["regime"]
    start = CostConfig(**res["cost_config"]) if res.get("cost_config") else CostConfig()
    res["cv"] = cross_validate(cases, res["cases"], start, quick)
    for line in cv_text(res["cv"]):
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


def tpot_pair(case: dict, sim: float, detail: dict, prefix: str = "") -> dict:
    """Decode cases: time per output token, published (stated, or implied by the published throughput at
    the published batch) and simulated (1 / the simulated per-user decode speed); keys ``prefix``ed."""
    if case["kind"] != "decode" or not detail.get("per_user_tok_s"):
        return {}
    c = case["config"]
    if case["metric"] == "per_user_tok_s":
        pub = 1.0 / case["published"]
    else:
        per_gpu = case["published"] / (8 if case["metric"].endswith("per_node") else 1)
        pub = c["batch_per_rank"] / (per_gpu * c.get("attention_tp", 1))  # seconds per token of a sequence
    simulated = 1.0 / detail["per_user_tok_s"]
    return {f"{prefix}tpot_published_s": pub, f"{prefix}tpot_simulated_s": simulated,
            f"{prefix}tpot_error": simulated / pub - 1}


def summarize_split(rows: list[dict], split: str) -> dict:
    from moeplace.sim.fidelity import LATENCY_METRICS

    out = {}
    for group, pred, key in (("throughput", lambda r: r["metric"] not in LATENCY_METRICS, "error"),
                             ("latency", lambda r: r["metric"] in LATENCY_METRICS, "error"),
                             ("tpot", lambda r: "tpot_error" in r, "tpot_error"),
                             ("all", lambda r: True, "error")):
        errs = [abs(r[key]) for r in rows if r["split"] == split and pred(r)]
        if errs:
            out[group] = {"cases": len(errs), "median_abs_error": float(np.median(errs)),
                          "max_abs_error": float(np.max(errs))}
    return out


def markdown(rows: list[dict], summary: dict) -> str:
    """The table docs/simulate.md shows (one row per case)."""
    lines = ["| split | case | source | configuration | metric | published | simulated | error | aiconfigurator |",
             "|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['split']} | {r['id']} | [{r['source']['org']}]({r['source']['url']}) | {r['gpu']}, "
                     f"{r['config']} | {r['metric']} | {fmt(r['published'])} | {fmt(r['simulated'])} | "
                     f"{r['error']:+.1%} | {peer_cell(r)} |")
    lines.append("")
    for s, groups in summary.items():
        for g, v in groups.items():
            lines.append(f"- {s}, {g}: {v['cases']} cases, median |error| {v['median_abs_error']:.1%}, "
                         f"max {v['max_abs_error']:.1%}")
    return "\n".join(lines)


def summary_target(out: str | Path, quick: bool) -> Path | None:
    """Where a run's validation summary goes: the package's committed one (sim/fidelity_summary.json) when
    the run writes the committed results file and is a full run; None otherwise (a --quick smoke run, or
    results written elsewhere, leave the committed summary as it is)."""
    from moeplace.sim.fidelity import SUMMARY_PATH

    if quick or Path(out).resolve() != (RESULTS / "fidelity.json").resolve():
        return None
    return SUMMARY_PATH


def write_summary(rows: list[dict], path: Path) -> None:
    from moeplace.foundation.files import write_text_atomic
    from moeplace.sim.fidelity import fidelity_note, summarize_cases

    s = summarize_cases(rows)
    write_text_atomic(path, json.dumps(s, indent=1) + "\n")
    print(f"wrote {path}: {fidelity_note(s)}")


def summary_only(results: str | Path) -> int:
    """``--summary-only``: the committed summary from a results file of a full run, nothing simulated."""
    from moeplace.foundation.files import read_json

    res = read_json(results)
    if not isinstance(res, dict) or not isinstance(res.get("cases"), list):
        print(f"error: {results}: field 'cases' missing, expected bench/fidelity.py results", file=sys.stderr)
        return 2
    if res.get("quick"):
        print(f"error: {results}: a --quick run's results; the summary comes from a full run", file=sys.stderr)
        return 2
    target = summary_target(results, False)
    if target is None:
        print(f"error: {results}: the summary is written from {RESULTS / 'fidelity.json'} only", file=sys.stderr)
        return 2
    write_summary(res["cases"], target)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--quick", action="store_true", help="shorter simulations and fit (smoke test)")
    ap.add_argument("--no-fit", action="store_true", help="evaluate the CostConfig defaults as they are")
    ap.add_argument("--out", default=str(RESULTS / "fidelity.json"))
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each end-to-end case's steady-iteration breakdown (every run stores it)")
    ap.add_argument("--summary-only", action="store_true",
                    help="only rewrite sim/fidelity_summary.json from the results file (--out), running nothing")
    ap.add_argument("--peer", default=str(PEER),
                    help="aiconfigurator's estimates (bench/peer_aiconfigurator.py); left out when absent")
    ap.add_argument("--peer-only", action="store_true",
                    help="only join --peer into the results file (--out), running nothing")
    ap.add_argument("--no-cv", action="store_true", help="leave out the grouped cross-validation (one fit and "
                    "one simulation per case more)")
    ap.add_argument("--cv-only", action="store_true",
                    help="only run the grouped cross-validation on the results file (--out), its split fit as the "
                         "start; the split columns left as they are")
    ap.add_argument("--measured-only", action="store_true",
                    help="only add the measured cost source's figures (--cost-model measured) to the results file "
                         "(--out), with its constants; nothing refitted")
    args = ap.parse_args()
    from moeplace.foundation.errors import MoeplaceError
    from moeplace.foundation.files import write_text_atomic
    from moeplace.sim.config import CostConfig

    # one step on an existing results file, instead of the whole run
    steps = [(args.measured_only, lambda: measured_only(args.out, args.cases, args.quick)),
             (args.cv_only, lambda: cv_only(args.out, args.cases, args.quick)),
             (args.summary_only, lambda: summary_only(args.out)),
             (args.peer_only, lambda: peer_only(args.out, args.peer))]
    step = next((run for chosen, run in steps if chosen), None)
    if step is not None:
        try:
            return step()
        except MoeplaceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        cases = load_cases(Path(args.cases))
        peer = load_peer(args.peer)
    except MoeplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_cal = sum(c["split"] == "calibration" for c in cases)
    print(f"{len(cases)} cases: {n_cal} calibration, {len(cases) - n_cal} validation; "
          f"{len({c['source']['org'] for c in cases})} source organisations")
    if args.no_fit:
        cfg, info = CostConfig(), {"params": None}
    else:
        print("fitting the global constants on the calibration cases ...", flush=True)
        cfg, info = fit([c for c in cases if c["split"] == "calibration"], args.quick)
        print(f"  rms log error {info['residual_rms_log']:.3f} after {info['nfev']} evaluations "
              f"({info['seconds']:.0f} s)")
        for n, v in info["params"].items():
            d = info["defaults"][n]
            flag = "" if math.isclose(v, d, rel_tol=0.05, abs_tol=1e-9) else f"   (CostConfig default {d:.4g})"
            print(f"  {n:22s} {v:.4g}{flag}")
    rows, steadies = [], {}
    for c in cases:
        t0 = time.perf_counter()
        detail = {}
        if c["kind"] in E2E:
            sim, detail = sim_metric(c, cfg, args.quick)
            st = steadies[c["id"]] = Steady(c, args.quick)
            steady, breakdown = st.metric(cfg), st.breakdown(cfg)
        else:
            sim, steady, breakdown = kernel_metric(c, cfg), None, None
        err = sim / c["published"] - 1
        tpot = tpot_pair(c, sim, detail)
        row = {"id": c["id"], "split": c["split"], "group": c["group"], "regime": c["regime"], "kind": c["kind"], "source": c["source"], "gpu": c["gpu"],
               "model": c.get("model"), "engine": case_engine(c), "config": config_text(c), "config_full": c["config"], "metric": c["metric"],
               "published": c["published"], "simulated": sim, "steady_state_estimate": steady, "error": err,
               "assumptions": c["assumptions"], "detail": detail, "breakdown": breakdown,
               "seconds": time.perf_counter() - t0,
               **tpot}
        rows.append(row)
        join_peer([row], peer)
        cell = peer_cell(row)
        print(f"  {c['split'][:3]} {c['id']:36s} {c['metric']:22s} published {fmt(c['published']):>9s}  "
              f"simulated {fmt(sim):>9s}  {err:+7.1%}" + (f"  aiconfigurator {cell}" if cell else ""), flush=True)
        row["measured"] = measured_metric(c, cfg, args.quick)
        print_measured(row)
        if args.breakdown and breakdown:
            print("      " + breakdown_text(breakdown), flush=True)
    summary = {s: summarize_split(rows, s) for s in ("calibration", "validation")}
    target = summary["validation"].get("all", {})
    meets = bool(target) and all(
        g["median_abs_error"] <= 0.15 and g["max_abs_error"] <= 0.35
        for g in summary["validation"].values())
    for r in rows:
        if "tpot_error" in r:
            print(f"  {r['split'][:3]} {r['id']:36s} TPOT published {r['tpot_published_s'] * 1e3:7.1f} ms  "
                  f"simulated {r['tpot_simulated_s'] * 1e3:7.1f} ms  {r['tpot_error']:+7.1%}")
    for s, groups in summary.items():
        for g, v in groups.items():
            print(f"{s:11s} {g:10s}: {v['cases']:2d} cases, median |error| {v['median_abs_error']:.1%}, "
                  f"max {v['max_abs_error']:.1%}")
    from moeplace.sim.fidelity import summarize_cases

    for name, g in summarize_cases(rows)["regimes"].items():  # the label's regimes (sim.fidelity.regime)
        print(f"validation {name:20s}: {g['cases']:2d} cases" + (
            f", median |error| {g['median_abs_error']:.1%}, worst {g['worst_error']:+.1%} ({g['worst_case']})"
            if g["cases"] else ""))
    print(f"validation target (median <= 15 %, max <= 35 %, throughput and latency): "
          f"{'met' if meets else 'NOT met'}")
    measured = measured_summary(rows)
    print(measured_text(measured))
    cv = None
    if not (args.no_fit or args.no_cv):
        cv = cross_validate(cases, rows, cfg, args.quick, steady=steadies)
        for line in cv_text(cv):
            print(line)
    peer_summary = join_peer(rows, peer)
    if peer_summary is None:
        print(f"peer: {args.peer} absent, no aiconfigurator column (bench/peer_aiconfigurator.py writes it)")
    else:
        for line in peer_text(peer_summary):
            print(line)
    out = {"cases": rows, "cv": cv, "summary": summary, "target_met": meets, "measured_summary": measured,
           "peer_summary": peer_summary, "fit": info,
           "cost_config": dataclasses.asdict(cfg), "quick": args.quick,
           "note": "end-to-end cases: discrete-event simulation, stat mode, steady state after the warm-up; "
                   "kernel cases: the cost model's formulas"}
    write_text_atomic(args.out, json.dumps(out, indent=1, default=float) + "\n")
    target = summary_target(args.out, args.quick)
    if target is not None:
        write_summary(rows, target)
    if args.markdown:
        print(markdown(rows, summary))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
