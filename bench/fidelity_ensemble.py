"""The ensemble of bench/fidelity.py: reference runs, the group-bootstrap members, each case priced by every
member, and what the held-out (out-of-bag) predictions say: errors, interval coverage and width.

- :func:`reference_runs`: every end-to-end case once through the event simulator with the reference
  constants, its steady-state iterations sampled (sim.ensemble.IterationSample), exactly as
  ``place simulate`` runs it.
- :func:`fit_members`: the group bootstrap. Each member draws as many groups as there are (of the cases
  before the cut-off), with replacement, and fits the constants by least squares with each case weighted by
  its group's draws (harness.fit), started from the reference fit. Members are fitted in worker processes.
- :func:`member_speeds`: each case's figure under every member (end-to-end: the reference run's sampled
  iterations re-priced, sim.ensemble.reprice; kernel tables: the cost model's formulas), as log speeds; a
  case that publishes its TTFT also its median TTFT, re-priced over the sampled iterations that compute
  prompt tokens (:class:`PrefillAwareSample`).
- :func:`held_out`: per case, the out-of-bag median (the members that never drew its group) and its
  residual; the grouped cross-validation's interval of each case (sim.ensemble.speed_interval with the
  case's group excluded: its members and its residuals); coverage and width, overall and by kind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import time

import numpy as np
from fidelity_harness import E2E, FIT, fit, kernel_metric, published_latency

from moeplace.sim import ensemble as ens_mod

KINDS_OF_RUN = ("prefill", "decode", "serve")


# ---------------------------------------------------------------------------- reference runs
@dataclasses.dataclass
class Run:
    """An end-to-end case's reference simulation: its figure, the summary's details, the sampled pool's
    iteration sample and cost model (its model and cluster: what re-pricing keeps), the engine
    configuration and the run's observed settings (sim.ensemble.FEATURES)."""

    simulated: float
    detail: dict
    sample: object
    cost: object
    engine: object
    features: dict


def parallel_map(fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]`` in ``workers`` forked processes (in order; one process: in this one). The
    workers inherit this process's state (synthesized traces, steady evaluators); ``fn`` must not use polars
    (its thread pool, started in this process, hangs in a fork): the cost model's numpy only."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(fn, items, chunksize=1)


def _install(state: dict) -> None:
    """A spawned worker's start: the parent's synthesized routing traces (harness ``_TRACES``, so each
    worker routes exactly the parent's tokens and synthesizes nothing), then ``init(state)``."""
    import fidelity_harness

    fidelity_harness._TRACES.update(state["traces"])
    if state["init"] is not None:
        state["init"](state["state"])


def spawn_map(fn, items: list, workers: int, init=None, state: dict | None = None,
              cost: list[float] | None = None) -> list:
    """``[fn(x) for x in items]`` in ``workers`` fresh (spawned) processes, for work that uses polars (the
    event simulator): a spawned worker starts its own interpreter, so it never inherits this process's
    polars thread pool (which hangs in a forked child). Each worker runs ``init(state)`` once, with this
    process's synthesized traces installed first (``fn``, ``init`` and ``state`` are pickled: module-level
    functions and plain data). Items are handed out longest first by ``cost`` (an estimate; it orders the
    work, never changes a result) and returned in input order. One worker, or one item: in this process,
    after ``init(state)``."""
    import fidelity_harness

    if workers <= 1 or len(items) <= 1:
        if init is not None:
            init(state)
        return [fn(x) for x in items]
    order = sorted(range(len(items)), key=lambda i: -cost[i]) if cost else list(range(len(items)))
    pack = {"traces": dict(fidelity_harness._TRACES), "init": init, "state": state}
    with multiprocessing.get_context("spawn").Pool(min(workers, len(items)), initializer=_install,
                                                   initargs=(pack,)) as pool:
        done = dict(zip(order, pool.imap(fn, [items[i] for i in order], chunksize=1)))
    return [done[i] for i in range(len(items))]


def speed(case: dict, v: float) -> float:
    """The figure as a speed (a kernel latency inverted), so that + log residual = the simulator was slow."""
    return 1.0 / v if case["metric"] == "latency_us" else v


class PrefillAwareSample(ens_mod.IterationSample):
    """A pool's iteration sample exactly as sim.ensemble.IterationSample keeps it, plus ``prefill``: a second
    systematic sample (same rule, same size) of the steady iterations that compute prompt tokens, the
    iterations a request's time to first token is spent in. It only observes: the simulation, and the main
    sample every figure is re-priced from, are the same with it or without it."""

    def __init__(self, keep: int = ens_mod.SAMPLE_ITERATIONS) -> None:
        super().__init__(keep)
        self.prefill = ens_mod.IterationSample(keep)

    def offer(self, work, moe, dt: float, link_share=None) -> None:
        super().offer(work, moe, dt, link_share)
        if float(work.pre_tokens.sum()) > 0:
            self.prefill.offer(work, moe, dt, link_share)


