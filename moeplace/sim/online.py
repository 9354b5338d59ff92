"""Online rebalancing against a static placement, scored only on routing the rebalancer has not observed.

A simulator run routes the trace's tokens in order; a run longer than the trace would bring tokens back
that the rebalancer's window has already seen, and score it on them. Here the routed tokens are split in
time into ``splits + 1`` contiguous blocks of whole requests. For each ``j < splits``: the rebalancer's
window starts out holding block ``j``'s expert loads (what it observed; it decides from them at the first
iteration) and the run routes block ``j + 1`` only, never longer than that block lasts (its duration is
cut to the simulated seconds the block's tokens fill at the static run's token rate), so no token is
routed twice and none the window held before is scored. The static placement runs on the same block with
the same seed. Each split gives one gain (tokens/s over static, minus 1; tokens = prompt tokens prefilled plus
tokens decoded); their mean with an 80 %
Student-t interval over the splits is the expected gain, and an interval that spans zero is "no clear
winner".
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.shift import t80
from moeplace.sim.config import RebalanceConfig, SimConfig
from moeplace.sim.runner import simulate
from moeplace.sim.workload import TraceTokens

FILL = 0.9  # share of a block's tokens a scored run may route (start-up routes fewer per second)
PROBE_S = 10.0  # simulated seconds of the run that measures the token rate (steady state after its warm-up)
MIN_SPLITS = 2  # an interval needs two gains at least


def request_blocks(trace: TraceTokens, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges of requests ``[a, b)`` with about equal tokens each (time order)."""
    if trace.num_requests < n:
        raise InputError(f"{trace.path}: {trace.num_requests} requests cannot be split into {n} parts of whole "
                         "requests (use a longer trace or fewer --recommend-splits)")
    cum = trace.req_offset[1:]
    cuts = [0]
    for i in range(1, n):
        c = int(np.searchsorted(cum, trace.num_tokens * i / n, side="left")) + 1
        cuts.append(min(max(c, cuts[-1] + 1), trace.num_requests - (n - i)))
    cuts.append(trace.num_requests)
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


def trace_part(trace: TraceTokens, a: int, b: int) -> TraceTokens:
    """Requests ``[a, b)`` of ``trace`` as a trace of their own."""
    lo, hi = int(trace.req_offset[a]), int(trace.req_offset[b])
    return dataclasses.replace(trace, expert_ids=trace.expert_ids[lo:hi],
                               req_offset=trace.req_offset[a:b + 1] - lo, prompt_len=trace.prompt_len[a:b],
                               output_len=trace.output_len[a:b], prefill_rows=trace.prefill_rows[a:b],
                               request_ids=trace.request_ids[a:b])


def routed_rate(summary: dict) -> float:
    """Tokens routed per simulated second in steady state (prompt tokens prefilled + tokens decoded)."""
    return float(summary.get("input_tok_s", 0.0)) + float(summary.get("output_tok_s", 0.0))


def scored_config(scored: TraceTokens, placements, cluster, config: SimConfig, profile) -> SimConfig:
    """``config`` with its duration cut to the simulated seconds ``scored``'s tokens fill (``FILL`` of them,
    at the token rate a ``PROBE_S`` run of the first placement measures), so no token is routed twice."""
    probe_cfg = dataclasses.replace(config, duration=min(config.duration, PROBE_S), warmup=None)
    rate = routed_rate(simulate(scored, placements[:1], cluster, probe_cfg, profile)[0].summary)
    duration = config.duration
    if rate > 0 and FILL * scored.num_tokens / rate < duration:
        duration = FILL * scored.num_tokens / rate
    return cut(config, duration)


def cut(config: SimConfig, duration: float) -> SimConfig:
    """``config`` run for ``duration`` simulated seconds; a run cut short (to the time its scored part
    lasts) is measured from its start (no warm-up: static and online start alike, and a warm-up would
    leave little of a short run)."""
    if duration >= config.duration:
        return config
    return dataclasses.replace(config, duration=duration, warmup=0.0)


def tok_s(summary: dict) -> float:
    """The score: tokens processed per simulated second, prompt tokens prefilled plus tokens decoded (a
    run of a fraction of a second may end before the first output token; every token crosses the MoE
    layers the placement balances)."""
    return routed_rate(summary)


