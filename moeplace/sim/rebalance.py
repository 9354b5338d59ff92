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
effect once the decision has run and the transfer has arrived in simulated time. The transfer's bytes
share each GPU's NVLink and NIC with the MoE all-to-all of the iterations it overlaps
(:class:`Transfer`): those iterations take longer, and the transfer lands later than on free links, so an
async rebalance is not free — a large one slows every step it overlaps.

:func:`recommend_configs`: the rebalancers ``place simulate --recommend`` compares with a static
placement: vLLM EPLB (window 1000, every 3000 steps, async), SGLang EPLB (every 1000 iterations,
blocking) and moeplace's migration-budget mode.
"""
from __future__ import annotations

import os
import time
from collections import deque

import numpy as np

from moeplace.placement.dispatch import expected_gpu_loads
from moeplace.placement.policies import PlacementProblem, get_policy, policy_names
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule
from moeplace.sim.config import RebalanceConfig

# Time limit of a moeplace re-plan when online rebalancing (--recommend's default): below 2 s the optimizer
# plans every layer in-process, and a migration-budgeted K3 re-plan at 32 GPUs decides within 2 s with it
# (bench/replan.py: 1.70 s wall at load average ~13 on 2 cores, 0.24 s of CPU)
REPLAN_TIME_LIMIT = 1.5


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (waited-for) children, user + system."""
    t = os.times()  # children: clock-tick resolution, fine for the optimizer's seconds-long workers
    return time.process_time() + t.children_user + t.children_system


