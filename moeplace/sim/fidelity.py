"""How far the simulator's absolute figures have been from published real-hardware results: the label
``place simulate`` and ``place sweep`` print under their tables.

``bench/fidelity.py`` prices published deployments (kernel tables and end-to-end runs) with the shipped
ensemble of constants (:mod:`sim.ensemble`), each case held out by group, and with its committed results
writes :data:`SUMMARY_PATH` (package data) through :func:`summarize_results`. The commands read that file
at run time (:func:`load_summary`) and print :func:`fidelity_note`; nothing here reads ``bench/``.

Errors are signed ``simulated / published - 1``: a positive throughput error means the simulator was
faster than the real deployment (optimistic), a positive TPOT error that it was slower. The regimes below
name kinds of deployment for the case table (bench/fidelity_cases.yaml's ``regime``); no interval depends
on them (the intervals weigh published cases by distance, :func:`sim.ensemble.speed_interval`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moeplace.foundation.files import read_json
from moeplace.sim.calibrate import calibration_note
from moeplace.sim.ensemble import NEAR

SUMMARY_PATH = Path(__file__).with_name("fidelity_summary.json")
PROVENANCE = ("bench/fidelity.py: the shipped ensemble, grouped cross-validation (each case priced by the members "
              "that never drew its group; its interval without its group's residuals)")
E2E_KINDS = ("prefill", "decode", "serve")  # end-to-end cases (the rest: kernel tables)
# metrics where larger is not more throughput: per-user decode speed and kernel latency (bench/fidelity.py
# groups its cases the same way)
LATENCY_METRICS = ("per_user_tok_s", "latency_us")
FAR_OFF = 0.35  # the validation target's bound on any one case's |error|
K3 = "kimi-k3"  # the first target: the label says whether any published case runs it

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
ENGINE_NAMES = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm": "vLLM"}


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


def run_context(config, num_gpus: int, model: str, gpu: str, cost: str | None = None,
                summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the label needs of a run (``config``: a ``sim.config.SimConfig``): its model, GPU and cost
    source (``cost``: what priced the run when known, e.g. ``profile`` or the source a ``measured`` /
    ``auto`` run ended with; else ``config.cost_model``; ``roofline`` is the cost model the ensemble was
    fitted for) and, from a result's ``summary``, whether the ensemble priced it and how near published
    cases are (``near``, :func:`sim.ensemble.speed_interval`)."""
    ens = (summary or {}).get("ensemble")
    return {"model": model, "gpu": gpu, "cost": cost or config.cost_model,
            "ensemble": ens is not None if summary is not None else None,
            "near": None if not ens else ens.get("near")}


def too_slow(row: dict[str, Any]) -> bool:
    """Whether the ensemble's held-out figure of a results row was slower than the published one (a
    throughput below it; for a kernel's ``latency_us``, a time above it)."""
    return row["cv_error"] > 0 if row["metric"] == "latency_us" else row["cv_error"] < 0


def _lean(slow: int, cases: int) -> str:
    """Which way ``cases`` held-out figures were off, ``slow`` of them slower than published."""
    if slow == cases:
        return f"all {cases} simulated slower than published"
    if slow == 0:
        return f"all {cases} simulated faster than published"
    return f"{slow} simulated slower and {cases - slow} faster than published"


def _by_kind(covered: dict[str, list[int]]) -> str:
    """``prefill 6 of 7, decode 11 of 19, ...``: how many held-out cases of each kind of run the interval held."""
    return ", ".join(f"{k} {c} of {n}" for k, (c, n) in covered.items())


