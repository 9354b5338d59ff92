"""The ``moeplace-decode`` policy: a placement for a decode pool, where a step at moderate batch is bound by
the expert weights each GPU reads, i.e. by how many distinct experts the step activates on the busiest GPU.

Objective (per MoE layer; a documented weighted one). A step sends ``N`` tokens (``decode_step_tokens``: the
pool's DP ranks x running sequences per rank) through the layer; a token selects expert ``e`` with
probability ``p_e`` (its share of the planning decode tokens' selections, per token). A slot holding one of
``c_e`` replicas of ``e`` receives a ``1 / c_e`` share of them (the even split of vLLM's rule), so over a step
it is activated with probability ``a = 1 - (1 - p_e / c_e)^N`` and receives ``N p_e / c_e`` tokens. A GPU's
expected MoE time in the step is, in the roofline, ``t_read x sum_slots a + t_token x sum_slots tokens``
(``t_read``: one expert's weights over HBM bandwidth; ``t_token``: one token through one expert at the tensor-
core rate; :func:`decode_weights`); the policy minimises the busiest GPU's expected time,
i.e. ``max_g (sum a + tau x sum tokens)`` with ``tau = t_token / t_read`` (``decode_token_weight``, default
from the GPU and model). At small ``N`` the activation term dominates (the busiest GPU should hold few likely
experts); as ``N`` grows every slot is active every step, the activation term is the same for every
placement and token balance decides.

Search: replica counts first, two ways (each of the ``R`` redundant slots to the expert whose extra replica
lowers the layer's lower bound ``max(total / G, max slot cost)`` the most, ties to the smallest added cost; or
to the costliest slot's expert, EPLB's rule on this cost, which packs better when token time matters; at most
one replica per GPU either way), then the slots onto GPUs (``P / G`` each, no two replicas of an expert on one
GPU; replicas first, then largest cost first into the cheapest GPU with room), then pairwise swaps between the
busiest GPU and the others while one lowers it; of the two, the lower busiest GPU is kept.
It minimises the maximum of expectations, not the expected maximum (which also depends on the variance);
``place optimize --phase decode`` scores every policy on the expected maximum measured on held-out decode
steps. Anytime: with a time limit, layers left when it runs out keep their greedy assignment (counted in
``params.summary.time_limited``).
"""
from __future__ import annotations

import time
from typing import Annotated, Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.settings import Range
from moeplace.placement.policies import PlacementProblem, check_options, declare_options, register_policy

declare_options({"decode_step_tokens": Annotated[int, Range(1)] | None,
                 "decode_token_weight": Annotated[float, Range(0)] | None})

MAX_SWAPS_PER_GPU = 40  # swap rounds per layer at most: G x this


def slot_cost(p: np.ndarray, c: np.ndarray, n: int, tau: float) -> np.ndarray:
    """Expected cost of one slot of an expert with per-token selection probability ``p`` and ``c``
    replicas in a step of ``n`` tokens: activation probability + ``tau`` x expected tokens (float arrays)."""
    q = np.clip(p / c, 0.0, 1.0)
    return -np.expm1(n * np.log1p(-np.minimum(q, 1 - 1e-12))) + tau * n * q


def replica_counts(p: np.ndarray, num_slots: int, num_gpus: int, n: int, tau: float,
                   split_costliest: bool = False) -> np.ndarray:
    """Replicas per expert ``[E]`` (sum ``num_slots``, each in ``[1, num_gpus]``): each extra slot to the
    expert whose replica lowers ``max(total / G, max slot cost)`` the most (ties: the smallest added cost, then
    the costliest slot); with ``split_costliest``, to the costliest slot's expert (EPLB's rule on this cost),
    which gives the packing smaller items at a larger total."""
    E = p.shape[0]
    c = np.ones(E, dtype=np.int64)
    cost = slot_cost(p, c, n, tau)
    for _ in range(num_slots - E):
        total = float((c * cost).sum())
        nxt = slot_cost(p, c + 1, n, tau)
        new_total = total - c * cost + (c + 1) * nxt
        top = np.argsort(cost)[::-1][:2]
        second = cost[top[1]] if E > 1 else 0.0
        new_max = np.where(np.arange(E) == top[0], np.maximum(nxt, second), cost[top[0]])
        new_max = np.maximum(new_max, np.where(np.arange(E) == top[0], 0.0, nxt))
        bound = np.maximum(new_total / num_gpus, new_max)
        bound = np.where(c >= num_gpus, np.inf, bound)
        if split_costliest:
            bound = np.where(c >= num_gpus, np.inf, -cost)
        # the lowest bound; among equals the smallest added cost (a replica of an expert every step activates
        # adds a whole weight read and lowers nothing), then the costliest slot
        e = int(np.lexsort((-cost, new_total, bound))[0])
        c[e] += 1
        cost[e] = nxt[e]
    return c


