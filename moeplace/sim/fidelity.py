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

SUMMARY_PATH = Path(__file__).with_name("fidelity_summary.json")
PROVENANCE = "bench/fidelity.py, validation split"
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
    if kind not in ("prefill", "decode", "serve"):
        return None
    phase = {"serve": "both"}.get(kind, kind)
    seqs = c.get("batch_per_rank", c.get("tokens_per_rank", 0) / max(c.get("isl", 1), 1))
    return regime(phase, False, float(seqs), c.get("isl"), c.get("osl"))


def run_context(config, num_gpus: int, model: str, gpu: str) -> dict[str, Any]:
    """What the label needs of a run (``config``: a ``sim.config.SimConfig``): its regime, model and GPU.
    Sequences per rank: the engine's ``max_seqs``, or fewer when a closed loop's concurrency spread over
    the ranks is smaller; lengths from the length mix (None with the trace's own lengths)."""
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
            "seqs_per_rank": seqs}


def _group(pairs: list[tuple[dict, float]]) -> dict[str, Any]:
    """``pairs``: (case row, signed error). Count, median |error|, and the case of the largest |error|."""
    if not pairs:
        return {"cases": 0}
    row, worst = max(pairs, key=lambda p: abs(p[1]))
    return {"cases": len(pairs), "median_abs_error": float(np.median([abs(e) for _, e in pairs])),
            "worst_error": float(worst), "worst_case": row["id"], "worst_org": row["source"]["org"]}


def summarize_cases(rows: list[dict]) -> dict[str, Any]:
    """The label's figures from ``bench/fidelity.py``'s per-case rows (each with ``id``, ``split``,
    ``metric``, ``source.org``, ``error`` and, for decode cases, ``tpot_error``); validation split only.
    ``throughput``: cases whose metric is a throughput (not in :data:`LATENCY_METRICS`); ``tpot``: cases
    with a TPOT comparison; ``ttft_cases``: cases with a published TTFT; ``far_off``: the validation cases
    whose |error| exceeds :data:`FAR_OFF`, largest first."""
    val = [r for r in rows if r["split"] == "validation"]
    far = sorted((r for r in val if abs(r["error"]) > FAR_OFF), key=lambda r: -abs(r["error"]))
    by_regime = {}
    for name in REGIMES:
        rs = [r for r in val if case_regime(r) == name]
        by_regime[name] = {**_group([(r, r["error"]) for r in rs]),
                           "models": sorted({r["model"] for r in rs if r.get("model")}),
                           "gpus": sorted({r["gpu"] for r in rs})}
    return {
        "provenance": PROVENANCE,
        "error": "simulated / published - 1 (throughput: + is faster than published; TPOT: + is slower)",
        "validation_cases": len(val),
        "throughput": _group([(r, r["error"]) for r in val if r["metric"] not in LATENCY_METRICS]),
        "tpot": _group([(r, r["tpot_error"]) for r in val if "tpot_error" in r]),
        "ttft_cases": sum("ttft" in r["metric"] for r in val),
        "far_off_threshold": FAR_OFF,
        "far_off": [{"id": r["id"], "org": r["source"]["org"], "metric": r["metric"], "error": float(r["error"])}
                    for r in far],
        # per regime (REGIMES, the rule in regime()): median |error| of each case's own metric
        "regimes": by_regime,
        "models": sorted({r["model"] for r in val if r.get("model")}),
        "gpus": sorted({r["gpu"] for r in val}),
    }


def load_summary(path: str | Path = SUMMARY_PATH) -> dict[str, Any]:
    """The committed summary (:func:`summarize_cases`'s dict)."""
    return read_json(path, missing="missing (the package's fidelity summary; bench/fidelity.py --summary-only "
                                   "writes it)")


def _way(error: float, faster: bool) -> str:
    """``+96%, too fast``: the signed error and what its sign means for the user."""
    return f"{error:+.0%}, too {'fast' if faster else 'slow'}"


def regime_note(s: dict[str, Any], run: dict[str, Any]) -> str:
    """The run's regime and the validation error there, and what no validation case covers (its model,
    its GPU; none in its regime)."""
    r = run.get("regime")
    reg = (s.get("regimes") or {}).get(r) if r else None
    parts = []
    if r and reg is not None:
        if reg["cases"]:
            parts.append(f"this run is {r}: there the median was {reg['median_abs_error']:.0%} over "
                         f"{reg['cases']} cases ({', '.join(reg['models'])} on {', '.join(reg['gpus'])})")
        else:
            parts.append(f"this run is {r}: no validation case in that regime")
    models, gpus = s.get("models") or [], s.get("gpus") or []
    if run.get("model") and models and run["model"] not in models:
        parts.append(f"no validation case runs {run['model']} (only {', '.join(models)})")
    if run.get("gpu") and gpus and run["gpu"] not in gpus:
        parts.append(f"none on {run['gpu']} (only {', '.join(gpus)})")
    return "; ".join(parts)


def fidelity_note(s: dict[str, Any], run: dict[str, Any] | None = None) -> str:
    """One line: absolute figures are estimates, how far they were off in validation, compare by ratios;
    with ``run`` (:func:`run_context`) also the run's regime, its validation error and what is not
    covered (:func:`regime_note`)."""
    parts = []
    t, p = s["throughput"], s["tpot"]
    if t["cases"]:
        far = (f"; {len(s['far_off'])} of {s['validation_cases']} cases beyond {s['far_off_threshold']:.0%}"
               if s["far_off"] else "")
        parts.append(f"simulated throughput was off by a median {t['median_abs_error']:.0%} (worst "
                     f"{_way(t['worst_error'], t['worst_error'] > 0)}: {t['worst_org']} {t['worst_case']}{far})")
    if p["cases"]:
        parts.append(f"TPOT by a median {p['median_abs_error']:.0%} (worst {_way(p['worst_error'], p['worst_error'] < 0)})")
    if not s["ttft_cases"]:
        parts.append("TTFT never checked")
    extra = regime_note(s, run) if run else ""
    return (f"absolute figures are model estimates: on {s['validation_cases']} published deployments "
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