def recommend_configs(moves: int, time_limit: float | None) -> dict[str, tuple[str | None, RebalanceConfig]]:
    """The online rebalancers to compare with a static placement, name -> (the engine whose own rebalancer it
    is, as ``place rebalance --engine`` names it; ``None`` for moeplace's mode, the config): the engines'
    own (their defaults) and moeplace's migration-budget mode (``moves`` slots per layer, ``time_limit`` per
    decision). An engine's is compared only where the capability table says it serves the model."""
    return {
        "vLLM EPLB (window 1000, every 3000, async)": ("vllm", RebalanceConfig(every=3000, window=1000,
                                                                              policy="eplb", asynchronous=True)),
        "SGLang EPLB (every 1000, blocking)": ("sglang", RebalanceConfig(every=1000, window=1000, policy="eplb")),
        f"moeplace migration ({moves} moves/layer, every 3000, async)": (None, RebalanceConfig(
            every=3000, window=1000, moves=moves, policy="moeplace", time_limit=time_limit, asynchronous=True)),
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


def transfer_bytes(old: Placement, new: Placement, bytes_per_expert: float) -> tuple[np.ndarray, np.ndarray, int]:
    """``(nvlink [G], nic [G], experts moved)`` of switching ``old`` -> ``new``: the bytes each GPU pulls
    over NVLink (its new experts a GPU of its own node held before) and over its NIC (the rest)."""
    mv = moved_experts(old, new)
    L, G, E = mv.shape
    if not mv.any():
        return np.zeros(G), np.zeros(G), 0
    per_node = old.gpus_per_node
    held = np.zeros((L, G, E), dtype=bool)
    held[np.arange(L)[:, None, None], np.arange(G)[None, :, None], old.phy2log.reshape(L, G, -1)] = True
    node_held = held.reshape(L, G // per_node, per_node, E).any(axis=2)  # [L, N, E]
    local_src = np.repeat(node_held, per_node, axis=1)  # [L, G, E]
    nv = (mv & local_src).sum(axis=(0, 2)) * float(bytes_per_expert)
    nic = (mv & ~local_src).sum(axis=(0, 2)) * float(bytes_per_expert)
    return nv, nic, int(mv.sum())


def transfer_stall(old: Placement, new: Placement, bytes_per_expert: float, nvlink_bw: float, nic_bw: float,
                   nvlink_latency: float, nic_latency: float) -> tuple[float, float, int]:
    """``(stall seconds, bytes moved, experts moved)`` of switching ``old`` -> ``new`` with the links to
    itself. Each GPU pulls its new experts from a same-node holder over NVLink when there is one, else
    over its NIC; the two links run in parallel; the slowest GPU sets the stall."""
    nv, nic, n = transfer_bytes(old, new, bytes_per_expert)
    if not n:
        return 0.0, 0.0, 0
    return free_link_time(nv, nic, nvlink_bw, nic_bw, nvlink_latency, nic_latency), float((nv + nic).sum()), int(n)


def free_link_time(nv: np.ndarray, nic: np.ndarray, nvlink_bw: float, nic_bw: float, nvlink_latency: float,
                   nic_latency: float) -> float:
    """Seconds to pull ``nv`` / ``nic`` bytes ``[G]`` over links nothing else uses: per GPU the slower of
    its two links (they run in parallel), the slowest GPU overall."""
    t = np.maximum(np.where(nv > 0, nvlink_latency + nv / nvlink_bw, 0.0),
                   np.where(nic > 0, nic_latency + nic / nic_bw, 0.0))
    return float(t.max(initial=0.0))


class Transfer:
    """An asynchronous weight transfer in flight, sharing each GPU's NVLink and NIC with the MoE
    all-to-all of the iterations it overlaps.

    ``nv`` / ``nic``: float ``[G]`` bytes each GPU still has to pull over each link, at ``nv_bw`` /
    ``nic_bw`` (the links' achieved bandwidths), flowing from ``start + latency`` (simulated seconds:
    the decision has ended, then the links' latency). Between iterations the transfer has the links to
    itself. During an iteration the two share a link fairly (half each while both send): spreading the
    iteration's all-to-all evenly over its duration ``T`` with free links, a GPU whose transfer is active
    for a fraction ``a`` of it takes ``1 + a`` times as long for its all-to-all bytes on that link, and
    the transfer moves ``bandwidth x a x T`` bytes in the (longer) iteration — the link is never idle
    while either has bytes left and neither gets more than its share. The copies' own load on HBM and
    SMs is not modelled (small next to the links for expert-sized copies)."""

    def __init__(self, start: float, nv: np.ndarray, nic: np.ndarray, nv_bw: float, nic_bw: float,
                 latency: float = 0.0) -> None:
        self.begin = start  # the copies are issued (the decision is done) ...
        self.start = start + latency  # ... and their bytes flow after the links' latency
        self.nv = np.asarray(nv, dtype=np.float64).copy()
        self.nic = np.asarray(nic, dtype=np.float64).copy()
        self.nv_bw = nv_bw
        self.nic_bw = nic_bw
        self.t = start  # simulated time up to which progress is accounted
        self.slowdown_s = 0.0  # seconds the sharing added to overlapped iterations
        self.overlapped = 0  # iterations that ran while it had bytes left
        self.free_s = 0.0  # what those iterations would have taken with free links
        self.done_at: float | None = None if self.left() else self.start

    def left(self) -> bool:
        """Bytes left on some link (under one byte counts as arrived: float residue of the accounting)."""
        return bool((self.nv >= 1.0).any() or (self.nic >= 1.0).any())

    def catch_up(self, now: float) -> None:
        """The links were the transfer's alone from the last accounted instant to ``now`` (no iteration
        ran in between)."""
        t0 = max(self.t, self.start)
        if self.left() and now > t0:
            need = float(max((self.nv / self.nv_bw).max(), (self.nic / self.nic_bw).max()))
            sec = now - t0
            self.nv = np.maximum(self.nv - self.nv_bw * sec, 0.0)
            self.nic = np.maximum(self.nic - self.nic_bw * sec, 0.0)
            if need <= sec:
                self.done_at = t0 + need
        self.t = max(self.t, now)

    def share(self, now: float, step: float) -> tuple[np.ndarray, np.ndarray] | None:
        """``(nvlink, nic)`` factors ``1 + a`` ``[G]`` for an iteration starting at ``now`` that takes
        ``step`` seconds with free links (:meth:`sim.cost.CostModel.a2a_time`'s ``link_share``); ``None``
        when the transfer does not overlap it."""
        self.catch_up(now)
        if not self.left() or step <= 0 or now + step <= self.start:
            return None
        u = now + step - max(now, self.start)  # seconds of the iteration after the transfer starts
        a_nv = np.minimum(u, self.nv / self.nv_bw) / step
        a_nic = np.minimum(u, self.nic / self.nic_bw) / step
        return 1.0 + a_nv, 1.0 + a_nic

    def overlap(self, now: float, step: float, shared: tuple[np.ndarray, np.ndarray], real: float) -> None:
        """Account an iteration that started at ``now``, would take ``step`` seconds with free links and
        took ``real`` with the ``shared`` factors from :meth:`share`."""
        a_nv, a_nic = shared[0] - 1.0, shared[1] - 1.0
        self.nv = np.maximum(self.nv - self.nv_bw * step * a_nv, 0.0)
        self.nic = np.maximum(self.nic - self.nic_bw * step * a_nic, 0.0)
        self.slowdown_s += max(real - step, 0.0)
        self.overlapped += 1
        self.free_s += step
        if self.done_at is None and not self.left():
            # it ends inside this iteration: after its active share of the longer iteration
            self.done_at = max(now, self.start) + real * float(max(a_nv.max(), a_nic.max()))
        self.t = now + real


def relabel_min_moves(old: Placement, new: Placement) -> Placement:
    """``new`` with its nodes and, within nodes, its GPUs renumbered to keep as many experts where they
    already are: per layer, nodes are matched to old nodes by expert overlap (Hungarian assignment,
    scipy), then GPUs within each matched node pair. A pure relabeling: every GPU's expert set, every
    node's set and so the balance are unchanged — only the weights that must move shrink. EPLB's
    output has no memory of the previous layout (its GPU numbering is arbitrary), so without this nearly
    every expert would move at each rebalance."""
    from scipy.optimize import linear_sum_assignment  # ~1.4 s to import; only rebalancing runs need it

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


def limit_moves(old: Placement, new: Placement, loads_LE: np.ndarray, rule: str, max_moves: int) -> Placement:
    """Take ``new``'s layout only for the layers that gain most (drop of the most loaded GPU's expected
    tokens) per moved expert, until ``max_moves`` moves are used; the other layers keep ``old``."""
    if max_moves <= 0:
        return new
    mv = moved_experts(old, new).sum(axis=(1, 2))  # [L]
    rule = get_rule(rule)
    gain = expected_gpu_loads(old, loads_LE, rule).max(axis=1) - expected_gpu_loads(new, loads_LE, rule).max(axis=1)
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
        # the pool router's (routed, repeated) token counts at the first decision: what the rebalancer is
        # scored on from then on, and how much of it repeats routing already seen (sim.routing)
        self.routed_at_first: tuple[int, int] | None = None
        # async: (earliest simulated time it can land: decision + transfer with free links, placement), and
        # the transfer in flight, whose sharing of the links with the all-to-all can make it later
        self.pending: tuple[float, Placement] | None = None
        self.transfer: Transfer | None = None
        # loads observed before the run (RebalanceConfig.observed): the window starts with them and the
        # first decision comes at the first iteration
        self.primed = cfg.observed is not None
        if self.primed:
            self.blocks.append(np.asarray(cfg.observed, dtype=np.float64))
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

    def link_share(self, now: float, step: float) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-GPU ``(nvlink, nic)`` slow-down factors of the all-to-all of an iteration starting at ``now``
        that takes ``step`` seconds with free links: the async transfer in flight shares them
        (:class:`Transfer`); ``None`` when none overlaps it."""
        return None if self.transfer is None else self.transfer.share(now, step)

    def overlapped(self, now: float, step: float, shared, real: float) -> None:
        """An iteration ran alongside the transfer (see :meth:`Transfer.overlap`)."""
        tr = self.transfer
        tr.overlap(now, step, shared, real)
        h = self.history[-1]
        h["a2a_slowdown_s"] = tr.slowdown_s
        h["overlapped_iterations"] = tr.overlapped
        h["overlapped_free_s"] = tr.free_s

    def _landed(self, now: float) -> bool:
        if self.pending is None or now < self.pending[0]:
            return False
        tr = self.transfer
        if tr is not None:
            tr.catch_up(now)
            if tr.left():
                return False
            self.history[-1]["transfer_shared_s"] = tr.done_at - tr.begin
        return True

    def maybe_rebalance(self, pool, now: float) -> float:
        if self._landed(now):
            pool.placement = self.pending[1]
            pool.router.set_placement(self.pending[1])
            self.pending = None
            self.transfer = None
        if (pool.iteration % self.cfg.every and not self.primed) or self.pending is not None:
            return 0.0
        self.primed = False
        loads = self.window_loads()
        if loads is None or loads.sum() == 0:
            return 0.0
        sim = self.sim
        old = pool.placement
        options = {}
        if self.policy == "moeplace":  # the optimizer's migration mode: at most K moves from `old`
            options = {"from": old, "max_moves": self.cfg.moves or None}
        problem = PlacementProblem(loads=loads[None], model=sim.model, cluster=sim.cluster,
                                   num_redundant=old.num_redundant, rule=sim.config.engine.replica_rule,
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
        return self.switch(pool, now, new, decision)

    def switch(self, pool, now: float, new: Placement, decision: float) -> float:
        """Move ``pool`` from its placement to ``new`` after a decision of ``decision`` seconds; returns
        the stall every rank pays (blocking: decision + transfer; async: 0, the transfer then shares the
        links with the iterations it overlaps and ``new`` lands once it has arrived)."""
        sim = self.sim
        old = pool.placement
        c = sim.cost
        g = sim.cluster.gpu
        nv, nic, n = transfer_bytes(old, new, sim.model.bytes_per_routed_expert)
        stall = free_link_time(nv, nic, c.nvlink_bw, c.nic_bw, g.nvlink_latency, g.nic_latency)
        moved = float((nv + nic).sum())
        if self.routed_at_first is None:
            self.routed_at_first = (pool.router.routed_tokens, pool.router.repeated_tokens)
        self.count += 1
        self.moved_bytes += moved
        self.history.append({"time": now, "iteration": pool.iteration, "experts_moved": n, "bytes": moved,
                             "transfer_s": stall, "decision_s": decision, "async": self.cfg.asynchronous,
                             "stall_s": 0.0 if self.cfg.asynchronous else decision + stall,
                             "policy": self.policy})
        if self.cfg.asynchronous:
            self.pending = (now + decision + stall, new)
            latency = max(g.nvlink_latency if nv.any() else 0.0, g.nic_latency if nic.any() else 0.0)
            # the bytes go over the same links as the all-to-all of the iterations the transfer overlaps
            self.transfer = Transfer(now + decision, nv, nic, c.nvlink_bw, c.nic_bw, latency)
            self.history[-1].update({"a2a_slowdown_s": 0.0, "overlapped_iterations": 0, "overlapped_free_s": 0.0})
            return 0.0
        pool.placement = new
        pool.router.set_placement(new)
        return decision + stall
