"""The simulated serving engine: attention-DP ranks with continuous batching over expert-parallel MoE
layers, driven by the event kernel.

A *pool* is one EP group spanning all the placement's GPUs: ``G / attention_tp`` DP ranks that step in
lockstep (every MoE layer's all-to-all joins them), one engine iteration at a time. Co-located serving
runs one pool doing prefill and decode; disaggregated serving runs a prefill pool (the decode pool's
size, or ``prefill_gpus`` with its own placement) and a decode pool, and hands each request's KV cache
and KDA state over the NIC. ``phase`` benchmarks one phase alone, the way published prefill/decode
figures are measured: ``prefill`` (1-token outputs) or ``decode`` (requests arrive with their prompt's
KV in place, as from an unlimited prefill pool).

MTP / speculative decoding (``mtp_draft`` d, ``mtp_acceptance`` a): every decode step verifies 1 + d
tokens per sequence (trunk, attention and MoE see 1 + d tokens) after d draft steps; the sequence keeps
``1 + j`` tokens, ``j`` the leading accepted drafts (each accepted with probability a, or with its
position's conditional probability a_i when one is given per draft position). A prefix-cache
hit rate h starts every request with ``h x prompt`` tokens already cached: prefill computes the rest,
attending to the whole prompt.

Per DP rank and iteration (vLLM/SGLang's scheduler, reduced to what costs time):
1. admit swapped-out requests, then waiting ones, first come first served, while the ``place plan``
   pools say the sequence fits (``CachePools.can_admit`` with the sequence's length so far + 1); a
   request that could not fit even alone is rejected;
2. make room for every decoding sequence's next token; when the pools are full, preempt the newest
   sequence (recompute: drop its KV and state and prefill it again later; swap: move them to host memory
   and back, paying host-link time); with ``admission="reserve"`` (TensorRT-LLM's default
   GUARANTEED_NO_EVICT capacity scheduler) a request is admitted only when its whole prompt + output
   fits next to what the running ones reserved, and nothing is ever preempted;
3. batch one token per decoding sequence and fill the rest of ``max_batched_tokens`` with prefill chunks
   (whole prompts only, without chunked prefill).
The iteration's duration is :meth:`sim.cost.CostModel.step_time` of the batch and of the routing of its
tokens (:mod:`sim.routing`), plus any stall (swap traffic, a blocking rebalance's weight transfer); an
asynchronous weight transfer instead shares the links with the all-to-all of the iterations it overlaps.
"""
from __future__ import annotations

import time as wallclock
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.pools import CachePools
from moeplace.foundation.progress import bar as progress_bar
from moeplace.placement.record import Placement
from moeplace.sim.calibration import Profile
from moeplace.sim.config import EngineConfig, SimConfig
from moeplace.sim.cost import CostModel, RankWork
from moeplace.sim.ensemble import Ensemble, IterationSample, ensemble_for
from moeplace.sim.events import Event, EventQueue
from moeplace.sim.measured import make_cost_model
from moeplace.sim.rebalance import Rebalancer
from moeplace.sim.results import Recorder, SimResult
from moeplace.sim.routing import make_router, src_gpus
from moeplace.sim.scheduler import make_scheduler
from moeplace.sim.workload import Request, RequestSource, TraceTokens, arrival_times, decode_row, token_rows


@dataclass
class Rank:
    """One attention-DP rank's scheduler state."""

    waiting: deque = field(default_factory=deque)
    swapped: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order
    used: int = 0  # KV token slots (per GPU) the running sequences hold for their next step
    pending: int = 0  # prompt tokens enqueued here and not yet prefilled (the DP balancer's load)


@dataclass
class _Batch:
    """One iteration being formed: the work per rank, its prefill chunks ``(request, rank, tokens)`` and
    decoding sequences ``(rank, [request, ...])`` (per rank, in rank order); with exact routing, the trace
    rows of its tokens and their ranks."""

    work: RankWork
    exact: bool
    prefill: list = field(default_factory=list)
    decoding: list = field(default_factory=list)
    dec_rows: list = field(default_factory=list)
    dec_rank: list = field(default_factory=list)
    pre_rows: list = field(default_factory=list)
    pre_rank: list = field(default_factory=list)