def summarize_results(res: dict[str, Any]) -> dict[str, Any]:
    """The label's figures from ``bench/fidelity.py``'s results (its ``cases``, ``cv``, ``coverage``,
    ``after_cutoff``, ``latency``, ``ensemble``, ``frozen``): how far the shipped ensemble's held-out
    figures were from the published deployments (grouped cross-validation), how often its 80 % interval held
    them, what the cases cover (models, GPUs, engines, publication dates) and what they do not."""
    rows = res["cases"]
    e2e = [r for r in rows if r.get("kind") in E2E_KINDS and not r.get("after_cutoff")]
    far = sorted((r for r in e2e if abs(r["cv_error"]) > FAR_OFF), key=lambda r: -abs(r["cv_error"]))
    dates = sorted(r["published_on"] for r in e2e if r.get("published_on") not in (None, "unknown"))
    cov = res["coverage"]["all"]
    lat = res.get("latency") or {}
    return {
        "provenance": PROVENANCE,
        "error": "ensemble median / published - 1 (throughput: + is faster than published; TPOT: + is slower)",
        "frozen_on": res["frozen"]["frozen_on"], "cutoff": res["frozen"]["cutoff"],
        "members": res["ensemble"]["members"],
        "cases": len(e2e), "groups": len({r["group"] for r in e2e}),
        "median_abs_error": res["cv"]["all"]["median"], "max_abs_error": res["cv"]["all"]["max"],
        "worst_case": res["cv"]["all"]["worst_case"], "worst_error": res["cv"]["all"]["worst_error"],
        "worst_org": next(r["source"]["org"] for r in e2e if r["id"] == res["cv"]["all"]["worst_case"]),
        "coverage": cov.get("coverage"), "covered": cov.get("covered"), "median_width": cov.get("median_width"),
        "coverage_by_kind": {k: v.get("coverage") for k, v in res["coverage"].items() if k != "all"},
        "covered_by_kind": {k: [v["covered"], v["cases"]] for k, v in res["coverage"].items()
                            if k != "all" and v.get("cases")},
        "after_cutoff": {"cases": res["after_cutoff"]["cases"],
                         "median_abs_error": (res["after_cutoff"]["errors"] or {}).get("median"),
                         "covered": (res["after_cutoff"]["coverage"] or {}).get("covered"),
                         "too_slow": res["after_cutoff"]["too_slow"],
                         "models": sorted({r["model"] for r in rows if r.get("after_cutoff") and r.get("model")})},
        **({"after_structure": {"structure_cutoff": st["structure_cutoff"], "cases": st["cases"],
                                "median_abs_error": (st["errors"] or {}).get("median"),
                                "covered": (st["coverage"] or {}).get("covered"), "too_slow": st["too_slow"]}}
           if (st := res.get("after_structure")) else {}),
        "tpot_cases": (lat.get("tpot") or {}).get("cases_n", len((lat.get("tpot") or {}).get("cases", []))),
        "tpot_median_abs_error": (lat.get("tpot") or {}).get("median_abs_error"),
        "ttft_cases": (lat.get("ttft") or {}).get("cases_n", sum(r.get("comparable", True) for r in
                                                                 (lat.get("ttft") or {}).get("cases", []))),
        "ttft_median_abs_error": (lat.get("ttft") or {}).get("median_abs_error"),
        "ttft_covered": (lat.get("ttft") or {}).get("covered"),
        "far_off_threshold": FAR_OFF,
        "far_off": [{"id": r["id"], "org": r["source"]["org"], "metric": r["metric"], "error": float(r["cv_error"])}
                    for r in far],
        "models": sorted({r["model"] for r in e2e if r.get("model")}),
        "gpus": sorted({r["gpu"] for r in e2e}),
        "engines": sorted({ENGINE_NAMES.get(r["engine"] or "", f"{r['source']['org']}'s own engine") for r in e2e}),
        "published": [dates[0], dates[-1]] if dates else None,
    }


def load_summary(path: str | Path = SUMMARY_PATH) -> dict[str, Any]:
    """The committed summary (:func:`summarize_cases`'s dict)."""
    return read_json(path, missing="missing (the package's fidelity summary; bench/fidelity.py --summary-only "
                                   "writes it)")


