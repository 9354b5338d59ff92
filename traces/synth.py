"""Synthetic routing traces shaped like a real MoE router (docs/design.md Sources §4), for models whose
traces we cannot capture (Kimi K3).

Every expert selection is drawn in "u-space": an expert popularity distribution is laid out as
consecutive intervals of the circle ``[0, 2^16)`` in a per-layer random expert order, and a selection is
the expert whose interval holds a point ``u`` (one table lookup). Each (MoE layer, domain) has its own
*base* layout ``pi[l, d]``; besides, each layer has a *shared grid* (every expert an equal interval, the
grid rotated by a random fraction of an interval per layer). The point comes from one of five sources:

- **base**: ``u`` uniform in the domain's layout.
- **inter-layer affinity** (``affinity``): ``u`` uniform inside the shared-grid interval of the expert
  the same slot chose at layer ``l-1``, read in the shared grid of layer ``l``: expert ``e`` at ``l-1``
  leads to the two experts at ``l`` whose intervals overlap its own, the same pairs in every domain
  (affinity is stable across workloads, ExFlow). This near-permutation carries each domain's load
  pattern from layer to layer without mixing domains; the popularity fields are correlated along it
  (``LAYER_COHERENCE``), so hot experts make their successors hot (hot paths) and cold ones stay cold.
- **token identity** (``token_effect``, ``token_experts``): the Zipf vocabulary tiles the circle, token
  ``t`` owning an interval as wide as its frequency; ``token_experts`` rotations of the circle per layer
  give the token its preferred points, and ``u`` is uniform inside the token's interval at one of them
  (domain layout). A rare token keeps landing on the same few experts (OLMoE: a token's most common
  expert is in its top-k in 90-99% of occurrences), a frequent one spreads, and over the vocabulary ``u``
  stays uniform, so this source preserves the domain's marginal.
- **theme** (``theme``, ``themes``): the experts of each layer form ``themes`` groups of consecutive
  circle positions, and the popularity is designed so that each group carries exactly 1/``themes`` of
  every domain's load (:func:`design_popularity`); a theme draw is ``u`` uniform inside the token's group.
  The token's theme comes from its id (the group under a point of the token's interval on the Zipf
  circle, so each theme gets 1/``themes`` of the tokens and the source preserves the marginal) and is the
  same at every layer. The experts one token uses therefore cluster within a layer, the way experts
  specialized on kinds of tokens are used together in real routers, which is what co-placement exploits
  (co-locating co-activated experts cuts inter-node all-to-all bytes by up to 20 % on DeepSeek-V3 /
  Qwen3 / Llama-4 traces, arXiv 2604.23150); since each group has equal load and equal size, a placement
  can co-locate groups without giving up balance. The affinity source keeps most of a token's theme from
  layer to layer (position ``i`` of the circle follows position ``i``).
- **temporal locality** (``locality``): copy the expert the same slot had at the previous token of the
  same request (marginal-neutral). The copy probability is solved (regula falsi on a pilot batch with
  fixed random numbers) so that consecutive tokens of a request share the requested fraction of top-k.

Duplicates within a token's top-k are re-drawn from the base source until none remain (this flattens
the hottest experts; the popularity design below compensates).

Popularity (:func:`design_popularity`): ``pi[l, d] ~ exp(sigma_l * x')`` with
``x = sqrt(rho) g[l] + sqrt(1 - rho) h[l, d]`` (standard normal vectors shared by all domains / per domain)
and ``x'`` its lower part stretched by ``1 + beta`` (cold experts). The realized per-slot distribution
``q[l, d]`` follows from the sources analytically (forward through the affinity coupling); ``sigma_l`` is
solved per layer so that the **whole trace's** load (domains weighted by the drift schedule's average
mix) has the layer's max/mean target (geometric in depth, median ``skew``); ``beta`` and ``rho`` so that
``q`` has the requested median CV and mean correlation between domains. A token's top-k holds distinct
experts (duplicates are re-drawn), which takes load off the hottest experts, the more so the more a
token's draws concentrate (themes): a pilot batch measures the realized median skew and CV, and the design
is solved again aiming higher (secant on the skew, up to ``SKEW_ROUNDS`` designs).

Requests: Poisson arrivals; prompt lengths lognormal with a Pareto tail (``long_fraction``) up to the
model's context (1 M tokens for K3); output lengths lognormal; a continuous-batching engine loop (decode
one token per running request per iteration, then chunked prefill FIFO under ``max_batch_tokens``) gives
the ``step`` column. **Long requests are represented, not replayed**: a prompt longer than
``max_prefill_tokens`` is represented by that many evenly spaced positions of the prompt (true position
values kept, so context lengths stay visible to sim/ and to the stats), and decode by its first
``max_decode_tokens`` tokens; the trace's token budget counts represented tokens, so a 1 M-token prompt
weighs ``max_prefill_tokens`` tokens in the loads. Each request gets a domain drawn from the mix at its
arrival; the mix moves linearly through ``drift_phases`` phases, each dominated by one domain to the
extent ``drift``.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foundation.errors import InputError
from foundation.files import raise_on_sigterm
from foundation.model import ModelSpec
from traces.format import PHASE_DECODE, PHASE_PREFILL, TraceWriter
from traces.measures import coef_of_variation, max_over_mean, topk_overlap

DOMAIN_NAMES = ("chat", "code", "math", "writing", "multilingual", "agentic", "science", "legal")
U_BITS = 16
U_SIZE = 1 << U_BITS
SYNTH_VERSION = 2


@dataclass(frozen=True)
class SynthConfig:
    """What the synthetic router should look like. Defaults follow the published statistics (docs/design.md Sources §4)."""

    num_tokens: int = 100_000
    seed: int = 0
    # popularity: median over layers of max/mean of the whole trace's per-layer load
    skew: float = 6.0
    skew_depth_ratio: float = 2.5  # skew target of the last MoE layer / first (geometric in depth)
    cv: float | None = 1.0  # median over layers of the trace load's std/mean; None: plain lognormal
    # workload domains
    num_domains: int = 5
    domain_correlation: float = 0.5  # mean Pearson correlation of two domains' per-layer loads
    drift: float = 0.6  # 0: constant even mix; 1: each phase is a single domain
    drift_phases: int = 4
    # structure on top of the popularity
    affinity: float = 0.45  # probability a slot follows the inter-layer coupling from its layer l-1 expert
    token_effect: float = 0.15  # probability a slot comes from the token id's preferred experts
    token_experts: int = 2  # preferred experts per (token id, layer) that token-sourced slots choose from
    theme: float = 0.35  # probability a slot comes from the token's theme (within-layer co-activation)
    themes: int | None = None  # equal-load expert groups per layer; None: auto (num_themes)
    locality: float | None = 0.15  # target top-k overlap of consecutive tokens of a request; None: no copy
    zipf_exponent: float = 1.05
    # requests and engine loop
    arrival_rate: float = 8.0  # requests per second (Poisson)
    prompt_median: int = 1024
    prompt_sigma: float = 1.1
    long_fraction: float = 0.03  # share of prompts from the Pareto long-context tail
    long_min: int = 32_768
    long_alpha: float = 1.1
    output_median: int = 256
    output_sigma: float = 1.0
    output_max: int = 32_768
    max_prefill_tokens: int = 4096  # represented prompt tokens per request (evenly spaced sample)
    max_decode_tokens: int = 1024  # represented decode tokens per request (the first ones)
    max_batch_tokens: int = 8192  # tokens per engine iteration
    max_running: int = 64  # concurrent requests
    iter_base_s: float = 0.012
    iter_token_s: float = 30e-6
    # output
    gate_weights: bool = False
    chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise InputError(f"synth config: field '{field}': {msg}")

        if self.num_tokens < 1:
            bad("num_tokens", f"must be >= 1, got {self.num_tokens}")
        if not self.skew >= 1.0:
            bad("skew", f"max/mean must be >= 1, got {self.skew}")
        if not self.skew_depth_ratio > 0:
            bad("skew_depth_ratio", f"must be > 0, got {self.skew_depth_ratio}")
        if self.cv is not None and not self.cv > 0:
            bad("cv", f"must be > 0 or None, got {self.cv}")
        if not 1 <= self.num_domains <= 64:
            bad("num_domains", f"must be in [1, 64], got {self.num_domains}")
        if not 0 <= self.domain_correlation <= 1:
            bad("domain_correlation", f"must be in [0, 1], got {self.domain_correlation}")
        if not 0 <= self.drift <= 1:
            bad("drift", f"must be in [0, 1], got {self.drift}")
        if self.drift_phases < 1:
            bad("drift_phases", f"must be >= 1, got {self.drift_phases}")
        for name in ("affinity", "token_effect", "theme"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.affinity + self.token_effect + self.theme > 0.95 + 1e-9:
            bad("affinity", "affinity + token_effect + theme must not exceed 0.95 (the base draw keeps the rest)")
        if self.themes is not None and not 1 <= self.themes <= 256:
            bad("themes", f"must be in [1, 256] or None (auto), got {self.themes}")
        if not 1 <= self.token_experts <= 64:
            bad("token_experts", f"must be in [1, 64], got {self.token_experts}")
        if self.locality is not None and not 0 <= self.locality < 0.9:
            bad("locality", f"must be in [0, 0.9) or None, got {self.locality}")
        for name in ("prompt_median", "output_median", "max_prefill_tokens", "max_decode_tokens",
                     "max_batch_tokens", "max_running", "chunk_tokens", "long_min", "output_max"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if not self.arrival_rate > 0:
            bad("arrival_rate", f"must be > 0, got {self.arrival_rate}")
        if not 0 <= self.long_fraction <= 1:
            bad("long_fraction", f"must be in [0, 1], got {self.long_fraction}")


# ---------------------------------------------------------------------------- popularity design
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


DEDUP_ROUNDS = 64  # re-draw rounds from the domain's layout before falling back to the shared grid
SKEW_ROUNDS = 4  # popularity designs per plan at most (pilot-measured skew and CV correction)
SKEW_TOL = 0.03  # relative miss of the pilot's median skew accepted (the pilot's own noise is ~1 %)
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
    w = np.exp(np.exp(log_sigma).astype(np.float32)[:, None, None] * xs)
    return w / w.sum(axis=-1, keepdims=True)


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
                      skew_scale: float = 1.0, cv_scale: float = 1.0
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
    (re-drawn duplicates; measured by :func:`build_plan`'s pilot).
    """
    num_layers, num_experts, num_domains = model.num_moe_layers, model.num_experts, cfg.num_domains
    g = rng.standard_normal((num_layers, 1, num_experts))
    h = rng.standard_normal((num_layers, num_domains, num_experts))
    # Along the affinity chain (circle position i of layer l follows position i of layer l-1) the
    # popularity fields are AR(1): the base pattern of layer l agrees with the pattern the coupling
    # carries over, so mixing the two keeps the cold experts cold and the hot paths hot.
    c = LAYER_COHERENCE
    for li in range(1, num_layers):
        g[li] = c * g[li - 1] + math.sqrt(1 - c * c) * g[li]
        h[li] = c * h[li - 1] + math.sqrt(1 - c * c) * h[li]
    g, h = g.astype(np.float32), h.astype(np.float32)
    # skew_scale: the design aims above the target by what re-drawn duplicates take off (build_plan)
    target = np.maximum(layer_skew_targets(cfg, num_layers) * skew_scale, 1.0)
    w = avg_mix.astype(np.float32)[None, :, None]
    w64 = avg_mix[:, None]
    a = cfg.affinity
    # the base, token and theme sources all keep the domain's layout: together they draw from pi
    b = 1.0 - a
    # the shared grid of layer l is rotated by grid_shift[l] intervals
    grid_shift = rng.random(num_layers)
    # theme groups: consecutive circle positions, each normalized to 1/T of every domain's load
    T = num_themes(model, cfg)
    groups = theme_groups(num_experts, T) if cfg.theme > 0 else None

    def field(rho: float) -> np.ndarray:
        return (math.sqrt(rho) * g + math.sqrt(1 - rho) * h).astype(np.float32)

    def solve_sigma_base(x: np.ndarray, beta: float) -> np.ndarray:
        # base shapes only, all layers at once: the starting point of the forward solve
        lo, hi = np.full(num_layers, math.log(1e-4)), np.full(num_layers, math.log(8.0))
        xs = _stretch(x, beta)
        for _ in range(22):
            mid = (lo + hi) / 2
            up = max_over_mean((_stretched_shapes(mid, xs) * w).sum(axis=1)) < target
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
        return (lo + hi) / 2

    def solve_shapes(cv_goal: float | None, corr_goal: float) -> tuple[np.ndarray, float, float]:
        rho = 1.0 if num_domains < 2 else corr_goal
        beta = 0.0
        x = field(rho)
        log_sigma = solve_sigma_base(x, beta)
        sub = slice(None, None, 4)  # beta and rho are global: solve them on every 4th layer
        for _ in range(2):
            if cv_goal is not None:
                beta = _bisect(lambda bt, ls=log_sigma, x=x: float(np.median(coef_of_variation(
                    (_shapes(ls[sub], x[sub], bt) * w).sum(axis=1)))) - cv_goal, 0.0, 40.0, 14)
            if num_domains >= 2:
                rho = _bisect(lambda r, ls=log_sigma, bt=beta: mean_domain_correlation(
                    _shapes(ls[sub], field(r)[sub], bt)) - corr_goal, 0.0, 1.0, 14)
                x = field(rho)
            log_sigma = solve_sigma_base(x, beta)
        return x, beta, rho

    def forward(x: np.ndarray, beta: float) -> tuple[np.ndarray, ...]:
        """Solve sigma_l layer by layer through the coupling; returns (pi, q, log_sigma)."""
        pi = np.empty((num_layers, num_domains, num_experts))
        q = np.empty_like(pi)
        log_sigma = np.empty(num_layers)
        moved = None
        for li in range(num_layers):
            xl = x[li].astype(np.float64)
            if beta > 0:
                xl = np.where(xl < COLD_KNEE, COLD_KNEE + (1 + beta) * (xl - COLD_KNEE), xl)

            def layer(ls: float, xl=xl, moved=moved):
                p = np.exp(math.exp(ls) * (xl - xl.max()))
                if groups is None:
                    p /= p.sum(axis=1, keepdims=True)
                else:
                    p /= np.add.reduceat(p, groups[:-1], axis=1).repeat(np.diff(groups), axis=1) * T
                # first MoE layer: no previous expert to follow, the affinity draws fall to the base
                return p, (p if moved is None else b * p + a * moved)

            lo, hi = math.log(1e-4), math.log(8.0)
            for _ in range(24):
                mid = (lo + hi) / 2
                if max_over_mean((w64 * layer(mid)[1]).sum(axis=0)) < target[li]:
                    lo = mid
                else:
                    hi = mid
            log_sigma[li] = (lo + hi) / 2
            pi[li], q[li] = layer(log_sigma[li])
            if li + 1 < num_layers:
                moved = _transport(q[li], grid_shift[li + 1] - grid_shift[li])
        return pi, q, log_sigma

    # cv_scale, like skew_scale: what re-drawn duplicates take off the realized CV (build_plan)
    cv_target = None if cfg.cv is None else cfg.cv * cv_scale
    cv_goal, corr_goal = cv_target, cfg.domain_correlation
    for _ in range(3):
        x, beta, rho = solve_shapes(cv_goal, corr_goal)
        pi, q, log_sigma = forward(x, beta)
        total = (w64[None] * q).sum(axis=1)
        cv_real = float(np.median(coef_of_variation(total)))
        corr_real = mean_domain_correlation(q)
        # move the goals of the base shapes by the realized miss
        if cfg.cv is not None:
            cv_goal = max(0.01, cv_goal * cv_target / max(cv_real, 1e-6))
        if num_domains >= 2:
            corr_goal = float(np.clip(corr_goal + cfg.domain_correlation - corr_real, 0.0, 1.0))
    report = {
        "rho": rho,
        "beta": beta,
        "sigma_per_layer": np.round(np.exp(log_sigma), 4).tolist(),
        "design_trace_skew_median": float(np.median(max_over_mean(total))),
        "design_trace_cv_median": cv_real,
        "design_domain_skew_median": float(np.median(max_over_mean(q))),
        "design_domain_correlation": corr_real,
    }
    return pi, grid_shift, report, total


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


