"""Online rebalancing (``--rebalance every=N,window=W,moves=K``): every N iterations of a pool, re-place
the experts from the loads of its last W iterations and pay for moving the weights.

The new placement comes from the moeplace optimizer's migration mode (``get_policy("moeplace")`` with
``options={"from": current, "max_moves": K}``: at most K slots change per MoE layer) when it is
registered and ``policy`` is ``auto`` or ``moeplace``, else from DeepSeek's EPLB (``get_policy("eplb")``).
EPLB knows no move budget, so with ``moves=K`` only whole layers are switched to EPLB's answer, best
predicted gain per moved expert first, within the same total budget of K x L moves.

The cost: every GPU receives the weights of the experts it newly holds, from a GPU of its own node
when one held the expert before (NVLink), else over its NIC; the slowest GPU sets the transfer time.
The decision itself costs the policy's measured time on this machine (the optimizer or EPLB really runs
here), not zero: its wall-clock time, or the CPU time it used when that is less (a busy host's other
programs do not count). Blocking (SGLang; vLLM with ``use_async`` off): all EP ranks wait for decision +
transfer — vLLM PR #50647 saw a 3.17x slower run from it; the stall is added to the pool's next
iteration. ``async`` (vLLM's default): serving goes on with the old placement and the new one takes
effect once decision + transfer time has passed in simulated time (the transfer's competition with the
all-to-all for the links is not modelled).

:func:`recommend_configs`: the rebalancers ``place simulate --recommend`` compares with a static
placement: vLLM EPLB (window 1000, every 3000 steps, async), SGLang EPLB (every 1000 iterations,
blocking) and moeplace's migration-budget mode.
"""
from __future__ import annotations

import os
import time
from collections import deque

import numpy as np

from placement.dispatch import ENGINE_RULES, expected_gpu_loads
from placement.policies import PlacementProblem, get_policy, policy_names
from placement.record import Placement
from sim.config import RebalanceConfig


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (waited-for) children, user + system."""
    t = os.times()  # children: clock-tick resolution, fine for the optimizer's seconds-long workers
    return time.process_time() + t.children_user + t.children_system


def recommend_configs(moves: int, time_limit: float | None) -> dict[str, RebalanceConfig]:
    """The online rebalancers to compare with a static placement: the engines' own (their defaults) and
    moeplace's migration-budget mode (``moves`` slots per layer, ``time_limit`` per decision)."""
    return {
        "vLLM EPLB (window 1000, every 3000, async)": RebalanceConfig(every=3000, window=1000, policy="eplb",
                                                                      asynchronous=True),
        "SGLang EPLB (every 1000, blocking)": RebalanceConfig(every=1000, window=1000, policy="eplb"),
        f"moeplace migration ({moves} moves/layer, every 3000, async)": RebalanceConfig(
            every=3000, window=1000, moves=moves, policy="moeplace", time_limit=time_limit, asynchronous=True),
    }


def moved_experts(old: Placement, new: Placement) -> np.ndarray:
    """Bool ``[L, G, E]``: GPU g holds expert e in ``new`` but not in ``old`` (its weights must arrive)."""
    L, G, E = old.num_layers, old.num_gpus, old.num_experts
    out = np.zeros((L, G, E), dtype=bool)
    held_old = np.zeros((L, G, E), dtype=bool)
    li = np.arange(L)[:, None, None]
    gi = np.arange(G)[None, :, None]
    held_old[li, gi, old.phy2log.reshape(L, G, -1)] = True
    out[li, gi, new.phy2log.reshape(L, G, -1)] = True
    return out & ~held_old


