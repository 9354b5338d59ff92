"""Building the sampling tables: the popularity design corrected by pilot batches (the realized skew and
CV by secant, the locality copy probability by regula falsi on fixed random numbers)."""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.measures import topk_overlap
from moeplace.traces.synth.config import U_SIZE, SynthConfig
from moeplace.traces.synth.popularity import (
    average_mix,
    design_popularity,
    domain_names,
    drift_anchor_mixes,
    num_themes,
    quantize,
    theme_bounds,
    theme_groups,
)
from moeplace.traces.synth.sampler import ExpertSampler, SynthDesign, zipf_ranks

SKEW_ROUNDS = 4  # popularity solves per built design at most (pilot-measured skew and CV correction)
SKEW_TOL = 0.03  # relative miss of the pilot's median skew accepted (the pilot's own noise is ~1 %)


def build_design(model: ModelSpec, cfg: SynthConfig) -> SynthDesign:
    """Design the popularity, build the sampler tables and calibrate the copy probability.

    A token's top-k holds distinct experts, so duplicates are re-drawn, which takes load off the hottest
    experts (more so when themes concentrate a token's draws on a group): a pilot batch measures the
    realized median skew, and the design is solved again aiming higher by the measured ratio (up to
    ``SKEW_ROUNDS`` designs, until the pilot is within ``SKEW_TOL`` of the target)."""
    scale, cv_scale, last, best, goals = 1.0, 1.0, None, None, None
    for _ in range(SKEW_ROUNDS):
        design = _build_design(model, cfg, scale, cv_scale, goals)
        goals = tuple(design.report["goals"])  # the next design's corrections start from these
        pilot, pilot_cv = _pilot_skew_cv(design)
        miss = abs(pilot / cfg.skew - 1.0) + (0.0 if cfg.cv is None else abs(pilot_cv / cfg.cv - 1.0) / 2)
        if best is None or miss < best[0]:
            best = (miss, design, scale, cv_scale, pilot, pilot_cv)
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
    _, design, scale, cv_scale, pilot, pilot_cv = best
    copy_prob, achieved = calibrate_copy(design)
    report = dict(design.report, skew_scale=scale, cv_scale=cv_scale, pilot_skew=pilot, pilot_cv=pilot_cv,
                  copy_prob=copy_prob, pilot_locality=achieved,
                  unreached=unreached_targets(model, cfg, pilot, pilot_cv, achieved))
    return SynthDesign(**{**design.__dict__, "copy_prob": copy_prob, "report": report})


UNREACHED_TOL = 0.10  # relative miss of the pilot's skew or CV that is reported as a target not reached
LOCALITY_TOL = 0.02  # absolute miss of the pilot's consecutive-token overlap reported likewise


def unreached_targets(model: ModelSpec, cfg: SynthConfig, skew: float, cv: float, locality: float) -> list[str]:
    """One sentence per target the pilot batch did not reach, with what it reached (the command prints
    them as warnings): never a silent miss such as ``--skew 1000`` ending at 14."""
    out = []
    ceiling = model.num_experts / model.top_k  # one expert in every token's top-k
    if cfg.skew > 1.0 and abs(skew / cfg.skew - 1.0) > UNREACHED_TOL:
        why = (f"no layer's skew can pass num_experts / top_k = {ceiling:g}, and distinct top-k flattens the "
               "hottest experts before that" if cfg.skew > skew else "the popularity design cannot get flatter")
        out.append(f"--skew {cfg.skew:g} not reached: the pilot batch's median layer skew is {skew:.2f} ({why})")
    if cfg.cv is not None and cv > 0 and abs(cv / cfg.cv - 1.0) > 2 * UNREACHED_TOL:
        out.append(f"--cv {cfg.cv:g} not reached: the pilot batch's median layer CV is {cv:.2f} (the skew target "
                   "and distinct top-k bound it)")
    if cfg.locality is not None and abs(locality - cfg.locality) > LOCALITY_TOL:
        out.append(f"--locality {cfg.locality:g} not reached: the pilot batch's consecutive-token overlap is "
                   f"{locality:.3f} ({'copying at most 95% of draws' if locality < cfg.locality else 'the overlap without copying'})")
    return out


