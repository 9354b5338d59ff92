"""Anchored fidelity: how close the simulator gets once calibrated on measured points of the deployment
itself (``place calibrate``), measured the honest way.

    python bench/fidelity_anchored.py [--quick] [--fidelity bench/results/fidelity.json]
    python bench/fidelity_anchored.py --summary-only        # rewrite the package summary from --out

For every fidelity group (bench/fidelity_cases.yaml: one table, one build, one blog's sweep) with at least
two cases, for every case of it:

1. start from the constants of the grouped cross-validation fold that left the whole group out
   (bench/results/fidelity.json ``cv.folds``): constants that never saw this deployment, as a team's would;
2. calibrate on the group's other cases exactly as ``place calibrate`` does (sim/calibrate.py: the
   efficiency and overhead terms refitted, pulled towards the starting values by the prior; end-to-end
   cases on the steady-iteration proxy times event / steady at the start, kernel tables on their
   formulas);
3. predict the left-out case (the event simulator for end-to-end cases) and record its error.

The interval a calibrated run prints is the 10th-90th percentile of these log errors (nominal 80 %). Its
coverage is checked without looking at the case it covers: each end-to-end case's interval is made of the
anchored errors of the *other* groups' end-to-end cases. Printed and written next to the uncalibrated
(cross-validated) figures of the same cases, and next to the simplest anchor, one ratio: the left-out
case's uncalibrated figure times the geometric mean of published / simulated over the group's other cases.

Writes bench/results/fidelity_anchored.json and, from a full run, the package summary that ``place
calibrate`` reads (moeplace/sim/anchored_summary.json: the interval and the refit's prior widths).
``--example GROUP:CASE`` also calibrates on that one case and predicts the rest of its group (the worked
example of docs/simulate.md, "Calibrate on your own benchmark").
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
from fidelity_harness import (
    CASES,
    E2E,
    RESULTS,
    ROOT,
    Steady,
    fmt,
    kernel_metric,
    load_cases,
    sim_metric,
)

OUT = RESULTS / "fidelity_anchored.json"
TARGET = {"median": 0.07, "coverage": (0.70, 0.90)}
EXAMPLE = "trtllm-b200-mtp-table:trtllm-b200-gtc-mtp0"


def fold_configs(fid: dict) -> dict:
    """Per group, the constants of the cross-validation fold that left it out (the split's constants with
    the fold's fitted ones)."""
    from moeplace.sim.config import CostConfig

    base = CostConfig(**fid["cost_config"])
    return {g: base.replace(**f["params"]) for g, f in fid["cv"]["folds"].items()}


def prior_widths(folds: dict) -> np.ndarray:
    """How far each refitted constant moves between the cross-validation folds (the standard deviation of
    its bound-scaled values over the folds, at least 0.05): the refit's prior width."""
    from moeplace.sim.calibrate import x_of

    xs = np.array([x_of(c) for c in folds.values()])
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

    def predict(self, cfg) -> float:
        return sim_metric(self.case, cfg, self.quick)[0] if self.e2e else kernel_metric(self.case, cfg)


def anchored_group(cases: list[dict], start, prior: np.ndarray, quick: bool, log=print) -> list[dict]:
    """Leave-one-out within one group (module docstring): a row per case."""
    from moeplace.sim.calibrate import REFIT, Member, calibrate_members

    pricers = {c["id"]: Pricer(c, start, quick) for c in cases}
    rows = []
    for held in cases:
        cal = [c for c in cases if c["id"] != held["id"]]

        def residuals(cfg, cal=cal):
            return np.array([math.log(max(pricers[c["id"]].proxy(cfg), 1e-30) / c["published"]) for c in cal])

        t0 = time.perf_counter()
        members, info = calibrate_members([Member(start, 1.0, f"fold without {held['group']}")], residuals, prior)
        cfg = members[0].cost
        pred = pricers[held["id"]].predict(cfg)
        base = pricers[held["id"]].event
        ratio = math.exp(float(np.mean([math.log(c["published"] / pricers[c["id"]].event) for c in cal])))
        row = {"id": held["id"], "group": held["group"], "kind": held["kind"], "metric": held["metric"],
               "published": held["published"], "calibrated_on": [c["id"] for c in cal],
               "uncalibrated": base, "uncalibrated_error": base / held["published"] - 1,
               "anchored": pred, "anchored_error": pred / held["published"] - 1,
               "ratio_anchored": base * ratio, "ratio_error": base * ratio / held["published"] - 1,
               "moved": info["refit"][0]["moved"],
               "fit_rms_log": float(np.sqrt(np.mean(np.square(info["refit"][0]["residuals"])))),
               "constants": {n: getattr(cfg, n) for n, _, _ in REFIT}, "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"  {held['group']:28s} {held['id']:40s} published {fmt(held['published']):>9s}  uncalibrated "
            f"{row['uncalibrated_error']:+7.1%}  anchored {row['anchored_error']:+7.1%}  (one ratio "
            f"{row['ratio_error']:+7.1%})", flush=True)
    return rows


def _stats(rows: list[dict], key: str) -> dict:
    if not rows:
        return {"cases": 0}
    e = np.abs([r[key] for r in rows])
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"cases": len(rows), "groups": len({r["group"] for r in rows}), "median": float(np.median(e)),
            "max": float(np.max(e)), "worst_case": worst["id"], "worst_error": float(worst[key])}


