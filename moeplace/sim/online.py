"""Online rebalancing against a static placement, on horizons where the rebalancers act.

An engine's rebalancer re-places every N iterations (vLLM: 3,000 steps; SGLang: 1,000): a comparison
shorter than that only ever sees the first decision. Here every candidate is simulated for at least
:data:`INTERVALS` of its own rebalance intervals after the warm-up, on routing it had not observed:

1. The input (a trace, a Loads file or phases: :mod:`sim.inputs`) becomes a timeline of expert
   distributions (:mod:`sim.timeline`), cut into ``splits + 1`` parts of about equal traffic. For each
   ``j < splits`` the static placement (and the rebalancer's starting one) is what was planned before, the
   rebalancer's window starts with part ``j``'s loads (what it observed; it decides at the first iteration)
   and the run is scored on part ``j + 1``, which it never saw before it is routed.
2. A pilot run (:data:`PILOT_FIRST_S`, else :data:`PILOT_S` simulated s of the static placement) measures the iteration time and the
   warm-up (until the first request completes: the batch has reached its mix of prefill and decode) and the
   wall time per iteration. The horizon is ``warm-up + INTERVALS x the longest interval x the iteration
   time x MARGIN``, and part ``j + 1``'s windows are spread over it (phases keep their own seconds). The
   statistical router is the cheaper mode that affords it; when the estimated wall time exceeds the budget
   the comparison is refused, saying what to change.
3. Every run is measured after the warm-up; the steady window is cut into :data:`BATCHES` batches of equal
   simulated time per split. The gain is ONE figure, the ratio of the same totals the tok/s column shows:
   tokens the online run processed over the static run's (same seed and traffic, all batches of all
   splits), minus 1 -- so a row whose tok/s is 2 % below static shows -2 %. Its 80 % Student-t interval is
   the ratio estimator's over the batches (residuals ``x_i - R y_i``; consecutive batches are correlated, so
   the interval is approximate) (:func:`ratio_gain`).
4. A candidate that performed fewer than :data:`INTERVALS` rebalances after the warm-up (in some split) is
   reported but not ranked; one that never rebalanced is never called best.
5. A run that completes no request, or processes no token after its warm-up, is an error, not a zero.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.placement.shift import t80
from moeplace.sim.config import RebalanceConfig, SimConfig
from moeplace.sim.inputs import Workload
from moeplace.sim.memory import plan_pools
from moeplace.sim.runner import simulate

INTERVALS = 5  # rebalance intervals every ranked candidate is simulated for, after the warm-up
MARGIN = 1.3  # headroom on the horizon (blocking stalls and slower steps stretch an interval)
BATCHES = 10  # batches of the steady window per split (batch means)
PILOT_S = 120.0  # simulated seconds of the pilot run at most
PILOT_FIRST_S = 10.0  # ... and of its first try
MIN_SPLITS = 1
DEFAULT_BUDGET_S = 900.0  # wall seconds a comparison may take by default


@dataclass(frozen=True)
class Candidate:
    """One configuration compared: ``name``, its rebalancer (None: static), redundant slots and replica rule."""

    name: str
    rebalance: RebalanceConfig | None
    num_redundant: int
    rule: str


@dataclass(frozen=True)
class Horizon:
    """What the pilot measured and the horizon it gives (simulated seconds)."""

    iter_s: float
    warmup_s: float
    duration_s: float
    wall_per_iter_s: float
    longest_interval: int
    estimate_wall_s: float
    runs: int
    fixed: bool = False  # the phases fixed the horizon (their own seconds)

    def describe(self) -> str:
        """The horizon in words, for the commands' header lines."""
        if self.fixed:
            return (f"runs of the scored phases' {self.duration_s:,.0f} simulated s ({self.warmup_s:.3g} s warm-up; "
                    f"iterations of {self.iter_s * 1e3:.0f} ms measured by a pilot run)")
        return (f"runs of {self.duration_s:,.0f} simulated s = {self.warmup_s:.3g} s warm-up + at least "
                f"{INTERVALS} x {self.longest_interval} iterations x {self.iter_s * 1e3:.0f} ms (a pilot run)")


def steady_tokens(ts, warmup: float, end: float, batches: int) -> np.ndarray:
    """Tokens processed (prompt chunks + decoded) per batch of ``[warmup, end)`` cut in ``batches`` equal
    parts of simulated time, by iteration start: float64 ``[batches]``."""
    t = ts["time"].to_numpy()
    tok = ts["batch_tokens"].to_numpy().astype(np.float64)
    edges = np.linspace(warmup, end, batches + 1)
    idx = np.searchsorted(edges, t, side="right") - 1
    ok = (idx >= 0) & (idx < batches)
    return np.bincount(idx[ok], weights=tok[ok], minlength=batches)


