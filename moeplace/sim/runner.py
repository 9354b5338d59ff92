"""The library calls behind ``place simulate``: :func:`prepare_run` reads the trace (its held-out part when
the placements were planned on the rest) and resolves the placements; :func:`simulate` builds the pools from
the plan model, runs one simulation per placement on the same workload and seed and collects the results.
The CLI parses flags into a :class:`RunInputs` and a :class:`SimConfig`, then calls these two."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import placement_estimate, require_memory
from moeplace.foundation.memory.planner import pool_cluster, pool_layout
from moeplace.foundation.model import load_model
from moeplace.foundation.settings import Range
from moeplace.placement.policies import PlacementProblem, get_policy, policy_names
from moeplace.placement.record import Placement, check_compatible, load_placement
from moeplace.placement.rules import get_rule
from moeplace.sim.calibration import Profile
from moeplace.sim.config import SimConfig, check_resources
from moeplace.sim.engine import PoolSetup, Simulation
from moeplace.sim.ensemble import price_run
from moeplace.sim.inputs import read_workload
from moeplace.sim.memory import override_pools, plan_pools
from moeplace.sim.results import SimResult
from moeplace.sim.workload import TraceTokens, load_trace_tokens, stand_in_layers
from moeplace.traces.loads import is_loads_file


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What one run reads, as the user named it: the trace, the placements (JSON files or policy names
    computed on the trace), and the overrides of the trace's model. ``max_trace_tokens``: tokens of the
    trace to load (``None``: all); ``route_all``: route the whole trace even where a placement was planned
    on part of it; ``prefill_gpus``: a disaggregated prefill pool of that many GPUs (policy names only)."""

    trace: str
    placements: tuple[str, ...]
    max_trace_tokens: Annotated[int, Range(1)] | None = None
    route_all: bool = False
    model: str | None = None
    expert_dtype: str | None = None
    weight_dtype: str | None = None
    num_redundant: int | None = None
    rule: str = "vllm"
    seed: int = 0
    prefill_gpus: int | None = None
    # phases (sim.inputs.Phase) instead of ``trace``; a Loads input or phases are routed from their expert
    # distributions over simulated time, spread over ``duration`` when the phases do not fix it
    phases: tuple = ()
    duration: float | None = None
    # a deployment's pools (place simulate --pools): each placement spec is resolved once per pool, on the
    # pool's own GPUs ("prefill=A,decode=B" names one per pool)
    pools: Any = None  # foundation.deployment.Deployment
    gpu: str = "h200"
    gpus_per_node: int | None = None


@dataclasses.dataclass
class PreparedRun:
    """The trace to route, the resolved ``(label, placement)`` pairs (labels unique), the prefill pools'
    placements, the first routed token and the sentence that says which part of the trace is routed."""

    trace: TraceTokens
    placements: list[tuple[str, Placement]]
    prefill: list[tuple[Placement, ClusterSpec]] | None
    from_token: int
    routing_note: str
    # with --pools: per label, the prefill and the decode pool's placements
    pool_placements: list[tuple[Placement, Placement]] | None = None


def is_placement_file(spec: str) -> bool:
    """``spec`` names a placement file (rather than a policy to compute on the trace)."""
    return Path(spec).suffix == ".json" or Path(spec).exists()


def held_out_start(trace: str, specs: tuple[str, ...] | list[str]) -> tuple[int, list[str]]:
    """The first token (file order) of ``trace`` that none of the placement files in ``specs`` was planned
    on (their provenance's ``planned_on``), and the names of those planned on this trace; ``(0, [])``
    when none was."""
    start, names = 0, []
    here = Path(trace).resolve()
    for spec in specs:
        if not is_placement_file(spec) or not Path(spec).is_file():
            continue
        on = load_placement(Path(spec)).provenance.get("planned_on") or {}
        inputs = on.get("inputs", [])
        if len(inputs) == 1 and Path(inputs[0]).resolve() == here and "held_out_from_token" in on:
            start = max(start, int(on["held_out_from_token"]))
            names.append(Path(spec).stem)
    return start, names


