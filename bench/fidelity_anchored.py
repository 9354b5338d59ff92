"""Anchored fidelity: how close the simulator gets once calibrated on measured points of the deployment
itself (``place calibrate``), measured the honest way.

    python bench/fidelity_anchored.py [--quick] [--ensemble moeplace/sim/cost_ensemble.json]
    python bench/fidelity_anchored.py --summary-only        # rewrite the package summary from --out

For every fidelity group (bench/fidelity_cases.yaml: one table, one build, one blog's sweep) with at least
two cases, for every case of it:

1. start from the shipped cost-model ensemble's (sim/cost_ensemble.json, bench/fidelity.py's group
   bootstrap) *out-of-bag* members for the group: the members whose resample never drew it (``bag``
   without the group), with their weights renormalized -- constants that never saw this deployment, as a
   team's would. Several members are passed to the calibration (``sim.calibrate.calibrate_members``
   takes an ensemble), exactly as ``place calibrate`` passes the shipped ones;
2. calibrate on the group's other cases exactly as ``place calibrate`` does (sim/calibrate.py: every
   out-of-bag member reweighted by the likelihood of those cases, each that keeps weight refitted -- the
   efficiency and overhead terms, pulled towards its own values by the prior, whose widths are the
   out-of-bag members' spread of each constant, at least 0.05; end-to-end cases on the steady-iteration
   proxy times event / steady at the start, kernel tables on their formulas);
3. predict the left-out case as a run with the calibration is priced (bench/fidelity_frozen.yaml,
   ``calibration``): one event simulation on the calibrated members' weighted median member, whose sampled
   steady iterations every calibrated member re-prices; the figure is their weighted median (kernel tables:
   every member's formula, weighted median), and its error is recorded.

"Uncalibrated" is the same case priced as ``place simulate`` prices it from the out-of-bag members (the
event simulation on the ensemble's reference constants, every out-of-bag member re-pricing it, their
weighted median: bench/fidelity.py's out-of-bag figure). The previous rule's figures (phase B: the case
priced by the calibrated, or the starting, weighted median member alone) are kept beside them
(``anchored_member``, ``uncalibrated_member``) so the change is visible. The structure (sigma, the refitted
constants, the prior rule, the weight cut) is phase A's, fixed before any case was scored; the pricing rule
was fixed on 2026-12-06 before this script ran with it.

The interval a calibrated run prints (sim.ensemble.within_interval) combines its members' spread with these
anchored errors: the 10th and 90th weighted percentiles of member figure + residual over every pair. Its
coverage is checked without looking at the case it covers: each end-to-end case's interval is its own
calibrated members' spread plus the anchored errors of the *other* groups' end-to-end cases. Printed and
written next to the uncalibrated figures of the same cases, and next to the simplest anchor, one ratio: the
left-out case's uncalibrated figure times the geometric mean of published / simulated over the group's other
cases.

Writes bench/results/fidelity_anchored.json and, from a full run, the package summary that ``place
calibrate`` reads (moeplace/sim/anchored_summary.json: the interval's residuals, and the whole ensemble's
spread as the refit's prior widths for a calibration that starts from fewer than 32 members). ``--example GROUP:CASE``
also calibrates on that one case and predicts the rest of its group (the worked example of
docs/simulate.md, "Calibrate on your own benchmark"). bench/fidelity.py runs the same steps on the
ensemble it has just fitted (:func:`anchored_all`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, beside this script
import fidelity_ensemble as fe
from fidelity_harness import (
    CASES,
    E2E,
    RESULTS,
    ROOT,
    Steady,
    after_cutoff,
    fmt,
    kernel_metric,
    load_cases,
    load_frozen,
    sim_metric,
)

OUT = RESULTS / "fidelity_anchored.json"
TARGET = {"median": 0.07, "coverage": (0.70, 0.90)}
EXAMPLE = "trtllm-b200-mtp-table:trtllm-b200-gtc-mtp0"


def oob_members(ens, group: str) -> list:
    """The ensemble's members that never drew ``group`` (all of them for a group the bootstrap did not draw
    from), as :class:`sim.calibrate.Member` s: the reference constants with the member's fitted values,
    weights renormalized to sum 1."""
    from moeplace.sim.calibrate import Member

    cfgs = ens.member_configs(ens.reference_config())
    keep = (np.arange(ens.size) if group not in ens.groups
            else np.flatnonzero(np.asarray(ens.bags)[:, list(ens.groups).index(group)] == 0))
    if not len(keep):
        raise ValueError(f"every member of the ensemble drew group {group}: no out-of-bag start")
    w = np.asarray(ens.weights, dtype=np.float64)[keep]
    w = w / w.sum()
    return [Member(cfgs[i], float(wi), f"member {i}") for i, wi in zip(keep, w)]


def prior_widths(members: list) -> np.ndarray:
    """The refit's prior widths: the standard deviation of each refitted constant's bound-scaled value over
    ``members``, at least 0.05 (what ``calibrate_members`` uses for several members)."""
    from moeplace.sim.calibrate import x_of

    xs = np.array([x_of(m.cost) for m in members])
    return np.maximum(xs.std(axis=0), 0.05)


class Pricer:
    """A case priced under any constants: kernel tables by their formulas, end-to-end cases by the
    steady-iteration proxy times event / steady at the group's starting constants (``event``), as
    ``place calibrate`` prices a measured point."""

    def __init__(self, case: dict, start, quick: bool) -> None:
        self.case, self.quick = case, quick
        self.e2e = case["kind"] in E2E
        if self.e2e:
            self.steady = Steady(case, quick)
            self.event, self.detail = sim_metric(case, start, quick)
            self.corr = self.event / self.steady.metric(start)
        else:
            self.event = kernel_metric(case, start)

    def proxy(self, cfg) -> float:
        return self.steady.metric(cfg) * self.corr if self.e2e else kernel_metric(self.case, cfg)


def priced(case: dict, event_cfg, members: list, quick: bool, run=None) -> dict:
    """The case priced as a run is (bench/fidelity_frozen.yaml, ``calibration``; sim.ensemble.price_run):
    end-to-end cases by one event simulation on ``event_cfg`` whose sampled steady iterations every member
    re-prices (fidelity_ensemble.member_speeds), kernel tables by every member's formula. Returns the
    members' log speeds ``z`` and weights ``w``, their weighted median as the case's figure (``figure``),
    and ``single``: the figure of ``event_cfg`` alone (the event simulation itself). ``run``: that event
    simulation when the caller already has it (fidelity_ensemble.reference_run of this case on ``event_cfg``,
    which is deterministic), so it is not simulated again."""
    from moeplace.sim.ensemble import weighted_quantile

    w = np.array([m.weight for m in members], dtype=np.float64)
    w = w / w.sum()
    if case["kind"] in E2E:
        run = run if run is not None else fe.reference_run(case, event_cfg, quick)
        z = fe.member_speeds(case, run, [m.cost for m in members], event_cfg)["figure"]
        single = run.simulated
    else:
        z = np.log([fe.speed(case, kernel_metric(case, m.cost)) for m in members])
        single = kernel_metric(case, event_cfg)
    med = weighted_quantile(z, w, 0.5)
    return {"z": z, "w": w, "figure": fe.speed(case, math.exp(med)), "single": single}


def anchored_group(cases: list[dict], members: list, quick: bool, log=print, reference=None,
                   runs: dict | None = None) -> list[dict]:
    """Leave-one-out within one group (module docstring), from ``members`` (the group's out-of-bag members;
    ``reference``: the ensemble's reference constants, on which an uncalibrated run's event simulation
    runs; ``runs``: those event simulations by case id where the caller has them, bench/fidelity.py's
    reference runs): a row per case."""
    from moeplace.sim.calibrate import REFIT, calibrate_members, median_member

    start = median_member(members)
    prior = prior_widths(members)
    pricers = {c["id"]: Pricer(c, start.cost, quick) for c in cases}
    uncal = {c["id"]: priced(c, reference if reference is not None else start.cost, members, quick,
                             run=(runs or {}).get(c["id"]) if reference is not None else None) for c in cases}
    rows = []
    for held in cases:
        cal = [c for c in cases if c["id"] != held["id"]]

        def residuals(cfg, cal=cal):
            return np.array([math.log(max(pricers[c["id"]].proxy(cfg), 1e-30) / c["published"]) for c in cal])

        t0 = time.perf_counter()
        calibrated, info = calibrate_members(members, residuals, prior)
        med = median_member(calibrated)
        cfg = med.cost
        fit = next(f for f in info["refit"] if f["member"] == med.name)
        p = priced(held, cfg, calibrated, quick)
        pred, single = p["figure"], p["single"]
        base = uncal[held["id"]]["figure"]
        start_fig = pricers[held["id"]].event
        ratio = math.exp(float(np.mean([math.log(c["published"] / uncal[c["id"]]["figure"]) for c in cal])))
        row = {"id": held["id"], "group": held["group"], "kind": held["kind"], "metric": held["metric"],
               "published": held["published"], "calibrated_on": [c["id"] for c in cal],
               "uncalibrated": base, "uncalibrated_error": base / held["published"] - 1,
               "anchored": pred, "anchored_error": pred / held["published"] - 1,
               # the previous rule's figures (phase B): the calibrated / starting weighted median member alone
               "anchored_member": single, "anchored_member_error": single / held["published"] - 1,
               "uncalibrated_member": start_fig, "uncalibrated_member_error": start_fig / held["published"] - 1,
               "ratio_anchored": base * ratio, "ratio_error": base * ratio / held["published"] - 1,
               "member_log_speeds": [float(v) for v in p["z"]], "member_weights": [float(v) for v in p["w"]],
               "members": len(members), "start": start.name, "ess": info["reweight"]["ess"],
               "refitted": len(calibrated), "priced_by": med.name, "moved": fit["moved"],
               "fit_rms_log": float(np.sqrt(np.mean(np.square(fit["residuals"])))),
               "prior_sd": [float(v) for v in prior],
               "constants": {n: getattr(cfg, n) for n, _, _ in REFIT}, "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"  {held['group']:28s} {held['id']:40s} published {fmt(held['published']):>9s}  uncalibrated "
            f"{row['uncalibrated_error']:+7.1%}  anchored {row['anchored_error']:+7.1%} (median member "
            f"{row['anchored_member_error']:+7.1%}; one ratio {row['ratio_error']:+7.1%}; {len(members)} out-of-bag "
            f"members, ESS {row['ess']:.1f}, {len(calibrated)} priced)", flush=True)
    return rows


def _stats(rows: list[dict], key: str) -> dict:
    if not rows:
        return {"cases": 0}
    e = np.abs([r[key] for r in rows])
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"cases": len(rows), "groups": len({r["group"] for r in rows}), "median": float(np.median(e)),
            "max": float(np.max(e)), "worst_case": worst["id"], "worst_error": float(worst[key])}


def log_error(r: dict, key: str = "anchored") -> float:
    """log(simulated / published) of a row's figure (``key``), speed-like (a latency's inverted)."""
    return math.log(fe.speed(r, r[key]) / fe.speed(r, r["published"]))


def coverage(rows: list[dict]) -> dict:
    """The nominal 80 % interval's coverage over the end-to-end cases, each case's interval made as a
    calibrated run's is (sim.ensemble.within_interval: its own calibrated members' spread plus the anchored
    residuals) with the residuals of the *other* groups' end-to-end cases only, and its median width
    (hi / lo - 1)."""
    from moeplace.sim.ensemble import within_interval

    resid = {r["id"]: -log_error(r) for r in rows}  # log(published / predicted)
    hits, widths = [], []
    for r in rows:
        others = [resid[o["id"]] for o in rows if o["group"] != r["group"]]
        iv = within_interval(r["member_log_speeds"], r["member_weights"], others, 0.8)
        y = math.log(r["published"])
        r["interval_log"] = [iv.lo - math.log(r["published"]), iv.hi - math.log(r["published"])]
        r["covered"] = bool(iv.lo <= y <= iv.hi)
        hits.append(r["covered"])
        widths.append(math.exp(iv.hi - iv.lo) - 1)
    return {"nominal": 0.8, "coverage": float(np.mean(hits)), "cases": len(rows),
            "median_width": float(np.median(widths)),
            "note": "each case's interval: its calibrated members' spread plus the anchored errors of the other "
                    "groups' end-to-end cases"}


def coverage_member(rows: list[dict]) -> dict:
    """The previous rule (phase B), measured on the same run: the case priced by the calibrated weighted
    median member alone, its interval the 10th-90th percentile of the other groups' median-member errors."""
    logs = {r["id"]: log_error(r, "anchored_member") for r in rows}
    hits, widths = [], []
    for r in rows:
        lo, hi = np.quantile([logs[o["id"]] for o in rows if o["group"] != r["group"]], [0.1, 0.9])
        hits.append(bool(lo <= logs[r["id"]] <= hi))
        widths.append(math.exp(hi - lo) - 1)
    return {"nominal": 0.8, "coverage": float(np.mean(hits)), "cases": len(rows),
            "median_width": float(np.median(widths)),
            "note": "the weighted median member alone; each case's interval from the other groups' errors"}


