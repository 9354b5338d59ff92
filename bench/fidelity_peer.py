"""The peer columns of bench/fidelity.py: NVIDIA aiconfigurator 0.12's estimate of each case it supports
(bench/peer_aiconfigurator.py writes them) and aisimulate 0.13's (bench/peer_aisimulate.py, the same call),
joined per case, tallied, and the two releases compared."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from fidelity_harness import E2E, fmt

# the peers' names, as their result files and each row's "peer" field carry them (aiconfigurator 0.12, then its
# successor aisimulate 0.13)
PEERS = ("aiconfigurator", "aisimulate")


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


def peer_why(row: dict, rec: dict, name: str = "aiconfigurator") -> str:
    """One phrase for a case where the peer ``name`` is closer: the time per output token each side implies
    (or, for prefill, the prompt throughput each side reaches)."""
    m = row["metric"]
    if m == "input_tok_s_per_node":
        return (f"prefill: moeplace {row['simulated']:,.0f}, {name} {rec['simulated']:,.0f}, "
                f"published {row['published']:,.0f} tok/s per node")
    user = m == "per_user_tok_s"
    lat = row.get("published_latency") or {}
    stat = next((st for st in ("p50", "mean") if f"tpot_{st}_ms" in lat), None)
    if stat:  # the source prints a TPOT of its own: that, against the run's same statistic
        pub = float(lat[f"tpot_{stat}_ms"])
        said = f"published {pub:.1f} ms ({'median' if stat == 'p50' else 'mean'} of its requests)"
        ours = (row.get("detail", {}).get(f"tpot_{stat}_s") or 0) * 1e3
    else:
        pub = _tpot_ms(row, row["published"] if user else None, _per_gpu(m, row["published"]))
        said = f"the published figure implies {pub:.1f} ms" if pub else ""
        ours = (row.get("tpot_simulated_s") or 0) * 1e3 or (row.get("detail", {}).get("tpot_p50_s") or 0) * 1e3 or \
            _tpot_ms(row, row["simulated"] if user else None, _per_gpu(m, row["simulated"]))
    theirs = (rec.get("result") or {}).get("tpot")
    if not (pub and ours and theirs):
        return "no per-token time to compare"
    side = "too fast" if _ours(row) > 0 else "too slow"
    return f"TPOT {ours:.1f} ms ({side}) vs {name}'s {theirs:.1f} ms; {said}"


def _ours(row: dict) -> float:
    """moeplace's error on a case: held out (``cv_error``) where the row has it, else the reference run's."""
    return row["cv_error"] if row.get("cv_error") is not None else row["error"]


def _theirs(rec: dict, row: dict) -> float:
    """A peer's error on a case: its figure ``rec["simulated"]`` against the published one."""
    return rec["simulated"] / row["published"] - 1


def _drop(row: dict, name: str) -> None:
    """Remove peer ``name``'s entry from a row (and the row's ``peer`` field once no peer is left)."""
    peers = row.get("peer")
    if peers is not None:
        peers.pop(name, None)
        if not peers:
            del row["peer"]


def join_peer(rows: list[dict], peer: dict | None) -> dict | None:
    """Attach a peer's records to each case row (``row["peer"][name]``, name: the file's ``peer``, default
    aiconfigurator; another peer's entry is kept) and summarize the shared cases: how many moeplace is at
    least as close on, and why not on the others."""
    if peer is None:
        return None
    name = peer.get("peer", "aiconfigurator")
    by_id = {r["id"]: r for r in peer["cases"]}
    shared, behind = [], []
    for row in rows:
        rec = by_id.get(row["id"])
        if rec is None or row["kind"] not in E2E:
            _drop(row, name)
            continue
        if not rec.get("supported"):
            row.setdefault("peer", {})[name] = {"supported": False, "reason": rec.get("reason", "")}
            continue
        entry = {"simulated": rec["simulated"], "error": _theirs(rec, row),
                 "backend_version": rec.get("backend_version"), "notes": rec.get("notes", [])}
        row.setdefault("peer", {})[name] = entry
        shared.append(row)
        if abs(_ours(row)) > abs(entry["error"]):
            entry["why_closer"] = peer_why(row, rec, name)
            behind.append({"id": row["id"], "moeplace_error": _ours(row),
                           f"{name}_error": entry["error"], "why": entry["why_closer"]})
    ids = {b["id"] for b in behind}
    return {"peer": name, "version": peer.get("version"), "shared_cases": len(shared),
            "basis": "moeplace's held-out (grouped cross-validation) error where the row has one, against the peer's own",
            "moeplace_at_least_as_close": len(shared) - len(ids),
            "median_abs_error": {
                "moeplace": float(np.median([abs(_ours(r)) for r in shared])) if shared else None,
                name: float(np.median([abs(r["peer"][name]["error"]) for r in shared])) if shared else None},
            "peer_closer": behind,
            "independent": independent_tally(shared, name)}


