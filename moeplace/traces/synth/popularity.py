"""Popularity design: the domains' drift schedule, the per-(layer, domain) expert popularity solved
for the skew, CV and cross-domain correlation targets, theme groups, and quantization to u-space."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from moeplace.foundation.model import ModelSpec
from moeplace.traces.measures import coef_of_variation, max_over_mean
from moeplace.traces.synth.config import DOMAIN_NAMES, U_SIZE, SynthConfig


def domain_names(num_domains: int) -> tuple[str, ...]:
    return tuple(DOMAIN_NAMES[i] if i < len(DOMAIN_NAMES) else f"domain-{i}" for i in range(num_domains))


def drift_anchor_mixes(cfg: SynthConfig, rng: np.random.Generator) -> np.ndarray:
    """Domain mix at the ``drift_phases + 1`` anchor points of the trace (fractions 0, 1/K, ..., 1);
    float64 ``[K+1, D]``, rows sum to 1. Phase i is dominated by one domain to the extent ``drift``."""
    num_domains = cfg.num_domains
    even = np.full(num_domains, 1.0 / num_domains)
    dominant = rng.permutation(max(num_domains, cfg.drift_phases + 1))[: cfg.drift_phases + 1] % num_domains
    return (1 - cfg.drift) * even[None, :] + cfg.drift * np.eye(num_domains)[dominant]


def mix_at(anchors: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Domain mix at trace fractions ``frac`` ([n] in [0, 1]) by linear interpolation of the anchors:
    ``[n, D]``."""
    num_phases = anchors.shape[0] - 1
    x = np.clip(np.asarray(frac, dtype=np.float64), 0.0, 1.0) * num_phases
    i = np.minimum(x.astype(np.int64), num_phases - 1) if num_phases > 0 else np.zeros(len(x), np.int64)
    t = (x - i)[:, None]
    return anchors[i] * (1 - t) + anchors[np.minimum(i + 1, num_phases)] * t


def average_mix(anchors: np.ndarray) -> np.ndarray:
    """Time-average of the piecewise-linear mix (trapezoid rule, exact): ``[D]``."""
    if anchors.shape[0] == 1:
        return anchors[0]
    return (anchors[:-1] + anchors[1:]).mean(axis=0) / 2


LAYER_COHERENCE = 0.9  # correlation of the popularity fields of consecutive layers along affinity pairs
COLD_KNEE = 0.75  # standard-normal quantile (77%) below which the cold tail is stretched


def _shapes(log_sigma: np.ndarray, x: np.ndarray, beta: float) -> np.ndarray:
    """Normalized popularities ``exp(sigma_l * x')`` with the cold tail ``x < COLD_KNEE`` stretched by
    ``1 + beta``: ``x`` float32 ``[L, D, E]``, ``log_sigma`` ``[L]`` -> float32 ``[L, D, E]``."""
    return _stretched_shapes(log_sigma, _stretch(x, beta))


def _stretch(x: np.ndarray, beta: float) -> np.ndarray:
    """``x'``: ``x`` with its part below ``COLD_KNEE`` stretched by ``1 + beta``."""
    return np.where(x < COLD_KNEE, COLD_KNEE + (1 + beta) * (x - COLD_KNEE), x) if beta > 0 else x