def summarize(rows: list[dict]) -> dict:
    e2e = [r for r in rows if r["kind"] in E2E]
    kern = [r for r in rows if r["kind"] not in E2E]
    out = {"end_to_end": {"anchored": _stats(e2e, "anchored_error"), "uncalibrated": _stats(e2e, "uncalibrated_error"),
                          "one_ratio": _stats(e2e, "ratio_error"),
                          "anchored_member": _stats(e2e, "anchored_member_error"),
                          "uncalibrated_member": _stats(e2e, "uncalibrated_member_error")},
           "kernel_tables": {"anchored": _stats(kern, "anchored_error"),
                             "uncalibrated": _stats(kern, "uncalibrated_error"),
                             "one_ratio": _stats(kern, "ratio_error"),
                             "anchored_member": _stats(kern, "anchored_member_error"),
                             "uncalibrated_member": _stats(kern, "uncalibrated_member_error")},
           "coverage": coverage(e2e) if len({r["group"] for r in e2e}) > 1 else None,
           "coverage_member": coverage_member(e2e) if len({r["group"] for r in e2e}) > 1 else None,
           "by_group": {g: {"anchored": _stats([r for r in rows if r["group"] == g], "anchored_error"),
                            "uncalibrated": _stats([r for r in rows if r["group"] == g], "uncalibrated_error"),
                            "one_ratio": _stats([r for r in rows if r["group"] == g], "ratio_error")}
                        for g in dict.fromkeys(r["group"] for r in rows)}}
    a = out["end_to_end"]["anchored"]
    cov = out["coverage"]["coverage"] if out["coverage"] else None
    out["target"] = {"median": TARGET["median"], "coverage": list(TARGET["coverage"])}
    out["target_met"] = bool(a["cases"] and a["median"] <= TARGET["median"] and cov is not None
                             and TARGET["coverage"][0] <= cov <= TARGET["coverage"][1])
    return out


