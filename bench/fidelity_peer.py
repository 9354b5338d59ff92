"""The peer column of bench/fidelity.py: NVIDIA aiconfigurator's estimate of each case it supports
(bench/peer_aiconfigurator.py writes them) joined per case and tallied."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from fidelity_harness import E2E, fmt


def load_peer(path: str | Path) -> dict | None:
    """bench/peer_aiconfigurator.py's records, or None when that file is absent (the peer column is then
    left out, and the run says so)."""
    from moeplace.foundation.files import read_json

    if not Path(path).exists():
        return None
    peer = read_json(path)
    if not isinstance(peer, dict) or not isinstance(peer.get("cases"), list):
        from moeplace.foundation.errors import InputError
        raise InputError(f"{path}: field 'cases' missing, expected bench/peer_aiconfigurator.py output")
    return peer


def _tpot_ms(row: dict, per_user: float | None, per_gpu: float | None) -> float | None:
    """Seconds per output token of one sequence implied by a per-user speed, or by a per-GPU output rate at
    the case's batch per rank (co-located and decode runs: every sequence of the batch decodes)."""
    if per_user:
        return 1e3 / per_user
    c = row["config_full"]
    if per_gpu and "batch_per_rank" in c:
        return 1e3 * c["batch_per_rank"] / (per_gpu * c.get("attention_tp", 1))
    return None


def _per_gpu(metric: str, v: float) -> float | None:
    return {"output_tok_s_per_gpu": v, "output_tok_s_per_node": v / 8}.get(metric)


def peer_why(row: dict, rec: dict) -> str:
    """One phrase for a case where the peer is closer: the time per output token each side implies (or,
    for prefill, the prompt throughput each side reaches)."""
    m = row["metric"]
    if m == "input_tok_s_per_node":
        return (f"prefill: moeplace {row['simulated']:,.0f}, aiconfigurator {rec['simulated']:,.0f}, "
                f"published {row['published']:,.0f} tok/s per node")
    user = m == "per_user_tok_s"
    pub = _tpot_ms(row, row["published"] if user else None, _per_gpu(m, row["published"]))
    ours = (row.get("tpot_simulated_s") or 0) * 1e3 or (row.get("detail", {}).get("tpot_p50_s") or 0) * 1e3 or \
        _tpot_ms(row, row["simulated"] if user else None, _per_gpu(m, row["simulated"]))
    theirs = (rec.get("result") or {}).get("tpot")
    if not (pub and ours and theirs):
        return "no per-token time to compare"
    side = "too fast" if _ours(row) > 0 else "too slow"
    return (f"TPOT {ours:.1f} ms ({side}) vs aiconfigurator's {theirs:.1f} ms; the published figure implies "
            f"{pub:.1f} ms")


def _ours(row: dict) -> float:
    """moeplace's error on a case: held out (``cv_error``) where the row has it, else the reference run's."""
    return row["cv_error"] if row.get("cv_error") is not None else row["error"]


def join_peer(rows: list[dict], peer: dict | None) -> dict | None:
    """Attach the peer's record to each case row (``row["peer"]["aiconfigurator"]``) and summarize the
    shared cases: how many moeplace is at least as close on (all, and validation only), and why not on
    the others."""
    if peer is None:
        return None
    by_id = {r["id"]: r for r in peer["cases"]}
    shared, behind = [], []
    for row in rows:
        rec = by_id.get(row["id"])
        if rec is None or row["kind"] not in E2E:
            row.pop("peer", None)
            continue
        if not rec.get("supported"):
            row["peer"] = {"aiconfigurator": {"supported": False, "reason": rec.get("reason", "")}}
            continue
        entry = {"simulated": rec["simulated"], "error": rec["simulated"] / row["published"] - 1,
                 "backend_version": rec.get("backend_version"), "notes": rec.get("notes", [])}
        row["peer"] = {"aiconfigurator": entry}
        shared.append(row)
        if abs(_ours(row)) > abs(entry["error"]):
            entry["why_closer"] = peer_why(row, rec)
            behind.append({"id": row["id"], "moeplace_error": _ours(row),
                           "aiconfigurator_error": entry["error"], "why": entry["why_closer"]})
    ids = {b["id"] for b in behind}
    return {"peer": "aiconfigurator", "version": peer.get("version"), "shared_cases": len(shared),
            "basis": "moeplace's held-out (grouped cross-validation) error where the row has one, against the peer's own",
            "moeplace_at_least_as_close": len(shared) - len(ids),
            "median_abs_error": {
                "moeplace": float(np.median([abs(_ours(r)) for r in shared])) if shared else None,
                "aiconfigurator": float(np.median([abs(r["peer"]["aiconfigurator"]["error"]) for r in shared]))
                if shared else None},
            "peer_closer": behind,
            "independent": independent_tally(shared)}


