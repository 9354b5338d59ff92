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

import json
import math
from dataclasses import dataclass, field

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.export import capabilities
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.sim.config import RebalanceConfig, SimConfig
from moeplace.sim.online import DEFAULT_BUDGET_S, INTERVALS, Candidate, compare


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


def tune(wl, cluster, config: SimConfig, profile, engines: list[str], splits: int = 1, quick: bool = False,
         progress=None, budget_s: float = DEFAULT_BUDGET_S, what_if: bool = False) -> dict:
    """Search each engine's settings (:func:`engine_settings`) on the workload ``wl``
    (:class:`sim.inputs.Workload`) with :func:`sim.online.compare`: each candidate runs at least five of its
    own rebalance intervals after warm-up, from the EPLB placement of the part it observed, and is scored
    against that placement held static. Returns ``{"engines": {engine: {"best": row | None, "rows": [...],
    "why_no_best"?} | {"unavailable": why}}, "horizon", "splits", "interval", "routing"}``; a row: ``label``,
    ``flags``, ``tok_s``, ``static_tok_s``, ``gain`` / ``gain_lo`` / ``gain_hi`` over its static alternative,
    ``rebalances`` (after warm-up), ``ranked``, ``decision_s``, ``transfer_s``, ``stall_s``.

    ``what_if``: an engine whose rebalancer does not serve the model in the checked release (the capability
    table) is simulated all the same, as it would behave once it does; its entry keeps the reason under
    ``"what_if"`` so no caller can mistake it for something the engine does today."""
    model = wl.trace.model
    plans: dict = {}  # (R, split) -> EPLB placement of the observed part

    def start(r: int, observed: np.ndarray, j: int):
        if (r, j) not in plans:
            plans[(r, j)] = get_policy("eplb")(PlacementProblem(loads=observed[None], model=model, cluster=cluster,
                                                                num_redundant=r, seed=config.seed))
        return plans[(r, j)]

    result: dict = {"engines": {}}
    settings: dict[str, Setting] = {}
    what_ifs: dict[str, str] = {}
    for engine in engines:
        why = unavailable(engine, model)
        if why and not what_if:
            result["engines"][engine] = {"unavailable": why}
            continue
        if why:
            what_ifs[engine] = why
        for s in engine_settings(engine, model.num_experts, model.num_moe_layers, cluster.num_gpus, quick):
            settings[s.label()] = s
    if not settings:
        return {**result, "horizon": None, "splits": [], "rows": []}
    cands = [Candidate(label, s.rebalance, s.num_redundant, s.rule) for label, s in settings.items()]
    out = compare(wl, cands, start, cluster, config, profile, splits, budget_s, progress)
    by_label = {r["name"]: r for r in out["rows"]}
    for engine in engines:
        if engine in result["engines"]:
            continue
        rows = []
        for label, s in settings.items():
            if s.engine != engine:
                continue
            r = by_label[label]
            rows.append({**r, "label": label, "flags": s.flags(), "params": s.params})
        ranked = [r for r in rows if r["ranked"]]
        best = max(ranked, key=lambda x: x["tok_s"]) if ranked else None
        d = {"best": best, "rows": rows} | ({"what_if": what_ifs[engine]} if engine in what_ifs else {})
        if best is None:
            d["why_no_best"] = (f"no setting performed {INTERVALS} rebalances after the warm-up on this horizon, so "
                                "none is ranked (a setting that never rebalanced is not an online rebalancer)")
        result["engines"][engine] = d
    result.update({k: out[k] for k in ("horizon", "splits", "interval", "routing", "input")})
    return result


def format_tune(res: dict) -> list[str]:
    lines = []
    for engine, d in res["engines"].items():
        name = ENGINE_NAMES[engine]
        if "unavailable" in d:
            lines.append(f"{name}: not available — {d['unavailable']}")
            continue
        if "what_if" in d:
            lines.append(f"{name} (what-if, not served today: {d['what_if']}):")
        b = d["best"]
        if b is None:
            lines.append(f"{name}: no best setting — {d['why_no_best']}")
        else:
            verdict = ("gain is clear" if b["gain_lo"] > 0 else "loses to static" if b["gain_hi"] < 0
                       else "no clear winner over static")
            lines.append(f"{name}: best of {sum(r['ranked'] for r in d['rows'])} ranked settings: {b['flags']}")
            lines.append(f"  {b['tok_s']:,.0f} tok/s, {b['gain']:+.1%} over static (80 % interval "
                         f"{b['gain_lo']:+.1%} to {b['gain_hi']:+.1%}: {verdict}); {b['rebalances']} rebalances "
                         f"after warm-up, decision {b['decision_s']:.2f} s, transfer {b['transfer_s']:.2f} s, "
                         f"stall {b['stall_s']:.2f} s")
            lines.append(f"  static alternative: the same {b['num_redundant']} redundant slots, EPLB planned once on "
                         f"the observed traffic and kept: {b['static_tok_s']:,.0f} tok/s (place optimize plans one "
                         "to export)")
        lines.append("  every setting: tok/s, its static alternative's tok/s (the same redundant slots and replica rule), "
                     "gain = their ratio - 1 (80 % interval), rebalances after warm-up")
        for r in sorted(d["rows"], key=lambda x: -x["tok_s"]):
            tag = "" if r["ranked"] else ("  static" if not r["online"] else f"  not ranked: {r['why_unranked']}")
            lines.append(f"    {r['tok_s']:10,.0f}  {r['static_tok_s']:10,.0f}  {r['gain']:+6.1%} ({r['gain_lo']:+.1%}, "
                         f"{r['gain_hi']:+.1%})  {r['rebalances']:4d}  {r['label']}{tag}")
    return lines