def text(s: dict) -> list[str]:
    def line(name, st):
        if not st["cases"]:
            return f"  {name:46s}  0 cases"
        return (f"  {name:46s} {st['cases']:2d} cases in {st['groups']:2d} groups: median |error| {st['median']:6.1%}, "
                f"max {st['max']:6.1%} (worst {st['worst_case']} {st['worst_error']:+.1%})")
    head = ("anchored fidelity (each case predicted after calibrating on the other cases of its group, from "
            "constants that never saw the group):")
    out = [head]
    for part, name in (("end_to_end", "end-to-end"), ("kernel_tables", "kernel tables")):
        out.append(line(f"{name}, anchored (place calibrate)", s[part]["anchored"]))
        out.append(line(f"{name}, uncalibrated (out-of-bag members)", s[part]["uncalibrated"]))
        out.append(line(f"{name}, one ratio per group", s[part]["one_ratio"]))
        if s[part].get("anchored_member"):  # the previous rule, same run
            out.append(line(f"{name}, anchored, median member alone", s[part]["anchored_member"]))
            out.append(line(f"{name}, uncalibrated, median member alone", s[part]["uncalibrated_member"]))
    c = s["coverage"]
    if c:
        out.append(f"  80 % interval (within-deployment): coverage {c['coverage']:.0%} of {c['cases']} end-to-end cases, "
                   f"median width {c['median_width']:.0%} ({c['note']})")
    cm = s.get("coverage_member")
    if cm:
        out.append(f"  80 % interval, previous rule: coverage {cm['coverage']:.0%}, median width {cm['median_width']:.0%} "
                   f"({cm['note']})")
    t = s["target"]
    a = s["end_to_end"]["anchored"]
    out.append(f"target (anchored median <= {t['median']:.0%}, coverage {t['coverage'][0]:.0%}-{t['coverage'][1]:.0%}): "
               + ("met" if s["target_met"] else f"NOT met (median {a.get('median', float('nan')):.1%}, coverage "
                  f"{(c or {}).get('coverage', float('nan')):.0%})"))
    return out


