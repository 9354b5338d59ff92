"""Expert distributions laid out over simulated time: the workload of long runs and of changing traffic.

A trace of 100k tokens is routed by a 32-GPU K3 cluster in a few seconds, shorter than any engine's
rebalance interval (vLLM: 3,000 steps). To simulate the hours over which traffic shifts and an online
rebalancer acts, the statistical router (:class:`sim.routing.StatRouter`) draws each iteration's routing
from the expert distribution of the window its *simulated time* falls in, instead of walking the trace's
tokens. A :class:`Timeline` holds those windows: ``counts`` (selections per MoE layer and expert, from a
trace's token windows, a Loads file's windows, or several inputs given as phases) and the simulated second
each window ends. Routes so drawn are an estimate: the window's distribution stands for every token routed
while it lasts (top-k co-selection within a token is not kept; the link copies per selection come from the
tokens the input holds, or from tokens drawn from the loads).

A window of few tokens carries sampling noise, and a stretched timeline would hold that noise for many
simulated seconds, where an online rebalancer could fit it as if it were real skew. So consecutive
windows of one phase are merged until each holds at least :data:`MIN_PER_EXPERT` selections per expert
on average (relative noise of a mean-load expert's count about 1 / sqrt(128) = 9 %; the hot experts that
set the busiest GPU hold several times more).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.foundation.errors import InputError

MIN_PER_EXPERT = 128  # mean selections per expert a timeline window must hold (see the module docstring)


@dataclass(frozen=True, eq=False)
class Timeline:
    """Windows of expert selections over simulated time.

    ``counts``: float64 ``[W, L, E]`` selections per window, MoE layer and expert; ``ends_s``: float64
    ``[W]`` the simulated second each window ends (ascending; the last window lasts past its end);
    ``weights``: float64 ``[W]`` the traffic each window stands for (tokens; used to cut the timeline in
    parts); ``labels``: one per window (phase name and window); ``drawn``: routes are drawn from loads
    (no per-token routing behind them at all)."""

    counts: np.ndarray
    ends_s: np.ndarray
    weights: np.ndarray
    labels: tuple[str, ...]
    drawn: bool = False

    @property
    def num_windows(self) -> int:
        return int(self.counts.shape[0])

    @property
    def duration_s(self) -> float:
        return float(self.ends_s[-1])

    def freq(self) -> np.ndarray:
        """Expert frequencies ``[W, L, E]`` (rows sum to 1; a layer without selections in a window takes the
        whole timeline's)."""
        tot = self.counts.sum(axis=0)
        whole = tot / np.maximum(tot.sum(axis=1, keepdims=True), 1e-300)
        s = self.counts.sum(axis=2, keepdims=True)
        return np.where(s > 0, self.counts / np.maximum(s, 1e-300), whole[None])

    def window_at(self, t: float) -> int:
        """The window simulated second ``t`` falls in (the last one past the end)."""
        return min(int(np.searchsorted(self.ends_s, t, side="right")), self.num_windows - 1)

    def stretched(self, duration: float) -> Timeline:
        """The same windows spread over ``duration`` simulated seconds (relative lengths kept)."""
        return Timeline(self.counts, self.ends_s * (duration / self.duration_s), self.weights, self.labels,
                        self.drawn)

    def part(self, a: int, b: int) -> Timeline:
        """Windows ``[a, b)`` as a timeline starting at 0 (their own lengths)."""
        start = float(self.ends_s[a - 1]) if a else 0.0
        return Timeline(self.counts[a:b], self.ends_s[a:b] - start, self.weights[a:b], self.labels[a:b], self.drawn)

    def blocks(self, n: int, what: str, splits_flag: str = "--splits") -> list[tuple[int, int]]:
        """``n`` contiguous window ranges ``[a, b)`` of about equal traffic (``weights``), time order.
        ``splits_flag``: the flag that chose ``n - 1`` splits, for the message when the input is too short."""
        W = self.num_windows
        if W < n:
            fewer = f"fewer {splits_flag} (it is {n - 1}), or " if n > 2 else ""
            raise InputError(f"{what}: {W} window(s) of at least {MIN_PER_EXPERT} selections per expert cannot be "
                             f"cut into {n} parts (one observed, one scored{' per split' if n > 2 else ''}): use "
                             f"{fewer}a longer input")
        cum = np.cumsum(self.weights)
        cuts = [0]
        for i in range(1, n):
            c = int(np.searchsorted(cum, cum[-1] * i / n, side="left")) + 1
            cuts.append(min(max(c, cuts[-1] + 1), W - (n - i)))
        cuts.append(W)
        return [(cuts[i], cuts[i + 1]) for i in range(n)]


def merge_windows(counts: np.ndarray, min_per_expert: float = MIN_PER_EXPERT) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of consecutive windows of ``counts`` ``[W, L, E]`` merged until each holds at least
    ``min_per_expert`` selections per expert on average (per layer, the least-filled layer decides); a short
    tail joins the range before it."""
    W, _, E = counts.shape
    per = counts.sum(axis=2).min(axis=1) / E  # [W] mean selections per expert, least-filled layer
    out, a, acc = [], 0, 0.0
    for w in range(W):
        acc += float(per[w])
        if acc >= min_per_expert:
            out.append((a, w + 1))
            a, acc = w + 1, 0.0
    if a < W:
        if out:
            out[-1] = (out[-1][0], W)
        else:
            out.append((0, W))
    return out


def phase_timeline(phases: list[tuple[str, np.ndarray, np.ndarray, float]], drawn: bool) -> Timeline:
    """One timeline of ``phases`` in order: ``(name, counts [W, L, E], weights [W], seconds)`` each; a
    phase's windows (merged by :func:`merge_windows`) share its seconds in proportion to their weights."""
    counts, ends, weights, labels = [], [], [], []
    t0 = 0.0
    for name, c, wts, seconds in phases:
        c = np.asarray(c, dtype=np.float64)
        if c.sum() <= 0:
            raise InputError(f"{name}: no expert selections to route")
        ranges = merge_windows(c)
        wsum = np.array([float(np.sum(wts[a:b])) for a, b in ranges])
        share = wsum / wsum.sum() if wsum.sum() > 0 else np.full(len(ranges), 1 / len(ranges))
        t = t0
        for (a, b), s, ws in zip(ranges, share, wsum):
            counts.append(c[a:b].sum(axis=0))
            t += seconds * float(s)
            ends.append(t)
            weights.append(ws)
            labels.append(f"{name} windows {a}-{b - 1}" if b - a > 1 else f"{name} window {a}")
        ends[-1] = t0 + seconds
        t0 += seconds
    return Timeline(np.stack(counts), np.asarray(ends, dtype=np.float64), np.asarray(weights, dtype=np.float64),
                    tuple(labels), drawn)


def token_windows(expert_ids: np.ndarray, num_experts: int, window_tokens: int) -> np.ndarray:
    """Selections per window of ``window_tokens`` consecutive tokens: ``expert_ids`` uint16 ``[T, L, k]`` ->
    float64 ``[ceil(T / window_tokens), L, E]``."""
    T, L, _ = expert_ids.shape
    out = []
    for a in range(0, T, window_tokens):
        ids = expert_ids[a:a + window_tokens]
        key = (np.arange(L, dtype=np.int64)[None, :, None] * num_experts + ids).ravel()
        out.append(np.bincount(key, minlength=L * num_experts).reshape(L, num_experts).astype(np.float64))
    return np.stack(out)