# ---------------------------------------------------------------------------- the sampling plan
@dataclass(frozen=True, eq=False)
class SynthPlan:
    """Everything fixed before the first token: tables of the u-space sampler and the solved knobs.

    ``pi``      float64 ``[L, D, E]``: each domain's base popularity (by expert id).
    ``table``   uint16 ``[L, (D + 1) * 2^16]``: expert owning each u; blocks 0..D-1 the domains' base
    layouts, block D the shared grid of the affinity source.
    ``start``   int64  ``[L, E]``: first u of each expert's interval in the shared grid (affinity source);
    ``width`` its length.
    ``tok_start`` uint32 ``[V]`` / ``tok_width`` uint32 ``[V]``: token intervals (2^32 circle, width in
    units of 2^16 so that ``v16 * width`` fits 32 bits); ``tok_cdf`` float64 ``[V]``: Zipf CDF by rank;
    ``rank2token`` int32 ``[V]``.
    ``slot_offset`` uint32 ``[L, m]``: the m rotations of the token circle per layer (preferred experts).
    ``theme_of`` int16 ``[L, E]``: the theme group of each expert (by expert id; all 0 without themes).
    ``design_top`` int ``[L]``: the designed hottest expert of each layer.
    """

    model: ModelSpec
    config: SynthConfig
    pi: np.ndarray
    table: np.ndarray
    start: np.ndarray
    width: np.ndarray
    tok_start: np.ndarray
    tok_width: np.ndarray
    tok_cdf: np.ndarray
    rank2token: np.ndarray
    slot_offset: np.ndarray
    anchors: np.ndarray
    domains: tuple[str, ...]
    copy_prob: float
    report: dict[str, Any]
    theme_of: np.ndarray | None = None
    design_top: np.ndarray | None = None