@contextlib.contextmanager
def prefill_sampling():
    """Within the block the event simulator's pools keep a :class:`PrefillAwareSample` (sim/engine.py makes
    each pool's sample from its module's ``IterationSample`` name when sampling is on)."""
    from moeplace.sim import engine  # bench-side hook: the name is swapped for this block only

    saved = engine.IterationSample
    engine.IterationSample = PrefillAwareSample
    try:
        yield
    finally:
        engine.IterationSample = saved


def reference_run(case: dict, cfg, quick: bool) -> Run:
    """The event simulator on an end-to-end case (stat mode, steady state after the warm-up), its pool's
    steady iterations sampled for re-pricing (and, apart, those that compute prompt tokens)."""
    from fidelity_harness import _from_summary, sim_run

    with prefill_sampling():
        res, s, keep, engine = sim_run(case, cfg, quick, keep_samples=True)
    pool = res.pools[-1]
    feats = ens_mod.sample_features(pool.sample, pool.cost, engine.mtp_draft)
    cost = _CostShape(pool.cost.model, pool.cost.cluster)
    return Run(_from_summary(case, s), keep, pool.sample, cost, engine, feats)


@dataclasses.dataclass
class _CostShape:
    """What re-pricing needs of a pool's cost model (sim.ensemble.reprice): its model and cluster."""

    model: object
    cluster: object


# ---------------------------------------------------------------------------- members
_W: dict = {}  # the worker processes' shared state (set before the fork)


def _fit_member(args):
    i, weights = args
    _cfg, info = fit(_W["cases"], _W["quick"], start=_W["start"], steady=_W["steady"], correction=_W["corr"],
                    weights=weights)
    return i, [info["params"][n] for n, _, _ in FIT], info["nfev"], info["seconds"], info["residual_rms_log"]


def bootstrap_bags(groups: list[str], members: int, seed: int) -> np.ndarray:
    """``[B, n]`` draws of each group per member: ``n`` draws with replacement from the ``n`` groups."""
    rng = np.random.default_rng(seed)
    n = len(groups)
    return np.stack([np.bincount(rng.integers(0, n, n), minlength=n) for _ in range(members)])


def fit_members(cases: list[dict], groups: list[str], bags: np.ndarray, start, steady: dict, corr: dict,
                quick: bool, workers: int = 2, log=print) -> tuple[np.ndarray, dict]:
    """One least-squares fit per member (its cases weighted by their group's draws), started from
    ``start``; ``workers`` processes (fork). Returns ``[B, P]`` and the cost (seconds, evaluations)."""
    _W.update(cases=cases, quick=quick, start=start, steady=steady, corr=corr)
    gi = {g: i for i, g in enumerate(groups)}
    tasks = [(b, {c["id"]: float(bag[gi[c["group"]]]) for c in cases}) for b, bag in enumerate(bags)]
    t0 = time.perf_counter()
    out = np.zeros((len(bags), len(FIT)))
    nfev, secs, rms = [0] * len(bags), [0.0] * len(bags), [0.0] * len(bags)
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.imap_unordered(_fit_member, tasks)
            for k, (i, params, nf, s, r) in enumerate(results):
                out[i], nfev[i], secs[i], rms[i] = params, nf, s, r
                if (k + 1) % 8 == 0:
                    log(f"  {k + 1} of {len(bags)} members fitted ({time.perf_counter() - t0:.0f} s)")
    else:
        for k, t in enumerate(tasks):
            i, params, nf, s, r = _fit_member(t)
            out[i], nfev[i], secs[i], rms[i] = params, nf, s, r
    return out, {"seconds": time.perf_counter() - t0, "workers": workers, "fit_seconds": secs,
                 "evaluations": nfev, "residual_rms_log": rms}


def member_configs(params: np.ndarray, base) -> list:
    names = [n for n, _, _ in FIT]
    return [base.replace(**dict(zip(names, map(float, row)))) for row in params]