def independent_tally(shared: list[dict], name: str = "aiconfigurator") -> dict | None:
    """The fair count: one vote per independent deployment (a case ``group``: one table, one build, one
    blog's sweep), on cross-validated errors only (each case predicted by constants fitted without its
    group, so no fitted margin counts). Per group, the median |error| of moeplace and of the peer ``name``
    over the cases both estimate; moeplace is as close where its median is not larger. None without
    ``cv_error``."""
    rows = [r for r in shared if r.get("cv_error") is not None and r.get("group")]
    if not rows:
        return None
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    deps = []
    for g, rs in by_group.items():
        ours = float(np.median([abs(r["cv_error"]) for r in rs]))
        theirs = float(np.median([abs(r["peer"][name]["error"]) for r in rs]))
        deps.append({"group": g, "cases": [r["id"] for r in rs], "moeplace_cv_median_abs_error": ours,
                     f"{name}_median_abs_error": theirs, "moeplace_as_close": ours <= theirs})
    return {"basis": "one vote per case group; moeplace's grouped cross-validation error, the peer's own",
            "deployments": len(deps), "moeplace_as_close": sum(d["moeplace_as_close"] for d in deps),
            "median_abs_error": {"moeplace": float(np.median([d["moeplace_cv_median_abs_error"] for d in deps])),
                                 name: float(np.median([d[f"{name}_median_abs_error"] for d in deps]))},
            "by_deployment": deps}


# two releases of one peer disagree on a case where one supports it and the other not, or where their
# estimates differ by more than this share (set before either was compared: below it, table rounding)
DISAGREE = 0.01


def compare_versions(rows: list[dict], old: dict, new: dict) -> dict:
    """Two releases of the peer (``old``, ``new``: their files, e.g. aiconfigurator 0.12 and aisimulate 0.13)
    on the end-to-end cases of ``rows``: on the cases both support, the median |error| of each and of
    moeplace (held out), overall, after the publication cut-off and by kind (serving runs; decode and prefill
    batches); the cases where they disagree (support,
    or estimates more than :data:`DISAGREE` apart) with each one's figure or reason, and whether the call
    was the same."""
    a, b = old["peer"], new["peer"]
    recs = {a: {r["id"]: r for r in old["cases"]}, b: {r["id"]: r for r in new["cases"]}}
    both, disagree, same_calls, missing = [], [], 0, []
    for row in rows:
        ra, rb = recs[a].get(row["id"]), recs[b].get(row["id"])
        if row["kind"] not in E2E:
            continue
        if ra is None or rb is None:
            missing.append({"id": row["id"], "run_by": [n for n, r in ((a, ra), (b, rb)) if r is not None]})
            continue
        if ra.get("supported") and rb.get("supported"):
            ratio = rb["simulated"] / ra["simulated"]
            same = ra.get("call") == rb.get("call")
            same_calls += same
            both.append((row, ra, rb))
            if abs(ratio - 1) > DISAGREE:
                disagree.append({"id": row["id"], f"{a}_error": _theirs(ra, row),
                                 f"{b}_error": _theirs(rb, row), "ratio": ratio,
                                 "same_call": same})
        elif ra.get("supported") or rb.get("supported"):
            disagree.append({"id": row["id"], "supported_by": a if ra.get("supported") else b,
                             "reason": (rb if ra.get("supported") else ra).get("reason", "")})

    def medians(sel):
        if not sel:
            return None
        return {"cases": len(sel), "moeplace": float(np.median([abs(_ours(r)) for r, _, _ in sel])),
                a: float(np.median([abs(_theirs(x, r)) for r, x, _ in sel])),
                b: float(np.median([abs(_theirs(y, r)) for r, _, y in sel]))}
    return {"old": f"{a} {old.get('version')}", "new": f"{b} {new.get('version')}", "shared_cases": len(both),
            "same_call": same_calls, "threshold": DISAGREE, "median_abs_error": medians(both),
            "after_cutoff": medians([t for t in both if t[0].get("after_cutoff")]),
            "by_kind": {"serving": medians([t for t in both if t[0]["kind"] == "serve"]),
                        "decode and prefill": medians([t for t in both if t[0]["kind"] != "serve"])},
            "disagree": disagree, "not_run_by_both": missing}