def package_summary(res: dict) -> dict:
    """What ``place calibrate`` reads (sim/calibrate.py ANCHORED_PATH): the interval from every end-to-end
    anchored log error, the prior widths, and the figures they come from."""
    from moeplace.sim.calibrate import REFIT

    e2e = [r for r in res["rows"] if r["kind"] in E2E]
    logs = [log_error(r) for r in e2e]
    lo, hi = np.quantile(logs, [0.1, 0.9])
    s = res["summary"]
    return {"source": "bench/fidelity_anchored.py (leave one case out within each published deployment group, "
                      "calibrated on the rest from constants that never saw the group)",
            "interval": {"coverage": 0.8, "log_lo": float(lo), "log_hi": float(hi),
                         "measured_coverage": (s["coverage"] or {}).get("coverage"), "cases": len(e2e),
                         "groups": len({r["group"] for r in e2e}),
                         # every anchored end-to-end case's log(simulated / published): the residuals a
                         # calibrated run's interval combines with its members' spread (sim.ensemble.within_interval)
                         "residuals_log": [float(v) for v in logs], "residual_cases": [r["id"] for r in e2e],
                         "source": f"bench/fidelity_anchored.py: the anchored errors of {len(e2e)} published "
                                   f"end-to-end cases in {len({r['group'] for r in e2e})} groups, each left out of "
                                   "its own group's calibration; coverage measured "
                                   f"{(s['coverage'] or {}).get('coverage', 0):.0%} (each case's interval from its "
                                   "own members and the other groups' errors)"},
            "prior_sd": dict(zip([n for n, _, _ in REFIT], res["prior_sd"])),
            "prior_source": res["prior_source"],
            "anchored": s["end_to_end"]["anchored"], "uncalibrated": s["end_to_end"]["uncalibrated"],
            "one_ratio": s["end_to_end"]["one_ratio"]}