def read_trace(inputs: RunInputs) -> tuple[TraceTokens, int, str]:
    """The trace ``inputs`` names, as a run routes it: from the first token no placement file was planned
    on (unless ``route_all``), at most ``max_trace_tokens`` tokens, with the model overrides applied.
    Returns ``(trace, first routed token, the sentence that says which part is routed)``."""
    if inputs.phases or is_loads_file(inputs.trace):
        wl = read_workload(None if inputs.phases else inputs.trace, inputs.phases, inputs.max_trace_tokens,
                           inputs.seed)
        trace, from_token, note = wl.on_timeline(inputs.duration), 0, wl.note()
        planned = []
    else:
        specs = ([x for spec in inputs.placements for x in _pool_specs(spec).values()] if inputs.pools is not None
                 else inputs.placements)
        from_token, planned = held_out_start(inputs.trace, specs)
        if inputs.route_all:
            from_token = 0
        trace = load_trace_tokens(inputs.trace, inputs.max_trace_tokens, from_token)
        note = ""
    if note:
        pass
    elif from_token:
        note = (f"routing on the held-out part of {inputs.trace}: requests starting at or after token "
                f"{from_token} ({', '.join(planned)} planned on the tokens before; --route-all routes "
                "on the whole trace)")
    elif planned:
        note = (f"routing on the whole of {inputs.trace}, including the tokens {', '.join(planned)} "
                "planned on (--route-all): in-sample")
    else:
        note = f"routing on {inputs.trace}"
    if inputs.expert_dtype or inputs.weight_dtype:
        try:
            m2 = dataclasses.replace(trace.model, expert_dtype=inputs.expert_dtype or trace.model.expert_dtype,
                                     weight_dtype=inputs.weight_dtype or trace.model.weight_dtype)
        except InputError as exc:
            raise InputError(f"--expert-dtype/--weight-dtype: {exc}") from None
        trace = dataclasses.replace(trace, model=m2)
    if inputs.model:
        m = load_model(inputs.model)
        if m.moe_layers != trace.model.moe_layers or m.num_experts != trace.model.num_experts \
                or m.top_k != trace.model.top_k:
            raise InputError(f"--model {inputs.model}: {m.num_moe_layers} MoE layers x {m.num_experts} experts top-"
                             f"{m.top_k} does not match the trace's '{trace.model.name}'")
        trace = dataclasses.replace(trace, model=m)
    if trace.layers_note:
        note += f"; {trace.layers_note}"
    return trace, from_token, note


def prepare_run(inputs: RunInputs, cluster: ClusterSpec, *, make_cluster=None, check=None) -> PreparedRun:
    """Read what ``inputs`` names for a run on ``cluster``: the trace (:func:`read_trace`); every placement
    resolved (:func:`resolve_placement`; repeated labels numbered); the prefill pool's placements on
    ``make_cluster(prefill_gpus)`` when there is one; with ``inputs.pools``, every spec once per pool
    (:func:`resolve_pool_placements`). ``check(trace)``: the caller's checks that need the trace's model
    (its settings against the model's context), run before any placement is computed."""
    trace, from_token, note = read_trace(inputs)
    if check is not None:
        check(trace)
    if inputs.pools is not None:
        pairs = [resolve_pool_placements(s, trace, inputs) for s in inputs.placements]
        labels = [_pool_label(s) for s in inputs.placements]
        for i, lab in enumerate(labels):
            if labels.count(lab) > 1:
                labels[i] = f"{lab}#{i + 1}"
        named = [s for s in inputs.placements if not all(is_placement_file(x) for x in _pool_specs(s).values())]
        if named:
            note += f"; {', '.join(named)} planned here on the routed tokens themselves (in-sample)"
        return PreparedRun(trace, [(lab, dec) for lab, (_, dec) in zip(labels, pairs)], None, from_token, note,
                           pool_placements=pairs)
    placements = [resolve_placement(s, trace, cluster, inputs.num_redundant, inputs.rule, inputs.seed)
                  for s in inputs.placements]
    labels = [lab for lab, _ in placements]
    for i, lab in enumerate(labels):  # keep labels unique in the table and file names
        if labels.count(lab) > 1:
            placements[i] = (f"{lab}#{i + 1}", placements[i][1])
    prefill = None
    if inputs.prefill_gpus is not None:
        p_cluster = make_cluster(inputs.prefill_gpus)
        prefill = []
        for spec in inputs.placements:
            if spec.endswith(".json"):
                raise InputError(f"--placement {spec}: with --prefill-gpus give a policy name (each pool gets its "
                                 "own placement for its GPU count)")
            prefill.append((resolve_placement(spec, trace, p_cluster, inputs.num_redundant, inputs.rule,
                                              inputs.seed)[1], p_cluster))
    named = [lab for lab, spec in zip(labels, inputs.placements) if not is_placement_file(spec)]
    if named:
        note += f"; {', '.join(named)} planned here on the routed tokens themselves (in-sample)"
    return PreparedRun(trace, placements, prefill, from_token, note)


