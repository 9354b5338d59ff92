"""Routing per engine iteration: where the batched tokens' experts live, per MoE layer and GPU.

Two modes behind one interface (:meth:`route` -> :class:`sim.cost.MoeWork`):

- :class:`ReplayRouter` (exact): the batch's trace tokens go through the placement and the engine's
  replica rule (``placement.dispatch.token_slots``: vLLM's replica hash (or the older modulo rule) on
  each rank's own batch, or SGLang's static dispatch map from the token's source GPU). Per-GPU
  selections, touched experts and token copies
  over NVLink / NIC (one copy per distinct destination GPU of a token, as DeepEP sends them) are counted
  exactly.
- :class:`StatRouter` (fast): fitted to the same trace, window by window in the trace's time order
  (``STAT_WINDOW_TOKENS`` tokens each, requests in order of arrival): the simulated iterations walk through
  the windows as they route tokens (wrapping at the end), so the trace's drift reaches the straggler and
  throughput figures and the online rebalancer. Each layer's selections per GPU are drawn from a
  multinomial over the GPUs' expected shares (the expert frequencies of the windows the iteration's tokens
  span, through the replica rule's expected split); touched experts are their expectation given the
  GPU's drawn selections (:meth:`StatRouter.expected_touched`); token copies per
  link kind scale with a GPU's selections by per-layer ratios measured by replaying a sample of the
  trace. Its mean per-layer, per-GPU load equals the replay's up to sampling noise (tested).
  An iteration of ``n`` tokens routes the trace tokens ``[cursor, cursor + n)``: when they span several
  windows (a large decode batch: one token of each of thousands of sequences) it draws from the
  token-weighted mixture of those windows, as a replay of the same tokens would. Drawing a batch much
  larger than a window from one window's frequencies would charge it that window's sampling noise and
  few-request concentration as if they were real skew (a 18k-token batch from one 4096-token window of a
  DeepSeek-V3 trace: busiest EPLB GPU 1.50x the mean at EP72 vs 1.17x replayed).

A run can outlive its trace (a 100k-token trace is routed in a few hundred iterations at production
batch sizes). Neither router invents routing the trace does not hold: past the trace's end both route
its tokens again, and count it. Every router keeps ``routed_tokens`` (token routings done) and
``repeated_tokens`` (those of a trace token already routed before in this run: replay counts each trace
row routed a second time or more, the statistical router every token past the cursor's first pass);
:func:`sim.results.summarize` reports their ratio and how many times over the run routed its trace,
and ``place simulate`` warns on stderr when it is more than once, so that a figure (an online
rebalancer's above all: it is scored on routing its window may already have observed) is never read as
if it came from unseen traffic.

Tokens of attention-DP rank ``r`` (``attention_tp`` GPUs) are dispatched from GPU ``r * tp + i % tp``:
each GPU of a TP group sends its share of the group's tokens, as SGLang's DP-attention + EP does.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.dispatch import batch_layout
from moeplace.placement.record import Placement
from moeplace.placement.rules import ReplicaRule, get_rule
from moeplace.sim.cost import MoeWork
from moeplace.sim.workload import TraceTokens

FIT_SAMPLE_TOKENS = 4096
STAT_WINDOW_TOKENS = 4096  # the trace's tokens per fitted distribution (place optimize's window)
TOUCHED_MEMO_ENTRIES = 2 ** 23  # StatRouter's remembered expected_touched figures (float64: 64 MiB), at most;
# one (window, tokens) table at most a quarter of it


def link_copies(gpu: np.ndarray, src: np.ndarray, gpus_per_node: int, num_gpus: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token copies each GPU receives per MoE layer, by link: ``(local, nvlink, nic)`` float64 ``[L, G]``.

    ``gpu``: int ``[n, L, k]`` destination GPU of every selection; ``src``: int ``[n]`` source GPU. A token
    sends one copy to each distinct destination GPU (several of its experts on one GPU share it).

    Fast path: each (token, layer) keeps its destination set as a bitmask of ``ceil(G / 64)`` words
    (OR over k, no sort), split into local / same-node / other-node bits with per-source masks, and the
    bits are counted per GPU with ``unpackbits``. :func:`link_copies_ref` is the sorting twin it is
    tested against."""
    n, L, k = gpu.shape
    W = -(-num_gpus // 64)
    own, node = _source_masks(num_gpus, gpus_per_node)  # uint64 [W, G] each
    src = np.asarray(src, dtype=np.int64)
    gpu = gpu.astype(np.uint64, copy=False)
    out = [np.zeros((L, W * 64)) for _ in range(3)]
    for w in range(W):
        bits = np.zeros((n, L), dtype=np.uint64)
        for j in range(k):
            g = gpu[:, :, j]
            if W == 1:
                bits |= np.left_shift(np.uint64(1), g)
            else:
                in_word = (g >> np.uint64(6)) == np.uint64(w)
                bits |= np.where(in_word, np.left_shift(np.uint64(1), g & np.uint64(63)), np.uint64(0))
        o, nd = own[w, src][:, None], node[w, src][:, None]
        for i, b in enumerate((bits & o, bits & nd & ~o, bits & ~nd)):
            unpacked = np.unpackbits(b.view(np.uint8).reshape(n, L, 8), axis=2, bitorder="little")
            out[i][:, w * 64:(w + 1) * 64] = unpacked.sum(axis=0, dtype=np.int64)
    return out[0][:, :num_gpus], out[1][:, :num_gpus], out[2][:, :num_gpus]


@lru_cache(maxsize=16)
def _source_masks(num_gpus: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Per source GPU, bitmasks (``ceil(G/64)`` uint64 words) of its own GPU and of its node's GPUs."""
    W = -(-num_gpus // 64)
    own = np.zeros((W, num_gpus), dtype=np.uint64)
    node = np.zeros((W, num_gpus), dtype=np.uint64)
    for s_ in range(num_gpus):
        own[s_ // 64, s_] = np.uint64(1) << np.uint64(s_ % 64)
        first = (s_ // gpus_per_node) * gpus_per_node
        for g in range(first, min(first + gpus_per_node, num_gpus)):
            node[g // 64, s_] |= np.uint64(1) << np.uint64(g % 64)
    own.setflags(write=False)
    node.setflags(write=False)
    return own, node


def link_copies_ref(gpu: np.ndarray, src: np.ndarray, gpus_per_node: int, num_gpus: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference for :func:`link_copies` (sort each token's destinations, keep first occurrences)."""
    L = gpu.shape[1]
    g = np.sort(gpu, axis=2)
    first = np.ones_like(g, dtype=bool)
    first[:, :, 1:] = g[:, :, 1:] != g[:, :, :-1]
    s = src[:, None, None]
    local = g == s
    same_node = (g // gpus_per_node) == (s // gpus_per_node)
    key = (np.arange(L)[None, :, None] * num_gpus + g)
    out = []
    for mask in (first & local, first & same_node & ~local, first & ~same_node):
        out.append(np.bincount(key[mask], minlength=L * num_gpus).reshape(L, num_gpus).astype(np.float64))
    return out[0], out[1], out[2]


def src_gpus(rank: np.ndarray, attention_tp: int) -> np.ndarray:
    """Source GPU of each token ``[n]`` given its DP rank ``[n]`` (tokens of a rank in batch order)."""
    rank = np.asarray(rank, dtype=np.int64)
    if attention_tp == 1:
        return rank
    # index of each token within its rank, in order
    order = np.argsort(rank, kind="stable")
    counts = np.bincount(rank)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    idx = np.empty_like(rank)
    idx[order] = np.arange(rank.size) - np.repeat(starts, counts)
    return rank * attention_tp + idx % attention_tp


class ReplayRouter:
    """Exact replay of the trace tokens' routing. ``route`` returns the :class:`MoeWork` of one
    iteration and, when ``want_counts``, the expert selections int64 ``[L, E]`` (for rebalancing)."""

    mode = "replay"
    needs_rows = True
    CHUNK = 16384  # tokens per batch given to the replica rule (its in-batch positions restart per chunk)
    BLOCK = 256  # tokens per vectorized step of the counting (its arrays stay in cache)

    def __init__(self, trace: TraceTokens, placement: Placement, engine: str, seed: int = 42) -> None:
        self.trace = trace
        self.engine = engine
        self.rule = get_rule(engine, seed=seed)
        self.seed = seed
        self._seen = np.zeros(trace.num_tokens, dtype=bool)  # trace rows routed so far
        self.routed_tokens = 0
        self.repeated_tokens = 0
        self.set_placement(placement)

    def _count(self, rows: np.ndarray) -> None:
        """Count ``rows`` (trace rows, already ``% T``) as routed; those routed before (earlier, or
        earlier in ``rows``) as repeats."""
        new = rows[~self._seen[rows]]
        first = np.unique(new).size if new.size else 0
        self._seen[new] = True
        self.routed_tokens += int(rows.size)
        self.repeated_tokens += int(rows.size) - first

    def set_placement(self, placement: Placement) -> None:
        self.placement = placement
        self.dmap = self.rule.dispatch_state(placement)
        L, G, P, E = placement.num_layers, placement.num_gpus, placement.num_slots, placement.num_experts
        # Per-selection tables, indexed by the (layer, expert) key l * E + e or the (layer, slot) key l * P + s.
        # An expert with one replica has one slot whatever the rule, so a layer without replicas maps
        # each key to ``log2phy[l, e, 0]``; only layers with replicas ask the rule (per token).
        self._single = (placement.logcnt == 1).all(axis=1)  # [L] layers without replicated experts
        self._key_off = (np.arange(L, dtype=np.int32) * E)[None, :, None]
        self._key_off_k = self._key_off.reshape(1, 1, L)
        self._gslot = (np.arange(L, dtype=np.int64)[:, None] * P + placement.log2phy[:, :, 0]).ravel()
        self._gslot_gpu = np.tile(placement.slot_gpu, L).astype(np.int16)  # GPU of each (layer, slot) key
        self._gslot_bit = None
        if G <= 64:  # destination sets as one bitmask word per (token, layer)
            dt = np.uint32 if G <= 32 else np.uint64
            self._gslot_bit = np.left_shift(dt(1), self._gslot_gpu.astype(dt))
        # the same by (layer, expert) key, for layers without replicas
        self._egpu = self._gslot_gpu[self._gslot]
        self._ebit = None if self._gslot_bit is None else self._gslot_bit[self._gslot]

    def route(self, rows: np.ndarray, src: np.ndarray, rng: np.random.Generator | None = None,
              want_counts: bool = False) -> tuple[MoeWork, np.ndarray | None]:
        placement = self.placement
        L, G, P, E = placement.num_layers, placement.num_gpus, placement.num_slots, placement.num_experts
        if len(rows) and not self.rule.per_token:  # as token_slots says it
            raise InputError(f"engine '{self.rule.name}' has no per-token slot choice")
        single = bool(self._single.all())
        slot_hits = np.zeros(L * P, dtype=np.int64)
        expert_hits = np.zeros(L * E, dtype=np.int64) if single or want_counts else None
        nv = np.zeros((L, G), dtype=np.int64)
        nic = np.zeros((L, G), dtype=np.int64)
        T = self.trace.num_tokens
        B = self.BLOCK
        for a in range(0, len(rows), self.CHUNK):  # a chunk is one batch to the rule (its positions restart)
            r = np.asarray(rows[a:a + self.CHUNK]) % T
            self._count(r)
            s = np.asarray(src[a:a + self.CHUNK], dtype=np.int64)
            gkey = None
            if not single:  # layers with replicas: the rule's per-token choice (as token_slots makes it)
                ids = self.trace.expert_ids[r]
                gkey = self._gslot.take(ids + self._key_off)
                step, pos = batch_layout(s, G, None)
                for l in np.flatnonzero(~self._single):
                    gkey[:, l, :] = l * P + self.rule.batch_slots(
                        placement, int(l), ids[:, l, :].astype(np.int64), src_gpu=s, pos_in_batch=pos,
                        batch_id=step, state=self.dmap)
            for c in range(0, len(r), B):  # blocks small enough to stay in cache; every count adds up
                sb = s[c:c + B]
                if gkey is None or expert_hits is not None:
                    # (layer, expert) keys, k-major [k, n, L]: the OR over k runs on whole contiguous planes
                    key = self.trace.expert_ids[r[c:c + B]].transpose(2, 0, 1) + self._key_off_k
                    expert_hits += np.bincount(key.ravel(), minlength=L * E)
                if gkey is None:  # one slot per expert: tables by (layer, expert) key
                    dest = key
                    bit_of, gpu_of = self._ebit, self._egpu
                else:
                    dest = gkey[c:c + B].transpose(2, 0, 1)
                    slot_hits += np.bincount(dest.ravel(), minlength=L * P)
                    bit_of, gpu_of = self._gslot_bit, self._gslot_gpu
                if bit_of is not None:
                    c_nv, c_nic = _link_copies_word(_or_first(bit_of.take(dest)), sb, placement.gpus_per_node, G)
                else:
                    _, c_nv, c_nic = link_copies(gpu_of.take(dest).transpose(1, 2, 0), sb, placement.gpus_per_node, G)
                    c_nv, c_nic = c_nv.astype(np.int64), c_nic.astype(np.int64)
                nv += c_nv
                nic += c_nic
        if single:
            slot_hits[self._gslot] = expert_hits
        hits = slot_hits.reshape(L, G, P // G)
        tokens = hits.sum(axis=2).astype(np.float64)
        touched = (hits > 0).sum(axis=2).astype(np.float64)
        counts = expert_hits.reshape(L, E) if want_counts else None
        return MoeWork(tokens, touched, nv.astype(np.float64), nic.astype(np.float64)), counts


def _or_first(x: np.ndarray) -> np.ndarray:
    """Bitwise OR over the first axis, in place (halving: a few whole-plane operations)."""
    m = x.shape[0]
    while m > 1:
        h = m // 2
        np.bitwise_or(x[:h], x[h:2 * h], out=x[:h])
        if m % 2:
            x[0] |= x[2 * h]
        m = h
    return x[0]


def _link_copies_word(bits: np.ndarray, src: np.ndarray, gpus_per_node: int, num_gpus: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`link_copies`' NVLink and NIC copies ``[L, G]`` from each (token, layer)'s destination GPUs
    as one bitmask word ``bits`` (uint32 or uint64 ``[n, L]``, G <= 64) and the tokens' source GPUs."""
    n, L = bits.shape
    own, node = _source_masks(num_gpus, gpus_per_node)
    dt = bits.dtype.type
    o, nd = own[0, src].astype(dt)[:, None], node[0, src].astype(dt)[:, None]
    nb = bits.dtype.itemsize
    out = []
    for b in (bits & nd & ~o, bits & ~nd):
        unpacked = np.unpackbits(b.view(np.uint8).reshape(n, L, nb), axis=2, bitorder="little")
        # per-bit sums in the narrowest exact dtype (a wide accumulator is several times slower)
        out.append(unpacked.sum(axis=0, dtype=np.uint16 if n < 2**16 else np.int64)[:, :num_gpus])
    return out[0], out[1]


def slot_shares(placement: Placement, freq_LE: np.ndarray, engine: str | ReplicaRule, seed: int = 42,
                dmap: np.ndarray | None = None) -> np.ndarray:
    """Expected share of a layer's selections that each slot serves, float64 ``[L, P]`` (rows sum to 1),
    for expert frequencies ``freq_LE`` (``[L, E]``, rows sum to 1) and tokens spread evenly over the
    source GPUs. vLLM: ``freq / logcnt`` per replica (the even split vLLM's hash and modulo rules give);
    SGLang: each source GPU's dispatch-map slot gets ``freq / G`` of the expert."""
    return get_rule(engine, seed=seed).slot_loads(placement, freq_LE, dmap)


class StatRouter:
    """Statistical routing fitted to a trace, one distribution per time window (see the module
    docstring). ``freq_w``: float ``[Wn, L, E]`` expert frequencies per window (rows sum to 1);
    ``window_end``: int ``[Wn]`` the trace token each window ends at."""

    mode = "stat"
    needs_rows = False

    def __init__(self, trace: TraceTokens, placement: Placement, engine: str, seed: int = 42,
                 attention_tp: int = 1, fit_tokens: int = FIT_SAMPLE_TOKENS,
                 window_tokens: int = STAT_WINDOW_TOKENS) -> None:
        self.trace = trace
        self.engine = engine
        self.rule = get_rule(engine, seed=seed)
        self.seed = seed
        self.attention_tp = attention_tp
        self.fit_tokens = fit_tokens
        self.timeline = getattr(trace, "timeline", None)
        if self.timeline is not None:  # windows over simulated time (sim.timeline): drawn by the clock
            tl = self.timeline
            self.freq_w = tl.freq()
            tot = tl.counts.sum(axis=0)
            self.freq = tot / np.maximum(tot.sum(axis=1, keepdims=True), 1e-300)
            # the windows' traffic as positions on a line, so the whole-timeline mixture weighs them alike
            self.window_end = np.cumsum(np.maximum(tl.weights, 1e-12))
            self.window_start = np.append(0.0, self.window_end[:-1])
        else:
            counts = trace.expert_counts().astype(np.float64)
            self.freq = counts / counts.sum(axis=1, keepdims=True)  # [L, E] the whole trace
            T = trace.num_tokens
            ends = np.append(np.arange(window_tokens, T, window_tokens), T)
            if len(ends) > 1 and T - ends[-2] < window_tokens // 2:  # a short tail joins the window before
                ends = np.delete(ends, -2)
            self.window_end = ends
            self.window_start = np.append(0, ends[:-1])
            self.freq_w = np.stack([_window_freq(trace, int(a), int(b), self.freq)
                                    for a, b in zip(self.window_start, ends)])
        self.cursor = 0  # trace tokens routed so far (the position in the trace's time line)
        self.set_placement(placement)

    @property
    def routed_tokens(self) -> int:
        return int(self.cursor)

    @property
    def repeated_tokens(self) -> int:
        """Tokens routed past the first pass over the trace (its windows' distributions again); none on a
        timeline (every token is drawn from the distribution of its simulated second)."""
        if self.timeline is not None:
            return 0
        return max(0, int(self.cursor) - self.trace.num_tokens)

    @property
    def num_windows(self) -> int:
        return int(self.freq_w.shape[0])

    def set_placement(self, placement: Placement) -> None:
        self.placement = placement
        L, G, P = placement.num_layers, placement.num_gpus, placement.num_slots
        dmap = self.rule.dispatch_state(placement)
        self.slot_q_w = np.stack([slot_shares(placement, f, self.rule, self.seed, dmap)
                                  for f in self.freq_w])  # [Wn, L, P]
        gq = self.slot_q_w.reshape(-1, L, G, P // G).sum(axis=3)
        self.gpu_q_w = gq / gq.sum(axis=2, keepdims=True)
        self._touched_memo: dict = {}  # expected_touched by (window, tokens): see _touched_in_window
        self._touched_seen: set = set()
        # each array's whole-trace mixture (window length-weighted), flattened, for spans of whole passes
        share = (self.window_end - self.window_start) / float(self.window_end[-1])
        self._whole = {name: np.einsum("w,wx->x", share, getattr(self, name).reshape(len(share), -1))
                       for name in ("freq_w", "gpu_q_w", "slot_q_w")}
        # Copies per selection by link, per layer, from replaying an evenly spread sample of the trace.
        T = self.trace.num_tokens
        n = min(T, self.fit_tokens)
        rows = np.linspace(0, T - 1, n).astype(np.int64)
        src = np.arange(n, dtype=np.int64) % G
        work, _ = ReplayRouter(self.trace, placement, self.engine, self.seed).route(rows, src)
        sel = work.tokens.sum(axis=1)  # [L]
        self.nv_ratio = work.nvlink.sum(axis=1) / sel  # copies per selection
        self.nic_ratio = work.nic.sum(axis=1) / sel

    def window(self) -> int:
        """The trace window the next iteration's first token comes from."""
        pos = self.cursor % self.trace.num_tokens
        return int(np.searchsorted(self.window_end, pos, side="right"))

    def _span(self, num_tokens: int) -> tuple[int, np.ndarray]:
        """The next ``num_tokens`` trace tokens (from the cursor on, wrapping at the trace's end): whole
        passes over the trace and the tokens of the rest that fall in each window (float64 ``[Wn]``)."""
        T = self.trace.num_tokens
        cycles, rest = divmod(max(int(num_tokens), 1), T)
        start, end = self.window_start, self.window_end
        cover = np.zeros(len(end))
        pos = self.cursor % T
        for a, b in ((pos, min(pos + rest, T)), (0, max(pos + rest - T, 0))):  # the rest, split at the wrap
            cover += np.clip(np.minimum(end, b) - np.maximum(start, a), 0, None)
        return cycles, cover

    def span_weights(self, num_tokens: int) -> np.ndarray:
        """Share of the next ``num_tokens`` trace tokens that falls in each window, float64 ``[Wn]``
        summing to 1."""
        cycles, cover = self._span(num_tokens)
        return (cycles * (self.window_end - self.window_start) + cover) / max(int(num_tokens), 1)

    def _mixed(self, name: str, cycles: int, cover: np.ndarray, n: int) -> np.ndarray:
        """Token-weighted mixture of the windows' ``name`` array (``freq_w``, ``gpu_q_w`` or ``slot_q_w``)
        over a span (:meth:`_span`): whole passes take the whole trace's mixture, the rest sums over its
        (at most two) runs of consecutive windows; a span inside one window is that window's array."""
        arr = getattr(self, name)
        hit = np.flatnonzero(cover)
        if cycles == 0 and len(hit) == 1:
            return arr[hit[0]]
        flat = arr.reshape(arr.shape[0], -1)  # a view; einsum over each run's slice copies nothing
        out = cycles * self.trace.num_tokens * self._whole[name] if cycles else np.zeros(flat.shape[1])
        if len(hit):
            breaks = np.flatnonzero(np.diff(hit) > 1) + 1
            for run in np.split(hit, breaks):
                a, b = int(run[0]), int(run[-1]) + 1
                out = out + np.einsum("w,wx->x", cover[a:b], flat[a:b])
        return (out / n).reshape(arr.shape[1:])

    def route(self, rows: np.ndarray, src: np.ndarray, rng: np.random.Generator,
              want_counts: bool = False, now: float = 0.0) -> tuple[MoeWork, np.ndarray | None]:
        """Same interface as :meth:`ReplayRouter.route`; only the number of tokens matters."""
        return self.route_count(len(rows), rng, want_counts, now)

    def route_count(self, num_tokens: int, rng: np.random.Generator,
                    want_counts: bool = False, now: float = 0.0) -> tuple[MoeWork, np.ndarray | None]:
        """:class:`MoeWork` of an iteration of ``num_tokens`` tokens (and expected expert counts
        ``[L, E]`` when ``want_counts``), drawn from the windows its tokens span (token-weighted);
        advances the time line. On a timeline (:mod:`sim.timeline`): drawn from the window of the
        simulated second ``now`` the iteration starts at."""
        n = max(int(num_tokens), 1)
        k = self.trace.model.top_k
        num_sel = num_tokens * k
        if self.timeline is not None:
            w = self.timeline.window_at(now)
            self.cursor += num_tokens
            gpu_q, slot_q = self.gpu_q_w[w], self.slot_q_w[w]
            tokens = rng.multinomial(num_sel, gpu_q).astype(np.float64)
            touched = self._touched_in_window(w, tokens, gpu_q, slot_q, k, num_tokens)
            counts = num_sel * self.freq_w[w] if want_counts else None
            return (MoeWork(tokens, touched, tokens * self.nv_ratio[:, None], tokens * self.nic_ratio[:, None]),
                    counts)
        cycles, cover = self._span(num_tokens)
        self.cursor += num_tokens
        gpu_q, slot_q = self._mixed("gpu_q_w", cycles, cover, n), self._mixed("slot_q_w", cycles, cover, n)
        tokens = rng.multinomial(num_sel, gpu_q).astype(np.float64)  # [L, G]
        hit = np.flatnonzero(cover)
        touched = (self._touched_in_window(int(hit[0]), tokens, gpu_q, slot_q, k, num_tokens)
                   if cycles == 0 and len(hit) == 1  # _mixed gave that window's own arrays
                   else self.expected_touched(tokens, gpu_q, slot_q, k, num_tokens))
        counts = None
        if want_counts:
            counts = num_sel * self._mixed("freq_w", cycles, cover, n)
        return (MoeWork(tokens, touched, tokens * self.nv_ratio[:, None], tokens * self.nic_ratio[:, None]),
                counts)


    def expected_touched(self, tokens: np.ndarray, gpu_q: np.ndarray, slot_q: np.ndarray, k: int,
                         num_tokens: int) -> np.ndarray:
        """Distinct local experts each GPU reads ``[L, G]`` when ``num_tokens`` tokens put ``tokens``
        selections on it (``[L, G]``, drawn), given its share of the layer's selections (``gpu_q`` ``[L, G]``)
        and the slots' shares (``slot_q`` ``[L, P]``). A token selects slot ``s`` with probability
        ``p_s = k q_s`` (its ``k`` experts are distinct), so ``n`` tokens touch it with probability
        ``1 - (1 - p_s)^n``. Conditioned on the draw: a GPU that drew ``c`` times its expected
        ``n k Q_g`` selections is given ``c p_s`` per token, so at batch 1 every selection on a GPU is a
        distinct expert (as replay counts) and at large batch the sum is the binomial expectation. The
        unconditioned expectation gave the busiest GPU the mean GPU's weight reads (issue 27: 1.96
        distinct experts for 4.18 selections at batch 1). Capped at the GPU's selections."""
        L, G = tokens.shape
        n = max(int(num_tokens), 1)
        touched = _distinct_experts(tokens, gpu_q, slot_q.reshape(L, G, self.placement.slots_per_gpu), k, n)
        return np.minimum(touched, tokens)

    def _touched_in_window(self, w: int, tokens: np.ndarray, gpu_q: np.ndarray, slot_q: np.ndarray, k: int,
                           num_tokens: int) -> np.ndarray:
        """:meth:`expected_touched` of an iteration drawn from window ``w``'s own shares (``gpu_q`` and
        ``slot_q`` are that window's arrays), remembered: given the window and ``num_tokens``, a GPU's
        distinct experts of a layer depend only on its drawn selections, a whole number from 0 to
        ``num_tokens k``, so each (layer, GPU, count) is computed once, by the same operations as
        :meth:`expected_touched` (the same figures to the last bit), and looked up after. A router's
        first iteration of a (window, tokens) pair, or one whose table would exceed a quarter of
        :data:`TOUCHED_MEMO_ENTRIES`, is computed directly; past that many entries the tables start afresh."""
        n = max(int(num_tokens), 1)
        L, G = tokens.shape
        key = (w, n)
        tab = self._touched_memo.get(key)
        if tab is None:
            size = L * G * (n * k + 1)
            if key not in self._touched_seen or 4 * size > TOUCHED_MEMO_ENTRIES:
                self._touched_seen.add(key)
                return self.expected_touched(tokens, gpu_q, slot_q, k, num_tokens)
            if sum(t.size for t in self._touched_memo.values()) + size > TOUCHED_MEMO_ENTRIES:
                self._touched_memo.clear()
            tab = self._touched_memo[key] = np.full((L, G, n * k + 1), np.nan)
        li, gi = np.indices((L, G))
        idx = tokens.astype(np.intp)
        v = tab[li, gi, idx]
        miss = np.isnan(v)
        if miss.any():
            lm, gm = li[miss], gi[miss]
            slots = slot_q.reshape(L, G, self.placement.slots_per_gpu)[lm, gm]
            tab[lm, gm, idx[miss]] = v[miss] = _distinct_experts(tokens[miss], gpu_q[lm, gm], slots, k, n)
        return np.minimum(v, tokens)


def _distinct_experts(tokens: np.ndarray, gpu_q: np.ndarray, slot_q: np.ndarray, k: int, n: int) -> np.ndarray:
    """The uncapped figure of :meth:`StatRouter.expected_touched` for GPUs (any leading shape) that drew
    ``tokens`` selections of ``n`` tokens, with shares ``gpu_q`` (same shape) and their slots' shares
    ``slot_q`` (that shape plus the slots): ``sum_s 1 - (1 - min(k q_s c, 1))^n``, ``c`` the drawn over the
    expected selections. One formula for the direct and the remembered figures (the same bits)."""
    c = np.divide(tokens, n * k * gpu_q, out=np.zeros_like(tokens), where=gpu_q > 0)
    p = np.minimum(k * slot_q * c[..., None], 1.0)
    return (1.0 - (1.0 - p) ** n).sum(axis=-1)


def _window_freq(trace: TraceTokens, a: int, b: int, fallback: np.ndarray) -> np.ndarray:
    """Expert frequencies ``[L, E]`` of trace tokens ``[a, b)`` (a layer without selections there takes
    ``fallback``'s row)."""
    L, E = trace.expert_ids.shape[1], trace.model.num_experts
    ids = trace.expert_ids[a:b]
    key = (np.arange(L, dtype=np.int64)[None, :, None] * E + ids).ravel()
    c = np.bincount(key, minlength=L * E).reshape(L, E).astype(np.float64)
    tot = c.sum(axis=1, keepdims=True)
    return np.where(tot > 0, c / np.maximum(tot, 1), fallback)


def make_router(mode: str, trace: TraceTokens, placement: Placement, engine: str, seed: int = 42,
                attention_tp: int = 1):
    if mode == "replay":
        if getattr(trace, "timeline", None) is not None:
            raise InputError(f"{trace.path}: --mode replay routes recorded tokens; this workload is expert "
                             "distributions over time (Loads input, --phases, or a comparison's long horizon): "
                             "use --mode stat")
        return ReplayRouter(trace, placement, engine, seed)
    return StatRouter(trace, placement, engine, seed, attention_tp)