def member_speeds(case: dict, run: Run | None, configs: list, reference) -> dict[str, np.ndarray]:
    """Log speed of the case's figure under every member ``[B]`` (``"figure"``); for end-to-end cases also
    of its time per output token (``"tpot"``, decode-weighted: its log is minus the TPOT's) and, where the
    case publishes a TTFT, of its median time to first token (``"ttft"``, :func:`ttft_ratio`)."""
    if run is None:
        return {"figure": np.log([speed(case, kernel_metric(case, cfg)) for cfg in configs])}
    r = ens_mod.reprice(run.sample, run.cost, configs, run.engine, reference)
    which = "decode" if case["metric"] == "per_user_tok_s" else "total"
    base = math.log(speed(case, run.simulated))
    out = {"figure": base - np.log(r[which])}
    pub = published_latency(case, "tpot")
    tpot = run.detail.get(f"tpot_{pub[1] if pub else 'p50'}_s")  # the published statistic; the median otherwise
    if tpot:
        out["tpot"] = -math.log(tpot) - np.log(r["decode"])
    pub = published_latency(case, "ttft")
    ttft = pub and run.detail.get(f"ttft_{pub[1]}_s")
    if ttft:
        out["ttft"] = -math.log(ttft) - np.log(ttft_ratio(run, configs, reference, r["total"]))
    return out


def prefill_iterations(run: Run) -> int:
    """How many sampled steady iterations that compute prompt tokens a run's TTFT is re-priced over (0: none
    sampled, or a run made without :class:`PrefillAwareSample`)."""
    pre = getattr(run.sample, "prefill", None)
    return len(pre.items) if pre is not None else 0


def ttft_ratio(run: Run, configs: list, reference, fallback: np.ndarray) -> np.ndarray:
    """Each member's time over the reference's for a request's time to first token ``[B]``: the ratio
    (sim.ensemble.reprice, ``total``) over the sampled steady iterations that compute prompt tokens, as a
    per-token time takes the decode-weighted one; the time spent waiting is taken to scale with it (the
    schedule is the reference run's, as for every re-priced figure). Where no such iteration was sampled,
    ``fallback`` (the ratio over all sampled iterations)."""
    if not prefill_iterations(run):
        return fallback
    return ens_mod.reprice(run.sample.prefill, run.cost, configs, run.engine, reference)["total"]


# ---------------------------------------------------------------------------- held-out analysis
def wmedian(z: np.ndarray, mask: np.ndarray) -> float:
    return ens_mod.weighted_quantile(z[mask], np.ones(int(mask.sum())), 0.5)


def oob_mask(bags: np.ndarray, gi: dict, group: str) -> np.ndarray:
    """Members that never drew ``group`` (all members for a group outside the bootstrap)."""
    if group not in gi:
        return np.ones(len(bags), dtype=bool)
    m = bags[:, gi[group]] == 0
    return m if m.any() else np.ones(len(bags), dtype=bool)


def held_out(cases: list[dict], speeds: dict[str, dict], features: dict[str, dict], groups: list[str],
             bags: np.ndarray, scales: dict, level: float, prior: float) -> tuple[list[dict], dict]:
    """Per case before the cut-off: the out-of-bag median and error; per end-to-end case also the residual
    record the intervals use and its grouped cross-validation interval (its group's cases and members left
    out). Returns the per-case records and the residual records (the shipped ensemble's ``cases``)."""
    gi = {g: i for i, g in enumerate(groups)}
    recs = {}
    for c in cases:
        z = speeds[c["id"]]["figure"]
        m = wmedian(z, oob_mask(bags, gi, c["group"]))
        recs[c["id"]] = {"oob_log_speed": m, "residual": math.log(speed(c, c["published"])) - m}
    residuals = [{"id": c["id"], "group": c["group"], "kind": c["kind"], "features": features[c["id"]],
                  "residual": recs[c["id"]]["residual"]} for c in cases if c["kind"] in E2E]
    ens = interval_ensemble(groups, bags, residuals, scales, level, prior)
    for c in cases:
        if c["kind"] not in E2E:
            continue
        iv = ens_mod.speed_interval(ens, speeds[c["id"]]["figure"], features[c["id"]], exclude_group=c["group"])
        recs[c["id"]]["interval"] = iv
    return [recs[c["id"]] for c in cases], residuals


def interval_ensemble(groups, bags, residuals, scales, level, prior, params=None, reference=None):
    """An :class:`sim.ensemble.Ensemble` for the intervals (uniform member weights)."""
    B = len(bags)
    names = tuple(n for n, _, _ in FIT)
    return ens_mod.Ensemble(names, reference or {}, np.zeros((B, len(names))) if params is None else params,
                            np.full(B, 1.0 / B), tuple(groups), bags, tuple(residuals), dict(scales), level, {},
                            prior)


def covered(case: dict, iv) -> bool:
    """The published figure lies in the case's interval (log speed)."""
    y = math.log(speed(case, case["published"]))
    return iv.lo <= y <= iv.hi


