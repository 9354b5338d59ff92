"""The cost model's fitted constants as a shipped ensemble, and the figures and 80 % intervals it gives a run.

The data do not pin the cost model's free constants down (different fits of the same published cases
disagree by tens of percent on K3), so the constants are a distribution, not a point: ``bench/fidelity.py``
fits them on resamples of whole case groups (a group bootstrap: one table, one build, one blog's sweep is
one draw) and writes the members, their weights, how they were made and each published case's held-out
residual to :data:`ENSEMBLE_PATH` (package data, format ``moeplace.cost-ensemble/1``). Nothing here reads
``bench/``.

How a run is priced (:func:`price_run`, the one function a calibration plugs into by changing members or
weights):

1. The event simulation runs once, with the ensemble's *reference* constants (the fit on every case the
   ensemble was made from; ``CostConfig()``'s defaults are the same values). The schedule it produces
   (which sequences and prefill chunks share each iteration, how they are routed) is taken as the schedule
   of every member: a documented approximation (see 3).
2. A systematic sample of the steady-state iterations (:class:`IterationSample`, at most
   ``2 x SAMPLE_ITERATIONS``, thinned by halving, never random) is re-priced by every member's
   ``CostModel.step_time`` (drafting included). Member m's time ratio over the reference is
   ``r_m = sum dt_m / sum dt_ref`` over the sample (``dt_m`` = the recorded iteration time with the
   reference's step replaced by member m's, so stalls and link sharing stay), for all iterations and, for
   the per-token figures, weighted by the decoding sequences of each iteration.
3. A throughput figure S of member m is ``S / r_m`` in a closed loop; with open-loop arrivals the pool
   cannot serve more than it was offered: ``min(S / (u r_m), S)`` below saturation (``u`` the pool's busy
   share), ``S / r_m`` at it. A per-token time T is ``T x r_m`` (decode-weighted). What this leaves out:
   a slower member's longer queues and larger batches (the batch composition is the reference run's).
4. The printed figure is the members' weighted median; the interval is the jackknife+-after-bootstrap
   interval (Kim, Xu and Barber 2020) over the published cases, weighted by how near each case's settings
   are to the run's (:func:`speed_interval`): for each case i, the median of the members that never saw
   case i's group, plus case i's own held-out residual (published over that out-of-bag median). So the
   interval carries both the members' spread at this run and the error the procedure made on held-out
   groups near it (it is not centred on the median: where the model was too slow on the cases near the
   run, it lies above; it is widened to hold the median where those errors all lean one way); the
   constants that priced the run are the ones its interval was measured with.
5. A run calibrated by ``place calibrate`` is priced the same way by the calibrated members (sim.calibrate.
   calibrated_ensemble: the event simulation on their weighted median member, every member with its
   calibrated weight); its interval is :func:`within_interval`: the members' spread combined with the
   within-deployment residuals of bench/fidelity_anchored.py (cases left out of their own deployment's
   calibration), with no nearness weighting.

Locality: each case weighs ``exp(-d^2 / 2)`` by its distance over the run's observed settings
(:data:`FEATURES`, scales fixed in bench/fidelity_frozen.yaml before any case was scored), divided by its
group's case count (a group counts once). ``near`` = the sum: how many groups' worth of published cases
resemble the run. Beside them, :data:`PRIOR_GROUPS` groups' worth of mass is spread over all cases (each
group alike), so where no case is near the interval becomes the one over all cases (the spread of every
error seen, wider than a well-predicted neighbourhood's) and the label says so; it never vanishes. Every
weight is a continuous function of the run's settings, and the weighted quantiles interpolate, so the
interval moves continuously with the inputs (no regime edge).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json
from moeplace.foundation.formats import check, tagged
from moeplace.sim.config import CostConfig
from moeplace.sim.cost import CostModel

ENSEMBLE_PATH = Path(__file__).with_name("cost_ensemble.json")
LEVEL = 0.8  # nominal coverage of the printed intervals
PRIOR_GROUPS = 1.0  # groups' worth of all-case mass beside the near cases' (bench/fidelity_frozen.yaml)
NEAR = 0.5  # below this many groups' worth of near cases a run is "not near any published case"
SAMPLE_ITERATIONS = 12  # an iteration sample holds between this many and twice as many steady iterations
# The run's settings the interval's locality is measured on (observed over the steady-state sample, the
# same way for a published case's reference run and for a user's run):
#   batch    log2 of the decoding sequences per attention-DP rank (at least 1)
#   prefill  the share of the pool's tokens that are prompt tokens (prefill chunks over all tokens)
#   context  log2 of the mean keys a decoding sequence or prefill chunk attends to
#   gpus     log2 of the pool's GPUs
#   blackwell 1 on B200 / B300 / GB200 / GB300, 0 on Hopper
#   drafts   MTP draft tokens per step
FEATURES = ("batch", "prefill", "context", "gpus", "blackwell", "drafts")
BLACKWELL = ("b200", "b300", "gb200-nvl72", "gb300-nvl72")


# ---------------------------------------------------------------------------- the artifact
@dataclass(frozen=True)
class Ensemble:
    """The shipped ensemble (:data:`ENSEMBLE_PATH`).

    ``names``: the fitted CostConfig fields; ``reference``: their values in the reference fit (the event
    simulation's constants); ``members`` ``[B, P]``: each member's values; ``weights`` ``[B]`` (sum 1: a
    calibration reweights them); ``groups``: the case groups the bootstrap drew from; ``bags`` ``[B, n]``:
    how many times each member's resample drew each group (0: out of bag); ``cases``: per published
    end-to-end case its ``id``, ``group``, ``kind``, ``features`` and ``residual`` (log of published over
    the out-of-bag median, speed-like: + means the simulator was too slow); ``scales``: the locality's
    feature scales; ``provenance``: how it was made."""

    names: tuple[str, ...]
    reference: dict[str, float]
    members: np.ndarray
    weights: np.ndarray
    groups: tuple[str, ...]
    bags: np.ndarray
    cases: tuple[dict, ...]
    scales: dict[str, float]
    level: float
    provenance: dict[str, Any]
    prior_groups: float = PRIOR_GROUPS
    # a calibrated ensemble's within-deployment residuals (log speed, published over predicted: the anchored
    # errors of bench/fidelity_anchored.py): its intervals are :func:`within_interval`, not the
    # jackknife+-after-bootstrap over ``cases``
    within: tuple[float, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    def reference_config(self, base: CostConfig | None = None) -> CostConfig:
        return (base or CostConfig()).replace(**self.reference)

    def member_configs(self, base: CostConfig | None = None) -> list[CostConfig]:
        """One CostConfig per member: ``base`` (default the CostConfig defaults) with the member's fitted
        values."""
        base = base or CostConfig()
        return [base.replace(**dict(zip(self.names, map(float, row)))) for row in self.members]

    def reweighted(self, weights) -> Ensemble:
        """The same members under other weights (non-negative, normalized here): what a calibration on a
        user's measured points changes."""
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != self.weights.shape or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise InputError(f"ensemble weights: expected {self.size} non-negative numbers with a positive sum")
        return dataclasses.replace(self, weights=w / w.sum())


def ensemble_doc(names, reference, members, weights, groups, bags, cases, scales, level, provenance,
                 prior_groups: float = PRIOR_GROUPS) -> dict:
    """The ``moeplace.cost-ensemble/1`` document (bench/fidelity.py writes it)."""
    return tagged("cost-ensemble", {
        "provenance": provenance, "level": level, "prior_groups": prior_groups, "names": list(names),
        "reference": {n: float(reference[n]) for n in names},
        "groups": list(groups), "scales": dict(scales),
        "members": [{"params": {n: float(v) for n, v in zip(names, row)}, "weight": float(w),
                     "bag": {g: int(k) for g, k in zip(groups, bag) if k}}
                    for row, w, bag in zip(members, weights, bags)],
        "cases": list(cases)})


def parse_ensemble(doc: Any, source: str) -> Ensemble:
    """An :class:`Ensemble` from its document; one-line errors naming ``source`` and the field."""
    check(doc, "cost-ensemble", source)
    try:
        names = tuple(doc["names"])
        fields = {f.name for f in dataclasses.fields(CostConfig)}
        bad = [n for n in names if n not in fields]
        if bad:
            raise InputError(f"{source}: field 'names' lists {bad[0]!r}, not a cost-model constant")
        groups = tuple(doc["groups"])
        members = np.array([[float(m["params"][n]) for n in names] for m in doc["members"]], dtype=np.float64)
        weights = np.array([float(m["weight"]) for m in doc["members"]], dtype=np.float64)
        bags = np.array([[int(m["bag"].get(g, 0)) for g in groups] for m in doc["members"]], dtype=np.int64)
        reference = {n: float(doc["reference"][n]) for n in names}
        scales = {f: float(doc["scales"][f]) for f in FEATURES}
        cases = tuple(doc["cases"])
        for c in cases:
            if c["group"] not in groups or not math.isfinite(float(c["residual"])):
                raise InputError(f"{source}: case {c.get('id')!r}: unknown group or no finite residual")
            for f in FEATURES:
                float(c["features"][f])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{source}: not a complete cost ensemble ({type(exc).__name__}: {exc})") from None
    if len(members) < 2 or np.any(weights < 0) or weights.sum() <= 0:
        raise InputError(f"{source}: field 'members': expected at least 2 members with non-negative weights")
    for row in members:  # every member must be a valid CostConfig
        CostConfig().replace(**dict(zip(names, map(float, row))))
    return Ensemble(names, reference, members, weights / weights.sum(), groups, bags, cases, scales,
                    float(doc.get("level", LEVEL)), dict(doc.get("provenance") or {}),
                    float(doc.get("prior_groups", PRIOR_GROUPS)))


@lru_cache(maxsize=4)
def _load(path: str) -> Ensemble:
    return parse_ensemble(read_json(path, missing="missing (the package's cost ensemble; bench/fidelity.py "
                                                  "writes it)"), path)


def load_ensemble(path: str | Path = ENSEMBLE_PATH) -> Ensemble:
    """The shipped ensemble (cached per path)."""
    return _load(str(path))


def on_reference(cfg: CostConfig, ens: Ensemble) -> bool:
    """``cfg`` holds the ensemble's reference constants (the CostConfig defaults do)."""
    return all(math.isclose(getattr(cfg, n), v, rel_tol=1e-9, abs_tol=1e-15) for n, v in ens.reference.items())


def ensemble_for(config, profile=None, ensemble: Ensemble | None = None) -> Ensemble | None:
    """The ensemble that prices a run of ``config`` (a ``sim.config.SimConfig``): ``ensemble`` when given
    (e.g. the shipped one reweighted by a calibration), else the shipped one; None unless ensemble pricing
    is on (``config.ensemble``), the run uses the roofline cost model without a calibration profile, and
    ``config.cost`` holds the ensemble's reference constants (a run on constants of its own is priced by
    those alone)."""
    if not config.ensemble or config.cost_model != "roofline" or profile is not None:
        return None
    ens = ensemble if ensemble is not None else load_ensemble()
    return ens if on_reference(config.cost, ens) else None


# ---------------------------------------------------------------------------- iteration sample
class IterationSample:
    """A systematic sample of a pool's steady-state iterations: every ``stride``-th one is kept, and when
    ``2 x keep`` are held every other one is dropped and the stride doubled (deterministic, uniform over
    the window, bounded memory). Each kept iteration holds what re-pricing it needs."""

    def __init__(self, keep: int = SAMPLE_ITERATIONS) -> None:
        self.keep = keep
        self.stride = 1
        self.seen = 0
        self.items: list[tuple] = []  # (index, work, moe, dt, link_share)

    def offer(self, work, moe, dt: float, link_share=None) -> None:
        i = self.seen
        self.seen += 1
        if i % self.stride:
            return
        self.items.append((i, dataclasses.replace(work), dataclasses.replace(moe), float(dt), link_share))
        if len(self.items) >= 2 * self.keep:
            self.stride *= 2
            self.items = [it for it in self.items if it[0] % self.stride == 0]


def sample_features(sample: IterationSample, cost, drafts: int) -> dict[str, float]:
    """The run's observed settings (:data:`FEATURES`) over a pool's iteration sample, time-weighted."""
    if not sample.items:
        return {}
    dt = np.array([it[3] for it in sample.items])
    w = dt / dt.sum()
    per = 1 + drafts
    ranks = len(sample.items[0][1].tokens)
    dec = np.array([float(it[1].dec_seqs.sum()) for it in sample.items])
    pre = np.array([float(it[1].pre_tokens.sum()) for it in sample.items])
    tok = np.array([float(it[1].tokens.sum()) for it in sample.items])
    keys = np.array([float(it[1].dec_ctx.sum()) / per + float(it[1].pre_ctx.sum()) for it in sample.items])
    seqs = np.array([float(it[1].dec_seqs.sum() + it[1].pre_seqs.sum()) for it in sample.items])
    ctx = float((w * keys).sum() / max((w * seqs).sum(), 1e-9))
    return {"batch": math.log2(max(float((w * dec).sum()) / ranks, 1.0)),
            "prefill": float((w * pre).sum() / max((w * tok).sum(), 1e-9)),
            "context": math.log2(max(ctx, 1.0)),
            "gpus": math.log2(max(cost.cluster.num_gpus, 1)),
            "blackwell": 1.0 if cost.cluster.gpu.name in BLACKWELL else 0.0,
            "drafts": float(drafts)}


def reprice(sample: IterationSample, cost, configs: list[CostConfig], engine, reference: CostConfig) -> dict:
    """Every member's time over a pool's iteration sample, relative to the reference: ``{"total": r [B],
    "decode": r_dec [B]}`` (``r = sum dt_m / sum dt_ref``; ``decode`` weights each iteration by its decoding
    sequences; where none decode it equals ``total``). ``cost``: the pool's cost model (its model, cluster
    and engine settings are kept; only the constants change)."""
    if not sample.items:
        ones = np.ones(len(configs))
        return {"total": ones, "decode": ones}

    def step(cm, work, moe, link):
        st = cm.step_time(work, moe, engine.dual_batch_overlap, link)
        return st.total + (cm.draft_time(st, work, engine.mtp_draft) if engine.mtp_draft else 0.0)

    kw = CostModel.engine_kwargs(engine)
    ref = CostModel(cost.model, cost.cluster, reference, **kw)
    base = np.array([it[3] - step(ref, it[1], it[2], it[4]) for it in sample.items])  # stalls, link waits
    dt_ref = np.array([it[3] for it in sample.items])
    dec = np.array([float(it[1].dec_seqs.sum()) for it in sample.items])
    total, decode = [], []
    for cfg in configs:
        cm = CostModel(cost.model, cost.cluster, cfg, **kw)
        dt = base + np.array([step(cm, it[1], it[2], it[4]) for it in sample.items])
        total.append(dt.sum() / dt_ref.sum())
        decode.append((dec * dt).sum() / (dec * dt_ref).sum() if dec.any() else total[-1])
    return {"total": np.array(total), "decode": np.array(decode)}


# ---------------------------------------------------------------------------- intervals
def effective_size(weights) -> float:
    """Kish's effective sample size of ``weights``: ``(sum w)^2 / sum w^2`` (how many members carry the
    answer; the number of members when the weights are equal)."""
    w = np.asarray(weights, dtype=np.float64)
    return float(w.sum() ** 2 / np.sum(w ** 2))


def weighted_quantile(values, weights, q: float) -> float:
    """The ``q`` quantile of a weighted sample, interpolated between the points' mid-cumulative weights
    (continuous in the weights and the values)."""
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    keep = w > 0
    v, w = v[keep], w[keep]
    if not len(v):
        return float("nan")
    c = (np.cumsum(w) - w / 2) / w.sum()
    return float(np.interp(q, c, v))


def locality(scales: dict[str, float], x: dict[str, float], cases) -> np.ndarray:
    """Each case's weight: ``exp(-d^2 / 2)`` over :data:`FEATURES` (each difference over its scale),
    divided by the number of cases of its group."""
    per_group: dict[str, int] = {}
    for c in cases:
        per_group[c["group"]] = per_group.get(c["group"], 0) + 1
    d2 = np.array([sum(((x[f] - float(c["features"][f])) / scales[f]) ** 2 for f in FEATURES) for c in cases])
    return np.exp(-d2 / 2) / np.array([per_group[c["group"]] for c in cases])


@dataclass(frozen=True)
class Interval:
    """A figure's ensemble median and interval, in log speed relative to the reference run (+ = faster):
    ``median``, ``lo``, ``hi``; ``near``: groups' worth of published cases near the run (None for a
    calibrated ensemble's within-deployment interval); ``members``: how many members priced it."""

    median: float
    lo: float
    hi: float
    near: float | None
    members: int


def speed_interval(ens: Ensemble, z, x: dict[str, float], exclude_group: str | None = None,
                   cases=None, members_mask=None) -> Interval:
    """The figure's weighted median and :data:`LEVEL` interval from the members' log speeds ``z`` ``[B]``
    (any common offset: log speed relative to the reference run, or absolute) at a run whose observed
    settings are ``x``: jackknife+-after-bootstrap over the published cases (module docstring), each case
    weighted by its nearness. ``exclude_group``: the grouped cross-validation's held-out group (its cases
    and every member that drew it are left out); ``cases``: the residual records (default the
    ensemble's)."""
    z = np.asarray(z, dtype=np.float64)
    if ens.within is not None and exclude_group is None and cases is None:
        return within_interval(z, ens.weights, ens.within, ens.level)
    w = ens.weights.copy()
    cases = ens.cases if cases is None else cases
    gi = {g: i for i, g in enumerate(ens.groups)}
    ok = np.ones(ens.size, dtype=bool) if members_mask is None else np.asarray(members_mask, dtype=bool)
    if exclude_group is not None:
        ok &= ens.bags[:, gi[exclude_group]] == 0 if exclude_group in gi else ok
        cases = [c for c in cases if c["group"] != exclude_group]
    if not ok.any():
        ok = np.ones(ens.size, dtype=bool)
    median = weighted_quantile(z[ok], w[ok], 0.5)
    if not cases:
        return Interval(median, median, median, 0.0, int(ok.sum()))
    scores = []
    for c in cases:
        out = ok & (ens.bags[:, gi[c["group"]]] == 0)
        if not out.any():  # no member left out both groups: the held-out group's own out-of-bag members
            out = ok
        scores.append(weighted_quantile(z[out], w[out], 0.5) + float(c["residual"]))
    scores = np.array(scores)
    lw = locality(ens.scales, x, cases)
    near = float(lw.sum())
    # the prior: PRIOR_GROUPS groups' worth of mass spread over all cases (each group alike); where no case
    # is near, the interval becomes that of all cases
    groups = {c["group"] for c in cases}
    per_group = {g: sum(c["group"] == g for c in cases) for g in groups}
    prior = np.array([ens.prior_groups / len(groups) / per_group[c["group"]] for c in cases])
    wts = lw + prior
    a = (1 - ens.level) / 2
    # the interval always holds the printed median: where the errors near the run all lean one way it is
    # widened to it rather than printed beside it
    lo, hi = weighted_quantile(scores, wts, a), weighted_quantile(scores, wts, 1 - a)
    return Interval(median, min(lo, median), max(hi, median), near, int(ok.sum()))


def within_interval(z, weights, residuals, level: float = LEVEL) -> Interval:
    """A calibrated run's figure and interval (bench/fidelity_frozen.yaml, ``calibration``): the members'
    weighted median of their log speeds ``z`` ``[B]``, and the ``(1 - level) / 2`` and ``(1 + level) / 2``
    weighted quantiles of ``z_m + e_j`` over every pair of a member (weight ``w_m``) and a within-deployment
    residual ``e_j`` (log published / predicted of a case left out of its group's calibration, weight ``1 /
    J``): the members' spread and the error the calibration made on held-out cases of other deployments,
    combined. No member of a calibration saw any of those cases, so each member is its own out-of-sample
    prediction (jackknife+ with every member out of bag for every case). Widened to hold the median."""
    z = np.asarray(z, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    e = np.asarray(residuals, dtype=np.float64)
    median = weighted_quantile(z, w, 0.5)
    if not e.size:
        return Interval(median, median, median, None, int((w > 0).sum()))
    scores = (z[:, None] + e[None, :]).ravel()
    wts = (w[:, None] * np.full(e.size, 1.0 / e.size)[None, :]).ravel()
    a = (1 - level) / 2
    lo, hi = weighted_quantile(scores, wts, a), weighted_quantile(scores, wts, 1 - a)
    return Interval(median, min(lo, median), max(hi, median), None, int((w > 0).sum()))


# ---------------------------------------------------------------------------- a run's figures
# the figures of a run's summary that the ensemble prices: throughputs (a member's S / r) and per-token
# times (T x r); TTFT is not among them (its queueing is not re-priced, and no published case checks it
# beside the two cookbook runs)
THROUGHPUT_FIGURES = ("output_tok_s", "output_tok_s_per_gpu", "input_tok_s", "input_tok_s_per_gpu", "prefill_tok_s",
                      "per_user_tok_s")
TIME_FIGURES = ("tpot_p50_s", "tpot_p99_s", "itl_s")
# which pool's ratio and which weighting each figure takes: "out" the pool that decodes, "in" the pool
# that prefills; "decode": weighted by decoding sequences
_FIGURE_RATIO = {"output_tok_s": ("out", "total"), "output_tok_s_per_gpu": ("out", "total"),
                 "input_tok_s": ("in", "total"), "input_tok_s_per_gpu": ("in", "total"),
                 "prefill_tok_s": ("in", "total"), "per_user_tok_s": ("out", "decode"),
                 "tpot_p50_s": ("out", "decode"), "tpot_p99_s": ("out", "decode"), "itl_s": ("out", "decode")}


def pool_ratios(sim, configs: list[CostConfig], reference: CostConfig) -> dict[str, dict]:
    """Per pool of a finished simulation, :func:`reprice` of its iteration sample, its busy share over the
    steady-state window and its observed settings."""
    out = {}
    window = max(sim.config.duration - sim.recorder.warmup, 1e-9)
    for p in sim.pools_list:
        s = p.sample
        pe = p.engine  # a deployment's pools batch by their own settings
        r = reprice(s, p.cost, configs, pe, reference)
        busy = sum(it[3] for it in s.items) * (s.seen / max(len(s.items), 1))
        out[p.role] = {**r, "busy": min(busy / window, 1.0), "features": sample_features(s, p.cost, pe.mtp_draft),
                       "sampled": len(s.items), "iterations": s.seen}
    return out


def member_log_speeds(summary: dict, ratios: dict[str, dict], closed: bool) -> dict[str, np.ndarray]:
    """Each priced figure's members' log speed relative to the reference run ``[B]`` (a time's is minus its
    log time ratio), from the pools' :func:`pool_ratios` (module docstring, 3)."""
    out = {}
    pools = {"out": ratios.get("decode") or ratios.get("both") or ratios.get("prefill"),
             "in": ratios.get("prefill") or ratios.get("both") or ratios.get("decode")}
    for key in THROUGHPUT_FIGURES + TIME_FIGURES:
        v = summary.get(key)
        if v is None or not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            continue
        which, weight = _FIGURE_RATIO[key]
        p = pools[which]
        r = np.asarray(p[weight], dtype=np.float64)
        if key in TIME_FIGURES or key == "per_user_tok_s" or closed or p["busy"] >= 0.98:
            z = -np.log(r)
        else:  # open loop below saturation: served what was offered unless the member is too slow for it
            z = np.minimum(-np.log(r) - np.log(max(p["busy"], 1e-9)), 0.0)
        out[key] = z
    return out


def price_run(summary: dict, sim, ens: Ensemble) -> None:
    """Price a finished simulation's figures by the ensemble (``sim`` ran with the ensemble's reference
    constants, its pools holding iteration samples): each throughput / per-token time of ``summary``
    becomes the members' weighted median, with ``<figure>_range`` ([lo, hi], the :data:`LEVEL`
    interval), and ``summary["ensemble"]`` says how (reference figures, members, nearness, iterations
    re-priced). A run priced otherwise (a profile, measured tables) is left as it is."""
    ratios = pool_ratios(sim, ens.member_configs(sim.config.cost), ens.reference_config(sim.config.cost))
    out_pool = ratios.get("decode") or ratios.get("both") or ratios.get("prefill")
    x = out_pool["features"]
    z = member_log_speeds(summary, ratios, sim.config.workload.arrival == "closed")
    reference, near = {}, None
    for key, zk in z.items():
        iv = speed_interval(ens, zk, x)
        near = iv.near
        v = float(summary[key])
        reference[key] = v
        if key in TIME_FIGURES:
            summary[key] = v * math.exp(-iv.median)
            summary[f"{key}_range"] = [v * math.exp(-iv.hi), v * math.exp(-iv.lo)]
        else:
            summary[key] = v * math.exp(iv.median)
            summary[f"{key}_range"] = [v * math.exp(iv.lo), v * math.exp(iv.hi)]
    if summary.get("itl_s") and summary.get("per_user_tok_s"):
        summary["itl_s"] = 1.0 / summary["per_user_tok_s"]
        lo, hi = summary["per_user_tok_s_range"]
        summary["itl_s_range"] = [1.0 / hi, 1.0 / lo]
    summary["ensemble"] = {
        "members": ens.size, "level": ens.level, "near": near, "features": x,
        "reference_figures": reference,
        "sampled_iterations": {k: v["sampled"] for k, v in ratios.items()},
        "iterations": {k: v["iterations"] for k, v in ratios.items()},
        "made": ens.provenance.get("made"), "cases": len(ens.cases)}
    if ens.within is not None:  # a calibration's members: the interval is the within-deployment one
        summary["ensemble"].update(calibrated=True, within_cases=len(ens.within),
                                   effective_members=effective_size(ens.weights))