def predict_summary(rows: list[dict], aisim: dict) -> dict | None:
    """aisimulate's own ``predict`` (its traffic replay, bench/peer_aisimulate.py's ``"predict"`` per record)
    on the serving cases it ran, beside its estimate (``cli_estimate``) and moeplace held out on the same
    cases: medians overall and after the cut-off, and each case's three errors. None when the file has no
    predict records."""
    recs = {r["id"]: r for r in aisim["cases"]}
    ran, refused = [], []
    for row in rows:
        pr = (recs.get(row["id"]) or {}).get("predict")
        if not pr or row["kind"] != "serve":  # predict replays traffic: the serving cases only
            continue
        if not pr.get("supported"):
            refused.append({"id": row["id"], "reason": pr.get("reason", "")})
            continue
        est = recs[row["id"]]
        ran.append({"id": row["id"], "after_cutoff": bool(row.get("after_cutoff")), "moeplace_error": _ours(row),
                    "estimate_error": _theirs(est, row) if est.get("supported") else None,
                    "predict_error": _theirs(pr, row), "predict": pr["simulated"]})
    if not ran and not refused:
        return None

    def medians(sel):
        both = [r for r in sel if r["estimate_error"] is not None]
        return None if not sel else {
            "cases": len(sel), "moeplace": float(np.median([abs(r["moeplace_error"]) for r in sel])),
            "predict": float(np.median([abs(r["predict_error"]) for r in sel])),
            "estimate": float(np.median([abs(r["estimate_error"]) for r in both])) if both else None}
    return {"basis": "aisimulate predict (traffic replay) on the serving cases; its estimate and moeplace held out "
                     "on the same cases", "median_abs_error": medians(ran),
            "after_cutoff": medians([r for r in ran if r["after_cutoff"]]), "cases": ran, "not_run": refused}


def predict_text(pm: dict) -> list[str]:
    """The printed lines of :func:`predict_summary`."""
    m = pm["median_abs_error"]
    if not m:
        return [f"  aisimulate predict: no serving case ran ({len(pm['not_run'])} refused)"]
    est = f"{m['estimate']:.1%}" if m["estimate"] is not None else "n/a"
    lines = [(f"aisimulate predict (its traffic replay) on {m['cases']} serving cases: median |error| moeplace (held out) "
             f"{m['moeplace']:.1%}, aisimulate estimate {est}, aisimulate predict {m['predict']:.1%}")]
    ac = pm.get("after_cutoff")
    if ac:
        lines.append(f"  after the cut-off ({ac['cases']} of them): moeplace {ac['moeplace']:.1%}, predict {ac['predict']:.1%}")
    lines += [f"  predict did not run {r['id']}: {r['reason'][:110]}" for r in pm["not_run"]]
    return lines