def coverage_stats(rows: list[tuple[dict, object]]) -> dict:
    """Coverage and median relative width ((hi - lo) / median, as figures) of (case, interval) pairs,
    overall and by kind of run, with how near each held-out case's published neighbours were. ``coverage`` is
    over cases (the issue's figure); ``group_coverage`` weighs each group (one table, one build) alike, the
    mean of its cases' coverage: printed beside it, because a group's cases miss or hold together;
    ``coverage_range``: :func:`coverage_range`, how precisely so few groups measure the coverage."""
    def stats(rs):
        if not rs:
            return {"cases": 0}
        cov = [covered(c, iv) for c, iv in rs]
        width = [math.exp(iv.hi - iv.median) - math.exp(iv.lo - iv.median) for _, iv in rs]
        by_group: dict[str, list[bool]] = {}
        for (c, _), ok in zip(rs, cov):
            by_group.setdefault(c["group"], []).append(ok)
        return {"cases": len(rs), "groups": len(by_group), "covered": int(sum(cov)),
                "coverage": float(np.mean(cov)), "group_coverage": float(np.mean([np.mean(v) for v in by_group.values()])),
                "coverage_range": coverage_range(by_group),
                "median_width": float(np.median(width)),
                "median_near": float(np.median([iv.near for _, iv in rs])),
                "missed": [{"id": c["id"], "published": c["published"],
                            "interval": [_figure(c, iv.lo), _figure(c, iv.hi)]}
                           for (c, iv), ok in zip(rs, cov) if not ok]}
    out = {"all": stats(rows)}
    for k in KINDS_OF_RUN:
        out[k] = stats([(c, iv) for c, iv in rows if c["kind"] == k])
    return out


# how precisely the held-out cases measure a coverage: resamples of whole groups (a group's cases miss or hold
# together), a fixed seed so the figure repeats
COVERAGE_RESAMPLES = 2000
COVERAGE_RANGE = (0.05, 0.95)


def coverage_range(by_group: dict[str, list[bool]], resamples: int = COVERAGE_RESAMPLES, seed: int = 0) -> list[float]:
    """The 5th and 95th percentiles of the per-case coverage over ``resamples`` group-bootstrap resamples of
    ``by_group`` (group -> its cases' covered flags; each resample draws as many groups as there are, with
    replacement, and counts every case of a drawn group): how far the coverage measured on these few groups
    could be from the one on other deployments like them. Not an interval of any simulated figure."""
    hits = np.array([sum(v) for v in by_group.values()], dtype=np.float64)
    size = np.array([len(v) for v in by_group.values()], dtype=np.float64)
    draw = np.random.default_rng(seed).integers(0, len(size), size=(resamples, len(size)))
    cov = hits[draw].sum(axis=1) / size[draw].sum(axis=1)
    return [float(np.quantile(cov, q)) for q in COVERAGE_RANGE]


COVERAGE_TARGET = (0.7, 0.9)  # issue 40: the nominal 80 % interval holds 70-90 % of held-out cases


def coverage_misses(cov: dict) -> list[str]:
    """Where :func:`coverage_stats`' coverage (overall, by kind of run) lies outside :data:`COVERAGE_TARGET`,
    as ``"decode 57.9%"``; empty when every one is within it."""
    lo, hi = COVERAGE_TARGET
    return [("overall" if k == "all" else k) + f" {v['coverage']:.1%}" for k, v in cov.items()
            if v.get("cases") and not lo <= v["coverage"] <= hi]


def _figure(case: dict, log_speed: float) -> float:
    v = math.exp(log_speed)
    return 1.0 / v if case["metric"] == "latency_us" else v


def error_stats(rows: list[tuple[dict, float]]) -> dict:
    """Median and max |error| of (case, signed error) pairs."""
    if not rows:
        return {"cases": 0}
    c, worst = max(rows, key=lambda p: abs(p[1]))
    return {"cases": len(rows), "groups": len({r["group"] for r, _ in rows}),
            "median": float(np.median([abs(e) for _, e in rows])), "max": float(max(abs(e) for _, e in rows)),
            "worst_case": c["id"], "worst_error": float(worst)}


def bound_findings(params: np.ndarray, tol: float = 0.01) -> list[dict]:
    """Per fitted constant: the members' range and how many sit on a bound (within ``tol`` of its range):
    a bound the data push against in most members is a finding, not a value."""
    out = []
    for j, (n, lo, hi) in enumerate(FIT):
        v = params[:, j]
        at_lo = int(np.sum(v <= lo + tol * (hi - lo)))
        at_hi = int(np.sum(v >= hi - tol * (hi - lo)))
        out.append({"name": n, "bounds": [lo, hi], "median": float(np.median(v)),
                    "p10": float(np.quantile(v, 0.1)), "p90": float(np.quantile(v, 0.9)),
                    "min": float(v.min()), "max": float(v.max()),
                    "at_lower": at_lo, "at_upper": at_hi, "members": len(v),
                    "pushed": (at_lo + at_hi) > len(v) / 2})
    return out