def _pilot_skew_cv(design: SynthDesign, tokens: int = 4096) -> tuple[float, float]:
    """Median over layers of the load of the designed hottest expert / the mean load, in a pilot batch
    (domains drawn from the average mix, no copying: the copy source is neutral; fixed seed). A fixed
    expert, not the batch's maximum: the maximum of noisy counts is biased upwards. Also the median CV,
    with the counts' sampling variance (Poisson: the mean) taken off."""
    cfg = design.config
    rng = np.random.default_rng([cfg.seed, 0x5CE3])
    sampler = ExpertSampler(design, rng, 1, 0.0)
    dom = rng.choice(cfg.num_domains, size=tokens, p=average_mix(design.anchors))
    ranks = zipf_ranks(design.tok_cdf, rng, tokens)
    out = sampler.sample(dom, ranks, np.full(tokens, -1), np.zeros(tokens, np.int64))
    L, E = design.model.num_moe_layers, design.model.num_experts
    key = (np.arange(L, dtype=np.int32)[None, :, None] * E + out).ravel()  # < 2^31: L * E is small
    counts = np.bincount(key, minlength=L * E).reshape(L, E).astype(np.float64)
    mean = counts.mean(axis=1)
    cv = np.sqrt(np.maximum(counts.var(axis=1) - mean, 0.0)) / mean
    return float(np.median(counts[np.arange(L), design.design_top] / mean)), float(np.median(cv))


def _build_design(model: ModelSpec, cfg: SynthConfig, skew_scale: float, cv_scale: float,
                  goals: tuple[float, float] | None = None) -> SynthDesign:
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
                                                        cv_scale, goals)
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

    design = SynthDesign(model=model, config=cfg, pi=pi, table=table.reshape(num_layers, -1), start=start, width=width,
                     tok_start=tok_start, tok_width=tok_width, tok_cdf=np.cumsum(zipf),
                     rank2token=rng.permutation(vocab).astype(np.int32), slot_offset=slot_offset,
                     anchors=anchors, domains=domain_names(num_domains), copy_prob=0.0, report=report,
                     theme_of=theme_of, design_top=design_top)
    return design


def _pilot_overlap(design: SynthDesign, copy_prob: float, num_requests: int, length: int) -> float:
    """Mean top-k overlap of consecutive tokens in a pilot of ``num_requests`` requests x ``length``
    decode tokens, with a fixed seed (common random numbers across calls)."""
    rng = np.random.default_rng([design.config.seed, 0xC0DE])
    sampler = ExpertSampler(design, rng, num_requests, copy_prob)
    dom = rng.integers(0, design.config.num_domains, num_requests)
    ranks = zipf_ranks(design.tok_cdf, rng, (num_requests, length))
    slot = np.arange(num_requests)
    overlaps = []
    for t in range(length):
        prev = slot if t > 0 else np.full(num_requests, -1)
        before = sampler.state.copy()
        out = sampler.sample(dom, ranks[:, t], prev, slot)
        if t > 0:
            overlaps.append(topk_overlap(out, before).mean())
    return float(np.mean(overlaps))


def calibrate_copy(design: SynthDesign, num_requests: int = 128, length: int = 4) -> tuple[float, float]:
    """Copy probability giving the requested consecutive-token overlap, by regula falsi on a pilot batch
    (the overlap grows with the copy probability, nearly linearly). Returns ``(copy_prob, pilot_overlap)``;
    ``locality=None``, or a target at or below the no-copy overlap, means no copying."""
    target = design.config.locality
    lo, f_lo = 0.0, _pilot_overlap(design, 0.0, num_requests, length)
    if target is None or target <= f_lo:
        return 0.0, f_lo
    hi, f_hi = 0.95, _pilot_overlap(design, 0.95, num_requests, length)
    if target >= f_hi:
        return hi, f_hi
    p, f_p = lo, f_lo
    for _ in range(5):
        p = lo + (target - f_lo) * (hi - lo) / (f_hi - f_lo)
        f_p = _pilot_overlap(design, p, num_requests, length)
        if abs(f_p - target) < 0.002:
            break
        if f_p < target:
            lo, f_lo = p, f_p
        else:
            hi, f_hi = p, f_p
    return p, f_p