@dataclass(frozen=True)
class PoolSetup:
    """One pool of a deployment run (``place simulate --pools``): its role (``prefill`` | ``decode``), placement,
    cluster, cache pools (from its own memory plan) and engine settings (its attention TP, MoE TP, batching
    limits; the run's other settings)."""

    role: str
    placement: Placement
    cluster: ClusterSpec
    pools: CachePools
    engine: EngineConfig


class Pool:
    """One EP group (all placement GPUs) running engine iterations (the simulation's real state)."""

    def __init__(self, name: str, role: str, sim: Simulation, placement: Placement, cost: CostModel | None = None,
                 pools: CachePools | None = None, engine: EngineConfig | None = None) -> None:
        self.name = name
        self.role = role  # "both" | "prefill" | "decode"
        self.sim = sim
        self.placement = placement
        self.cost = cost or sim.cost
        self.pools = pools or sim.pools
        # the pool's own attention layout and batching limits (a deployment's pools differ); the run's otherwise
        self.engine = engine or sim.config.engine
        self.num_gpus = placement.num_gpus
        self.ranks = [Rank() for _ in range(placement.num_gpus // self.engine.attention_tp)]
        self.router = make_router(sim.config.mode, sim.trace, placement, self.engine.replica_rule,
                                  sim.config.seed, self.engine.attention_tp)
        self.link_free = [0.0] * len(self.ranks)  # when each rank's inbound KV link is free (deployment runs)
        self.inbound = [0] * len(self.ranks)  # KV hand-offs on their way to each rank
        self.busy = False
        self.wake_pending = False
        self.iteration = 0
        self.stall = 0.0  # seconds added to the next iteration (swap traffic, weight moves)
        self.batch: list = []  # prefill chunks of the iteration in flight: (request, rank, tokens)
        self.decoding: list = []  # decoding sequences of the iteration in flight: (rank, [request, ...])
        self.rebalancer = None
        self.next_rank = 0
        self.last_dt = 0.0
        # the engine's batching rules: what a sequence holds, whether it grows, which prefill chunks join
        self.scheduler = make_scheduler(self.engine, self.pools)
        # steady-state iterations kept for re-pricing under every ensemble member (sim.ensemble)
        self.sample = IterationSample() if sim.sampling else None

    # ------------------------------------------------------------------ memory checks
    def _kv(self, n):
        return self.pools.kv_tokens(n)

    def _used(self, rank: Rank) -> int:
        """Recomputed from scratch (checks of the incremental ``Rank.used``)."""
        kv = self.pools.kv_tokens
        return int(sum(kv(self.scheduler.need(q)) for q in rank.running))

    def _admit(self, r: int, now: float, used: int) -> int:
        """Admit from the swapped, then the waiting queue; returns the rank's KV token slots in use."""
        rank = self.ranks[r]
        pools = self.pools
        for queue in (rank.swapped, rank.waiting):
            while queue:
                q = queue[0]
                need = self.scheduler.need(q)
                if not pools.can_admit(need, 0, 0):  # could not fit even alone: never will
                    queue.popleft()
                    self.sim.reject(q, now)
                    continue
                if not pools.can_admit(need, used, len(rank.running)):
                    return used  # head-of-line: first come, first served
                queue.popleft()
                rank.running.append(q)
                q.kv = self._kv(need)
                used += q.kv
                if np.isnan(q.admitted):
                    q.admitted = now
                    q.queue_time = now - q.arrival
                if q.swapped:  # swap back in: the KV and state cross the host link again
                    q.swapped = False
                    self.stall += self.sim.swap_time(q, self)
        return used

    def _make_room(self, r: int, now: float, used: int) -> int:
        """Preempt the newest sequences until every running one fits its next step; returns the KV
        token slots in use. ``used``: the running sequences' slots for their next step."""
        rank = self.ranks[r]
        pools = self.pools
        while len(rank.running) > 1:
            last = rank.running[-1]
            mine = last.kv
            if pools.can_admit(self.scheduler.need(last), used - mine, len(rank.running) - 1):
                return used
            rank.running.pop()
            used -= mine
            self.sim.preempt(self, r, last, now)
        if rank.running and not pools.can_admit(self.scheduler.need(rank.running[0]), 0, 0):
            # a lone sequence that has outgrown the pools: the engine aborts it
            q = rank.running.pop()
            used -= q.kv
            self.sim.reject(q, now)
        return used

    # ------------------------------------------------------------------ one iteration
    def maybe_start(self, now: float) -> list[Event]:
        """Start an iteration if the pool is idle and has work: form the batch, route it, cost it."""
        if self.busy:
            return []
        b = self._form_batch(now)
        if b is None:
            return []
        moe, counts = self._route(b, now)
        dt, st, stall, shared = self._cost(now, b, moe)
        if self.sample is not None and self.sim.recorder.in_window(now):
            self.sample.offer(b.work, moe, dt, shared)
        self.last_dt = dt
        self.busy = True
        self.batch = b.prefill
        self.decoding = b.decoding
        self.iteration += 1
        if counts is not None:
            self.rebalancer.observe(counts)
        self.sim.recorder.iteration(self, now, dt, st, b.work, moe, stall)
        return [Event(now + dt, "iteration_end", self)]

    def _form_batch(self, now: float) -> _Batch | None:
        """Admission, preemption and batching on every rank (the scheduler's rules): the iteration's work
        per rank, its prefill chunks and decoding sequences and, for exact routing, the trace rows of its
        tokens by rank. ``None`` when no rank has anything to run."""
        cfg = self.engine
        b = _Batch(RankWork.zeros(len(self.ranks)), exact=self.router.needs_rows)
        decode_here = self.role != "prefill"
        per_seq = 1 + cfg.mtp_draft  # tokens each decoding sequence verifies per step
        work = b.work
        for r, rank in enumerate(self.ranks):
            used = self._make_room(r, now, rank.used)
            rank.used = self._admit(r, now, used)
            prefilling = []
            ctx_sum = 0
            if decode_here:  # this loop runs for every running sequence: locals only
                dec = []
                pre_append, dec_append = prefilling.append, dec.append
                for q in rank.running:
                    c = q.ctx
                    if c < q.prefill_target:
                        pre_append(q)
                    elif q.generated < q.output_len:
                        dec_append(q)
                        ctx_sum += c
                if dec and self.scheduler.decodes_wait(prefilling):
                    dec, ctx_sum = [], 0  # SGLang: a prefill batch runs alone, this rank's decodes wait
                if dec:
                    b.decoding.append((r, dec))
                    if b.exact:  # decode_row(q, q.ctx), inlined
                        b.dec_rows += [q.row_base + q.n_pre + (q.ctx - q.prompt_len) % q.n_dec if q.n_dec
                                       else decode_row(q, q.ctx) for q in dec]
                n_dec = len(dec)
            else:
                prefilling = [q for q in rank.running if q.ctx < q.prefill_target]
                n_dec = 0
            ctx_sum += n_dec  # each decode token attends to its own key too
            if b.exact:
                b.dec_rank += [r] * (n_dec * per_seq)
            work.dec_seqs[r] = n_dec
            # with drafts, each of the 1 + d verified tokens attends to the context (and the drafts before it)
            work.dec_ctx[r] = ctx_sum * per_seq + n_dec * per_seq * (per_seq - 1) / 2
            for q, c in self.scheduler.prefill_chunks(prefilling, cfg.max_batched_tokens - n_dec):
                b.prefill.append((q, r, c))
                s0 = q.ctx
                work.pre_tokens[r] += c
                work.pre_seqs[r] += 1
                work.pre_pairs[r] += c * s0 + c * (c + 1) / 2
                work.pre_ctx[r] += s0 + c
                if s0 + c >= q.prefill_target:
                    work.sampled[r] += 1
                if b.exact:
                    b.pre_rows.append(token_rows(q, s0, c))
                    b.pre_rank.append(np.full(c, r, dtype=np.int64))
        if not b.prefill and not b.decoding:
            return None
        work.tokens = work.dec_seqs * per_seq + work.pre_tokens
        work.sampled += work.dec_seqs * per_seq
        return b

    def _route(self, b: _Batch, now: float):
        """The batch's MoE work per layer and GPU from the router (and expert counts for a rebalancer)."""
        sim = self.sim
        cfg = self.engine
        want = self.rebalancer is not None and self.rebalancer.wants_counts
        t0 = wallclock.perf_counter()
        if b.exact:
            per_seq = 1 + cfg.mtp_draft
            drows = np.asarray(b.dec_rows, dtype=np.int64)
            if per_seq > 1:  # draft positions route like the following output tokens
                drows = (drows[:, None] + np.arange(per_seq)[None, :]).ravel()
            rows = np.concatenate([drows] + b.pre_rows)
            ranks = np.concatenate([np.asarray(b.dec_rank, dtype=np.int64)] + b.pre_rank)
            order = np.argsort(ranks, kind="stable")  # each rank's tokens contiguous, in batch order
            rows, ranks = rows[order], ranks[order]
            out = self.router.route(rows, src_gpus(ranks, cfg.attention_tp), sim.rng, want_counts=want)
        else:
            out = self.router.route_count(int(b.work.tokens.sum()), sim.rng, want_counts=want, now=now)
        sim.route_wall += wallclock.perf_counter() - t0
        return out

    def _cost(self, now: float, b: _Batch, moe):
        """The iteration's seconds (with the stall carried in from swaps and weight moves), its step-time
        breakdown, that stall and the link share an async weight transfer took (None without one)."""
        cfg = self.engine
        st = self._step_time(b.work, moe, cfg)
        shared = self.rebalancer.link_share(now, st.total) if self.rebalancer is not None else None
        if shared is not None:  # an async weight transfer shares the links with this step's all-to-all
            free = st.total
            st = self._step_time(b.work, moe, cfg, shared)
            self.rebalancer.overlapped(now, free, shared, st.total)
        stall, self.stall = self.stall, 0.0
        return st.total + stall, st, stall, shared

    def _step_time(self, work, moe, cfg, link_share=None):
        st = self.cost.step_time(work, moe, cfg.dual_batch_overlap, link_share)
        if cfg.mtp_draft:
            st.total += self.cost.draft_time(st, work, cfg.mtp_draft)
        return st

    def finish_iteration(self, now: float) -> list[Event]:
        sim = self.sim
        events: list[Event] = []
        made = prefilled = 0
        kv = self.pools.kv_tokens
        ranks = self.ranks
        # Decode: one token each. With pages (dcp 1) a sequence needs a new page only when its need
        # passes the slots it holds, so the plan's kv_tokens is asked only then.
        paged = self.pools.dcp == 1
        max_len = self.pools.max_model_len  # a sequence stops at the model's context, as engines cap it
        e = self.engine
        n_decoding = sum(len(qs) for _, qs in self.decoding)
        if e.mtp_draft and n_decoding:
            # leading accepted drafts per sequence: the first rejection ends the run
            acc = np.asarray(e.mtp_position_acceptance())
            ok = sim.rng.random((n_decoding, e.mtp_draft)) < acc[None, :]
            gains = (1 + np.cumprod(ok, axis=1).sum(axis=1)).tolist()
        else:
            gains = None
        grows = self.scheduler.grows
        i = 0
        for r, qs in self.decoding:  # this loop runs for every decoding sequence: locals only
            rank = ranks[r]
            done = []
            used = 0  # change of the rank's KV slots
            if gains is None:  # one token each
                for q in qs:
                    need = q.ctx + 2  # the sequence's tokens after this step, + 1
                    q.ctx = need - 1
                    q.generated += 1
                    if grows and (not paged or need > q.kv):
                        after = kv(need)
                        used += after - q.kv
                        q.kv = after
                    if q.generated >= q.output_len or need >= max_len:  # need = the sequence's tokens now
                        done.append(q)
                made += len(qs)
            else:
                for q in qs:
                    g = max(min(gains[i], q.output_len - q.generated, max_len - 1 - q.ctx), 1)
                    i += 1
                    q.ctx += g
                    q.generated += g
                    made += g
                    need = q.ctx + 1
                    if grows and (not paged or need > q.kv):
                        after = kv(need)
                        used += after - q.kv
                        q.kv = after
                    if q.generated >= q.output_len or need >= max_len:
                        done.append(q)
            rank.used += used
            for q in done:
                rank.running.remove(q)
                rank.used -= q.kv
                events += sim.finish(q, now)
        decoded = made
        for q, r, c in self.batch:
            rank = ranks[r]
            q.ctx += c
            prefilled += c
            rank.pending = max(rank.pending - c, 0)
            after = self.scheduler.held_after_prefill(q)
            rank.used += after - q.kv
            q.kv = after
            if q.ctx < q.prefill_target:
                continue
            # the last chunk's logits give the next token (the first one, or the next after a recompute
            # preemption)
            q.generated += 1
            made += 1
            if q.generated == 1:
                q.first_token = now
                sim.recorder.prompt_done(now, q.prompt_len)
                if self.role == "prefill" and q.generated < q.output_len:
                    rank.running.remove(q)
                    rank.used -= after
                    events.append(sim.handoff(q, now))
                    continue
            if q.generated >= q.output_len or q.ctx + 1 >= max_len:
                rank.running.remove(q)
                rank.used -= after
                events += sim.finish(q, now)
        sim.recorder.tokens_done(now, made, prefilled, decoded, n_decoding, self.last_dt, pool=self.name)
        self.batch = []
        self.decoding = []
        self.busy = False
        if self.rebalancer is not None:
            self.stall += self.rebalancer.maybe_rebalance(self, now)
        events += self.wake(now)
        return events

    def wake(self, now: float) -> list[Event]:
        """Ask for a scheduling pass at ``now``, after every same-time arrival and completion (the
        ``wake`` priority), so requests arriving together are batched together."""
        if self.busy or self.wake_pending:
            return []
        self.wake_pending = True
        return [Event(now, "wake", self)]

    def on_wake(self, now: float) -> list[Event]:
        self.wake_pending = False
        return self.maybe_start(now)

    def pick_rank(self) -> int:
        """The DP rank a new request goes to (see :meth:`enqueue`); hand-offs still on their way count."""
        if self.engine.dp_balance == "tokens" and len(self.ranks) > 1:
            # prompt tokens still to prefill plus one per sequence held (decode work)
            loads = [rk.pending + len(rk.running) + len(rk.waiting) + self.inbound[i] for i, rk in enumerate(self.ranks)]
            n = len(self.ranks)
            r = min(range(n), key=lambda i: (loads[(self.next_rank + i) % n], i))
            r = (self.next_rank + r) % n
            self.next_rank = (r + 1) % n
            return r
        r = self.next_rank
        self.next_rank = (self.next_rank + 1) % len(self.ranks)
        return r

    def enqueue(self, q: Request, now: float, rank: int | None = None) -> list[Event]:
        """A new request joins a DP rank's waiting queue: round robin over ranks (a DP load balancer that
        cannot tell requests apart), or with ``dp_balance="tokens"`` the rank with the fewest outstanding
        tokens (prompt tokens still to prefill plus decoding sequences), as engines' prefill balancers do
        (SGLang --load-balance-method minimum_tokens; DeepSeek's prefill load balancer)."""
        r = self.pick_rank() if rank is None else rank
        q.rank = r
        q.pool = self.name
        self.ranks[r].waiting.append(q)
        self.ranks[r].pending += q.prefill_target - q.ctx
        return self.wake(now)

    def occupancy(self) -> tuple[float, float, int, int]:
        """Peak over ranks of (KV pool fraction, state pool fraction), running and waiting counts."""
        pools = self.pools
        kv_frac = st_frac = 0.0
        running = waiting = 0
        for rank in self.ranks:
            n = len(rank.running)
            running += n
            waiting += len(rank.waiting) + len(rank.swapped)
            used = rank.used
            if pools.shared:
                kv_frac = max(kv_frac, used * pools.kv_bytes_per_token / pools.pool_bytes if pools.pool_bytes else 0)
                st_frac = max(st_frac, n * pools.state_bytes_per_seq / pools.pool_bytes if pools.pool_bytes else 0)
            else:
                cap = pools.kv_token_capacity or 1
                kv_frac = max(kv_frac, used / cap)
                st_frac = max(st_frac, n / max(pools.state_slots or 1, 1))
        return kv_frac, st_frac, running, waiting


class Simulation:
    """One run: a workload through pools of one placement. Build, then :meth:`run`."""

    def __init__(self, config: SimConfig, trace: TraceTokens, placement: Placement, cluster: ClusterSpec,
                 pools: CachePools, profile: Profile | None = None, label: str = "",
                 chrome: bool = False, progress: bool = False,
                 prefill: tuple[Placement, ClusterSpec, CachePools] | None = None,
                 on_advance: Callable[[float], None] | None = None,
                 deployment: tuple[PoolSetup, ...] | None = None, sample: bool = False,
                 ensemble: Ensemble | None = None) -> None:
        placement.check_model(trace.model, "placement")
        if placement.num_gpus != cluster.num_gpus:
            raise InputError(f"placement {label or ''}: made for {placement.num_gpus} GPUs, the cluster has "
                             f"{cluster.num_gpus} (--gpus)")
        self.config = config
        self.trace = trace
        self.model = trace.model
        self.cluster = cluster
        self.pools = pools
        self.label = label
        self.progress = progress
        self.on_advance = on_advance  # called with the simulated time after each event (timing, progress)
        e = config.engine
        self.num_ranks = cluster.num_gpus // e.attention_tp
        self.cost = self.make_cost(cluster, profile)
        # the shipped ensemble (or ``ensemble``: another, e.g. reweighted by a calibration) prices this run's
        # figures when it runs on the ensemble's reference constants (sim.ensemble.ensemble_for); its pools
        # then keep iteration samples to re-price (also on request)
        self.ensemble: Ensemble | None = ensemble_for(config, profile, ensemble)
        self.sampling = sample or self.ensemble is not None
        self.rng = np.random.default_rng(config.seed)
        self.source = RequestSource(trace, config.workload.lengths, np.random.default_rng(config.seed + 1))
        self.queue = EventQueue()
        self.recorder = Recorder(self, chrome=chrome)
        self.route_wall = 0.0
        self.deployment = deployment is not None
        if deployment is not None:  # a prefill and a decode pool, each with its own layout (place simulate --pools)
            self.pools_list = []
            for ps in deployment:
                ps.placement.check_model(trace.model, f"{ps.role} placement")
                if ps.placement.num_gpus != ps.cluster.num_gpus:
                    raise InputError(f"{ps.role} placement: made for {ps.placement.num_gpus} GPUs, the {ps.role} pool "
                                     f"has {ps.cluster.num_gpus} (--pools)")
                self.pools_list.append(Pool(ps.role, ps.role, self, ps.placement,
                                            self.make_cost(ps.cluster, profile, ps.engine), ps.pools, ps.engine))
            self.cost = self.pools_list[-1].cost
        elif e.phase == "decode":
            self.pools_list = [Pool("decode", "decode", self, placement)]
        elif e.disaggregated and e.phase == "both":
            if prefill is not None:
                p_placement, p_cluster, p_pools = prefill
                p_placement.check_model(trace.model, "prefill placement")
                if p_placement.num_gpus != p_cluster.num_gpus:
                    raise InputError(f"prefill placement: made for {p_placement.num_gpus} GPUs, the prefill pool has "
                                     f"{p_cluster.num_gpus} (--prefill-gpus)")
                pre = Pool("prefill", "prefill", self, p_placement, self.make_cost(p_cluster, profile), p_pools)
            else:
                pre = Pool("prefill", "prefill", self, placement)
            self.pools_list = [pre, Pool("decode", "decode", self, placement)]
        else:
            self.pools_list = [Pool("main", "both", self, placement)]
        self.num_gpus = sum(p.num_gpus for p in self.pools_list)
        if config.rebalance is not None:
            for p in self.pools_list:
                p.rebalancer = Rebalancer(config.rebalance, self, p)
        self.pending: list[Event] = []  # follow-ups produced outside a handler's return path
        self._arrivals: np.ndarray | None = None
        self._next_arrival = 0

    def make_cost(self, cluster: ClusterSpec, profile: Profile | None, engine: EngineConfig | None = None) -> CostModel:
        c = self.config
        return make_cost_model(self.model, cluster, c.cost, engine or c.engine, profile, c.cost_model, c.cost_engine)

    # ------------------------------------------------------------------ request lifecycle
    def entry_pool(self) -> Pool:
        return self.pools_list[0]

    def new_request(self, now: float) -> Request:
        q = self.source.make(now)
        e = self.config.engine
        if e.phase == "prefill":
            q.output_len = 1
        elif e.phase == "decode":
            q.output_len = max(q.output_len, 2)
        q.prefill_target = q.prompt_len
        q.ctx = min(int(e.prefix_hit * q.prompt_len), q.prompt_len - 1)  # prefix-cache hit: KV already there
        if e.phase == "decode":  # the prompt's KV and first token come from an (unlimited) prefill pool
            q.ctx = q.prompt_len
            q.generated = 1
            q.first_token = now
        self.recorder.requests.append(q)
        return q

    def on_arrival(self, ev: Event) -> list[Event]:
        now = ev.time
        events = []
        q = self.new_request(now)
        events += self.entry_pool().enqueue(q, now)
        if self._arrivals is not None:
            self._next_arrival += 1
            if self._next_arrival < len(self._arrivals):
                events.append(Event(float(self._arrivals[self._next_arrival]), "arrival"))
        return events

    def _replace_closed(self, now: float) -> list[Event]:
        if self.config.workload.arrival == "closed" and now < self.config.duration:
            cap = self.config.workload.max_requests
            if cap is None or len(self.recorder.requests) < cap:
                return [Event(now, "arrival")]
        return []

    def finish(self, q: Request, now: float) -> list[Event]:
        q.finished = now
        return self._replace_closed(now)

    def reject(self, q: Request, now: float) -> None:
        q.rejected = True
        q.finished = now
        self.recorder.rejected += 1
        self.pending += self._replace_closed(now)

    def preempt(self, pool: Pool, r: int, q: Request, now: float) -> None:
        q.preemptions += 1
        self.recorder.preemptions += 1
        if self.config.engine.preemption == "swap":
            q.swapped = True
            pool.stall += self.swap_time(q, pool)
            pool.ranks[r].swapped.appendleft(q)
        else:  # recompute: everything so far becomes a prompt to prefill again
            q.prefill_target = q.prompt_len + max(q.generated - 1, 0)  # == q.ctx
            q.ctx = 0
            pool.ranks[r].waiting.appendleft(q)
            pool.ranks[r].pending += q.prefill_target

    def swap_time(self, q: Request, pool: Pool | None = None) -> float:
        p = self.pools if pool is None else pool.pools
        b = p.seq_bytes(max(q.ctx, 1))
        return b / self.config.engine.swap_bw

    def handoff(self, q: Request, now: float) -> Event:
        """Disaggregated: ship the KV cache and state from the prefill to the decode pool over the NIC
        (every GPU of the TP group sends its copy in parallel)."""
        if self.deployment:
            return self.deployment_handoff(q, now)
        p = self.pools
        b = p.seq_bytes(q.ctx)
        dt = self.cost.transfer_time(b, same_node=False)
        self.recorder.transfer_bytes += b * self.config.engine.attention_tp * 1.0
        return Event(now + dt, "transfer_done", q)

    def deployment_handoff(self, q: Request, now: float) -> Event:
        """A deployment's hand-off (NIXL): the decode DP rank is chosen now; each of its ``attention_tp`` GPUs
        pulls its share, laid out as the decode pool holds it (the MLA latent of every cached token at the
        decode pool's KV dtype, replicated on its TP ranks unless DCP shards it; its share of the KDA state),
        whatever the prefill pool's layout (the cache does not depend on expert ids or the prefill TP). One
        GPU receives ``kv_tokens(ctx) x bytes/token + state`` over the ``kv_link`` (its NIC for ``rdma``,
        NVLink for ``nvlink``); hand-offs into one rank queue on its link, first come first served."""
        dec = self.pools_list[1]
        r = dec.pick_rank()
        dec.inbound[r] += 1
        p = dec.pools
        b = p.seq_bytes(q.ctx)
        dt = dec.cost.transfer_time(b, same_node=dec.engine.kv_link == "nvlink")
        start = max(now, dec.link_free[r])
        dec.link_free[r] = start + dt
        self.recorder.transfer_bytes += b * dec.engine.attention_tp
        q.transfer_s = start + dt - now
        q.rank = r
        return Event(start + dt, "transfer_done", q)

    def on_transfer(self, ev: Event) -> list[Event]:
        dec = self.pools_list[1]
        if self.deployment:
            dec.inbound[ev.data.rank] -= 1
            return dec.enqueue(ev.data, ev.time, rank=ev.data.rank)
        return dec.enqueue(ev.data, ev.time)

    def on_iteration_end(self, ev: Event) -> list[Event]:
        return ev.data.finish_iteration(ev.time)

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        wl = self.config.workload
        dur = self.config.duration
        if wl.arrival == "closed":
            n0 = wl.concurrency if wl.max_requests is None else min(wl.concurrency, wl.max_requests)
            for _ in range(n0):
                self.queue.push(Event(0.0, "arrival"))
        else:
            self._arrivals = arrival_times(wl, dur, np.random.default_rng(self.config.seed + 2))
            if len(self._arrivals):
                self.queue.push(Event(float(self._arrivals[0]), "arrival"))
        def with_pending(fn):
            def handler(ev: Event) -> list[Event]:
                out = fn(ev) or []
                if self.pending:
                    out, self.pending = out + self.pending, []
                return out
            return handler

        handlers = {k: with_pending(fn) for k, fn in (("arrival", self.on_arrival),
                                                      ("iteration_end", self.on_iteration_end),
                                                      ("transfer_done", self.on_transfer),
                                                      ("wake", lambda ev: ev.data.on_wake(ev.time)))}
        t0 = wallclock.perf_counter()
        bar = None
        if self.progress:
            bar = progress_bar(total=round(dur), unit="sim s", desc=self.label or "simulate", on=True)
        shown = [0]

        def advance(now: float) -> None:
            s = int(min(now, dur))
            if s > shown[0]:
                bar.update(s - shown[0])
                shown[0] = s

        hook = self.on_advance
        if bar is not None and hook is not None:
            def both(now: float) -> None:
                advance(now)
                hook(now)
            hook = both
        elif bar is not None:
            hook = advance
        self.queue.run(handlers, until=dur, on_advance=hook)
        if bar is not None:
            bar.close()
        wall = wallclock.perf_counter() - t0
        return self.recorder.result(wall)