def gain_interval(gains: list[float]) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean gain over splits with an 80 % Student-t interval (one split: no
    interval, ``lo = hi = mean``)."""
    g = np.asarray(gains, dtype=np.float64)
    m = float(g.mean())
    if g.size < 2:
        return m, m, m
    h = t80(g.size - 1) * float(g.std(ddof=1)) / math.sqrt(g.size)
    return m, m - h, m + h


def unseen_runs(trace: TraceTokens, placement, cluster, config: SimConfig, profile,
                configs: dict[str, RebalanceConfig], splits: int = 3) -> dict:
    """Score each of ``configs`` against ``placement`` held static on routing it has not observed (see the
    module docstring). Returns ``{"splits": [{"observe": [a, b], "score": [a, b], "duration_s",
    "static": summary-row, name: row, ...}], "rows": [per config: mean figures and ``gain``, ``gain_lo``,
    ``gain_hi``]}``."""
    if splits < MIN_SPLITS:
        raise InputError(f"--recommend-splits must be >= {MIN_SPLITS} (an interval needs two gains), got {splits}")
    blocks = request_blocks(trace, splits + 1)
    per_split = []
    for j in range(splits):
        (oa, ob), (sa, sb) = blocks[j], blocks[j + 1]
        observed = trace_part(trace, oa, ob).expert_counts().astype(np.float64)
        scored = trace_part(trace, sa, sb)
        cfg = scored_config(scored, [("static", placement)], cluster, config, profile)
        static = simulate(scored, [("static", placement)], cluster, cfg, profile)[0].summary
        split = {"observe": [oa, ob], "score": [sa, sb], "duration_s": cfg.duration, "scored_tokens": scored.num_tokens,
                 "static": _row(static)}
        for name, rb in configs.items():
            rb = dataclasses.replace(rb, observed=observed)
            r = simulate(scored, [("static", placement)], cluster, dataclasses.replace(cfg, rebalance=rb), profile)[0].summary
            split[name] = _row(r)
        per_split.append(split)
    rows = [_mean_row("static", [s["static"] for s in per_split], None)]
    for name in configs:
        rows.append(_mean_row(name, [s[name] for s in per_split], [s["static"] for s in per_split]))
    return {"splits": per_split, "rows": rows}


def _row(summary: dict) -> dict:
    hist = summary.get("rebalance_history", [])
    return {"tok_s": tok_s(summary), "output_tok_s": float(summary["output_tok_s"]),
            "iterations": int(summary.get("iterations", 0)), "straggler_share": float(summary["straggler_share"]),
            "rebalances": int(summary.get("rebalances", 0)), "stall_s": float(summary.get("stall_s", 0.0)),
            "decision_s": float(sum(h["decision_s"] for h in hist)),
            "transfer_s": float(sum(h["transfer_s"] for h in hist)),
            # async transfers share the links with the all-to-all: the steps they overlap slow down
            "a2a_slowdown_s": float(sum(h.get("a2a_slowdown_s", 0.0) for h in hist))}


def _mean_row(name: str, rows: list[dict], static: list[dict] | None) -> dict:
    out = {"config": name}
    for k in rows[0]:
        v = float(np.mean([r[k] for r in rows]))
        out[k] = round(v) if k in ("rebalances", "iterations") else v
    if static is not None:
        gains = [r["tok_s"] / s["tok_s"] - 1 if s["tok_s"] > 0 else 0.0
                 for r, s in zip(rows, static)]
        out["gains"] = gains
        out["gain"], out["gain_lo"], out["gain_hi"] = gain_interval(gains)
    return out


def verdict(rows: list[dict]) -> str:
    """The recommendation from :func:`unseen_runs`' rows: online when the best rebalancer's interval lies
    above zero, static when every rebalancer's lies below, else "no clear winner"."""
    online = [r for r in rows if "gain" in r]
    best = max(online, key=lambda r: r["gain"])
    span = f"{best['gain']:+.1%} tok/s over static, 80 % interval {best['gain_lo']:+.1%} to {best['gain_hi']:+.1%}"
    if best["gain_lo"] > 0:
        return f"online rebalancing: {best['config']} ({span})"
    if all(r["gain_hi"] < 0 for r in online):
        return f"a static placement: every rebalancer loses on unseen traffic (best {best['config']}: {span})"
    return (f"no clear winner: the best rebalancer ({best['config']}: {span}) is not clearly better or worse than "
            "static on traffic it had not seen; static is the simpler choice")