def _pool_specs(spec: str) -> dict[str, str]:
    """``"prefill=A.json,decode=B.json"`` -> one spec per pool; any other spec is both pools'."""
    if "=" not in spec:
        return {"prefill": spec, "decode": spec}
    out: dict[str, str] = {}
    for part in spec.split(","):
        role, eq, what = part.partition("=")
        role = role.strip()
        if not eq or role not in ("prefill", "decode") or not what.strip() or role in out:
            raise InputError(f"--placement {spec}: with --pools give FILE|POLICY for both pools, or "
                             "prefill=FILE|POLICY,decode=FILE|POLICY")
        out[role] = what.strip()
    if set(out) != {"prefill", "decode"}:
        raise InputError(f"--placement {spec}: name a placement for both pools (prefill=...,decode=...)")
    return out


def _pool_label(spec: str) -> str:
    s = _pool_specs(spec)
    if s["prefill"] == s["decode"]:
        return Path(s["prefill"]).stem if is_placement_file(s["prefill"]) else s["prefill"]
    return "|".join(Path(x).stem if is_placement_file(x) else x for x in (s["prefill"], s["decode"]))


def resolve_pool_placements(spec: str, trace: TraceTokens, inputs: RunInputs) -> tuple[Placement, Placement]:
    """The prefill and decode pools' placements of one ``--placement`` spec with ``--pools``: a file must be
    made for its pool's GPUs; a policy name is planned on the trace for each pool's GPU count and redundant
    slots (``moeplace-decode`` for the decode pool's step: its DP ranks x batch)."""
    dep = inputs.pools
    out = []
    for role, what in _pool_specs(spec).items():
        pool = dep.pool(role)
        cl = pool_cluster(dep, pool, inputs.gpu, inputs.gpus_per_node)
        opts = {"decode_step_tokens": pool_layout(trace.model, pool).dp * pool.max_seqs} if role == "decode" else {}
        try:
            out.append(resolve_placement(what, trace, cl, pool.redundant, inputs.rule, inputs.seed, options=opts,
                                         phase=role)[1])
        except InputError as exc:
            raise InputError(f"--pools {role}: {exc}") from None
    return out[0], out[1]


def resolve_placement(spec: str, trace: TraceTokens, cluster: ClusterSpec, num_redundant: int | None, rule: str,
                      seed: int, options: dict[str, Any] | None = None,
                      phase: str | None = None) -> tuple[str, Placement]:
    """``spec`` is a placement JSON file, or a policy name computed here on the trace's expert loads
    (all of its tokens as one window) with ``num_redundant`` slots (``None``: 0). A file must have been
    made for the trace's model and ``cluster`` (and, when given, ``num_redundant``). Returns
    ``(label, placement)``."""
    p = Path(spec)
    if p.suffix == ".json" or p.exists():
        placement = load_placement(p)
        if placement.layers_label and trace.layers_note and placement.model_name == trace.model.name \
                and list(trace.model.moe_layers) == placement.provenance["model_moe_layers"]:
            # planned on the same kind of partial log: each other layer takes its nearest held layer's row,
            # as its routing does (workload.stand_in_layers)
            part = trace.model.restrict(placement.moe_layers)
            placement = Placement(placement.phy2log[stand_in_layers(part)], placement.num_gpus,
                                  placement.gpus_per_node, placement.model_name, placement.num_experts,
                                  tuple(trace.model.moe_layers), dict(placement.provenance))
        check_compatible(placement, trace.model, cluster, num_redundant=num_redundant, what=str(p))
        return p.stem, placement
    names = policy_names(phase)
    if spec not in names:
        raise InputError(f"--placement '{spec}': no such file and not a policy (policies: {', '.join(names)})")
    m = trace.model
    require_memory(placement_estimate(m.num_moe_layers, m.num_experts, cluster.num_gpus, num_redundant or 0,
                                      rule=get_rule(rule).planning_memory(m.num_moe_layers, m.num_experts,
                                                                          cluster.num_gpus)))
    loads = trace.expert_counts()[None].astype(np.float64)
    problem = PlacementProblem(loads=loads, model=trace.model, cluster=cluster, num_redundant=num_redundant or 0,
                               rule=rule, seed=seed, options=dict(options or {}))
    return spec, get_policy(spec)(problem)