def ratio_gain(online: np.ndarray, static: np.ndarray) -> tuple[float, float, float]:
    """``(gain, lo, hi)``: ``sum(online) / sum(static) - 1`` over paired batches (tokens per batch of the online
    and the static run) -- the ratio of the totals, the same the tok/s columns give -- with an 80 %
    Student-t interval from the ratio estimator's standard error, ``sqrt(sum((x - R y)^2) / (n - 1) / n) /
    mean(y)`` (one batch: ``lo = hi = gain``)."""
    x, y = np.asarray(online, dtype=np.float64), np.asarray(static, dtype=np.float64)
    total = float(y.sum())
    if total <= 0:
        raise InputError("the static run processed no token after its warm-up: nothing to compare against")
    r = float(x.sum()) / total
    n = x.size
    if n < 2:
        return r - 1, r - 1, r - 1
    se = math.sqrt(float(((x - r * y) ** 2).sum()) / (n - 1) / n) / (total / n)
    h = t80(n - 1) * se
    return r - 1, r - 1 - h, r - 1 + h


def check_deployments(model, candidates: list[Candidate], cluster, config: SimConfig) -> None:
    """Every candidate's deployment before anything is read into parts or simulated: attention TP over the
    GPUs and the memory plan with its redundant slots (one line naming the cause: the GPU count, not a
    symptom found later)."""
    for r in sorted({c.num_redundant for c in candidates}):
        plan_pools(model, cluster, config.engine, r)


def _degenerate(label: str, summary: dict, ts, warmup: float, end: float, config: SimConfig) -> None:
    if summary.get("requests_finished", 0) == 0 or steady_tokens(ts, warmup, end, 1).sum() <= 0:
        wl = config.workload
        load = (f"{wl.concurrency} concurrent requests" if wl.arrival == "closed" else f"{wl.rate:g} req/s")
        raise InputError(f"{label}: the run completed {summary.get('requests_finished', 0)} requests in "
                         f"{end:g} simulated s ({summary.get('iterations', 0)} iterations, {load}): nothing to "
                         "compare; shorten the requests (--context-mix, --output-len) or lower the load")


