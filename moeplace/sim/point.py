"""One measured serving point priced by the simulator under a given constant set: what ``place
calibrate`` fits the constants on.

:class:`PointModel` sets up the deployment (:class:`sim.calibrate.Deployment`) at the point's load
(closed loop at its concurrency, or Poisson arrivals at its rate; its mean prompt and output lengths) and
prices it two ways: :meth:`PointModel.event`, the discrete-event simulator in stat mode (what ``place
simulate`` prints), and :meth:`PointModel.steady`, one steady decode iteration at the point's batch (the
fit's fast evaluator). A fit multiplies the steady figure by the ratio event / steady at the starting
constants (the iteration leaves out the prefills a serving run interleaves; the ratio carries them, to
first order) and checks the result with the event simulator at the end.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import numpy as np

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import load_model
from moeplace.sim.bench_results import MeasuredPoint
from moeplace.sim.calibrate import Deployment
from moeplace.sim.config import (
    CostConfig,
    EngineConfig,
    LengthMix,
    SimConfig,
    WorkloadConfig,
    parse_mtp,
    prefill_batches_of,
)

TRACE_TOKENS = 16000  # tokens of the synthetic routing trace (stationary: one benchmark's prompt mix)


def synthetic_trace(model, tokens: int = TRACE_TOKENS):
    """A stationary synthetic routing trace of ``model`` (the project's router, drift 0), in memory."""
    from moeplace.sim.workload import load_trace_tokens  # sim.workload reads traces; import with the trace
    from moeplace.traces.synth import SynthConfig, synthesize  # the synthesizer: only without a user trace

    tmp = tempfile.mkdtemp(prefix="moeplace-calibrate-")
    try:
        synthesize(model, SynthConfig(num_tokens=tokens, drift=0.0), Path(tmp) / "trace")
        return load_trace_tokens(Path(tmp) / "trace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def deployment_model(dep: Deployment):
    m = load_model(dep.model)
    for f in ("expert_dtype", "weight_dtype"):
        if getattr(dep, f):
            m = dataclasses.replace(m, **{f: getattr(dep, f)})
    return m


def engine_config(dep: Deployment) -> EngineConfig:
    draft, acc = parse_mtp(dep.mtp) if dep.mtp else (0, 0.0)
    return EngineConfig(attention_tp=dep.attention_tp, max_batched_tokens=dep.max_batched_tokens, max_seqs=dep.max_seqs,
                        cuda_graph_max_bs=dep.cuda_graph_max_bs, dual_batch_overlap=dep.dbo,
                        replica_rule=dep.engine, kv_dtype=dep.kv_dtype, attention_dtype=dep.attention_dtype,
                        a2a_mode=dep.deepep_mode, kernel_build=dep.kernel_build, mtp_draft=draft,
                        mtp_acceptance=acc, moe_tp=dep.moe_tp, prefill_batches=prefill_batches_of(dep.engine))


class PointModel:
    """A measured point's deployment and load, priced under any constant set (module docstring)."""

    def __init__(self, dep: Deployment, point: MeasuredPoint, trace) -> None:
        from moeplace.sim.routing import StatRouter  # the router is built once per point
        from moeplace.sim.runner import (
            resolve_placement,  # the placement policy, as place simulate resolves it
        )

        self.dep, self.point = dep, point
        model = deployment_model(dep)
        self.trace = dataclasses.replace(trace, model=model)
        self.cluster = make_cluster(dep.gpus, dep.gpu, dep.gpus_per_node)
        self.engine = engine_config(dep)
        self.label, self.placement = resolve_placement(dep.placement, self.trace, self.cluster, dep.redundant,
                                                       dep.engine, 0)
        self.router = StatRouter(self.trace, self.placement, dep.engine, 0, dep.attention_tp)
        self.ranks = dep.gpus // dep.attention_tp
        self._duration: float | None = None

    # ------------------------------------------------------------------ the event simulator
    def sim_config(self, cfg: CostConfig, ensemble: bool = False) -> SimConfig:
        p = self.point
        isl, osl = max(1, round(p.isl)), max(1, round(p.osl))
        lengths = LengthMix(components=((isl, 1.0),), sigma=0.0, output_mean=osl, output_sigma=0.0,
                            max_len=LengthMix.cap_for(self.trace.model.max_context), range_ratio=p.range_ratio)
        if p.rate is None:
            wl = WorkloadConfig(arrival="closed", concurrency=p.concurrency, lengths=lengths)
        else:
            wl = WorkloadConfig(arrival="poisson", rate=p.rate, lengths=lengths)
        # without ``ensemble``, priced by cfg alone, even when cfg is the ensemble's reference
        return SimConfig(duration=self.duration, mode="stat", seed=0, engine=self.engine, cost=cfg, workload=wl,
                         ensemble=ensemble)

    @property
    def duration(self) -> float:
        """Simulated seconds of the point: 20 request lifetimes at the simulator's own pace with the shipped
        constants (the steady iteration's time per token), between 5 and 600 s -- the same for every
        constant set, so before and after compare like with like."""
        if self._duration is None:
            life = (self.point.ttft_s or 0.0) + self.point.osl * self.steady(CostConfig())["tpot_s"]
            self._duration = float(min(max(20 * life, 5.0), 600.0))
        return self._duration

    def event(self, cfg: CostConfig, ensemble=None) -> dict[str, float | None]:
        """The event simulator's figures at the point: output tok/s of the deployment, median TPOT and TTFT.
        With ``ensemble`` (a :class:`sim.ensemble.Ensemble` whose reference is ``cfg``), priced as ``place
        simulate`` prices a run: every member re-prices the run, the figures are their weighted median, with
        ``output_tok_s_range`` / ``tpot_s_range`` (the interval) and ``single``: the figures of ``cfg``
        alone."""
        from moeplace.sim.runner import simulate  # the event simulator (heavy): only when a point is priced

        config = self.sim_config(cfg, ensemble=ensemble is not None)
        s = simulate(self.trace, [(self.label, self.placement)], self.cluster, config, ensemble=ensemble)[0].summary
        out = {"output_tok_s": float(s["output_tok_s"]), "tpot_s": s.get("tpot_p50_s"), "ttft_s": s.get("ttft_p50_s"),
               "requests_finished": s["requests_finished"]}
        if ensemble is not None and s.get("ensemble"):
            ref = s["ensemble"]["reference_figures"]
            out.update(output_tok_s_range=s.get("output_tok_s_range"), tpot_s_range=s.get("tpot_p50_s_range"),
                       single={"output_tok_s": ref.get("output_tok_s"), "tpot_s": ref.get("tpot_p50_s")})
        return out

    # ------------------------------------------------------------------ one steady decode iteration
    def batch(self) -> np.ndarray:
        """Decoding sequences per attention-DP rank at the point's load ``[D]`` (a closed loop's concurrency
        spread over the ranks, at most the engine's max_seqs)."""
        D, p = self.ranks, self.point
        conc = p.concurrency if p.rate is None else max(1, round(p.rate * p.osl * (p.tpot_s or 0.02)))
        b = np.full(D, conc // D, dtype=np.float64)
        b[: conc % D] += 1
        return np.minimum(b, self.engine.max_seqs)

    def steady(self, cfg: CostConfig) -> dict[str, float]:
        """One decode iteration at the point's batch: output tok/s of the deployment and the time per output
        token of a sequence."""
        from moeplace.sim.cost import CostModel, RankWork  # the cost model, priced per constant set

        e, p = self.engine, self.point
        cost = CostModel.for_engine(self.trace.model, self.cluster, cfg, e)
        b = self.batch()
        per = 1 + e.mtp_draft
        w = RankWork.zeros(self.ranks)
        ctx = p.isl + p.osl / 2
        w.dec_seqs[:] = b
        w.tokens[:] = w.sampled[:] = b * per
        w.dec_ctx[:] = b * (ctx + 1) * per + b * per * (per - 1) / 2
        self.router.cursor = 0
        moe, _ = self.router.route_count(int(w.tokens.sum()), np.random.default_rng(0))
        st = cost.step_time(w, moe, e.dual_batch_overlap)
        dt = st.total + cost.draft_time(st, w, e.mtp_draft)
        gain = e.mtp_tokens_per_step()
        return {"output_tok_s": float(b.sum()) * gain / dt, "tpot_s": dt / gain}


def shipped_members() -> list:
    """The ensemble a calibration starts from: the shipped cost-model ensemble (sim/cost_ensemble.json, issue
    40's group bootstrap), one :class:`sim.calibrate.Member` per bootstrap member -- ``CostConfig()`` (the
    ensemble's reference constants) with the member's fitted values, its weight (normalized to sum 1) and
    its index as its name."""
    from moeplace.sim.calibrate import Member  # the ensemble interface
    from moeplace.sim.ensemble import load_ensemble  # the shipped ensemble (package data)

    ens = load_ensemble()
    w = np.asarray(ens.weights, dtype=np.float64)
    w = w / w.sum()
    return [Member(cfg, float(wi), f"member {i}") for i, (cfg, wi) in
            enumerate(zip(ens.member_configs(ens.reference_config()), w))]


def calibrate_points(dep: Deployment, points: list[MeasuredPoint], trace, members=None, prior_sd=None,
                     interval: dict | None = None, prior_source: str = "", log=None, start=None) -> dict:
    """Calibrate ``members`` (default :func:`shipped_members`) on the measured ``points`` of ``dep`` and
    return the CAL.json document: per point its measured figures, before (priced as ``place simulate``
    prices it uncalibrated: ``start``, default the shipped :class:`sim.ensemble.Ensemble`) and after (priced
    as a run with the calibration is: every calibrated member, sim.calibrate.calibrated_ensemble); what
    changed (sim.calibrate.calibrate_members); the calibrated members; the interval (``interval``: the
    within-deployment one, with its residuals)."""
    from moeplace.sim.calibrate import (  # the math
        FIT_METRICS,
        calibrate_members,
        calibrated_ensemble,
        calibration_doc,
        median_member,
    )
    from moeplace.sim.ensemble import load_ensemble  # what prices an uncalibrated run

    log = log or (lambda _msg: None)
    members = list(members or shipped_members())
    start = start if start is not None else load_ensemble()
    base = median_member(members).cost
    models = [PointModel(dep, p, trace) for p in points]
    before, starts = [], []
    obs: list[tuple[int, str, float, float]] = []  # (point, metric, measured, event / steady at the start)
    for i, (pm, p) in enumerate(zip(models, points)):
        log(f"  pricing {p.source} uncalibrated (the shipped ensemble, as place simulate) ...")
        before.append(pm.event(start.reference_config(), start))
        # the fit's correction event / steady, at the starting members' weighted median member (phase B's start)
        ev = pm.event(base)
        st = pm.steady(base)
        starts.append(ev)
        for m in FIT_METRICS:
            meas = getattr(p, m)
            if meas and ev.get(m):
                obs.append((i, m, float(meas), float(ev[m]) / st[m]))
    if not obs:
        from moeplace.foundation.errors import InputError  # an input problem, raised where it is found

        raise InputError("no measured figure to calibrate on (each point needs output_throughput and the "
                         "simulator must complete requests at its load)")

    def residuals(cfg: CostConfig) -> np.ndarray:
        cache: dict[int, dict] = {}
        out = []
        for i, m, meas, corr in obs:
            if i not in cache:
                cache[i] = models[i].steady(cfg)
            out.append(np.log(cache[i][m] * corr / meas))
        return np.array(out)

    log(f"  calibrating {len(members)} member(s) on {len(obs)} measured figures ...")
    cal, info = calibrate_members(members, residuals, prior_sd)
    after_ens = calibrated_ensemble(cal, interval or {})
    after_cfg = median_member(cal).cost
    rows = []
    for pm, p, ev, st0 in zip(models, points, before, starts):
        log(f"  re-pricing {p.source} calibrated (every calibrated member) ...")
        af = pm.event(after_cfg, after_ens)
        rows.append({"source": p.source, "tool": p.tool, "concurrency": p.concurrency, "rate": p.rate,
                     "isl": p.isl, "osl": p.osl, "duration_s": p.duration_s, "simulated_s": pm.duration,
                     "measured": {"output_tok_s": p.output_tok_s, "tpot_s": p.tpot_s, "ttft_s": p.ttft_s,
                                  "total_tok_s": p.total_tok_s, "accept_length": p.accept_length},
                     "before": ev, "after": af, "start_member": st0})
    return calibration_doc(dep, rows, cal, info, members, interval or {}, prior_source)