def example(cases: list[dict], ens, spec: str, quick: bool) -> dict:
    """Calibrate on one case of a group (``GROUP:CASE``), from the group's out-of-bag members, and predict
    the rest of it."""
    from moeplace.sim.calibrate import REFIT, calibrate_members, median_member

    group, anchor = spec.split(":", 1)
    grp = [c for c in cases if c["group"] == group]
    if not grp or anchor not in {c["id"] for c in grp}:
        raise SystemExit(f"error: --example {spec}: no case {anchor} in group {group}")
    members = oob_members(ens, group)
    start = median_member(members)
    pricers = {c["id"]: Pricer(c, start.cost, quick) for c in grp}
    a = next(c for c in grp if c["id"] == anchor)
    calibrated, info = calibrate_members(
        members, lambda cfg: np.array([math.log(pricers[anchor].proxy(cfg) / a["published"])]), prior_widths(members))
    med = median_member(calibrated)
    cfg = med.cost
    ref = ens.reference_config()
    rows = []
    for c in grp:
        un = priced(c, ref, members, quick)  # as place simulate prices it from these members
        p = priced(c, cfg, calibrated, quick)  # as a run with the calibration is priced
        base, pred = un["figure"], p["figure"]
        rows.append({"id": c["id"], "config": c["config"], "metric": c["metric"], "published": c["published"],
                     "uncalibrated": base, "calibrated": pred, "anchor": c["id"] == anchor,
                     "uncalibrated_error": base / c["published"] - 1,
                     "calibrated_error": pred / c["published"] - 1,
                     "calibrated_member": p["single"], "uncalibrated_member": pricers[c["id"]].event})
        print(f"  {'anchor ' if c['id'] == anchor else '       '}{c['id']:32s} published {fmt(c['published']):>8s}  "
              f"uncalibrated {fmt(base):>8s} ({rows[-1]['uncalibrated_error']:+6.1%})  calibrated "
              f"{fmt(pred):>8s} ({rows[-1]['calibrated_error']:+6.1%}; median member "
              f"{p['single'] / c['published'] - 1:+6.1%})")
    return {"group": group, "anchor": anchor, "rows": rows, "members": len(members), "ess": info["reweight"]["ess"],
            "refitted": len(calibrated), "priced_by": med.name,
            "moved": next(f["moved"] for f in info["refit"] if f["member"] == med.name),
            "constants": {n: getattr(cfg, n) for n, _, _ in REFIT}}