def assign(slot_expert: np.ndarray, slot_costs: np.ndarray, num_gpus: int, deadline: float | None
           ) -> tuple[np.ndarray, bool]:
    """Slots onto GPUs: ``phy2log [P]`` with ``P / G`` consecutive slots per GPU, minimising the largest GPU
    sum of ``slot_costs`` (greedy, then swaps with the busiest GPU). Returns ``(phy2log, cut)``: ``cut`` when
    the deadline stopped the swaps."""
    P = slot_expert.shape[0]
    S = P // num_gpus
    # the replicas of replicated experts first (each needs a GPU of its own: placing them while every GPU has
    # room always succeeds), then the rest, costliest first into the cheapest GPU with room
    multi = np.bincount(slot_expert)[slot_expert] > 1
    order = np.lexsort((-slot_costs, ~multi))
    members = [[] for _ in range(num_gpus)]
    held = [set() for _ in range(num_gpus)]
    load = np.zeros(num_gpus)
    for i in order:
        e = int(slot_expert[i])
        ok = [g for g in range(num_gpus) if len(members[g]) < S and e not in held[g]]
        g = min(ok, key=lambda x: (load[x], x))
        members[g].append(int(i))
        held[g].add(e)
        load[g] += slot_costs[i]
    mem = np.array(members)  # [G, S] slot indices
    cut = False
    for _ in range(MAX_SWAPS_PER_GPU * num_gpus):
        if deadline is not None and time.monotonic() > deadline:
            cut = True
            break
        g = int(np.argmax(load))
        cg, eg = slot_costs[mem[g]], slot_expert[mem[g]]
        best = None
        for h in np.argsort(load):
            h = int(h)
            gap = load[g] - load[h]
            if h == g or gap <= 1e-12:
                continue
            ch, eh = slot_costs[mem[h]], slot_expert[mem[h]]
            d = cg[:, None] - ch[None, :]
            ok = (d > 1e-12) & (d < gap - 1e-12)
            ok &= ~np.isin(eg, eh)[:, None] & ~np.isin(eh, eg)[None, :]
            if not ok.any():
                continue
            pair = np.where(ok, np.maximum(load[g] - d, load[h] + d), np.inf)
            i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
            best = (h, int(i), int(j), float(d[i, j]))
            break
        if best is None:
            break
        h, i, j, dd = best
        mem[g, i], mem[h, j] = mem[h, j], mem[g, i]
        load[g] -= dd
        load[h] += dd
    return slot_expert[mem.ravel()], cut


@register_policy("moeplace-decode", anytime=True, phase="decode")
def decode_policy(problem: PlacementProblem):
    """Plan a decode pool's placement (see the module docstring)."""
    opts = check_options("options", problem.options)
    n = opts.get("decode_step_tokens")
    if n is None:
        raise InputError("moeplace-decode plans for a step size: give the decode pool's batch (place optimize "
                         "--phase decode --batch N, or --pools ... decode:...,batch=N)")
    read_s, token_s = decode_weights(problem.model, problem.cluster)
    tau = opts.get("decode_token_weight")
    tau = token_s / read_s if tau is None else tau
    loads = problem.loads.sum(axis=0)  # [L, E]
    k = problem.model.top_k
    G, P, E = problem.cluster.num_gpus, problem.num_slots, problem.model.num_experts
    deadline = None if problem.time_limit is None else time.monotonic() + problem.time_limit
    p2l = np.empty((loads.shape[0], P), dtype=np.int64)
    cut_layers = 0
    bound_gap = []
    for li in range(loads.shape[0]):
        tokens = loads[li].sum() / k
        p = loads[li] / tokens if tokens > 0 else np.full(E, k / E)
        best = None
        # two replica counts (see replica_counts), each packed; the one whose busiest GPU costs less is kept
        for split in (False, True) if P > E else (False,):
            c = replica_counts(p, P, G, n, tau, split_costliest=split)
            slot_expert = np.repeat(np.arange(E), c)
            costs = slot_cost(p[slot_expert], c[slot_expert].astype(np.float64), n, tau)
            row, cut = assign(slot_expert, costs, G, deadline)
            got = _max_gpu_cost(row, p, n, tau, G)
            if best is None or got < best[0] - 1e-12:
                best = (got, row, costs, cut)
        _, p2l[li], costs, cut = best
        cut_layers += cut
        # the gap to this replica count's bound max(total / G, costliest slot) on the busiest GPU
        lb = max(costs.sum() / G, costs.max())
        bound_gap.append(best[0] / lb - 1 if lb > 0 else 0.0)
    summary: dict[str, Any] = {"objective": "max over GPUs of expected (activated slots + tau x tokens) per step",
                               "decode_step_tokens": int(n), "token_weight": tau, "t_read_s": read_s,
                               "t_token_s": token_s, "max_gap": float(max(bound_gap, default=0.0)),
                               "mean_gap": float(np.mean(bound_gap)) if bound_gap else 0.0,
                               "planned_layers": int(loads.shape[0]),
                               "time_limited": {"cut": {"swaps": cut_layers}} if cut_layers else {},
                               "reproducible": cut_layers == 0}
    return problem.placement(p2l, "moeplace-decode", summary=summary)


def _max_gpu_cost(phy2log: np.ndarray, p: np.ndarray, n: int, tau: float, num_gpus: int) -> float:
    """The busiest GPU's expected cost of one layer's ``phy2log [P]``."""
    c = np.bincount(phy2log, minlength=p.shape[0])
    costs = slot_cost(p[phy2log], c[phy2log].astype(np.float64), n, tau)
    return float(costs.reshape(num_gpus, -1).sum(axis=1).max())


def decode_weights(model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """``(seconds to read one routed expert's weights, seconds per token an expert computes)`` on the
    cluster's GPU at its peak HBM bandwidth and tensor-core rate: the roofline's two terms of a GPU's MoE time
    in a step, ``t_read x active slots + t_token x tokens``. The decode objective weighs activated experts and
    tokens by them (only their ratio matters)."""
    g = cluster.gpu
    read = model.bytes_per_routed_expert / g.hbm_bw
    token = 2.0 * model.params_per_routed_expert / g.flops(model.expert_dtype)
    return read, token
