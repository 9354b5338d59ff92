"""Check the distributed MoE against the single-process reference on one set of random inputs.

``verify_rank`` runs inside each process of :func:`kernels.launch.run_distributed`: every rank builds the
same global data from the seed, keeps its share of the tokens, runs :func:`kernels.moe.ep_moe_forward`
and compares with :func:`kernels.moe.reference_moe` on the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeplace.kernels.moe import StepTimes, ep_moe_forward, local_weights, reference_moe
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule


@dataclass(frozen=True)
class VerifyCase:
    """One random MoE layer: ``tokens_per_rank[r]`` tokens on rank r (0 allowed: an empty rank)."""

    num_experts: int = 8
    top_k: int = 2
    hidden: int = 16
    intermediate: int = 8
    num_redundant: int = 0
    tokens_per_rank: tuple[int, ...] = (5, 7)
    rule: str = "vllm"  # the replica rule
    unused_experts: int = 0  # the last ``unused_experts`` experts are never chosen by any token
    seed: int = 0
    dtype: str = "float32"


def random_placement(case: VerifyCase, world_size: int, gpus_per_node: int | None = None) -> Placement:
    """A random valid placement with ``num_redundant`` extra replicas (duplicates on one GPU allowed)."""
    rng = np.random.default_rng(case.seed + 1)
    E, P = case.num_experts, case.num_experts + case.num_redundant
    phy2log = np.concatenate([np.arange(E), rng.integers(0, E, size=P - E)])
    phy2log = rng.permutation(phy2log)[None, :]
    return Placement(phy2log, world_size, gpus_per_node or world_size, "verify", E, (0,))


def case_data(case: VerifyCase):
    """Global inputs, identical on every rank: hidden, ids, weights (per rank lists) and expert weights."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    E, k, h, inter = case.num_experts, case.top_k, case.hidden, case.intermediate
    w_gate_up = (torch.randn(E, 2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    w_down = (torch.randn(E, h, inter, generator=g) / inter ** 0.5).to(dtype)
    choosable = E - case.unused_experts
    per_rank = []
    for n in case.tokens_per_rank:
        x = torch.randn(n, h, generator=g).to(dtype)
        scores = torch.rand(n, choosable, generator=g)
        ids = torch.topk(scores, k, dim=1).indices
        w = torch.softmax(torch.randn(n, k, generator=g), dim=1).to(dtype)
        per_rank.append((x, ids, w))
    return per_rank, w_gate_up, w_down


def verify_rank(rank: int, world_size: int, cases: list[VerifyCase]) -> list[dict]:
    """Run every case on this rank; return max abs error vs the reference and the step counters."""
    out = []
    for case in cases:
        per_rank, w_gate_up, w_down = case_data(case)
        placement = random_placement(case, world_size)
        dmap = get_rule(case.rule, seed=case.seed).dispatch_state(placement)
        x, ids, w = per_rank[rank]
        lw_gu, lw_d = local_weights(placement, 0, rank, w_gate_up, w_down)
        times = StepTimes()
        y = ep_moe_forward(x, ids, w, placement, 0, lw_gu, lw_d, rule=case.rule, dispatch_map=dmap,
                           times=times)
        ref = reference_moe(x, ids, w, w_gate_up, w_down)
        err = float((y - ref).abs().max()) if len(x) else 0.0
        scale = float(ref.abs().max()) if len(x) else 0.0
        out.append({"case": case, "max_abs_err": err, "ref_scale": scale, "rows_sent": times.rows_sent,
                    "rows_received": times.rows_received})
    return out