def with_ranges(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with each ``<figure>_range`` right after its figure (``output_tok_s``,
    ``output_tok_s_range``, ...); the ensemble set them (:func:`sim.ensemble.price_run`)."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if k.endswith("_range") and k[:-6] in summary:
            continue
        out[k] = v
        if f"{k}_range" in summary:
            out[f"{k}_range"] = summary[f"{k}_range"]
    return out


def other_cost(run: dict[str, Any] | None) -> str | None:
    """The run's cost source when it is not the roofline model the published cases checked (a calibration
    profile, aiconfigurator's measured tables), else None."""
    cost = (run or {}).get("cost", ROOFLINE)
    return None if cost == ROOFLINE else cost


def run_note(s: dict[str, Any], run: dict[str, Any]) -> str:
    """What the run's intervals rest on (how near published cases are), or why it has none, and what no
    case covers (its model, its GPU)."""
    parts = []
    cost = other_cost(run)
    if cost:
        what = "a calibration profile" if cost == "profile" else f"the {cost} cost source"
        parts.append(f"this run is priced by {what}, not the roofline cost model the ensemble was fitted for: no "
                     "interval is printed")
    elif run.get("ensemble") is False:
        parts.append("this run is priced by constants of its own, not the shipped ensemble: no interval is printed")
    elif run.get("near") is not None:
        if run["near"] < NEAR:
            parts.append(f"no published case is near this run ({run['near']:.2f} groups' worth): its intervals are "
                         "the spread over all cases, wide")
        else:
            parts.append(f"published cases near this run: {run['near']:.1f} groups' worth")
    models, gpus = s.get("models") or [], s.get("gpus") or []
    if run.get("model") and models and run["model"] not in models:
        parts.append(f"no fitted case runs {run['model']} (only {', '.join(models)})")
    if run.get("gpu") and gpus and run["gpu"] not in gpus:
        parts.append(f"none on {run['gpu']} (only {', '.join(gpus)})")
    return "; ".join(parts)


def fidelity_note(s: dict[str, Any], run: dict[str, Any] | None = None) -> str:
    """The label under every simulate table: what the figures are (the ensemble's median and 80 %
    interval), how far they were off and how often the interval held on published deployments held out
    by group (which cases, models, GPUs, engines, dates), what was checked on its own data (TPOT, TTFT) and
    what never was; with ``run`` (:func:`run_context`) also how near published cases are to this run."""
    cov = s.get("coverage")
    scope = (f"{s['cases']} published deployments in {s['groups']} groups ({', '.join(s['models'])} on "
             f"{', '.join(s['gpus'])}; {', '.join(s['engines'])}"
             + (f"; published {s['published'][0]} to {s['published'][1]}" if s.get("published") else "") + ")")
    parts = [f"throughput and TPOT are the median of {s['members']} fitted constant sets [80 % interval: their "
             f"spread plus the held-out errors of nearby published cases]; on {scope}, held out by group, the "
             f"median was off by {s['median_abs_error']:.0%} (worst {s['worst_error']:+.0%}: {s['worst_org']} "
             f"{s['worst_case']})"
             + (f" and the interval held the published figure in {s['covered']} of {s['cases']} cases ({cov:.0%}"
                + (f"; by kind of run: {_by_kind(s['covered_by_kind'])}" if s.get("covered_by_kind") else "")
                + f"; median width {s['median_width']:.0%})" if cov is not None else "")]
    st = s.get("after_structure") or {}
    if st.get("cases"):
        parts.append(f"of them, the {st['cases']} published after {st['structure_cutoff']} (never used to choose the "
                     f"model's structure): median off by {st['median_abs_error']:.0%}, {st['covered']} inside the "
                     f"interval, {_lean(st['too_slow'], st['cases'])}")
    a = s.get("after_cutoff") or {}
    if a.get("cases"):
        parts.append(f"after the {s['cutoff']} cut-off {a['cases']} unseen case(s): median off by "
                     f"{a['median_abs_error']:.0%}, {a['covered']} inside the interval, "
                     f"{_lean(a['too_slow'], a['cases'])}")
    else:
        parts.append(f"no case published after the {s['cutoff']} cut-off yet")
    if s.get("tpot_cases"):
        parts.append(f"TPOT checked on {s['tpot_cases']} cases that print it (median off "
                     f"{s['tpot_median_abs_error']:.0%})")
    if s.get("ttft_cases"):
        inside = s.get("ttft_covered")
        parts.append(f"TTFT on {s['ttft_cases']} (median off {s['ttft_median_abs_error']:.0%}"
                     + (f", {inside} inside its interval)" if inside is not None else ", no interval)"))
    else:
        parts.append("TTFT never checked")
    if run and run.get("calibration"):
        return calibration_note(run["calibration"])
    if K3 in s.get("models", []):
        k3 = "Kimi K3 is among the fitted cases"
    elif K3 in (a.get("models") or []):
        k3 = "Kimi K3 itself only on the unseen cases after the cut-off"
    else:
        k3 = "not checked: Kimi K3 itself"
    parts.append(f"{k3}; structure frozen {s['frozen_on']}")
    extra = run_note(s, run) if run else ""
    return ("absolute figures are model estimates: " + "; ".join(parts) + "; " + (f"{extra}; " if extra else "")
            + "compare placements by their ratios within one run")


def fidelity_doc(run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``fidelity`` object of the JSON outputs: the committed summary and its :func:`fidelity_note`
    (with ``run``, :func:`run_context`, how near published cases are to the run too)."""
    s = load_summary()
    out = {**s, "note": fidelity_note(s, run)}
    if run:
        out["run"] = run
    return out
