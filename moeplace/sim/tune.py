"""Tune the serving engines' own online rebalancers on a routing trace (``place rebalance``).

Each engine's real settings, with the names and flag spellings of its released parser:

- vLLM 0.34 (``vllm/config/parallel.py`` ``EPLBConfig``; ``--enable-eplb --eplb-config JSON`` in
  ``engine/arg_utils.py``): ``num_redundant_experts`` (E + R divisible by the EP size), ``window_size``
  (steps of load the decision looks at, default 1000), ``step_interval`` (steps between rearrangements,
  default 3000), ``use_async`` (default true: decision and transfer overlap serving). Policy "default" is
  DeepSeek's EPLB; replicas are picked evenly (the hash rule).
- SGLang 0.5.23 (``srt/arg_groups/fields/exec_.py``; flags are the field names with dashes):
  ``--ep-num-redundant-experts`` (default 0), ``--enable-eplb``, ``--eplb-rebalance-num-iterations``
  (default 1000; the load window, ``--expert-distribution-recorder-buffer-size``, defaults to it),
  ``--ep-dispatch-algorithm static|dynamic`` (static: the per-rank dispatch map; dynamic: an even split over
  an expert's replicas). The rebalance runs inside the forward pass: every rank waits for it.
- TensorRT-LLM (``MoeLoadBalancerConfig`` in ``llmapi/llm_args.py``, set through ``moe_config.load_balancer``
  of ``--extra_llm_api_options``): ``num_slots`` (E + R) and ``layer_updates_per_iter`` (0: static; u > 0:
  u layers re-placed per iteration in the background, modelled here as a whole re-placement every
  ceil(L / u) iterations from the loads of those iterations, asynchronous).

An engine whose rebalancer does nothing for the model (the capability table's online-EPLB cell,
``placement/export/capabilities.py``: vLLM 0.34.0 and SGLang 0.5.23 for Kimi K3, TensorRT-LLM for the
architectures its balancer leaves out) is reported with the reason and the route it offers instead, not
simulated: its flags would be accepted and change nothing.

Every candidate is scored as :mod:`sim.online` scores ``--recommend``: the rebalancer's window holds one part of
the routed tokens, the run routes the next part only. The rebalancer starts from the placement its engine's
algorithm (EPLB) gives the observed part with the same redundant slots, and the static alternative keeps that
placement: the gain is what rebalancing online adds. Decision time (EPLB really runs here) and weight transfer
are charged as :mod:`sim.rebalance` charges them.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.export import capabilities
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.sim.config import RebalanceConfig, SimConfig
from moeplace.sim.online import MIN_SPLITS, gain_interval, request_blocks, scored_config, tok_s, trace_part
from moeplace.sim.runner import simulate


@dataclass(frozen=True)
class Setting:
    """One engine configuration: its own parameter names and values, and how the simulator runs it."""

    engine: str  # the name of its OnlineRebalancer: vllm | sglang | trtllm
    params: dict = field(hash=False)
    num_redundant: int
    rule: str  # the simulator's replica rule: vllm (even split) | sglang (static dispatch map)
    rebalance: RebalanceConfig | None  # None: static (TensorRT-LLM with layer_updates_per_iter 0)

    def flags(self) -> str:
        """Launch flags the released engine accepts."""
        return REBALANCERS[self.engine].flags(self.params)

    def label(self) -> str:
        return f"{ENGINE_NAMES[self.engine]} " + ", ".join(f"{k}={v}" for k, v in self.params.items())


class OnlineRebalancer:
    """One engine's online rebalancer, as ``place rebalance`` searches it (one subclass per engine, found in
    :data:`REBALANCERS`): its candidate settings, their launch flags, and the models it cannot serve."""

    name: str  # the --engine value
    title: str  # the engine, for sentences

    def candidates(self, rs: list[int], num_experts: int, num_layers: int, quick: bool) -> list[Setting]:
        """The settings searched for redundant-slot counts ``rs``."""
        raise NotImplementedError

    def flags(self, params: dict) -> str:
        raise NotImplementedError

    def unavailable(self, model) -> str | None:
        """Why the rebalancer cannot serve ``model`` (None when it can): the capability table's online-EPLB
        cell, with the replica-free route the engine offers instead."""
        c = capabilities.cell(self.name, "online_eplb", model)
        if c.supported is not False:  # supported, or an architecture the table has not checked
            return None
        alt = capabilities.offer(self.name, model)
        return c.reason + (f"; instead {alt}" if alt else "")


class _VllmEplb(OnlineRebalancer):
    name, title = "vllm", "vLLM"

    def candidates(self, rs, num_experts, num_layers, quick):
        return [Setting("vllm", {"num_redundant_experts": r, "window_size": window, "step_interval": interval,
                                 "use_async": use_async}, r, "vllm",
                        RebalanceConfig(every=interval, window=window, policy="eplb", asynchronous=use_async))
                for r in rs
                for window, interval in ([(1000, 3000)] if quick else [(1000, 3000), (100, 300), (1000, 1000)])
                for use_async in (True, False)]

    def flags(self, p):
        cfg = {"num_redundant_experts": p["num_redundant_experts"], "window_size": p["window_size"],
               "step_interval": p["step_interval"], "use_async": p["use_async"]}
        # --enable-expert-parallel: vLLM 0.34.0 ParallelConfig: "enable_expert_parallel must be True to use EPLB"
        return f"--enable-expert-parallel --enable-eplb --eplb-config '{json.dumps(cfg, separators=(',', ':'))}'"


class _SglangEplb(OnlineRebalancer):
    name, title = "sglang", "SGLang"

    def candidates(self, rs, num_experts, num_layers, quick):
        return [Setting("sglang", {"ep_num_redundant_experts": r, "eplb_rebalance_num_iterations": every,
                                   "ep_dispatch_algorithm": algo}, r,
                        "sglang" if algo == "static" else "vllm",  # dynamic: an even split over the replicas
                        RebalanceConfig(every=every, window=every, policy="eplb"))
                for r in rs for every in ([1000] if quick else [1000, 100]) for algo in ("static", "dynamic")]

    def flags(self, p):
        return (f"--enable-eplb --ep-num-redundant-experts {p['ep_num_redundant_experts']} "
                f"--eplb-rebalance-num-iterations {p['eplb_rebalance_num_iterations']} "
                f"--ep-dispatch-algorithm {p['ep_dispatch_algorithm']}")


class _TrtllmLoadBalancer(OnlineRebalancer):
    name, title = "trtllm", "TensorRT-LLM"

    def candidates(self, rs, num_experts, num_layers, quick):
        out = []
        for r in rs:
            for u in ([0, 1] if quick else [0, 1, 4]):
                every = math.ceil(num_layers / u) if u else 0
                out.append(Setting("trtllm", {"num_slots": num_experts + r, "layer_updates_per_iter": u}, r, "vllm",
                                   RebalanceConfig(every=every, window=every, policy="eplb", asynchronous=True)
                                   if u else None))
        return out

    def flags(self, p):
        lb = f"{{num_slots: {p['num_slots']}, layer_updates_per_iter: {p['layer_updates_per_iter']}}}"
        return ("--extra_llm_api_options lb.yaml  # lb.yaml: enable_attention_dp: true, moe_config: {backend: "
                f"WIDEEP, load_balancer: {lb}}}")


REBALANCERS: dict[str, OnlineRebalancer] = {r.name: r for r in (_VllmEplb(), _SglangEplb(), _TrtllmLoadBalancer())}
ENGINE_NAMES = {name: r.title for name, r in REBALANCERS.items()}


def _rebalancer(engine: str) -> OnlineRebalancer:
    if engine not in REBALANCERS:
        raise InputError(f"--engine {engine}: expected one of {', '.join(REBALANCERS)}")
    return REBALANCERS[engine]


def engine_settings(engine: str, num_experts: int, num_layers: int, num_gpus: int, quick: bool = False
                    ) -> list[Setting]:
    """The candidates searched for ``engine``: redundant slots (the smallest count that divides over the
    GPUs, and one more slot per GPU) x the engine's own rebalancing knobs; ``quick``: the engine's defaults
    and one alternative each."""
    r0 = (-num_experts) % num_gpus
    rs = [r0 + num_gpus] if quick else sorted({r0, r0 + num_gpus})
    return _rebalancer(engine).candidates(rs, num_experts, num_layers, quick)


def unavailable(engine: str, model) -> str | None:
    """Why ``engine``'s online rebalancer cannot serve ``model`` (None when it can)."""
    return _rebalancer(engine).unavailable(model)