def compare(wl: Workload, candidates: list[Candidate], start: Callable[[int, np.ndarray, int], object],
            cluster, config: SimConfig, profile, splits: int = 1, budget_s: float = DEFAULT_BUDGET_S,
            progress=None, pilot_s: float = PILOT_S, splits_flag: str = "--splits") -> dict:
    """Score ``candidates`` against their static alternative (same slots and rule, placement held) on the
    horizon the module docstring describes. ``start(num_redundant, observed [L, E], split)``: the placement a
    run starts from (and the static one keeps). Returns ``{"horizon": {...}, "splits": [...], "rows": [...],
    "static": {(R, rule) key: row}}``; a row: ``name``, ``tok_s``, ``static_tok_s``, ``gain``, ``gain_lo``,
    ``gain_hi``, ``gains`` (per batch), ``rebalances`` (after the warm-up, fewest over splits),
    ``rebalances_total``, ``ranked``, ``decision_s``, ``transfer_s``, ``stall_s``, ``a2a_slowdown_s``,
    ``straggler_share``, ``iterations``."""
    if splits < MIN_SPLITS:
        raise InputError(f"{splits_flag} must be >= {MIN_SPLITS}, got {splits}")
    check_deployments(wl.trace.model, candidates, cluster, config)
    tl = wl.timeline
    blocks = tl.blocks(splits + 1, wl.what, splits_flag)
    parts = []
    for j in range(splits):
        (oa, ob), (sa, sb) = blocks[j], blocks[j + 1]
        parts.append((tl.counts[oa:ob].sum(axis=0), tl.part(sa, sb), [oa, ob], [sa, sb]))
    # comparisons: ratios of runs on the reference constants (the ensemble's median would re-price each run
    # alike, sim.ensemble; its intervals are not the comparison's)
    base = dataclasses.replace(config, mode="stat", rebalance=None, ensemble=False)
    first = candidates[0]
    hz = _plan(wl, parts, candidates, start, cluster, base, profile, budget_s, pilot_s)
    cfg = dataclasses.replace(base, duration=hz.duration_s, warmup=hz.warmup_s)
    statics: dict = {}
    per_split = []
    for j, (observed, scored, obs_w, score_w) in enumerate(parts):
        trace = dataclasses.replace(wl.trace, timeline=scored if wl.fixed_time else scored.stretched(hz.duration_s))
        split = {"observe_windows": obs_w, "score_windows": score_w, "runs": {}}
        for c in candidates:
            key = (c.num_redundant, c.rule)
            c_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, replica_rule=c.rule))
            placement = start(c.num_redundant, observed, j)
            if (key, j) not in statics:
                if progress:
                    progress(f"split {j + 1}/{splits}: static ({c.num_redundant} redundant, {c.rule} rule)")
                r = simulate(trace, [("static", placement)], cluster, c_cfg, profile)[0]
                _degenerate(f"static placement ({c.num_redundant} redundant slots)", r.summary, r.timeseries,
                            hz.warmup_s, hz.duration_s, c_cfg)
                statics[(key, j)] = _measure(r, hz)
            if c.rebalance is None:
                split["runs"][c.name] = statics[(key, j)]
                continue
            if progress:
                progress(f"split {j + 1}/{splits}: {c.name}")
            rb = dataclasses.replace(c.rebalance, observed=observed)
            r = simulate(trace, [("online", placement)], cluster, dataclasses.replace(c_cfg, rebalance=rb),
                         profile)[0]
            _degenerate(c.name, r.summary, r.timeseries, hz.warmup_s, hz.duration_s, c_cfg)
            split["runs"][c.name] = _measure(r, hz)
        per_split.append(split)
    rows = []
    for c in candidates:
        runs = [s["runs"][c.name] for s in per_split]
        bases = [statics[((c.num_redundant, c.rule), j)] for j in range(splits)]
        online_batches = np.concatenate([r["batch_tokens"] for r in runs])
        static_batches = np.concatenate([b["batch_tokens"] for b in bases])
        g, lo, hi = ratio_gain(online_batches, static_batches)
        online = c.rebalance is not None
        reb = min(r["rebalances_steady"] for r in runs)
        row = {"name": c.name, "num_redundant": c.num_redundant, "rule": c.rule, "online": online,
               "tok_s": float(np.mean([r["tok_s"] for r in runs])),
               "static_tok_s": float(np.mean([b["tok_s"] for b in bases])),
               "batch_tokens": online_batches.tolist(), "static_batch_tokens": static_batches.tolist(),
               "gain": g, "gain_lo": lo, "gain_hi": hi,
               "rebalances": int(reb), "rebalances_total": int(min(r["rebalances"] for r in runs)),
               "ranked": online and reb >= INTERVALS}
        for k in ("decision_s", "transfer_s", "stall_s", "a2a_slowdown_s", "straggler_share", "iterations"):
            row[k] = float(np.mean([r[k] for r in runs]))
        if online and not row["ranked"]:
            row["why_unranked"] = (f"{reb} rebalances after the warm-up (fewer than {INTERVALS}): its interval "
                                   f"({c.rebalance.every} iterations) outlasts the horizon; lengthen it "
                                   + ("(longer --phases)" if wl.fixed_time else "(--intervals)"))
        rows.append(row)
    return {"horizon": {**dataclasses.asdict(hz), "text": hz.describe()}, "splits": [{k: v for k, v in s.items() if k != "runs"}
                                                        for s in per_split],
            "rows": rows, "first": first.name, "input": wl.what, "routing": wl.note(),
            "interval": (f"gain = tokens over the static run's, the ratio of the tok/s columns; 80 % interval of "
                         f"that ratio over {BATCHES} batches of {(hz.duration_s - hz.warmup_s) / BATCHES:.0f} simulated "
                         f"s per split x {splits} split(s) (batches are correlated in time: approximate)")}


def _measure(r, hz: Horizon) -> dict:
    s, ts = r.summary, r.timeseries
    bt = steady_tokens(ts, hz.warmup_s, hz.duration_s, BATCHES)
    hist = s.get("rebalance_history", [])
    return {"tok_s": float(bt.sum() / (hz.duration_s - hz.warmup_s)), "batch_tokens": bt,
            "iterations": float(s.get("iterations", 0)), "straggler_share": float(s["straggler_share"]),
            "rebalances": int(s.get("rebalances", 0)),
            "rebalances_steady": sum(1 for h in hist if h["time"] >= hz.warmup_s),
            "stall_s": float(s.get("stall_s", 0.0)),
            "decision_s": float(sum(h["decision_s"] for h in hist)),
            "transfer_s": float(sum(h["transfer_s"] for h in hist)),
            "a2a_slowdown_s": float(sum(h.get("a2a_slowdown_s", 0.0) for h in hist))}