def _stretched_shapes(log_sigma: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """:func:`_shapes` of an already stretched ``xs`` (bisections over sigma stretch once)."""
    a = np.exp(log_sigma).astype(np.float32)[:, None, None] * xs
    with np.errstate(over="ignore"):
        w = np.exp(a)
    total = w.sum(axis=-1, keepdims=True)
    bad = ~(np.isfinite(total[..., 0]) & (total[..., 0] > 0))
    if bad.any():  # exp over- or underflowed (a bisection probing an extreme sigma): shift by the row maximum
        big = np.finfo(np.float32).max / 4  # sigma itself may overflow: inf * 0 -> 0, +-inf -> +-big
        ab = np.nan_to_num(a[bad], nan=0.0, posinf=big, neginf=-big)
        shifted = ab - ab.max(axis=-1, keepdims=True)
        w[bad] = np.exp(shifted)
        total[bad] = w[bad].sum(axis=-1, keepdims=True)
    return w / total


def mean_domain_correlation(pi: np.ndarray) -> float:
    """Mean over layers and domain pairs of the Pearson correlation of per-expert loads, ``pi [L, D, E]``."""
    num_domains = pi.shape[1]
    if num_domains < 2:
        return 1.0
    c = pi - pi.mean(axis=-1, keepdims=True)
    c = c / np.maximum(np.linalg.norm(c, axis=-1, keepdims=True), 1e-30)
    corr = np.einsum("lde,lfe->ldf", c, c)
    iu = np.triu_indices(num_domains, 1)
    return float(corr[:, iu[0], iu[1]].mean())


def layer_skew_targets(cfg: SynthConfig, num_layers: int) -> np.ndarray:
    """Per-MoE-layer max/mean targets: geometric in depth with median ``cfg.skew`` (never below 1)."""
    x = np.linspace(-0.5, 0.5, num_layers) if num_layers > 1 else np.zeros(1)
    return np.maximum(cfg.skew * cfg.skew_depth_ratio ** x, 1.0)


def _bisect(f, lo: float, hi: float, iters: int) -> float:
    """Root of an increasing function by bisection (the bracket end if there is none)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _transport(q_prev: np.ndarray, shift: float) -> np.ndarray:
    """Push the per-domain distributions ``q_prev [D, E]`` (circle positions of layer l-1) through the
    affinity coupling. The shared grid is uniform, rotated by ``shift`` intervals (in (-1, 1))
    relative to layer l-1, so position i of layer l overlaps positions i and i +- 1 of layer l-1:
    ``[D, E]`` (circle positions of layer l)."""
    if shift >= 0:
        return (1 - shift) * q_prev + shift * np.roll(q_prev, -1, axis=1)
    return (1 + shift) * q_prev - shift * np.roll(q_prev, 1, axis=1)


def design_popularity(model: ModelSpec, cfg: SynthConfig, rng: np.random.Generator, avg_mix: np.ndarray,
                      skew_scale: float = 1.0, cv_scale: float = 1.0, goals: tuple[float, float] | None = None
                      ) -> tuple[np.ndarray, np.ndarray, dict[str, Any], np.ndarray]:
    """Solve the popularity of the sampler's sources, in circle order (position i of layer l is expert
    ``order[l, i]``).

    Returns ``pi`` float64 ``[L, D, E]``: each domain's base distribution; ``grid_shift`` float ``[L]``: the
    rotation (in intervals) of each layer's shared grid (uniform; the affinity source uses it);
    a report; and ``total`` ``[L, E]``, the designed whole-trace load shares (circle order). A slot of
    domain d at layer l is distributed as (the copy source is neutral, the token and theme sources keep
    the domain's layout) ``q[l, d] = (1 - a) pi[l, d] + a T_l(q[l-1, d])`` with ``T_l`` the
    affinity coupling (:func:`_transport`), a near-permutation: each domain's load pattern is carried
    along stable expert pairs (hot experts make their successors hot) without mixing domains.

    ``pi[l, d] ~ exp(sigma_l * x')``, ``x = sqrt(rho) g[l] + sqrt(1 - rho) h[l, d]`` (standard normals shared
    by all domains / per domain), ``x'`` with its part below ``COLD_KNEE`` stretched by ``1 + beta``.
    ``sigma_l`` is solved layer by layer (bisection, forward through the coupling) so that the whole
    trace's load ``sum_d mix_d q[l, d]`` has the layer's max/mean target; ``beta`` and ``rho`` are solved
    on the base shapes for goals that two correction rounds move until the realized ``q`` has the
    requested median CV and mean domain correlation. With themes, each theme group of ``pi[l, d]`` is
    normalized to 1/T. ``skew_scale`` / ``cv_scale`` raise the targets by what sampling takes off
    (re-drawn duplicates; measured by :func:`build_design`'s pilot). ``goals``: the base shapes' CV and
    correlation goals a previous design with nearby targets converged to (its report's ``goals``): the
    corrections then start there and take two rounds instead of three.
    """
    design = _PopularityDesign(model, cfg, rng, avg_mix, skew_scale)
    w64 = design.w64
    # cv_scale, like skew_scale: what re-drawn duplicates take off the realized CV (build_design)
    cv_target = None if cfg.cv is None else cfg.cv * cv_scale
    cv_goal, corr_goal = cv_target, cfg.domain_correlation
    if goals is not None:
        cv_goal = None if cv_target is None else goals[0] * cv_scale
        corr_goal = goals[1]
    for _ in range(3 if goals is None else 2):
        x, beta, rho = design.solve_shapes(cv_goal, corr_goal)
        pi, q, log_sigma = design.forward(x, beta)
        total = (w64[None] * q).sum(axis=1)
        cv_real = float(np.median(coef_of_variation(total)))
        corr_real = mean_domain_correlation(q)
        # move the goals of the base shapes by the realized miss
        if cfg.cv is not None:
            cv_goal = max(0.01, cv_goal * cv_target / max(cv_real, 1e-6))
        if design.num_domains >= 2:
            corr_goal = float(np.clip(corr_goal + cfg.domain_correlation - corr_real, 0.0, 1.0))
    report = {
        "rho": rho,
        "beta": beta,
        "sigma_per_layer": np.round(np.exp(log_sigma), 4).tolist(),
        "design_trace_skew_median": float(np.median(max_over_mean(total))),
        "design_trace_cv_median": cv_real,
        "design_domain_skew_median": float(np.median(max_over_mean(q))),
        "design_domain_correlation": corr_real,
        # per unit of cv_scale: the next design of build_design starts its corrections here
        "goals": [None if cv_goal is None else cv_goal / cv_scale, corr_goal],
    }
    return pi, design.grid_shift, report, total


class _PopularityDesign:
    """The random fields, targets and solvers of one :func:`design_popularity` call (the draws happen
    here, in a fixed order, so a seed gives one design)."""

    def __init__(self, model: ModelSpec, cfg: SynthConfig, rng: np.random.Generator, avg_mix: np.ndarray,
                 skew_scale: float) -> None:
        self.num_layers, self.num_experts = model.num_moe_layers, model.num_experts
        self.num_domains = num_domains = cfg.num_domains
        num_layers, num_experts = self.num_layers, self.num_experts
        g = rng.standard_normal((num_layers, 1, num_experts))
        h = rng.standard_normal((num_layers, num_domains, num_experts))
        # Along the affinity chain (circle position i of layer l follows position i of layer l-1) the
        # popularity fields are AR(1): the base pattern of layer l agrees with the pattern the coupling
        # carries over, so mixing the two keeps the cold experts cold and the hot paths hot.
        c = LAYER_COHERENCE
        for li in range(1, num_layers):
            g[li] = c * g[li - 1] + math.sqrt(1 - c * c) * g[li]
            h[li] = c * h[li - 1] + math.sqrt(1 - c * c) * h[li]
        self.g, self.h = g.astype(np.float32), h.astype(np.float32)
        # skew_scale: the design aims above the target by what re-drawn duplicates take off (build_design)
        self.target = np.maximum(layer_skew_targets(cfg, num_layers) * skew_scale, 1.0)
        self.w = avg_mix.astype(np.float32)[None, :, None]
        self.w64 = avg_mix[:, None]
        self.a = cfg.affinity
        # the base, token and theme sources all keep the domain's layout: together they draw from pi
        self.b = 1.0 - self.a
        # the shared grid of layer l is rotated by grid_shift[l] intervals
        self.grid_shift = rng.random(num_layers)
        # theme groups: consecutive circle positions, each normalized to 1/T of every domain's load
        self.T = num_themes(model, cfg)
        self.groups = theme_groups(num_experts, self.T) if cfg.theme > 0 else None
        self.group_sizes = None if self.groups is None else np.diff(self.groups)

    def field(self, rho: float) -> np.ndarray:
        return (math.sqrt(rho) * self.g + math.sqrt(1 - rho) * self.h).astype(np.float32)

    def solve_sigma_base(self, x: np.ndarray, beta: float) -> np.ndarray:
        """Base shapes only, all layers at once: the starting point of the forward solve."""
        lo, hi = np.full(self.num_layers, math.log(1e-4)), np.full(self.num_layers, math.log(8.0))
        xs = _stretch(x, beta)
        for _ in range(18):  # log-sigma to 4e-5 (the skew targets hold to ~1 %)
            mid = (lo + hi) / 2
            up = max_over_mean((_stretched_shapes(mid, xs) * self.w).sum(axis=1)) < self.target
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
        return (lo + hi) / 2

    def solve_shapes(self, cv_goal: float | None, corr_goal: float) -> tuple[np.ndarray, float, float]:
        """``(x, beta, rho)`` of the base shapes for the CV and correlation goals."""
        w, field = self.w, self.field
        rho = 1.0 if self.num_domains < 2 else corr_goal
        beta = 0.0
        x = field(rho)
        log_sigma = self.solve_sigma_base(x, beta)
        sub = slice(None, None, 4)  # beta and rho are global: solve them on every 4th layer
        for _ in range(2):
            if cv_goal is not None:
                beta = _bisect(lambda bt, ls=log_sigma, x=x: float(np.median(coef_of_variation(
                    (_shapes(ls[sub], x[sub], bt) * w).sum(axis=1)))) - cv_goal, 0.0, 40.0, 14)
            if self.num_domains >= 2:
                rho = _bisect(lambda r, ls=log_sigma, bt=beta: mean_domain_correlation(
                    _shapes(ls[sub], field(r)[sub], bt)) - corr_goal, 0.0, 1.0, 14)
                x = field(rho)
            log_sigma = self.solve_sigma_base(x, beta)
        return x, beta, rho

    def forward(self, x: np.ndarray, beta: float) -> tuple[np.ndarray, ...]:
        """Solve sigma_l layer by layer through the coupling; returns (pi, q, log_sigma)."""
        pi = np.empty((self.num_layers, self.num_domains, self.num_experts))
        q = np.empty_like(pi)
        log_sigma = np.empty(self.num_layers)
        moved = None
        for li in range(self.num_layers):
            xl = x[li].astype(np.float64)
            if beta > 0:
                xl = np.where(xl < COLD_KNEE, COLD_KNEE + (1 + beta) * (xl - COLD_KNEE), xl)
            xl = xl - xl.max()  # what _layer exponentiates (once per layer, not per bisection step)
            lo, hi = math.log(1e-4), math.log(8.0)
            for _ in range(18):
                mid = (lo + hi) / 2
                if max_over_mean((self.w64 * self._layer(mid, xl, moved)[1]).sum(axis=0)) < self.target[li]:
                    lo = mid
                else:
                    hi = mid
            log_sigma[li] = (lo + hi) / 2
            pi[li], q[li] = self._layer(log_sigma[li], xl, moved)
            if li + 1 < self.num_layers:
                moved = _transport(q[li], self.grid_shift[li + 1] - self.grid_shift[li])
        return pi, q, log_sigma

    def _layer(self, ls: float, xc: np.ndarray, moved: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """One layer's base popularity ``pi`` at log-sigma ``ls`` and its per-slot distribution ``q``
        (``xc``: the layer's field less its maximum)."""
        p = np.exp(math.exp(ls) * xc)
        if self.groups is None:
            p /= p.sum(axis=1, keepdims=True)
        else:
            p /= np.add.reduceat(p, self.groups[:-1], axis=1).repeat(self.group_sizes, axis=1) * self.T
        # first MoE layer: no previous expert to follow, the affinity draws fall to the base
        return p, (p if moved is None else self.b * p + self.a * moved)


THEME_GROUP_PER_SLOT = 7  # auto themes: a group has at least ~7 experts per top-k slot (K3: 8 x 112)


def num_themes(model: ModelSpec, cfg: SynthConfig) -> int:
    """``cfg.themes``, or by default the largest power of two T with groups of at least
    ``THEME_GROUP_PER_SLOT * top_k`` experts (K3: 8 groups of 112; Qwen3-30B-A3B: 2 of 64; a model too
    small for that: 1, which makes theme draws plain base draws). Groups much smaller than that would
    hold most of a token's top-k and make random tokens share experts far more than real routers do."""
    if cfg.themes is not None:
        return cfg.themes
    fit = model.num_experts // (THEME_GROUP_PER_SLOT * model.top_k)
    return 1 << (fit.bit_length() - 1) if fit >= 1 else 1


def theme_groups(num_experts: int, themes: int) -> np.ndarray:
    """Boundaries ``[T + 1]`` of the theme groups in circle positions (consecutive, sizes differ by <= 1)."""
    return np.arange(themes + 1) * num_experts // themes


def theme_bounds(themes: int) -> np.ndarray:
    """Boundaries ``[T + 1]`` of the themes' u-intervals (each layout gives a group exactly its interval)."""
    return np.arange(themes + 1, dtype=np.int64) * U_SIZE // themes


def quantize(pi: np.ndarray, total: int = U_SIZE) -> np.ndarray:
    """Integer interval widths ``[..., E]`` summing to ``total`` along the last axis (largest remainder)."""
    x = pi * total
    q = np.floor(x).astype(np.int64)
    short = total - q.sum(axis=-1)
    frac_rank = np.argsort(-(x - q), axis=-1, kind="stable")
    add = np.arange(pi.shape[-1]) < short[..., None]
    np.put_along_axis(q, frac_rank, np.take_along_axis(q, frac_rank, axis=-1) + add, axis=-1)
    return q