def anchored_all(cases: list[dict], ens, quick: bool, example_spec: str | None = EXAMPLE,
                 chosen: set | None = None, source: str = "the shipped ensemble", report: bool = True,
                 map_groups=None, runs: dict | None = None) -> dict:
    """Every group with at least two cases (or only ``chosen``) left out case by case from its out-of-bag
    members of ``ens``; the summary (printed with ``report``); the worked example (``example_spec``, not with
    ``chosen``). The results document (what --out holds and bench/fidelity.py's ``anchored`` block).
    ``map_groups``: runs :func:`anchored_group` over a list of ``(cases, members, quick, reference, runs)`` and returns
    their rows in order (bench/fidelity.py's worker processes); default in this process. ``runs``: each case's event
    simulation on the ensemble's reference constants where the caller has made it (bench/fidelity.py's reference
    runs; deterministic, so the same rows), handed to the uncalibrated figures instead of simulating again."""
    from moeplace.sim.calibrate import REFIT, SIGMA

    t0 = time.perf_counter()
    # cases published after the frozen cut-off are scored once in their own column and never fitted: their
    # anchored errors would become the residuals of the interval place calibrate ships (anchored_summary.json)
    frozen = load_frozen()
    late = [c["id"] for c in cases if after_cutoff(c, frozen)]
    if late:
        print(f"  {len(late)} case(s) published after the {frozen['cutoff']} cut-off left out (scored once in their own "
              "column, never part of the calibrate interval)", flush=True)
    cases = [c for c in cases if not after_cutoff(c, frozen)]
    groups: dict[str, list[dict]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(c)
    todo = []
    for g, cs in groups.items():
        if len(cs) < 2 or (chosen and g not in chosen):
            continue
        try:
            members = oob_members(ens, g)
        except ValueError as exc:
            print(f"  {g}: {exc}; left out", flush=True)
            continue
        todo.append((cs, members, quick, ens.reference_config(),
                     {c["id"]: runs[c["id"]] for c in cs if c["id"] in runs} if runs else None))
    done = map_groups(todo) if map_groups else [anchored_group(c, m, q, reference=r, runs=rs) for c, m, q, r, rs in todo]
    rows = [r for part in done for r in part]
    summary = summarize(rows)
    if report:
        for line in text(summary):
            print(line)
    ex = None
    if example_spec and not chosen:
        print(f"worked example: calibrated on {example_spec.split(':', 1)[1]} alone, the rest of its group predicted:")
        ex = example(cases, ens, example_spec, quick)
    whole = prior_widths(_all_members(ens))  # what place calibrate's prior is (the whole ensemble's spread)
    return {"rows": rows, "summary": summary, "example": ex,
            "prior_sd": [float(v) for v in whole],
            "prior_source": (f"standard deviation of each constant's bound-scaled value over the {ens.size} members of "
                             f"{source} (at least 0.05); each anchored case used its group's out-of-bag members' "
                             "spread (rows' prior_sd)"),
            "start": (f"the out-of-bag members of {source} for each group (bootstrap members that never drew it), "
                      "reweighted and refitted as place calibrate does; predicted as a calibrated run is priced: one "
                      "event simulation on the calibrated weighted median member, every calibrated member "
                      "re-pricing it, their weighted median (bench/fidelity_frozen.yaml, calibration); "
                      "uncalibrated: the out-of-bag members priced the same way around the ensemble's reference"),
            "refit": [n for n, _, _ in REFIT], "sigma": SIGMA, "quick": quick,
            "groups_only": sorted(chosen) if chosen else None, "seconds": time.perf_counter() - t0}


def _all_members(ens) -> list:
    from moeplace.sim.calibrate import Member

    return [Member(c, 1.0, f"member {i}") for i, c in enumerate(ens.member_configs(ens.reference_config()))]


def main() -> int:
    from moeplace.sim.ensemble import ENSEMBLE_PATH

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--ensemble", default=str(ENSEMBLE_PATH),
                    help="the cost-model ensemble (bench/fidelity.py writes it): each group starts from its "
                         "out-of-bag members")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quick", action="store_true", help="shorter simulations (smoke test; no package summary)")
    ap.add_argument("--groups", default=None, help="only these groups (comma-separated; no package summary)")
    ap.add_argument("--example", default=EXAMPLE, metavar="GROUP:CASE",
                    help=f"the worked example: calibrate on CASE alone, predict the rest of GROUP (default {EXAMPLE})")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite the package summary from --out")
    args = ap.parse_args()
    from moeplace.foundation.errors import MoeplaceError
    from moeplace.foundation.files import read_json, write_text_atomic
    from moeplace.sim.calibrate import ANCHORED_PATH
    from moeplace.sim.ensemble import load_ensemble

    try:
        if args.summary_only:
            res = read_json(args.out)
            write_text_atomic(ANCHORED_PATH, json.dumps(package_summary(res), indent=1) + "\n")
            print(f"wrote {ANCHORED_PATH.relative_to(ROOT)}")
            return 0
        cases = load_cases(Path(args.cases))
        ens = load_ensemble(args.ensemble)
    except MoeplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = set(args.groups.split(",")) if args.groups else None
    res = anchored_all(cases, ens, args.quick, args.example, chosen, source=Path(args.ensemble).name)
    write_text_atomic(args.out, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")
    if not args.quick and not chosen and Path(args.out).resolve() == OUT.resolve():
        write_text_atomic(ANCHORED_PATH, json.dumps(package_summary(res), indent=1) + "\n")
        print(f"wrote {ANCHORED_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