def _plan(wl: Workload, parts, candidates: list[Candidate], start, cluster, config: SimConfig, profile,
          budget_s: float, pilot_s: float = PILOT_S) -> Horizon:
    """The pilot run and the horizon (module docstring, step 2); refuses when the wall-time estimate exceeds
    ``budget_s``."""
    observed, scored = parts[0][0], parts[0][1]
    c0 = candidates[0]
    placement = start(c0.num_redundant, observed, 0)
    # a short pilot first; a longer one only when no request completed in it (long requests)
    for p_s in (min(PILOT_FIRST_S, pilot_s), pilot_s):
        p_s = min(p_s, scored.duration_s) if wl.fixed_time else p_s
        trace = dataclasses.replace(wl.trace, timeline=scored if wl.fixed_time else scored.stretched(p_s))
        pcfg = dataclasses.replace(config, duration=p_s, warmup=0.0, ensemble=False,
                                   engine=dataclasses.replace(config.engine, replica_rule=c0.rule))
        t0 = time.perf_counter()
        r = simulate(trace, [("pilot", placement)], cluster, pcfg, profile)[0]
        wall = time.perf_counter() - t0
        ts, reqs = r.timeseries, r.requests
        finished = reqs["finished_s"].drop_nulls()
        if finished.len() and ts.filter(ts["time"] >= float(finished.min())).height >= 10:
            break
    pilot_s = p_s
    if ts.height == 0 or finished.len() == 0:
        _degenerate(f"pilot run ({pilot_s:g} simulated s of the static placement)", r.summary, ts, 0.0, pilot_s,
                    pcfg)
    warmup = float(finished.min())
    after = ts.filter(ts["time"] >= warmup)
    iter_s = float((after if after.height else ts)["duration"].mean())
    wall_per_iter = wall / ts.height
    online = [c for c in candidates if c.rebalance is not None]
    longest = max((c.rebalance.every for c in online), default=0)
    if wl.fixed_time:
        duration = scored.duration_s
        if warmup >= duration:
            raise InputError(f"{wl.what}: the scored phases last {duration:g} simulated s, no longer than the "
                             f"warm-up ({warmup:.0f} s until the first request completes): lengthen the phases")
    else:
        duration = warmup + INTERVALS * longest * iter_s * MARGIN if longest else warmup + BATCHES * iter_s * 10
    iters = duration / max(iter_s, 1e-9)
    statics = len({(c.num_redundant, c.rule) for c in candidates})
    runs = (statics + len(online)) * len(parts)
    decisions = sum(iters / c.rebalance.every for c in online) * len(parts)
    t1 = time.perf_counter()
    get_policy("eplb")(PlacementProblem(loads=observed[None], model=wl.trace.model, cluster=cluster,
                                        num_redundant=c0.num_redundant, seed=config.seed))
    per_decision = 3 * (time.perf_counter() - t1)  # EPLB, relabelling and the router's refit
    estimate = runs * iters * wall_per_iter + decisions * per_decision
    if estimate > budget_s:
        raise InputError(
            f"the comparison needs about {estimate / 60:.0f} min of wall time ({runs} runs of {duration:,.0f} "
            f"simulated s = {INTERVALS} x {longest} iterations x {iter_s * 1e3:.0f} ms + {warmup:.0f} s warm-up; "
            f"{wall_per_iter * 1e3:.1f} ms wall per iteration; {decisions:,.0f} rebalance decisions), more than "
            f"--budget {budget_s / 60:g} min: raise --budget, compare fewer settings (--quick, one --engine"
            + (", --splits 1" if len(parts) > 1 else "") + "), or shorten the requests (--context-mix) so that "
            "iterations are shorter")
    return Horizon(iter_s, warmup, float(duration), wall_per_iter, int(longest), float(estimate), runs,
                   wl.fixed_time)


def verdict(rows: list[dict]) -> str:
    """The recommendation from :func:`compare`'s rows: online when the best ranked rebalancer's interval
    lies above zero, static when every ranked one's lies below, else "no clear winner"; none ranked: no
    verdict."""
    online = [r for r in rows if r.get("ranked")]
    if not online:
        return ("none: no rebalancer performed enough rebalances on the horizon to be ranked (see each row); "
                "static is the choice this run can support")
    best = max(online, key=lambda r: r["tok_s"])
    span = f"{best['gain']:+.1%} tok/s over static, 80 % interval {best['gain_lo']:+.1%} to {best['gain_hi']:+.1%}"
    if best["gain_lo"] > 0:
        return f"online rebalancing: {best['name']} ({span})"
    if all(r["gain_hi"] < 0 for r in online):
        return f"a static placement: every rebalancer loses on unseen traffic (best {best['name']}: {span})"
    return (f"no clear winner: the best rebalancer ({best['name']}: {span}) is not clearly better or worse than "
            "static on traffic it had not seen; static is the simpler choice")