def peer_lines(ps: dict) -> list[str]:
    """The printed lines of one peer's summary (:func:`join_peer`)."""
    name = ps["peer"]
    if not ps["shared_cases"]:
        return [f"peer {name} {ps['version']}: no case of this table it supports"]
    lines = [(f"peer {name} {ps['version']}: {ps['shared_cases']} shared cases; moeplace (held out) at least as "
             f"close to the published figure on {ps['moeplace_at_least_as_close']} of {ps['shared_cases']}; "
             f"median |error| moeplace {ps['median_abs_error']['moeplace']:.1%}, {name} "
             f"{ps['median_abs_error'][name]:.1%} on the shared cases")]
    ind = ps.get("independent")
    if ind:
        lines.append(f"  by independent deployment (case groups), cross-validated: moeplace at least as close on "
                     f"{ind['moeplace_as_close']} of {ind['deployments']}; median of the groups' median |error| "
                     f"moeplace {ind['median_abs_error']['moeplace']:.1%}, {name} "
                     f"{ind['median_abs_error'][name]:.1%}")
        for d in ind["by_deployment"]:
            lines.append(f"    {d['group']:30s} {len(d['cases'])} case(s): moeplace {d['moeplace_cv_median_abs_error']:6.1%}"
                         f"  {name} {d[f'{name}_median_abs_error']:6.1%}"
                         + ("" if d["moeplace_as_close"] else "  (peer closer)"))
    for b in ps["peer_closer"]:
        lines.append(f"  {name} closer on {b['id']} ({b['moeplace_error']:+.1%} vs "
                     f"{b[f'{name}_error']:+.1%}): {b['why']}")
    return lines


def versions_text(v: dict) -> list[str]:
    """The printed lines of :func:`compare_versions`."""
    m = v["median_abs_error"]
    a, b = v["old"].split()[0], v["new"].split()[0]
    if not m:
        return [f"{v['old']} vs {v['new']}: no case both support"]
    lines = [(f"{v['old']} vs {v['new']}: {v['shared_cases']} cases both support ({v['same_call']} with the same call); "
             f"median |error| moeplace (held out) {m['moeplace']:.1%}, {a} {m[a]:.1%}, {b} {m[b]:.1%}")]
    for label, k in [("after the cut-off", v.get("after_cutoff")), *v.get("by_kind", {}).items()]:
        if k:
            lines.append(f"  {label} ({k['cases']} of them): moeplace {k['moeplace']:.1%}, {a} {k[a]:.1%}, {b} {k[b]:.1%}")
    for d in v["disagree"]:  # estimates apart, or supported by one release only
        what = (f"{a} {d[f'{a}_error']:+.1%}, {b} {d[f'{b}_error']:+.1%} ({d['ratio'] - 1:+.1%}"
                + ("" if d["same_call"] else ", another call") + ")" if "ratio" in d else
                f"only {d['supported_by']} supports it (the other: {d['reason'][:100]})")
        lines.append(f"  disagree on {d['id']}: {what}")
    if v["not_run_by_both"]:
        lines.append(f"  not run by both: {', '.join(d['id'] for d in v['not_run_by_both'])}")
    return lines


def peer_text(ps: dict) -> list[str]:
    """The printed summary of both peers: aiconfigurator's (:func:`join_peer`), then aisimulate's with the
    comparison of the two releases, or why aisimulate did not run."""
    ais = ps.get("aisimulate")
    tail = []
    if ais and not ais.get("run"):
        tail = [f"peer aisimulate {ais.get('version')}: {ais.get('why', '')}"]
    elif ais:
        tail = peer_lines(ais) + [f"  ({ais.get('index', '')})"] + (
            versions_text(ais["versions"]) if "versions" in ais else []) + (
            predict_text(ais["predict"]) if ais.get("predict") else [])
    return peer_lines(ps) + tail


def peer_cell(row: dict, name: str = "aiconfigurator") -> str:
    rec = (row.get("peer") or {}).get(name)
    if not rec:
        return ""
    if not rec.get("supported", True):
        return "n/a"
    return f"{fmt(rec['simulated'])} ({rec['error']:+.1%})"