def tune(trace, cluster, config: SimConfig, profile, engines: list[str], splits: int = 2, quick: bool = False,
         progress=None) -> dict:
    """Search each engine's settings (:func:`engine_settings`) on ``trace``; see the module docstring.
    Returns ``{"engines": {engine: {"best": row, "rows": [...], "static": {...}} | {"unavailable": why}},
    "splits": [...]}``; a row: ``label``, ``flags``, ``tok_s`` (mean tokens/s), ``gain`` / ``gain_lo`` /
    ``gain_hi`` over its static alternative, ``decision_s``, ``transfer_s``, ``stall_s``, ``rebalances``."""
    if splits < MIN_SPLITS:
        raise InputError(f"--splits must be >= {MIN_SPLITS} (an interval needs two gains), got {splits}")
    model = trace.model
    blocks = request_blocks(trace, splits + 1)
    parts = []
    for j in range(splits):
        (oa, ob), (sa, sb) = blocks[j], blocks[j + 1]
        parts.append((trace_part(trace, oa, ob).expert_counts().astype(np.float64), trace_part(trace, sa, sb),
                      [oa, ob], [sa, sb]))
    start: dict = {}  # (R, split) -> EPLB placement of the observed part
    statics: dict = {}  # (R, rule, split) -> static summary
    durations: dict = {}  # split -> cfg with the duration cut to the scored part

    def plan(r: int, j: int):
        if (r, j) not in start:
            observed = parts[j][0]
            start[(r, j)] = get_policy("eplb")(PlacementProblem(loads=observed[None], model=model, cluster=cluster,
                                                                num_redundant=r, seed=config.seed))
        return start[(r, j)]

    def cfg_for(j: int, rule: str) -> SimConfig:
        if j not in durations:
            r0 = engine_settings(engines[0], model.num_experts, model.num_moe_layers, cluster.num_gpus, quick)[0]
            durations[j] = scored_config(parts[j][1], [("probe", plan(r0.num_redundant, j))], cluster, config,
                                         profile)
        c = durations[j]
        return dataclasses.replace(c, engine=dataclasses.replace(c.engine, replica_rule=rule))

    def static(r: int, rule: str, j: int) -> dict:
        if (r, rule, j) not in statics:
            statics[(r, rule, j)] = simulate(parts[j][1], [("static", plan(r, j))], cluster, cfg_for(j, rule),
                                             profile)[0].summary
        return statics[(r, rule, j)]

    result: dict = {"engines": {}, "splits": [{"observe": p[2], "score": p[3]} for p in parts]}
    for engine in engines:
        why = unavailable(engine, model)
        if why:
            result["engines"][engine] = {"unavailable": why}
            continue
        rows = []
        for s in engine_settings(engine, model.num_experts, model.num_moe_layers, cluster.num_gpus, quick):
            if progress:
                progress(s.label())
            runs, bases = [], []
            for j in range(splits):
                base = static(s.num_redundant, s.rule, j)
                if s.rebalance is None:
                    summ = base
                else:
                    rb = dataclasses.replace(s.rebalance, observed=parts[j][0])
                    summ = simulate(parts[j][1], [("online", plan(s.num_redundant, j))], cluster,
                                    dataclasses.replace(cfg_for(j, s.rule), rebalance=rb), profile)[0].summary
                runs.append(summ)
                bases.append(base)
            gains = [tok_s(r) / tok_s(b) - 1 if tok_s(b) > 0 else 0.0 for r, b in zip(runs, bases)]
            g, lo, hi = gain_interval(gains)
            hist = [h for r in runs for h in r.get("rebalance_history", [])]
            rows.append({"label": s.label(), "flags": s.flags(), "params": s.params, "num_redundant": s.num_redundant,
                         "tok_s": float(np.mean([tok_s(r) for r in runs])),
                         "static_tok_s": float(np.mean([tok_s(b) for b in bases])),
                         "iterations": float(np.mean([r.get("iterations", 0) for r in runs])),
                         "gains": gains, "gain": g, "gain_lo": lo, "gain_hi": hi,
                         "rebalances": float(np.mean([r.get("rebalances", 0) for r in runs])),
                         "decision_s": float(sum(h["decision_s"] for h in hist)) / splits,
                         "transfer_s": float(sum(h["transfer_s"] for h in hist)) / splits,
                         "stall_s": float(np.mean([r.get("stall_s", 0.0) for r in runs]))})
        best = max(rows, key=lambda x: x["tok_s"])
        result["engines"][engine] = {"best": best, "rows": rows}
    result["durations_s"] = [durations[j].duration for j in sorted(durations)]
    return result


