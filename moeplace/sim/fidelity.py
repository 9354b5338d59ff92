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
    }


def load_summary(path: str | Path = SUMMARY_PATH) -> dict[str, Any]:
    """The committed summary (:func:`summarize_cases`'s dict)."""
    return read_json(path, missing="missing (the package's fidelity summary; bench/fidelity.py --summary-only "
                                   "writes it)")


def _way(error: float, faster: bool) -> str:
    """``+96%, too fast``: the signed error and what its sign means for the user."""
    return f"{error:+.0%}, too {'fast' if faster else 'slow'}"


def fidelity_note(s: dict[str, Any]) -> str:
    """One line: absolute figures are estimates, how far they were off in validation, compare by ratios."""
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
    return (f"absolute figures are model estimates: on {s['validation_cases']} published deployments "
            f"({s['provenance']}) {', '.join(parts)}; compare placements by their ratios within one run")


def fidelity_doc() -> dict[str, Any]:
    """The ``fidelity`` object of the JSON outputs: the committed summary and its :func:`fidelity_note`."""
    s = load_summary()
    return {**s, "note": fidelity_note(s)}