def pool_setups(trace: TraceTokens, deployment: Any, pair: tuple[Placement, Placement], config: SimConfig,
                gpu: str, gpus_per_node: int | None = None) -> tuple[PoolSetup, PoolSetup]:
    """The prefill and decode pools of a deployment run: each on its own cluster, with its own attention
    layout (from its memory plan), batching limits and cache pools (:func:`plan_pools` on its layout)."""
    out = []
    for pool, placement in zip(deployment.pools, pair):
        lay = pool_layout(trace.model, pool)
        if lay.moe_tp > 1:
            raise InputError(f"--pools {pool.role}: ep {lay.ep} < gpus {pool.gpus}: the simulator's placements spread "
                             "experts over all of a pool's GPUs; give ep = gpus")
        cl = pool_cluster(deployment, pool, gpu, gpus_per_node)
        engine = dataclasses.replace(config.engine, attention_tp=lay.tp, max_batched_tokens=pool.max_batched_tokens,
                                     max_seqs=pool.max_seqs, disaggregated=True, prefill_gpus=None,
                                     kv_link=deployment.kv_link, phase="both")
        try:
            cache, _ = plan_pools(trace.model, cl, engine, placement.num_redundant)
        except InputError as exc:
            raise InputError(f"--pools {pool.role}: {exc}") from None
        cache = override_pools(cache, config.kv_tokens_per_rank, config.state_slots_per_rank)
        out.append(PoolSetup(pool.role, placement, cl, cache, engine))
    return out[0], out[1]


def simulate(trace: TraceTokens, placements: list[tuple[str, Placement]], cluster: ClusterSpec,
             config: SimConfig, profile: Profile | None = None, chrome: bool = False,
             progress: bool = False, prefill: list[tuple[Placement, ClusterSpec]] | None = None,
             on_advance: Callable[[float], None] | None = None, deployment: Any = None,
             pool_placements: list[tuple[Placement, Placement]] | None = None, gpu: str = "h200",
             gpus_per_node: int | None = None, keep_samples: bool = False, ensemble=None) -> list[SimResult]:
    """Run ``config`` once per placement (same seed, so the same arrivals and lengths). ``prefill``: per
    placement, the prefill pool's own placement and cluster (disaggregated with ``prefill_gpus``).
    ``on_advance(now)``: called with the simulated time after every event of every run (bench/sim.py
    times the steady state with it). Where the shipped ensemble prices the run (:func:`sim.ensemble.
    ensemble_for`), each throughput and per-token time of a summary is its members' median with its
    interval (:func:`sim.ensemble.price_run`); ``ensemble``: another :class:`sim.ensemble.Ensemble` in its
    place (a calibration's reweighting). ``keep_samples``: each result keeps its pools' iteration samples
    (``SimResult.pools``, for re-pricing them under other constants: bench/fidelity.py)."""
    check_resources(config)
    if deployment is not None:
        return [_simulate_deployment(trace, label, deployment, pair, config, profile, chrome, progress, on_advance,
                                     gpu, gpus_per_node, keep_samples, ensemble)
                for (label, _), pair in zip(placements, pool_placements)]
    out = []
    for i, (label, placement) in enumerate(placements):
        pools, _ = plan_pools(trace.model, cluster, config.engine, placement.num_redundant)
        pools = override_pools(pools, config.kv_tokens_per_rank, config.state_slots_per_rank)
        pre = None
        if prefill is not None:
            p_placement, p_cluster = prefill[i]
            p_pools, _ = plan_pools(trace.model, p_cluster, config.engine, p_placement.num_redundant)
            pre = (p_placement, p_cluster,
                   override_pools(p_pools, config.kv_tokens_per_rank, config.state_slots_per_rank))
        sim = Simulation(config, trace, placement, cluster, pools, profile=profile, label=label, chrome=chrome,
                         progress=progress, prefill=pre, on_advance=on_advance, sample=keep_samples,
                         ensemble=ensemble)
        res = sim.run()
        if sim.ensemble is not None:
            price_run(res.summary, sim, sim.ensemble)
        if keep_samples:
            res.pools = sim.pools_list
        res.summary["placement"] = {"label": label, "num_gpus": placement.num_gpus,
                                    "num_slots": placement.num_slots,
                                    "policy": placement.provenance.get("policy"),
                                    "fingerprint": placement.fingerprint()}
        res.summary["pools"] = {"shared": pools.shared, "pool_bytes": pools.pool_bytes,
                                "kv_token_capacity": pools.kv_token_capacity, "state_slots": pools.state_slots,
                                "kv_bytes_per_token": pools.kv_bytes_per_token,
                                "state_bytes_per_seq": pools.state_bytes_per_seq}
        if any(p.rebalancer is not None for p in sim.pools_list):
            res.summary["rebalance_history"] = [h for p in sim.pools_list if p.rebalancer for h in p.rebalancer.history]
        out.append(res)
    return out


