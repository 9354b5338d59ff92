"""How far the simulator's absolute figures have been from published real-hardware results: the label
``place simulate`` and ``place sweep`` print under their tables.

``bench/fidelity.py`` runs the simulator on published deployments (kernel tables and end-to-end runs,
each case fixed to a calibration or validation split before the one global fit) and, with its committed
results, writes :data:`SUMMARY_PATH` (package data) through :func:`summarize_cases`. The commands read
that file at run time (:func:`load_summary`) and print :func:`fidelity_note`; nothing here reads
``bench/``.

Errors are signed ``simulated / published - 1``: a positive throughput error means the simulator was
faster than the real deployment (optimistic), a positive TPOT error that it was slower.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.files import read_json
from moeplace.sim.calibrate import calibrated_ranges, calibration_note

SUMMARY_PATH = Path(__file__).with_name("fidelity_summary.json")
PROVENANCE = "bench/fidelity.py, grouped cross-validation: each case predicted by constants fitted without its group"
PROVENANCE_SPLIT = "bench/fidelity.py, validation split"
E2E_KINDS = ("prefill", "decode", "serve")  # end-to-end cases (the rest: kernel tables)
MIN_GROUPS = 2  # a regime gives a range only from the cases of at least this many groups
# metrics where larger is not more throughput: per-user decode speed and kernel latency (bench/fidelity.py
# groups its cases the same way)
LATENCY_METRICS = ("per_user_tok_s", "latency_us")
FAR_OFF = 0.35  # the validation target's bound on any one case's |error|

# The run's regime, by a rule over its settings (first match; "per rank" = per attention-DP rank):
#   prefill-heavy        a prefill pool benchmarked alone (phase prefill), or co-located serving whose
#                        prompts are >= PREFILL_HEAVY_RATIO x its outputs
#   single-user latency  <= SINGLE_USER_MAX_SEQS decoding sequences per rank
#   disaggregated        a decode pool (phase decode, or --disaggregated serving)
#   max-throughput       co-located serving with >= MAX_THROUGHPUT_MIN_SEQS sequences per rank
#   mid-batch decode     the rest: co-located, between the two
REGIMES = ("single-user latency", "mid-batch decode", "max-throughput", "prefill-heavy", "disaggregated")
SINGLE_USER_MAX_SEQS = 4
MAX_THROUGHPUT_MIN_SEQS = 128
PREFILL_HEAVY_RATIO = 8.0


ROOFLINE = "roofline"  # the cost source the published cases checked (sim.config.SimConfig.cost_model)


def regime(phase: str, disaggregated: bool, seqs_per_rank: float, prompt_len: float | None = None,
           output_len: float | None = None) -> str:
    """The regime of a run (the rule above): ``phase`` both | prefill | decode; ``seqs_per_rank`` the
    decoding sequences one attention-DP rank holds at most; prompt and output lengths when known."""
    if phase == "prefill" or (phase == "both" and not disaggregated and prompt_len and output_len
                              and prompt_len >= PREFILL_HEAVY_RATIO * output_len):
        return "prefill-heavy"
    if seqs_per_rank <= SINGLE_USER_MAX_SEQS:
        return "single-user latency"
    if phase == "decode" or disaggregated:
        return "disaggregated"
    return "max-throughput" if seqs_per_rank >= MAX_THROUGHPUT_MIN_SEQS else "mid-batch decode"


def case_regime(row: dict) -> str | None:
    """The regime of a bench/fidelity.py case row (``kind``, ``config_full``); None for kernel-table
    cases."""
    c = row.get("config_full") or {}
    kind = row.get("kind")
    if kind not in E2E_KINDS:
        return None
    phase = {"serve": "both"}.get(kind, kind)
    seqs = c.get("batch_per_rank", c.get("tokens_per_rank", 0) / max(c.get("isl", 1), 1))
    return regime(phase, False, float(seqs), c.get("isl"), c.get("osl"))


def run_context(config, num_gpus: int, model: str, gpu: str, cost: str | None = None) -> dict[str, Any]:
    """What the label needs of a run (``config``: a ``sim.config.SimConfig``): its regime, model, GPU and
    cost source (``cost``: what priced the run when known, e.g. ``profile`` or the source a ``measured``
    / ``auto`` run ended with; else ``config.cost_model``; ``roofline`` is the cost model the published
    cases checked). Sequences per rank: the engine's ``max_seqs``, or fewer when a closed loop's
    concurrency spread over the ranks is smaller; lengths from the length mix (None with the trace's own
    lengths)."""
    e, w = config.engine, config.workload
    ranks = max(num_gpus // e.attention_tp, 1)
    seqs = float(e.max_seqs)
    if w.arrival == "closed":
        seqs = min(seqs, w.concurrency / ranks)
    prompt = output = None
    if w.lengths is not None:
        comps = w.lengths.components
        prompt = sum(n * wt for n, wt in comps) / sum(wt for _, wt in comps)
        output = float(w.lengths.output_mean)
    return {"regime": regime(e.phase, e.disaggregated, seqs, prompt, output), "model": model, "gpu": gpu,
            "seqs_per_rank": seqs, "cost": cost or config.cost_model}


def _group(pairs: list[tuple[dict, float]]) -> dict[str, Any]:
    """``pairs``: (case row, signed error). Count, groups, median |error|, the case of the largest |error|,
    and every signed error (sorted: what a run's range is made of)."""
    if not pairs:
        return {"cases": 0}
    row, worst = max(pairs, key=lambda p: abs(p[1]))
    return {"cases": len(pairs), "groups": len({r.get("group") or r["id"] for r, _ in pairs}),
            "median_abs_error": float(np.median([abs(e) for _, e in pairs])),
            "worst_error": float(worst), "worst_case": row["id"], "worst_org": row["source"]["org"],
            "errors": sorted(float(e) for _, e in pairs)}


def summarize_cases(rows: list[dict]) -> dict[str, Any]:
    """The label's figures from ``bench/fidelity.py``'s per-case rows (each with ``id``, ``group``,
    ``kind``, ``metric``, ``source.org``, and the grouped cross-validation's ``cv_error`` and, for decode
    cases, ``cv_tpot_error``): the end-to-end cases (deployments; kernel tables are component benchmarks)
    each predicted by constants fitted without its group. Rows without ``cv_error`` (a run without the
    cross-validation) fall back to the validation split's ``error`` / ``tpot_error``, and say so in
    ``provenance``. ``throughput``: cases whose metric is a throughput (not in :data:`LATENCY_METRICS`);
    ``tpot``: cases with a TPOT comparison; ``ttft_cases``: cases with a published TTFT; ``far_off``: the
    cases whose |error| exceeds :data:`FAR_OFF`, largest first; ``regimes``: per regime, with every signed
    error (what :func:`figure_ranges` makes a run's range of)."""
    cv = any(r.get("cv_error") is not None for r in rows)
    if cv:
        val = [r for r in rows if r.get("cv_error") is not None and r.get("kind") in E2E_KINDS]
        err, tpot = "cv_error", "cv_tpot_error"
    else:
        val = [r for r in rows if r["split"] == "validation"]
        err, tpot = "error", "tpot_error"
    far = sorted((r for r in val if abs(r[err]) > FAR_OFF), key=lambda r: -abs(r[err]))
    by_regime = {}
    for name in REGIMES:
        rs = [r for r in val if case_regime(r) == name]
        by_regime[name] = {**_group([(r, r[err]) for r in rs]),
                           "models": sorted({r["model"] for r in rs if r.get("model")}),
                           "gpus": sorted({r["gpu"] for r in rs})}
    return {
        "provenance": PROVENANCE if cv else PROVENANCE_SPLIT,
        "error": "simulated / published - 1 (throughput: + is faster than published; TPOT: + is slower)",
        "cases": len(val),
        "groups": len({r.get("group") or r["id"] for r in val}),
        "throughput": _group([(r, r[err]) for r in val if r["metric"] not in LATENCY_METRICS]),
        "tpot": _group([(r, r[tpot]) for r in val if tpot in r]),
        "ttft_cases": sum("ttft" in r["metric"] for r in val),
        "far_off_threshold": FAR_OFF,
        "far_off": [{"id": r["id"], "org": r["source"]["org"], "metric": r["metric"], "error": float(r[err])}
                    for r in far],
        # per regime (REGIMES, the rule in regime()): each case's own metric
        "regimes": by_regime,
        "min_groups_for_range": MIN_GROUPS,
        "models": sorted({r["model"] for r in val if r.get("model")}),
        "gpus": sorted({r["gpu"] for r in val}),
    }


# the figures of a run's summary that get a range (figure_ranges): throughputs (a simulated S against a
# signed error e means a real S / (1 + e)) and per-token times (a real S x (1 + e)); TTFT is not among
# them: no case publishes one
THROUGHPUT_FIGURES = ("output_tok_s", "output_tok_s_per_gpu", "input_tok_s", "input_tok_s_per_gpu", "prefill_tok_s",
                      "per_user_tok_s")
TIME_FIGURES = ("tpot_p50_s", "tpot_p99_s", "itl_s")


def regime_range(s: dict[str, Any], regime_name: str | None) -> tuple[float, float] | None:
    """(smallest, largest) signed error of the regime's cases, or None where fewer than
    :data:`MIN_GROUPS` groups' cases resemble the run (one deployment's errors are no spread)."""
    reg = (s.get("regimes") or {}).get(regime_name) if regime_name else None
    if not reg or not reg.get("cases") or reg.get("groups", 0) < s.get("min_groups_for_range", MIN_GROUPS):
        return None
    e = reg["errors"]
    return e[0], e[-1]


def figure_ranges(s: dict[str, Any], run: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """``{"<figure>_range": [lo, hi] | None}`` for each throughput and per-token time of a run's
    ``summary`` (:data:`THROUGHPUT_FIGURES`, :data:`TIME_FIGURES`): where the real figure would lie had
    the simulator erred as it did, over the cases of the run's regime, between its most optimistic and its
    most pessimistic case (a throughput S: [S / (1 + largest), S / (1 + smallest)]; a time, the
    reverse). None for every figure where no case resembles the run (:func:`regime_range`). No range at all
    for a run priced by another cost source than the roofline model the cases checked (:func:`other_cost`)."""
    if (run or {}).get("calibration"):  # calibrated on measured points: the within-deployment interval
        return calibrated_ranges(summary, run["calibration"]["interval"], THROUGHPUT_FIGURES, TIME_FIGURES)
    if other_cost(run):
        return {}
    rr = regime_range(s, (run or {}).get("regime"))
    out: dict[str, Any] = {}
    for key in THROUGHPUT_FIGURES + TIME_FIGURES:
        v = summary.get(key)
        if v is None or (isinstance(v, float) and not np.isfinite(v)):
            continue
        if rr is None:
            out[f"{key}_range"] = None
        elif key in THROUGHPUT_FIGURES:
            out[f"{key}_range"] = [float(v) / (1 + rr[1]), float(v) / (1 + rr[0])]
        else:
            out[f"{key}_range"] = [float(v) * (1 + rr[0]), float(v) * (1 + rr[1])]
    return out


def load_summary(path: str | Path = SUMMARY_PATH) -> dict[str, Any]:
    """The committed summary (:func:`summarize_cases`'s dict)."""
    return read_json(path, missing="missing (the package's fidelity summary; bench/fidelity.py --summary-only "
                                   "writes it)")


def _way(error: float, faster: bool) -> str:
    """``+96%, too fast``: the signed error and what its sign means for the user."""
    return f"{error:+.0%}, too {'fast' if faster else 'slow'}"


def with_ranges(summary: dict[str, Any], s: dict[str, Any], run: dict[str, Any] | None) -> dict[str, Any]:
    """``summary`` with each :func:`figure_ranges` entry right after its figure (``output_tok_s``,
    ``output_tok_s_range``, ...)."""
    ranges = figure_ranges(s, run, summary)
    out: dict[str, Any] = {}
    for k, v in summary.items():
        out[k] = v
        if f"{k}_range" in ranges:
            out[f"{k}_range"] = ranges[f"{k}_range"]
    return out


def other_cost(run: dict[str, Any] | None) -> str | None:
    """The run's cost source when it is not the roofline model the published cases checked (a calibration
    profile, aiconfigurator's measured tables), else None."""
    cost = (run or {}).get("cost", ROOFLINE)
    return None if cost == ROOFLINE else cost


def regime_note(s: dict[str, Any], run: dict[str, Any]) -> str:
    """The run's regime and the error there (its range, or that no case resembles the run), and what no
    case covers (its model, its GPU)."""
    r = run.get("regime")
    reg = (s.get("regimes") or {}).get(r) if r else None
    parts = []
    cost = other_cost(run)
    if cost:
        what = "a calibration profile" if cost == "profile" else f"the {cost} cost source"
        parts.append(f"this run is priced by {what}, not the roofline cost model the published cases checked: "
                     "their errors do not apply, so no range is printed")
    elif r and reg is not None:
        if not reg["cases"]:
            parts.append(f"this run is {r}: no case resembles this run (none in that regime)")
        else:
            rr = regime_range(s, r)
            where = f"{reg['cases']} cases ({', '.join(reg['models'])} on {', '.join(reg['gpus'])})"
            if rr is None:
                parts.append(f"this run is {r}: no case resembles this run closely enough for a range (only one "
                             f"deployment group there: {where}, median {reg['median_abs_error']:.0%})")
            else:
                parts.append(f"this run is {r}: there the median was {reg['median_abs_error']:.0%} over {where} "
                             f"in {reg['groups']} groups, errors from {rr[0]:+.0%} to {rr[1]:+.0%} (the ranges)")
    models, gpus = s.get("models") or [], s.get("gpus") or []
    if run.get("model") and models and run["model"] not in models:
        parts.append(f"no case runs {run['model']} (only {', '.join(models)})")
    if run.get("gpu") and gpus and run["gpu"] not in gpus:
        parts.append(f"none on {run['gpu']} (only {', '.join(gpus)})")
    return "; ".join(parts)


def fidelity_note(s: dict[str, Any], run: dict[str, Any] | None = None) -> str:
    """One line: absolute figures are estimates, how far they were off on held-out published deployments,
    compare by ratios; with ``run`` (:func:`run_context`) also the run's regime, its error there and what
    is not covered (:func:`regime_note`)."""
    parts = []
    t, p = s["throughput"], s["tpot"]
    if t["cases"]:
        far = (f"; {len(s['far_off'])} of {s['cases']} cases beyond {s['far_off_threshold']:.0%}"
               if s["far_off"] else "")
        parts.append(f"simulated throughput was off by a median {t['median_abs_error']:.0%} (worst "
                     f"{_way(t['worst_error'], t['worst_error'] > 0)}: {t['worst_org']} {t['worst_case']}{far})")
    if p["cases"]:
        parts.append(f"TPOT by a median {p['median_abs_error']:.0%} (worst {_way(p['worst_error'], p['worst_error'] < 0)})")
    if not s["ttft_cases"]:
        parts.append("TTFT never checked")
    if run and run.get("calibration"):
        return calibration_note(run["calibration"])
    extra = regime_note(s, run) if run else ""
    return (f"absolute figures are model estimates: on {s['cases']} published deployments in {s['groups']} groups "
            f"({s['provenance']}) {', '.join(parts)}; " + (f"{extra}; " if extra else "")
            + "compare placements by their ratios within one run")


def fidelity_doc(run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``fidelity`` object of the JSON outputs: the committed summary and its :func:`fidelity_note`
    (with ``run``, :func:`run_context`, the run's regime too)."""
    s = load_summary()
    out = {**s, "note": fidelity_note(s, run)}
    if run:
        out["run"] = run
    return out