def build_plan(model: ModelSpec, cfg: SynthConfig) -> SynthPlan:
    """Design the popularity, build the sampler tables and calibrate the copy probability.

    A token's top-k holds distinct experts, so duplicates are re-drawn, which takes load off the hottest
    experts (more so when themes concentrate a token's draws on a group): a pilot batch measures the
    realized median skew, and the design is solved again aiming higher by the measured ratio (up to
    ``SKEW_ROUNDS`` designs, until the pilot is within ``SKEW_TOL`` of the target)."""
    scale, cv_scale, last, best = 1.0, 1.0, None, None
    for _ in range(SKEW_ROUNDS):
        plan = _build_plan(model, cfg, scale, cv_scale)
        pilot, pilot_cv = _pilot_skew_cv(plan)
        miss = abs(pilot / cfg.skew - 1.0) + (0.0 if cfg.cv is None else abs(pilot_cv / cfg.cv - 1.0) / 2)
        if best is None or miss < best[0]:
            best = (miss, plan, scale, cv_scale, pilot, pilot_cv)
        skew_ok = cfg.skew <= 1.0 or pilot <= 1.0 or abs(pilot / cfg.skew - 1.0) <= SKEW_TOL
        cv_ok = cfg.cv is None or pilot_cv <= 0 or abs(pilot_cv / cfg.cv - 1.0) <= 2 * SKEW_TOL
        if skew_ok and cv_ok:
            break
        if not cv_ok:
            cv_scale = float(np.clip(cv_scale * cfg.cv / pilot_cv, 0.5, 2.0))
        if not skew_ok:
            step = scale * (cfg.skew / pilot - 1.0)  # first round: proportional
            if last is not None and abs(pilot - last[1]) > 1e-6:  # then secant on (scale, pilot)
                step = (cfg.skew - pilot) * (scale - last[0]) / (pilot - last[1])
            last = (scale, pilot)
            scale = float(np.clip(scale + step, 0.5, 2.0))
    # the round closest to the targets (a model with few experts per top-k slot may not reach them:
    # distinct top-k caps how much load one expert can take)
    _, plan, scale, cv_scale, pilot, pilot_cv = best
    copy_prob, achieved = calibrate_copy(plan)
    report = dict(plan.report, skew_scale=scale, cv_scale=cv_scale, pilot_skew=pilot, pilot_cv=pilot_cv,
                  copy_prob=copy_prob, pilot_locality=achieved)
    return SynthPlan(**{**plan.__dict__, "copy_prob": copy_prob, "report": report})