def _simulate_deployment(trace, label, deployment, pair, config, profile, chrome, progress, on_advance, gpu,
                         gpus_per_node, keep_samples: bool = False, ensemble=None) -> SimResult:
    setups = pool_setups(trace, deployment, pair, config, gpu, gpus_per_node)
    dec = setups[1]
    sim = Simulation(config, trace, dec.placement, dec.cluster, dec.pools, profile=profile, label=label, chrome=chrome,
                     progress=progress, on_advance=on_advance, deployment=setups, sample=keep_samples,
                     ensemble=ensemble)
    res = sim.run()
    if sim.ensemble is not None:  # each pool's iterations re-priced under its own settings
        price_run(res.summary, sim, sim.ensemble)
    if keep_samples:
        res.pools = sim.pools_list
    res.summary["deployment"] = deployment.to_dict()
    res.summary["placement"] = {"label": label, "num_gpus": sum(ps.placement.num_gpus for ps in setups),
                                "num_slots": dec.placement.num_slots, "policy": dec.placement.provenance.get("policy"),
                                "fingerprint": dec.placement.fingerprint(),
                                "pools": {ps.role: {"num_gpus": ps.placement.num_gpus, "num_slots": ps.placement.num_slots,
                                                    "policy": ps.placement.provenance.get("policy"),
                                                    "fingerprint": ps.placement.fingerprint()} for ps in setups}}
    res.summary["pools"] = {"shared": dec.pools.shared, "pool_bytes": dec.pools.pool_bytes,
                            "kv_token_capacity": dec.pools.kv_token_capacity, "state_slots": dec.pools.state_slots,
                            "kv_bytes_per_token": dec.pools.kv_bytes_per_token,
                            "state_bytes_per_seq": dec.pools.state_bytes_per_seq,
                            "by_pool": {ps.role: {"pool_bytes": ps.pools.pool_bytes,
                                                  "kv_token_capacity": ps.pools.kv_token_capacity,
                                                  "state_slots": ps.pools.state_slots} for ps in setups}}
    if any(p.rebalancer is not None for p in sim.pools_list):
        res.summary["rebalance_history"] = [h for p in sim.pools_list if p.rebalancer for h in p.rebalancer.history]
    return res


def resolved_config(config: SimConfig, cluster: ClusterSpec, trace: TraceTokens, placements, profile) -> dict[str, Any]:
    return {"sim": dataclasses.asdict(config), "cluster": {**cluster.to_dict(), "num_gpus": cluster.num_gpus},
            "model": trace.model.name, "trace": {"path": trace.path, "tokens": trace.num_tokens,
                                                 "requests": trace.num_requests},
            "placements": [{"label": lab, "policy": placement.provenance.get("policy"),
                            "slots": placement.num_slots, "fingerprint": placement.fingerprint()}
                           for lab, placement in placements],
            "profile": None if profile is None else {"source": profile.source, "device": profile.device,
                                                     "ops": sorted(profile.ops)}}
