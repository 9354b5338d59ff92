"""One library call behind ``place simulate``: resolve the placements, build the pools from the plan
model, run one simulation per placement on the same workload and seed, collect the results."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import placement_estimate, require_memory
from moeplace.placement.policies import PlacementProblem, get_policy, policy_names
from moeplace.placement.record import Placement, check_compatible, load_placement
from moeplace.sim.calibration import Profile
from moeplace.sim.config import SimConfig, check_resources
from moeplace.sim.engine import Simulation
from moeplace.sim.memory import override_pools, plan_pools
from moeplace.sim.results import SimResult
from moeplace.sim.workload import TraceTokens


def resolve_placement(spec: str, trace: TraceTokens, cluster: ClusterSpec, num_redundant: int | None, engine: str,
                      seed: int) -> tuple[str, Placement]:
    """``spec`` is a placement JSON file, or a policy name computed here on the trace's expert loads
    (all of its tokens as one window) with ``num_redundant`` slots (``None``: 0). A file must have been
    made for the trace's model and ``cluster`` (and, when given, ``num_redundant``). Returns
    ``(label, placement)``."""
    p = Path(spec)
    if p.suffix == ".json" or p.exists():
        placement = load_placement(p)
        check_compatible(placement, trace.model, cluster, num_redundant=num_redundant, what=str(p))
        return p.stem, placement
    names = policy_names()
    if spec not in names:
        raise InputError(f"--placement '{spec}': no such file and not a policy (policies: {', '.join(names)})")
    require_memory(placement_estimate(trace.model.num_moe_layers, trace.model.num_experts, cluster.num_gpus,
                                      num_redundant or 0, engine=engine))
    loads = trace.expert_counts()[None].astype(np.float64)
    problem = PlacementProblem(loads=loads, model=trace.model, cluster=cluster, num_redundant=num_redundant or 0,
                               engine=engine, seed=seed)
    return spec, get_policy(spec)(problem)


def simulate(trace: TraceTokens, placements: list[tuple[str, Placement]], cluster: ClusterSpec,
             config: SimConfig, profile: Profile | None = None, chrome: bool = False,
             progress: bool = False, prefill: list[tuple[Placement, ClusterSpec]] | None = None) -> list[SimResult]:
    """Run ``config`` once per placement (same seed, so the same arrivals and lengths). ``prefill``: per
    placement, the prefill pool's own placement and cluster (disaggregated with ``prefill_gpus``)."""
    check_resources(config)
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
                         progress=progress, prefill=pre)
        res = sim.run()
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


def resolved_config(config: SimConfig, cluster: ClusterSpec, trace: TraceTokens, placements, profile) -> dict[str, Any]:
    return {"sim": dataclasses.asdict(config), "cluster": {**cluster.to_dict(), "num_gpus": cluster.num_gpus},
            "model": trace.model.name, "trace": {"path": trace.path, "tokens": trace.num_tokens,
                                                 "requests": trace.num_requests},
            "placements": [{"label": lab, "policy": placement.provenance.get("policy"),
                            "slots": placement.num_slots, "fingerprint": placement.fingerprint()}
                           for lab, placement in placements],
            "profile": None if profile is None else {"source": profile.source, "device": profile.device,
                                                     "ops": sorted(profile.ops)}}