def _pilot_skew_cv(plan: SynthPlan, tokens: int = 4096) -> tuple[float, float]:
    """Median over layers of the load of the designed hottest expert / the mean load, in a pilot batch
    (domains drawn from the average mix, no copying: the copy source is neutral; fixed seed). A fixed
    expert, not the batch's maximum: the maximum of noisy counts is biased upwards. Also the median CV,
    with the counts' sampling variance (Poisson: the mean) taken off."""
    cfg = plan.config
    rng = np.random.default_rng([cfg.seed, 0x5CE3])
    sampler = ExpertSampler(plan, rng, 1, 0.0)
    dom = rng.choice(cfg.num_domains, size=tokens, p=average_mix(plan.anchors))
    ranks = zipf_ranks(plan.tok_cdf, rng, tokens)
    out = sampler.sample(dom, ranks, np.full(tokens, -1), np.zeros(tokens, np.int64))
    L, E = plan.model.num_moe_layers, plan.model.num_experts
    key = (np.arange(L, dtype=np.int32)[None, :, None] * E + out).ravel()  # < 2^31: L * E is small
    counts = np.bincount(key, minlength=L * E).reshape(L, E).astype(np.float64)
    mean = counts.mean(axis=1)
    cv = np.sqrt(np.maximum(counts.var(axis=1) - mean, 0.0)) / mean
    return float(np.median(counts[np.arange(L), plan.design_top] / mean)), float(np.median(cv))