def transfer_stall(old: Placement, new: Placement, bytes_per_expert: float, nvlink_bw: float, nic_bw: float,
                   nvlink_latency: float, nic_latency: float) -> tuple[float, float, int]:
    """``(stall seconds, bytes moved, experts moved)`` of switching ``old`` -> ``new``. Each GPU pulls its
    new experts from a same-node holder over NVLink when there is one, else over its NIC; the two links
    run in parallel; the slowest GPU sets the stall."""
    mv = moved_experts(old, new)
    if not mv.any():
        return 0.0, 0.0, 0
    L, G, E = mv.shape
    per_node = old.gpus_per_node
    held = np.zeros((L, G, E), dtype=bool)
    held[np.arange(L)[:, None, None], np.arange(G)[None, :, None], old.phy2log.reshape(L, G, -1)] = True
    node_held = held.reshape(L, G // per_node, per_node, E).any(axis=2)  # [L, N, E]
    local_src = np.repeat(node_held, per_node, axis=1)  # [L, G, E]
    nv = (mv & local_src).sum(axis=(0, 2)) * bytes_per_expert
    nic = (mv & ~local_src).sum(axis=(0, 2)) * bytes_per_expert
    t = np.maximum(np.where(nv > 0, nvlink_latency + nv / nvlink_bw, 0.0),
                   np.where(nic > 0, nic_latency + nic / nic_bw, 0.0))
    return float(t.max()), float((nv + nic).sum()), int(mv.sum())


def relabel_min_moves(old: Placement, new: Placement) -> Placement:
    """``new`` with its nodes and, within nodes, its GPUs renumbered to keep as many experts where they
    already are: per layer, nodes are matched to old nodes by expert overlap (Hungarian assignment,
    scipy), then GPUs within each matched node pair. A pure relabeling: every GPU's expert set, every
    node's set and so the balance are unchanged — only the weights that must move shrink. EPLB's
    output has no memory of the previous layout (its GPU numbering is arbitrary), so without this nearly
    every expert would move at each rebalance."""
    from scipy.optimize import linear_sum_assignment

    L, G, E = old.num_layers, old.num_gpus, old.num_experts
    S, n = old.slots_per_gpu, old.gpus_per_node
    N = G // n
    held_old = np.zeros((L, G, E), dtype=np.int32)
    held_new = np.zeros((L, G, E), dtype=np.int32)
    li, gi = np.arange(L)[:, None, None], np.arange(G)[None, :, None]
    np.add.at(held_old, (li, gi, old.phy2log.reshape(L, G, S)), 1)
    np.add.at(held_new, (li, gi, new.phy2log.reshape(L, G, S)), 1)
    src = new.phy2log.reshape(L, G, S)
    out = np.empty_like(src)
    for l in range(L):
        a_old, a_new = held_old[l], held_new[l]  # [G, E]
        node_old = a_old.reshape(N, n, E).sum(axis=1)
        node_new = a_new.reshape(N, n, E).sum(axis=1)
        overlap = np.minimum(node_new[:, None, :], node_old[None, :, :]).sum(axis=2)  # [N_new, N_old]
        rows, cols = linear_sum_assignment(-overlap)
        for nn, no in zip(rows, cols):
            g_new = np.arange(nn * n, (nn + 1) * n)
            g_old = np.arange(no * n, (no + 1) * n)
            ov = np.minimum(a_new[g_new][:, None, :], a_old[g_old][None, :, :]).sum(axis=2)
            r2, c2 = linear_sum_assignment(-ov)
            for i, j in zip(r2, c2):
                out[l, g_old[j]] = src[l, g_new[i]]
    return Placement(out.reshape(L, G * S), G, n, old.model_name, E, old.moe_layers, dict(new.provenance))


def limit_moves(old: Placement, new: Placement, loads_LE: np.ndarray, engine: str, max_moves: int) -> Placement:
    """Take ``new``'s layout only for the layers that gain most (drop of the most loaded GPU's expected
    tokens) per moved expert, until ``max_moves`` moves are used; the other layers keep ``old``."""
    if max_moves <= 0:
        return new
    mv = moved_experts(old, new).sum(axis=(1, 2))  # [L]
    eng = engine if engine in ENGINE_RULES else "vllm"
    gain = expected_gpu_loads(old, loads_LE, eng).max(axis=1) - expected_gpu_loads(new, loads_LE, eng).max(axis=1)
    order = np.argsort(-(gain / np.maximum(mv, 1)), kind="stable")
    p2l = old.phy2log.copy()
    used = 0
    for l in order:
        if gain[l] <= 0 or mv[l] == 0:
            continue
        if used + mv[l] > max_moves:
            continue
        p2l[l] = new.phy2log[l]
        used += int(mv[l])
    return Placement(p2l, old.num_gpus, old.gpus_per_node, old.model_name, old.num_experts, old.moe_layers,
                     {**new.provenance, "move_budget": max_moves, "moves_used": used})


class Rebalancer:
    """Per-pool rebalancing state: a sliding window of expert loads in blocks of iterations."""

    wants_counts = True

    def __init__(self, cfg: RebalanceConfig, sim, pool) -> None:
        self.cfg = cfg
        self.sim = sim
        self.block = max(1, cfg.window // 8)
        self.blocks: deque = deque(maxlen=-(-cfg.window // self.block))
        self._cur = None
        self._cur_n = 0
        self.count = 0
        self.moved_bytes = 0.0
        self.history: list[dict] = []
        self.pending: tuple[float, Placement] | None = None  # async: (simulated time it lands, placement)
        names = policy_names()
        want = cfg.policy
        if want == "auto":
            want = "moeplace" if "moeplace" in names else "eplb"
        self.policy = want
        get_policy(self.policy)  # fail early with the registry's message when it does not exist

    def observe(self, counts: np.ndarray) -> None:
        if self._cur is None:
            self._cur = np.zeros_like(counts, dtype=np.float64)
        self._cur += counts
        self._cur_n += 1
        if self._cur_n >= self.block:
            self.blocks.append(self._cur)
            self._cur, self._cur_n = None, 0

    def window_loads(self) -> np.ndarray | None:
        parts = list(self.blocks) + ([self._cur] if self._cur is not None else [])
        return np.sum(parts, axis=0) if parts else None

    def maybe_rebalance(self, pool, now: float) -> float:
        if self.pending is not None and now >= self.pending[0]:
            pool.placement = self.pending[1]
            pool.router.set_placement(self.pending[1])
            self.pending = None
        if pool.iteration % self.cfg.every or self.pending is not None:
            return 0.0
        loads = self.window_loads()
        if loads is None or loads.sum() == 0:
            return 0.0
        sim = self.sim
        old = pool.placement
        options = {}
        if self.policy == "moeplace":  # the optimizer's migration mode: at most K moves from `old`
            options = {"from": old, "max_moves": self.cfg.moves or None}
        problem = PlacementProblem(loads=loads[None], model=sim.model, cluster=sim.cluster,
                                   num_redundant=old.num_redundant, engine=sim.config.engine.replica_rule,
                                   seed=sim.config.seed, time_limit=self.cfg.time_limit, options=options)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        new = get_policy(self.policy)(problem)
        # the decision's measured cost: wall-clock, or the CPU time it used (its worker processes included)
        # when that is less — on a busy host the wall clock counts other programs' time too
        measured = min(time.perf_counter() - t0, _cpu_seconds() - c0)
        decision = measured if self.cfg.decision_s is None else self.cfg.decision_s
        if self.policy != "moeplace":
            new = relabel_min_moves(old, new)
        if self.policy != "moeplace" and self.cfg.moves:
            new = limit_moves(old, new, loads, sim.config.engine.replica_rule, self.cfg.moves * old.num_layers)
        c = sim.cost
        g = sim.cluster.gpu
        stall, moved, n = transfer_stall(old, new, sim.model.bytes_per_routed_expert, c.nvlink_bw, c.nic_bw,
                                         g.nvlink_latency, g.nic_latency)
        self.count += 1
        self.moved_bytes += moved
        self.history.append({"time": now, "iteration": pool.iteration, "experts_moved": n, "bytes": moved,
                             "transfer_s": stall, "decision_s": decision, "async": self.cfg.asynchronous,
                             "stall_s": 0.0 if self.cfg.asynchronous else decision + stall,
                             "policy": self.policy})
        if self.cfg.asynchronous:
            self.pending = (now + decision + stall, new)
            return 0.0
        pool.placement = new
        pool.router.set_placement(new)
        return decision + stall