def independent_tally(shared: list[dict]) -> dict | None:
    """The fair count: one vote per independent deployment (a case ``group``: one table, one build, one
    blog's sweep), on cross-validated errors only (each case predicted by constants fitted without its
    group, so no fitted margin counts). Per group, the median |error| of moeplace and of the peer over the
    cases both estimate; moeplace is as close where its median is not larger. None without ``cv_error``."""
    rows = [r for r in shared if r.get("cv_error") is not None and r.get("group")]
    if not rows:
        return None
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    deps = []
    for g, rs in by_group.items():
        ours = float(np.median([abs(r["cv_error"]) for r in rs]))
        theirs = float(np.median([abs(r["peer"]["aiconfigurator"]["error"]) for r in rs]))
        deps.append({"group": g, "cases": [r["id"] for r in rs], "moeplace_cv_median_abs_error": ours,
                     "aiconfigurator_median_abs_error": theirs, "moeplace_as_close": ours <= theirs})
    return {"basis": "one vote per case group; moeplace's grouped cross-validation error, the peer's own",
            "deployments": len(deps), "moeplace_as_close": sum(d["moeplace_as_close"] for d in deps),
            "median_abs_error": {"moeplace": float(np.median([d["moeplace_cv_median_abs_error"] for d in deps])),
                                 "aiconfigurator": float(np.median([d["aiconfigurator_median_abs_error"]
                                                                    for d in deps]))},
            "by_deployment": deps}


def peer_text(ps: dict) -> list[str]:
    """The printed summary of :func:`join_peer`."""
    ais = ps.get("aisimulate")
    tail = []
    if ais:
        tail = [f"peer aisimulate {ais.get('version')}: " + (ais.get("why", "") if not ais.get("run") else
                                                             ais.get("summary", "run"))]
    if not ps["shared_cases"]:
        return [f"peer {ps['peer']} {ps['version']}: no case of this table it supports"] + tail
    lines = [(f"peer {ps['peer']} {ps['version']}: {ps['shared_cases']} shared cases; moeplace (held out) at least as "
             f"close to the published figure on {ps['moeplace_at_least_as_close']} of {ps['shared_cases']}; "
             f"median |error| moeplace {ps['median_abs_error']['moeplace']:.1%}, aiconfigurator "
             f"{ps['median_abs_error']['aiconfigurator']:.1%} on the shared cases")]
    ind = ps.get("independent")
    if ind:
        lines.append(f"  by independent deployment (case groups), cross-validated: moeplace at least as close on "
                     f"{ind['moeplace_as_close']} of {ind['deployments']}; median of the groups' median |error| "
                     f"moeplace {ind['median_abs_error']['moeplace']:.1%}, aiconfigurator "
                     f"{ind['median_abs_error']['aiconfigurator']:.1%}")
        for d in ind["by_deployment"]:
            lines.append(f"    {d['group']:30s} {len(d['cases'])} case(s): moeplace {d['moeplace_cv_median_abs_error']:6.1%}"
                         f"  aiconfigurator {d['aiconfigurator_median_abs_error']:6.1%}"
                         + ("" if d["moeplace_as_close"] else "  (peer closer)"))
    for b in ps["peer_closer"]:
        lines.append(f"  aiconfigurator closer on {b['id']} ({b['moeplace_error']:+.1%} vs "
                     f"{b['aiconfigurator_error']:+.1%}): {b['why']}")
    return lines + tail


def peer_cell(row: dict) -> str:
    rec = (row.get("peer") or {}).get("aiconfigurator")
    if not rec:
        return ""
    if not rec.get("supported", True):
        return "n/a"
    return f"{fmt(rec['simulated'])} ({rec['error']:+.1%})"