def _build_plan(model: ModelSpec, cfg: SynthConfig, skew_scale: float, cv_scale: float) -> SynthPlan:
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    num_layers, num_experts, num_domains = model.num_moe_layers, model.num_experts, cfg.num_domains
    T = num_themes(model, cfg)
    if cfg.theme > 0 and T > num_experts:
        raise InputError(f"synth config: field 'themes': {T} themes for {num_experts} experts per layer; "
                         "a theme needs at least one expert")
    anchors = drift_anchor_mixes(cfg, rng)
    # circle position i of layer l holds expert order[l, i]: a random order, so successors are random
    order = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    pi_c, grid_shift, report, total = design_popularity(model, cfg, rng, average_mix(anchors), skew_scale,
                                                        cv_scale)
    # the designed hottest expert of each layer (the skew pilot measures what sampling leaves of it)
    design_top = order[np.arange(num_layers), total.argmax(axis=1)]
    # blocks 0..D-1: each domain's base layout; block D: the shared uniform grid (affinity source)
    widths = quantize(np.concatenate([pi_c, np.full((num_layers, 1, num_experts), 1.0 / num_experts)], axis=1))
    if cfg.theme > 0:
        # each theme group fills exactly its u-interval of every domain layout (the theme source's range)
        pos, ub = theme_groups(num_experts, T), theme_bounds(T)
        for j in range(T):
            part = pi_c[:, :, pos[j]:pos[j + 1]]
            widths[:, :num_domains, pos[j]:pos[j + 1]] = quantize(part / part.sum(axis=-1, keepdims=True),
                                                                  int(ub[j + 1] - ub[j]))
    shift = np.round(grid_shift * U_SIZE / num_experts).astype(np.int64)
    table = np.empty((num_layers, num_domains + 1, U_SIZE), np.uint16)
    for li in range(num_layers):
        for d in range(num_domains):
            table[li, d] = np.repeat(order[li], widths[li, d]).astype(np.uint16)
        table[li, num_domains] = np.roll(np.repeat(order[li], widths[li, -1]), shift[li]).astype(np.uint16)
    start = np.empty((num_layers, num_experts), np.int64)
    width = np.empty_like(start)
    grid_start = (np.cumsum(widths[:, -1], axis=1) - widths[:, -1] + shift[:, None]) % U_SIZE
    np.put_along_axis(start, order, grid_start, axis=1)
    np.put_along_axis(width, order, widths[:, -1], axis=1)
    pi = np.empty_like(pi_c)
    np.put_along_axis(pi, order[:, None, :], pi_c, axis=2)
    theme_of = np.zeros((num_layers, num_experts), np.int16)
    if cfg.theme > 0:
        group = np.repeat(np.arange(T), np.diff(theme_groups(num_experts, T))).astype(np.int16)
        np.put_along_axis(theme_of, order, np.broadcast_to(group, order.shape), axis=1)

    # Token circle: Zipf over the vocabulary; ranks map to ids by a random permutation.
    vocab = model.vocab_size
    zipf = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** cfg.zipf_exponent
    zipf /= zipf.sum()
    tok_perm = rng.permutation(vocab)  # circle order of the ranks
    tok_lo = np.empty(vocab)
    tok_lo[tok_perm] = np.cumsum(zipf[tok_perm]) - zipf[tok_perm]
    tok_start = (np.floor(tok_lo * 2.0**32) % 2**32).astype(np.uint32)
    tok_width = np.minimum(np.floor(zipf * 2.0**16), 2**16 - 1).astype(np.uint32)
    # the token's preferred points at each layer: m rotations of the token circle (any rotation keeps
    # u uniform over the Zipf vocabulary, so the token source preserves the popularity marginal)
    m = cfg.token_experts
    slot_offset = ((rng.integers(0, 2**32, num_layers, dtype=np.uint64)[:, None]
                    + (np.arange(m, dtype=np.uint64) * (2**32 // m))[None, :]) % 2**32).astype(np.uint32)

    plan = SynthPlan(model=model, config=cfg, pi=pi, table=table.reshape(num_layers, -1), start=start, width=width,
                     tok_start=tok_start, tok_width=tok_width, tok_cdf=np.cumsum(zipf),
                     rank2token=rng.permutation(vocab).astype(np.int32), slot_offset=slot_offset,
                     anchors=anchors, domains=domain_names(num_domains), copy_prob=0.0, report=report,
                     theme_of=theme_of, design_top=design_top)
    return plan


# ---------------------------------------------------------------------------- the sampler
class ExpertSampler:
    """Draws the top-k of batches of tokens, layer by layer. State: the last token's experts of every
    running request (the copy source across batches) and reusable scratch space."""

    block_tokens = 2048  # rows per inner block: keeps the working arrays in cache

    def __init__(self, plan: SynthPlan, rng: np.random.Generator, num_slots: int, copy_prob: float) -> None:
        self.plan = plan
        self.rng = rng
        m = plan.model
        self.num_layers, self.num_experts, self.k = m.num_moe_layers, m.num_experts, m.top_k
        self.num_slots = num_slots
        self.state = np.zeros((num_slots, self.num_layers, self.k), np.uint16)
        cfg = plan.config
        # Thresholds on a uint32 draw: [0, c) copy, [c, c+a) affinity, [c+a, c+a+t) token,
        # [c+a+t, c+a+t+h) theme, rest base.
        rest = 1 - copy_prob
        cuts = np.array([copy_prob, copy_prob + cfg.affinity * rest,
                         copy_prob + (cfg.affinity + cfg.token_effect) * rest,
                         copy_prob + (cfg.affinity + cfg.token_effect + cfg.theme) * rest])
        (self.copy_cut, self.aff_cut, self.tok_cut,
         self.theme_cut) = (np.minimum(cuts, 1 - 2**-32) * 2**32).astype(np.uint32)
        self.aff_span = np.uint32(self.aff_cut - self.copy_cut)
        self.tok_span = np.uint32(self.tok_cut - self.aff_cut)
        self.theme_span = np.uint32(self.theme_cut - self.tok_cut)
        # theme j is the u-interval [bounds[j], bounds[j + 1]) of every domain layout
        T = num_themes(m, cfg)
        self.themes = np.uint64(T)
        self.theme_bounds = theme_bounds(T).astype(np.uint32)
        self.theme_bounds32 = (np.arange(T + 1, dtype=np.uint64) << np.uint64(32)) // self.themes
        pow2 = T & (T - 1) == 0
        self.theme_bits = np.uint32(T.bit_length() - 1) if pow2 else None
        self.theme_keep = np.uint32((1 << (32 - T.bit_length() + 1)) - 1) if pow2 else None
        self.table = plan.table
        self.token_experts = np.uint32(cfg.token_experts)
        self.slot_step = np.uint32(2**32 // cfg.token_experts % 2**32)  # spacing of plan.slot_offset's rotations
        assert np.array_equal(plan.slot_offset, plan.slot_offset[:, :1] + self.slot_step
                              * np.arange(cfg.token_experts, dtype=np.uint32)), "slot_offset rotations"
        # start << 16 | width of every expert's interval in the shared grid: one gather per affinity draw
        self.start_width = ((plan.start.astype(np.uint32) << np.uint32(U_BITS))
                            | np.minimum(plan.width, U_SIZE - 1).astype(np.uint32))
        self.shared_key = np.uint32(cfg.num_domains << U_BITS)
        self._scratch = np.zeros(self.block_tokens * self.num_experts, np.uint8)
        self._slot_ids = np.broadcast_to(np.arange(self.k, dtype=np.uint8), (self.block_tokens, self.k))
        # intp keys: fancy indexing would otherwise convert the index array on every call
        self._row_key = (np.arange(self.block_tokens, dtype=np.intp) * self.num_experts)[:, None]

    def sample(self, domain: np.ndarray, token_rank: np.ndarray, prev: np.ndarray, slot: np.ndarray
               ) -> np.ndarray:
        """Top-k experts of ``n`` tokens in order.

        ``domain`` int [n]; ``token_rank`` int [n] (Zipf rank of the token id); ``prev`` int [n]: the
        previous token of the same request: ``-1`` none, ``< num_slots`` the saved state of that running
        slot, else ``num_slots + i`` for token ``i`` (earlier) of this batch; ``slot`` int [n]: running
        slot of the token's request (the last token of each slot is saved for the next batch).
        Returns uint16 ``[n, L, k]``.
        """
        n, num_slots = len(domain), self.num_slots
        # Rows [0, num_slots) hold the saved state, then the batch: copy sources index into it directly.
        big = np.empty((num_slots + n, self.num_layers, self.k), np.uint16)
        big[:num_slots] = self.state
        domain = np.asarray(domain, np.int32)
        prev = np.asarray(prev, np.int64)
        token_rank = np.asarray(token_rank, np.int64)
        for b0 in range(0, n, self.block_tokens):
            b1 = min(n, b0 + self.block_tokens)
            self._block(big, b0, b1, domain[b0:b1], token_rank[b0:b1], prev[b0:b1])
        out = big[num_slots:]
        last = np.full(num_slots, -1)
        last[slot] = np.arange(n)  # later tokens of a slot overwrite earlier ones
        live = last >= 0
        self.state[live] = out[last[live]]
        return out

    def _block(self, big, b0, b1, dom, rank, prev) -> None:
        plan, k, num_layers, num_slots = self.plan, self.k, self.num_layers, self.num_slots
        nb = b1 - b0
        r0 = num_slots + b0
        dom_key = (dom.astype(np.uint32) << np.uint32(U_BITS))[:, None]
        shared_key = self.shared_key
        t_start = plan.tok_start[rank][:, None]
        t_width = plan.tok_width[rank][:, None]
        can_copy = (prev >= 0)[:, None]
        src_row = np.where(prev >= 0, prev, 0)
        row_key, slot_ids = self._row_key[:nb], self._slot_ids[:nb]
        bits = np.uint32(U_BITS)
        low = np.uint32(U_SIZE - 1)
        prev_e = None
        if self.theme_span:
            # the token's theme, the same at every layer: the theme under a random point of the token's
            # interval on the 2^32 Zipf circle (a token inside one theme's arc always gets that theme)
            r16 = (self.rng.bit_generator.random_raw(nb) & np.uint64(U_SIZE - 1)).astype(np.uint32)
            point = t_start[:, 0] + r16 * t_width[:, 0]
            th = ((point.astype(np.uint64) * self.themes) >> np.uint64(32)).astype(np.intp)
            th_start = self.theme_bounds[th][:, None]
            th_width = (self.theme_bounds[th + 1] - self.theme_bounds[th])[:, None]
        if self.copy_cut:
            big_flat = big.reshape(-1)
            row_stride = num_layers * k
        for li in range(num_layers):
            table = self.table[li]
            # one 64-bit draw per selection: its halves pick the source and the point
            raw = self.rng.bit_generator.random_raw(nb * k).view(np.uint32)
            comp = raw[: nb * k].reshape(nb, k)
            v = raw[nb * k:].reshape(nb, k)
            u = v >> bits  # base: uniform point
            v16 = v & low  # uniform inside an interval (affinity / token)
            # Branch-free selects (random masks make np.where mispredict): x ^ ((x ^ y) & mask).
            # which preferred point: the low 16 bits of the source draw, scaled to [0, m)
            pick = ((comp & low) * self.token_experts) >> bits
            # = slot_offset[li, pick]: the rotations are evenly spaced (uint32 arithmetic wraps alike)
            offset = pick * self.slot_step + plan.slot_offset[li, 0]
            if self.theme_span:
                tok_u = self._token_in_theme(t_start + v16 * t_width, offset)
            else:
                tok_u = (t_start + offset + v16 * t_width) >> bits
            # (comp - lo) < (hi - lo) in uint32 arithmetic tests lo <= comp < hi in two passes
            mask = np.uint32(0) - ((comp - self.aff_cut) < self.tok_span).astype(np.uint32)
            u ^= (u ^ tok_u) & mask
            if self.theme_span:
                theme_u = th_start + ((v16 * th_width) >> bits)
                mask = np.uint32(0) - ((comp - self.tok_cut) < self.theme_span).astype(np.uint32)
                u ^= (u ^ theme_u) & mask
            if prev_e is not None:
                sw = np.take(self.start_width[li - 1], prev_e)
                aff_u = ((sw >> bits) + (((sw & low) * v16) >> bits)) & low
                mask = np.uint32(0) - ((comp - self.copy_cut) < self.aff_span).astype(np.uint32)
                u ^= (u ^ aff_u) & mask
                # affinity draws read the shared grid; base and token draws their domain's layout
                u += dom_key ^ ((dom_key ^ shared_key) & mask)
            else:
                u += dom_key
            if nb >= 512:
                # The layer's table (~0.8 MB) is cold (the other layers' tables evicted it): one sequential
                # read just before the random gather pulls it into cache, ~2x cheaper than the misses.
                np.bitwise_or.reduce(table.view(np.uint64))
            e = np.take(table, u)
            if self.copy_cut:
                flat = np.flatnonzero(((comp < self.copy_cut) & can_copy).ravel())
                if len(flat):
                    # a copying entry takes its source's settled value: sources before this block are
                    # final in `big`; sources inside it are entries of `e`, which may copy in turn
                    cr = flat // k
                    cc = flat - cr * k
                    src = src_row[cr]
                    inside = src >= r0
                    e_flat = e.reshape(-1)
                    vals = np.take(big_flat, src * row_stride + (li * k) + cc)
                    i_pos = np.flatnonzero(inside)
                    i_src = (src[i_pos] - r0) * k + cc[i_pos]
                    vals[i_pos] = np.take(e_flat, i_src)
                    while True:  # chains of copies inside the block settle in (chain length) rounds
                        e_flat[flat] = vals
                        nxt = np.take(e_flat, i_src)
                        if np.array_equal(nxt, vals[i_pos]):
                            break
                        vals[i_pos] = nxt
            e = self._dedup(li, e, dom_key, row_key, slot_ids)
            big[r0:r0 + nb, li, :] = e
            prev_e = e

    def _token_in_theme(self, point: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """u of token draws when themes are on: the preferred points rotate *within* the theme arc that
        holds the token's point on the 2^32 circle (``offset`` scaled to the arc), so a token's preferred
        experts lie in its theme; the Zipf mass is uniform along each arc, so the marginal is kept."""
        if self.theme_bits is not None:  # T a power of two: arcs of 2^(32-b), all in uint32
            keep = self.theme_keep
            return ((point & ~keep) | ((point + (offset >> self.theme_bits)) & keep)) >> np.uint32(U_BITS)
        p = point.astype(np.uint64)
        th = (p * self.themes) >> np.uint64(32)
        lo = self.theme_bounds32[th]
        arc = self.theme_bounds32[th + np.uint64(1)] - lo
        rel = p - lo + ((offset.astype(np.uint64) * arc) >> np.uint64(32))
        rel -= arc * (rel >= arc)
        return ((lo + rel) >> np.uint64(U_BITS)).astype(np.uint32)

    def _duplicates(self, e: np.ndarray, row_key, slot_ids, tile: int = 512) -> np.ndarray:
        """bool [n, k]: entries repeating an expert of a later slot of the same row."""
        n = len(e)
        if n <= tile:
            flat = row_key[:n] + e
            self._scratch[flat] = slot_ids[:n]  # the last slot of each repeated expert wins
            return self._scratch[flat] != slot_ids[:n]
        # tiles of rows reuse one cache-sized part of the scratch
        out = np.empty(e.shape, bool)
        for t0 in range(0, n, tile):
            out[t0:t0 + tile] = self._duplicates(e[t0:t0 + tile], row_key, slot_ids, tile)
        return out

    def _dedup(self, li: int, e: np.ndarray, dom_key, row_key, slot_ids) -> np.ndarray:
        """Re-draw repeated experts within a row from the base source until every row is distinct.

        Each round re-draws the flagged entries in row-major order; only rows touched by the previous
        round are re-checked (an untouched row had no repeat and did not change). After
        ``DEDUP_ROUNDS`` rounds the rest come from the shared grid (every expert an equal share), so a
        layout with fewer than k experts of non-zero width cannot make this loop forever."""
        k = self.k
        flat = np.flatnonzero(self._duplicates(e, row_key, slot_ids).ravel())
        if not len(flat):
            return e
        e_flat = e.reshape(-1)
        key = dom_key[:, 0]
        table = self.table[li]
        low = np.uint32(U_SIZE - 1)
        for r in itertools.count():
            if r == DEDUP_ROUNDS:
                key = np.full_like(key, self.shared_key)
            rows = flat // k  # ascending
            u = self.rng.bit_generator.random_raw(len(flat)).astype(np.uint32) & low
            e_flat[flat] = np.take(table, key[rows] + u)
            first = np.empty(len(rows), bool)
            first[0] = True
            np.not_equal(rows[1:], rows[:-1], out=first[1:])
            act = rows[first]  # rows re-drawn in this round, ascending
            dup = self._duplicates(e[act], row_key[:len(act)], slot_ids[:len(act)])
            local = np.flatnonzero(dup.ravel())
            if not len(local):
                return e
            lr = local // k
            flat = act[lr] * k + (local - lr * k)


def zipf_ranks(tok_cdf: np.ndarray, rng: np.random.Generator, shape) -> np.ndarray:
    """Zipf ranks of ``shape`` token draws (inverse CDF; clamped against the CDF's rounding at 1)."""
    return np.minimum(np.searchsorted(tok_cdf, rng.random(shape)), len(tok_cdf) - 1)


def _pilot_overlap(plan: SynthPlan, copy_prob: float, num_requests: int, length: int) -> float:
    """Mean top-k overlap of consecutive tokens in a pilot of ``num_requests`` requests x ``length``
    decode tokens, with a fixed seed (common random numbers across calls)."""
    rng = np.random.default_rng([plan.config.seed, 0xC0DE])
    sampler = ExpertSampler(plan, rng, num_requests, copy_prob)
    dom = rng.integers(0, plan.config.num_domains, num_requests)
    ranks = zipf_ranks(plan.tok_cdf, rng, (num_requests, length))
    slot = np.arange(num_requests)
    overlaps = []
    for t in range(length):
        prev = slot if t > 0 else np.full(num_requests, -1)
        before = sampler.state.copy()
        out = sampler.sample(dom, ranks[:, t], prev, slot)
        if t > 0:
            overlaps.append(topk_overlap(out, before).mean())
    return float(np.mean(overlaps))


def calibrate_copy(plan: SynthPlan, num_requests: int = 128, length: int = 4) -> tuple[float, float]:
    """Copy probability giving the requested consecutive-token overlap, by regula falsi on a pilot batch
    (the overlap grows with the copy probability, nearly linearly). Returns ``(copy_prob, pilot_overlap)``;
    ``locality=None``, or a target at or below the no-copy overlap, means no copying."""
    target = plan.config.locality
    lo, f_lo = 0.0, _pilot_overlap(plan, 0.0, num_requests, length)
    if target is None or target <= f_lo:
        return 0.0, f_lo
    hi, f_hi = 0.95, _pilot_overlap(plan, 0.95, num_requests, length)
    if target >= f_hi:
        return hi, f_hi
    p, f_p = lo, f_lo
    for _ in range(5):
        p = lo + (target - f_lo) * (hi - lo) / (f_hi - f_lo)
        f_p = _pilot_overlap(plan, p, num_requests, length)
        if abs(f_p - target) < 0.002:
            break
        if f_p < target:
            lo, f_lo = p, f_p
        else:
            hi, f_hi = p, f_p
    return p, f_p


# ---------------------------------------------------------------------------- requests and engine loop
@dataclass
class _Request:
    rid: int
    arrival: float
    domain: int
    prompt_len: int
    prefill_pos: np.ndarray  # represented prompt positions
    num_decode: int  # represented decode tokens
    done_prefill: int = 0
    done_decode: int = 0
    slot: int = -1


def _request_stream(cfg: SynthConfig, model: ModelSpec, anchors: np.ndarray, rng: np.random.Generator
                    ) -> Iterator[_Request]:
    """Requests in arrival order until the token budget (represented tokens) is spent exactly."""
    budget = cfg.num_tokens
    used, t, rid = 0, 0.0, 0
    max_ctx = model.max_context
    while used < budget:
        t += rng.exponential(1.0 / cfg.arrival_rate)
        if rng.random() < cfg.long_fraction:  # Pareto tail of long-context prompts
            prompt = int(min(cfg.long_min * (1 - rng.random()) ** (-1 / cfg.long_alpha), max_ctx - 1))
        else:
            prompt = int(np.clip(rng.lognormal(math.log(cfg.prompt_median), cfg.prompt_sigma), 1, max_ctx - 1))
        output = int(np.clip(rng.lognormal(math.log(cfg.output_median), cfg.output_sigma), 1,
                             min(cfg.output_max, max_ctx - prompt)))
        n_pre = min(prompt, cfg.max_prefill_tokens)
        n_dec = min(output, cfg.max_decode_tokens)
        take = min(n_pre + n_dec, budget - used)
        n_pre, n_dec = min(n_pre, take), max(0, take - n_pre)
        if prompt <= cfg.max_prefill_tokens:
            pos = np.arange(n_pre, dtype=np.int64)
        else:  # evenly spaced sample of a long prompt, true positions kept
            pos = np.unique(np.linspace(0, prompt - 1, cfg.max_prefill_tokens).astype(np.int64))[:n_pre]
        mix = mix_at(anchors, np.array([used / budget]))[0]
        domain = int(rng.choice(len(mix), p=mix))
        yield _Request(rid, t, domain, prompt, pos, n_dec)
        used += take
        rid += 1


def engine_batches(cfg: SynthConfig, model: ModelSpec, anchors: np.ndarray, rng: np.random.Generator
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Continuous batching: each iteration decodes one token of every running request in decode, then
    fills the rest of ``max_batch_tokens`` with prefill chunks (FIFO). Yields per-iteration arrays
    ``request_id, position, phase, step, domain, slot, seq`` (``seq`` = represented index of the token in
    its request)."""
    arrivals = _request_stream(cfg, model, anchors, rng)
    pending: _Request | None = next(arrivals, None)
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    free_slots = list(range(cfg.max_running - 1, -1, -1))
    clock, step = 0.0, 0
    while pending is not None or waiting or running:
        while pending is not None and pending.arrival <= clock:
            waiting.append(pending)
            pending = next(arrivals, None)
        while waiting and free_slots:
            r = waiting.popleft()
            r.slot = free_slots.pop()
            running.append(r)
        if not running:
            if pending is not None:
                clock = max(clock, pending.arrival)
            continue
        parts = []
        budget = cfg.max_batch_tokens
        for r in running:  # decode first: one token each
            if r.done_prefill == len(r.prefill_pos) and r.done_decode < r.num_decode:
                parts.append((r, np.array([r.prompt_len + r.done_decode]), PHASE_DECODE,
                              len(r.prefill_pos) + r.done_decode))
                r.done_decode += 1
                budget -= 1
        for r in running:
            if budget <= 0:
                break
            left = len(r.prefill_pos) - r.done_prefill
            if left > 0:
                take = min(left, budget)
                parts.append((r, r.prefill_pos[r.done_prefill:r.done_prefill + take], PHASE_PREFILL,
                              r.done_prefill))
                r.done_prefill += take
                budget -= take
        if parts:
            sizes = [len(p[1]) for p in parts]
            yield {
                "request_id": np.repeat([p[0].rid for p in parts], sizes),
                "position": np.concatenate([p[1] for p in parts]),
                "phase": np.repeat([p[2] for p in parts], sizes).astype(np.uint8),
                "step": np.full(sum(sizes), step, np.int64),
                "domain": np.repeat([p[0].domain for p in parts], sizes),
                "slot": np.repeat([p[0].slot for p in parts], sizes),
                "seq": np.concatenate([p[3] + np.arange(s) for p, s in zip(parts, sizes)]),
            }
            step += 1
            clock += cfg.iter_base_s + cfg.iter_token_s * sum(sizes)
        still = []
        for r in running:
            if r.done_prefill == len(r.prefill_pos) and r.done_decode >= r.num_decode:
                free_slots.append(r.slot)
            else:
                still.append(r)
        running = still


def _concat_batches(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def synth_chunks(plan: SynthPlan) -> Iterator[dict[str, np.ndarray]]:
    """Token batches of the synthetic trace in step order: the engine-loop arrays plus ``token_id``
    int32 [n] and ``experts`` uint16 ``[n, L, k]`` (and ``gate_weights`` float32 ``[n, L, k]`` when
    configured)."""
    cfg, model = plan.config, plan.model
    rng = np.random.default_rng([cfg.seed, 0x7A11])
    sampler = ExpertSampler(plan, np.random.default_rng([cfg.seed, 0xE4]), cfg.max_running, plan.copy_prob)
    buf: list[dict[str, np.ndarray]] = []
    buffered = 0

    def flush() -> dict[str, np.ndarray]:
        b = _concat_batches(buf)
        n = len(b["slot"])
        # previous token of the same request: earlier in this chunk, else the slot's saved state
        order = np.lexsort((np.arange(n), b["request_id"]))
        same = np.zeros(n, bool)
        same[1:] = b["request_id"][order[1:]] == b["request_id"][order[:-1]]
        prev = np.where(b["seq"] > 0, b["slot"], -1)
        prev[order[1:][same[1:]]] = cfg.max_running + order[:-1][same[1:]]
        ranks = zipf_ranks(plan.tok_cdf, rng, n)
        b["experts"] = sampler.sample(b["domain"], ranks, prev, b["slot"])
        b["token_id"] = plan.rank2token[ranks]
        if cfg.gate_weights:
            # sigmoid router, renormalized top-k: weights in the router's (descending) order
            g = -np.sort(-rng.exponential(1.0, b["experts"].shape).astype(np.float32), axis=-1)
            b["gate_weights"] = g / g.sum(axis=-1, keepdims=True)
        return b

    for batch in engine_batches(cfg, model, plan.anchors, rng):
        buf.append(batch)
        buffered += len(batch["slot"])
        if buffered >= cfg.chunk_tokens:
            yield flush()
            buf, buffered = [], 0
    if buf:
        yield flush()


class _TraceSink:
    """Writes the token batches of :func:`synth_chunks` as trace rows (token-major: the L MoE-layer rows
    of a token are consecutive) through a :class:`TraceWriter`."""

    def __init__(self, model: ModelSpec, cfg: SynthConfig, domains: tuple[str, ...]) -> None:
        import pyarrow as pa

        self.pa = pa
        self.cfg = cfg
        self.num_layers = model.num_moe_layers
        self.layers = np.asarray(model.moe_layers, np.uint16)
        self.names = pa.array(list(domains), pa.string())

    def write(self, writer: TraceWriter, b: dict[str, np.ndarray]) -> None:
        pa, num_layers = self.pa, self.num_layers
        n = len(b["request_id"])

        def rep(x: np.ndarray) -> np.ndarray:  # token-major rows: all layers of a token
            return np.repeat(x, num_layers)

        dom = pa.DictionaryArray.from_arrays(pa.array(rep(b["domain"]).astype(np.int8)), self.names)
        writer.write(request_id=rep(b["request_id"]), position=rep(b["position"]), phase=rep(b["phase"]),
                     step=rep(b["step"]), layer=np.tile(self.layers, n),
                     expert_ids=b["experts"].reshape(n * num_layers, -1),
                     gate_weights=(b["gate_weights"].reshape(n * num_layers, -1) if self.cfg.gate_weights
                                   else None),
                     token_id=rep(b["token_id"]), domain=dom.cast(pa.string()))


_ROW_KEYS = ("request_id", "position", "phase", "step", "domain", "token_id", "gate_weights")


class _WriterProcess:
    """The Parquet encoding and compression of a trace on a second core: a forked process owns the
    :class:`TraceWriter` (so the output stays atomic: it renames the finished directory, or deletes it
    when either side fails). Expert ids travel through a shared-memory ring of ``num_slots`` slots
    (one copy each), the small per-token columns through a pipe; a slot is reused only after the writer
    acknowledged it, so at most ``num_slots`` batches are in flight."""

    num_slots = 2

    def __init__(self, out: Path, model: ModelSpec, cfg: SynthConfig, provenance: dict[str, Any],
                 sink: _TraceSink, max_tokens: int) -> None:
        import mmap
        import multiprocessing as mp

        self.shape_per_token = (model.num_moe_layers, model.top_k)
        self.slot_elems = max_tokens * model.num_moe_layers * model.top_k
        self.shm = mmap.mmap(-1, self.num_slots * self.slot_elems * 2)  # anonymous, shared with the fork
        self.ring = np.frombuffer(self.shm, np.uint16).reshape(self.num_slots, self.slot_elems)
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=self._serve, args=(child, out, model, cfg, provenance, sink),
                                daemon=True, name="moeplace-synth-writer")
        self.proc.start()
        child.close()
        self.busy = [False] * self.num_slots
        self.next_slot = 0

    def _serve(self, conn, out, model, cfg, provenance, sink) -> None:
        """In the child: write every batch received, acknowledging its slot; exit on 'close'."""
        self.conn.close()  # the parent's end: the child must see EOF if the parent dies
        raise_on_sigterm()  # a SIGTERM sent to the child (or its process group) removes the temporary too
        try:
            with TraceWriter(out, model, provenance, gate_weights=cfg.gate_weights, token_id=True,
                             domain=True) as writer:
                while True:
                    msg = conn.recv()
                    if msg[0] == "close":
                        break
                    if msg[0] == "abort":
                        raise _Aborted
                    _, slot, n, cols = msg
                    cols["experts"] = self.ring[slot, : n * self.shape_per_token[0] * self.shape_per_token[1]
                                                ].reshape(n, *self.shape_per_token)
                    sink.write(writer, cols)
                    conn.send(("ack", slot))
            conn.send(("done", None))
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001  (any failure goes to the parent, which raises it)
            try:
                conn.send(("error", exc))
            except Exception:  # noqa: BLE001  (an exception that does not pickle)
                conn.send(("error", RuntimeError(f"trace writer failed: {exc!r}")))
        finally:
            conn.close()

    def _recv(self) -> tuple[str, Any]:
        """One message from the writer; its error is raised here."""
        try:
            kind, val = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError("the trace writer process died") from None
        if kind == "error":
            raise val
        return kind, val

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the writer is gone: raise its own error if it sent one
            while True:
                self._recv()

    def _wait(self) -> None:
        """Take one message from the writer: an acknowledged slot becomes free."""
        kind, val = self._recv()
        if kind == "ack":
            self.busy[val] = False

    def send(self, b: dict[str, np.ndarray]) -> None:
        slot = self.next_slot
        while self.busy[slot]:
            self._wait()
        ex = b["experts"]
        self.ring[slot, : ex.size] = ex.reshape(-1)
        self.busy[slot] = True
        self._send(("batch", slot, len(ex), {key: b[key] for key in _ROW_KEYS if key in b}))
        self.next_slot = (slot + 1) % self.num_slots

    def close(self) -> None:
        """Wait until every batch is written and the directory is in place."""
        self._send(("close",))
        while self._recv()[0] != "done":
            pass
        self.proc.join()

    def abort(self) -> None:
        try:
            self.conn.send(("abort",))
        except OSError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def release(self) -> None:
        self.conn.close()
        del self.ring
        self.shm.close()


class _Aborted(Exception):
    pass


def synthesize(model: ModelSpec, cfg: SynthConfig, out: str | Path, writer_process: bool | None = None
               ) -> dict[str, Any]:
    """Write a synthetic trace directory ``out`` (atomically; rows token-major: the L MoE-layer rows of a
    token are consecutive, tokens in step order). Returns a summary: tokens, rows, selections,
    requests, seconds, bytes on disk, bytes per selection and the solved knobs.

    Sampling is serial (one random stream: the trace is a function of the seed alone); the Parquet
    encoding and compression run in a forked writer process (``writer_process``; default: where fork
    exists) on the other core while the next batch is sampled, else on a thread. Either way the files
    are the same."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    plan = build_plan(model, cfg)
    t_plan = time.perf_counter() - t0
    provenance = {"kind": "synthetic", "generator": f"moeplace.synth/{SYNTH_VERSION}",
                  "config": asdict(cfg), "domains": list(plan.domains), "solved": plan.report}
    num_layers = model.num_moe_layers
    sink = _TraceSink(model, cfg, plan.domains)
    num_tokens = 0
    requests: set[int] = set()
    if writer_process is None:  # a daemonic process (a multiprocessing.Pool worker) may not have children
        writer_process = "fork" in mp.get_all_start_methods() and not mp.current_process().daemon
    if writer_process:
        # a flushed batch holds at least chunk_tokens and less than one more engine iteration
        wp = _WriterProcess(Path(out), model, cfg, provenance, sink,
                            min(cfg.num_tokens, cfg.chunk_tokens + cfg.max_batch_tokens))
        try:
            for b in synth_chunks(plan):
                wp.send(b)
                num_tokens += len(b["slot"])
                requests.update(np.unique(b["request_id"]).tolist())
            wp.close()
        except BaseException:
            wp.abort()
            raise
        finally:
            wp.release()
    else:
        with TraceWriter(out, model, provenance, gate_weights=cfg.gate_weights, token_id=True,
                         domain=True) as writer, ThreadPoolExecutor(max_workers=1) as pool:
            pending = None
            for b in synth_chunks(plan):
                if pending is not None:
                    pending.result()  # at most one batch in flight: memory stays at two batches
                pending = pool.submit(sink.write, writer, b)
                num_tokens += len(b["slot"])
                requests.update(np.unique(b["request_id"]).tolist())
            if pending is not None:
                pending.result()
    seconds = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
    selections = num_tokens * num_layers * model.top_k
    return {"out": str(out), "tokens": num_tokens, "rows": num_tokens * num_layers, "selections": selections,
            "requests": len(requests), "seconds": seconds, "plan_seconds": t_plan,
            "selections_per_s": selections / seconds, "bytes": disk, "bytes_per_selection": disk / selections,
            "solved": plan.report}