def coverage(rows: list[dict]) -> dict:
    """The nominal 80 % interval's coverage over the end-to-end cases, each case's interval from the other
    groups' anchored log errors (10th and 90th percentiles), and its median width."""
    logs = {r["id"]: math.log(r["anchored"] / r["published"]) for r in rows}
    hits, widths = [], []
    for r in rows:
        others = [logs[o["id"]] for o in rows if o["group"] != r["group"]]
        lo, hi = np.quantile(others, [0.1, 0.9])
        r["interval_log"] = [float(lo), float(hi)]
        r["covered"] = bool(lo <= logs[r["id"]] <= hi)
        hits.append(r["covered"])
        widths.append(math.exp(hi) / math.exp(lo) - 1)
    return {"nominal": 0.8, "coverage": float(np.mean(hits)), "cases": len(rows),
            "median_width": float(np.median(widths)),
            "note": "each case's interval from the anchored log errors of the other groups' end-to-end cases"}


def summarize(rows: list[dict]) -> dict:
    e2e = [r for r in rows if r["kind"] in E2E]
    kern = [r for r in rows if r["kind"] not in E2E]
    out = {"end_to_end": {"anchored": _stats(e2e, "anchored_error"), "uncalibrated": _stats(e2e, "uncalibrated_error"),
                          "one_ratio": _stats(e2e, "ratio_error")},
           "kernel_tables": {"anchored": _stats(kern, "anchored_error"),
                             "uncalibrated": _stats(kern, "uncalibrated_error"),
                             "one_ratio": _stats(kern, "ratio_error")},
           "coverage": coverage(e2e) if len({r["group"] for r in e2e}) > 1 else None,
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
            return f"  {name:34s}  0 cases"
        return (f"  {name:34s} {st['cases']:2d} cases in {st['groups']:2d} groups: median |error| {st['median']:6.1%}, "
                f"max {st['max']:6.1%} (worst {st['worst_case']} {st['worst_error']:+.1%})")
    head = ("anchored fidelity (each case predicted after calibrating on the other cases of its group, from "
            "constants that never saw the group):")
    out = [head]
    for part, name in (("end_to_end", "end-to-end"), ("kernel_tables", "kernel tables")):
        out.append(line(f"{name}, anchored (place calibrate)", s[part]["anchored"]))
        out.append(line(f"{name}, uncalibrated (grouped CV)", s[part]["uncalibrated"]))
        out.append(line(f"{name}, one ratio per group", s[part]["one_ratio"]))
    c = s["coverage"]
    if c:
        out.append(f"  80 % interval (within-deployment): coverage {c['coverage']:.0%} of {c['cases']} end-to-end cases, "
                   f"median width {c['median_width']:.0%} ({c['note']})")
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
    logs = [math.log(r["anchored"] / r["published"]) for r in e2e]
    lo, hi = np.quantile(logs, [0.1, 0.9])
    s = res["summary"]
    return {"source": "bench/fidelity_anchored.py (leave one case out within each published deployment group, "
                      "calibrated on the rest from constants that never saw the group)",
            "interval": {"coverage": 0.8, "log_lo": float(lo), "log_hi": float(hi),
                         "measured_coverage": (s["coverage"] or {}).get("coverage"), "cases": len(e2e),
                         "groups": len({r["group"] for r in e2e}),
                         "source": f"bench/fidelity_anchored.py: 10th-90th percentile of the anchored log errors of "
                                   f"{len(e2e)} published end-to-end cases in {len({r['group'] for r in e2e})} "
                                   f"groups; coverage measured {(s['coverage'] or {}).get('coverage', 0):.0%} "
                                   "(each case's interval from the other groups)"},
            "prior_sd": dict(zip([n for n, _, _ in REFIT], res["prior_sd"])),
            "prior_source": res["prior_source"],
            "anchored": s["end_to_end"]["anchored"], "uncalibrated": s["end_to_end"]["uncalibrated"],
            "one_ratio": s["end_to_end"]["one_ratio"]}


def example(cases: list[dict], folds: dict, prior: np.ndarray, spec: str, quick: bool) -> dict:
    """Calibrate on one case of a group (``GROUP:CASE``) and predict the rest of it."""
    from moeplace.sim.calibrate import REFIT, Member, calibrate_members

    group, anchor = spec.split(":", 1)
    grp = [c for c in cases if c["group"] == group]
    if not grp or anchor not in {c["id"] for c in grp}:
        raise SystemExit(f"error: --example {spec}: no case {anchor} in group {group}")
    start = folds[group]
    pricers = {c["id"]: Pricer(c, start, quick) for c in grp}
    a = next(c for c in grp if c["id"] == anchor)
    members, info = calibrate_members([Member(start, 1.0, "fold")],
                                      lambda cfg: np.array([math.log(pricers[anchor].proxy(cfg) / a["published"])]),
                                      prior)
    cfg = members[0].cost
    rows = []
    for c in grp:
        pred = pricers[c["id"]].predict(cfg)
        rows.append({"id": c["id"], "config": c["config"], "metric": c["metric"], "published": c["published"],
                     "uncalibrated": pricers[c["id"]].event, "calibrated": pred, "anchor": c["id"] == anchor,
                     "uncalibrated_error": pricers[c["id"]].event / c["published"] - 1,
                     "calibrated_error": pred / c["published"] - 1})
        print(f"  {'anchor ' if c['id'] == anchor else '       '}{c['id']:32s} published {fmt(c['published']):>8s}  "
              f"uncalibrated {fmt(pricers[c['id']].event):>8s} ({rows[-1]['uncalibrated_error']:+6.1%})  calibrated "
              f"{fmt(pred):>8s} ({rows[-1]['calibrated_error']:+6.1%})")
    return {"group": group, "anchor": anchor, "rows": rows, "moved": info["refit"][0]["moved"],
            "constants": {n: getattr(cfg, n) for n, _, _ in REFIT}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--fidelity", default=str(RESULTS / "fidelity.json"),
                    help="bench/fidelity.py's results: the cross-validation folds' constants")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quick", action="store_true", help="shorter simulations (smoke test; no package summary)")
    ap.add_argument("--groups", default=None, help="only these groups (comma-separated; no package summary)")
    ap.add_argument("--example", default=EXAMPLE, metavar="GROUP:CASE",
                    help=f"the worked example: calibrate on CASE alone, predict the rest of GROUP (default {EXAMPLE})")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite the package summary from --out")
    args = ap.parse_args()
    from moeplace.foundation.errors import MoeplaceError
    from moeplace.foundation.files import read_json, write_text_atomic
    from moeplace.sim.calibrate import ANCHORED_PATH, SIGMA

    try:
        if args.summary_only:
            res = read_json(args.out)
            write_text_atomic(ANCHORED_PATH, json.dumps(package_summary(res), indent=1) + "\n")
            print(f"wrote {ANCHORED_PATH.relative_to(ROOT)}")
            return 0
        cases = load_cases(Path(args.cases))
        fid = read_json(args.fidelity)
        if not isinstance(fid, dict) or not (fid.get("cv") or {}).get("folds"):
            print(f"error: {args.fidelity}: no grouped cross-validation folds (run bench/fidelity.py)", file=sys.stderr)
            return 2
    except MoeplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folds = fold_configs(fid)
    prior = prior_widths(folds)
    from moeplace.sim.calibrate import REFIT

    print("prior widths (bound-scaled s.d. of each refitted constant over the cross-validation folds): "
          + ", ".join(f"{n} {v:.2f}" for (n, _, _), v in zip(REFIT, prior)))
    groups: dict[str, list[dict]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(c)
    chosen = set(args.groups.split(",")) if args.groups else None
    t0 = time.perf_counter()
    rows = []
    for g, cs in groups.items():
        if len(cs) < 2 or (chosen and g not in chosen):
            continue
        if g not in folds:
            print(f"  {g}: no cross-validation fold in {args.fidelity}; left out", flush=True)
            continue
        rows += anchored_group(cs, folds[g], prior, args.quick)
    summary = summarize(rows)
    for line in text(summary):
        print(line)
    ex = None
    if args.example and not chosen:
        print(f"worked example: calibrated on {args.example.split(':', 1)[1]} alone, the rest of its group predicted:")
        ex = example(cases, folds, prior, args.example, args.quick)
    res = {"rows": rows, "summary": summary, "example": ex, "prior_sd": [float(v) for v in prior],
           "prior_source": "standard deviation of each constant's bound-scaled value over the grouped "
                           f"cross-validation folds of {Path(args.fidelity).name} (at least 0.05)",
           "sigma": SIGMA,
           "quick": args.quick, "groups_only": sorted(chosen) if chosen else None,
           "seconds": time.perf_counter() - t0}
    write_text_atomic(args.out, json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")
    if not args.quick and not chosen and Path(args.out).resolve() == OUT.resolve():
        write_text_atomic(ANCHORED_PATH, json.dumps(package_summary(res), indent=1) + "\n")
        print(f"wrote {ANCHORED_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