def format_tune(res: dict) -> list[str]:
    lines = []
    for engine, d in res["engines"].items():
        name = ENGINE_NAMES[engine]
        if "unavailable" in d:
            lines.append(f"{name}: not available — {d['unavailable']}")
            continue
        b = d["best"]
        verdict = ("gain is clear" if b["gain_lo"] > 0 else "loses to static" if b["gain_hi"] < 0
                   else "no clear winner over static")
        lines.append(f"{name}: best of {len(d['rows'])} settings: {b['flags']}")
        lines.append(f"  {b['tok_s']:,.0f} tok/s, {b['gain']:+.1%} over static (80 % interval "
                     f"{b['gain_lo']:+.1%} to {b['gain_hi']:+.1%}: {verdict}); {b['rebalances']:.1f} rebalances per "
                     f"run, decision {b['decision_s']:.2f} s, transfer {b['transfer_s']:.2f} s, stall {b['stall_s']:.2f} s")
        lines.append(f"  static alternative: the same {b['num_redundant']} redundant slots, EPLB planned once on the "
                     f"observed traffic and kept: {b['static_tok_s']:,.0f} tok/s (place optimize plans one to "
                     "export)")
        least = min(r["params"].get("step_interval", r["params"].get("eplb_rebalance_num_iterations", 10**9))
                    for r in d["rows"])
        if b["iterations"] < least:
            lines.append(f"  note: a scored run lasts {b['iterations']:.0f} iterations, fewer than any candidate's "
                         f"interval ({least}): only the decision at the part boundary counts; a longer trace tells "
                         "the intervals apart")
    return lines
