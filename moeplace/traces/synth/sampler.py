"""The sampling tables (:class:`SynthDesign`) and the sampler that draws every token's top-k from them
(base, affinity, token identity, theme and locality sources; duplicates re-drawn)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeplace.foundation.model import ModelSpec
from moeplace.traces import jit
from moeplace.traces.synth.config import U_BITS, U_SIZE, SynthConfig
from moeplace.traces.synth.popularity import num_themes, theme_bounds

DEDUP_ROUNDS = 64  # re-draw rounds from the domain's layout before falling back to the shared grid
PAIRWISE_MIN_ROWS = 256  # rows from which the duplicate check compares slot pairs instead of scattering


@dataclass(frozen=True, eq=False)
class SynthDesign:
    """Everything fixed before the first token: tables of the u-space sampler and the solved knobs.

    ``pi``      float64 ``[L, D, E]``: each domain's base popularity (by expert id).
    ``table``   uint16 ``[L, (D + 1) * 2^16]``: expert owning each u; blocks 0..D-1 the domains' base
    layouts, block D the shared grid of the affinity source.
    ``start``   int64  ``[L, E]``: first u of each expert's interval in the shared grid (affinity source);
    ``width`` its length.
    ``tok_start`` uint32 ``[V]`` / ``tok_width`` uint32 ``[V]``: token intervals (2^32 circle, width in
    units of 2^16 so that ``v16 * width`` fits 32 bits); ``tok_cdf`` float64 ``[V]``: Zipf CDF by rank;
    ``rank2token`` int32 ``[V]``.
    ``slot_offset`` uint32 ``[L, m]``: the m rotations of the token circle per layer (preferred experts).
    ``theme_of`` int16 ``[L, E]``: the theme group of each expert (by expert id; all 0 without themes).
    ``design_top`` int ``[L]``: the designed hottest expert of each layer.
    """

    model: ModelSpec
    config: SynthConfig
    pi: np.ndarray
    table: np.ndarray
    start: np.ndarray
    width: np.ndarray
    tok_start: np.ndarray
    tok_width: np.ndarray
    tok_cdf: np.ndarray
    rank2token: np.ndarray
    slot_offset: np.ndarray
    anchors: np.ndarray
    domains: tuple[str, ...]
    copy_prob: float
    report: dict[str, Any]
    theme_of: np.ndarray | None = None
    design_top: np.ndarray | None = None


class ExpertSampler:
    """Draws the top-k of batches of tokens, layer by layer. State: the last token's experts of every
    running request (the copy source across batches) and reusable scratch space."""

    block_tokens = 4096  # tokens per inner block: the working arrays stay in L2 (2048 cost ~8 % more per selection)

    def __init__(self, design: SynthDesign, rng: np.random.Generator | None, num_slots: int, copy_prob: float,
                 layers: range | None = None) -> None:
        self.design = design
        self.rng = rng  # one stream for every draw; None: streams given per call (sample's rngs)
        m = design.model
        self.num_layers, self.num_experts, self.k = m.num_moe_layers, m.num_experts, m.top_k
        # the MoE layers this sampler draws (a worker of a layer-split pipeline draws a range of them)
        self.layers = range(self.num_layers) if layers is None else layers
        self.num_slots = num_slots
        self.state = np.zeros((num_slots, len(self.layers), self.k), np.uint16)
        cfg = design.config
        # Thresholds on a uint32 draw: [0, c) copy, [c, c+a) affinity, [c+a, c+a+t) token,
        # [c+a+t, c+a+t+h) theme, rest base.
        rest = 1 - copy_prob
        cuts = np.array([copy_prob, copy_prob + cfg.affinity * rest,
                         copy_prob + (cfg.affinity + cfg.token_effect) * rest,
                         copy_prob + (cfg.affinity + cfg.token_effect + cfg.theme) * rest])
        (self.copy_cut, self.aff_cut, self.tok_cut,
         self.theme_cut) = (np.minimum(cuts, 1 - 2**-32) * 2**32).astype(np.uint32)
        self.aff_span = np.uint32(self.aff_cut - self.copy_cut)
        self.tok_span = np.uint32(self.tok_cut - self.aff_cut)
        self.theme_span = np.uint32(self.theme_cut - self.tok_cut)
        # theme j is the u-interval [bounds[j], bounds[j + 1]) of every domain layout
        T = num_themes(m, cfg)
        self.themes = np.uint64(T)
        self.theme_bounds = theme_bounds(T).astype(np.uint32)
        self.theme_bounds32 = (np.arange(T + 1, dtype=np.uint64) << np.uint64(32)) // self.themes
        pow2 = T & (T - 1) == 0
        self.theme_bits = np.uint32(T.bit_length() - 1) if pow2 else None
        self.theme_keep = np.uint32((1 << (32 - T.bit_length() + 1)) - 1) if pow2 else None
        self.table = design.table
        self.token_experts = np.uint32(cfg.token_experts)
        self.slot_step = np.uint32(2**32 // cfg.token_experts % 2**32)  # spacing of design.slot_offset's rotations
        assert np.array_equal(design.slot_offset, design.slot_offset[:, :1] + self.slot_step
                              * np.arange(cfg.token_experts, dtype=np.uint32)), "slot_offset rotations"
        # start << 16 | width of every expert's interval in the shared grid: one gather per affinity draw
        self.start_width = ((design.start.astype(np.uint32) << np.uint32(U_BITS))
                            | np.minimum(design.width, U_SIZE - 1).astype(np.uint32))
        self.shared_key = np.uint32(cfg.num_domains << U_BITS)
        self._scratch = np.zeros(self.block_tokens * self.num_experts, np.uint8)
        self._slot_ids = np.broadcast_to(np.arange(self.k, dtype=np.uint8), (self.block_tokens, self.k))
        # intp keys: fancy indexing would otherwise convert the index array on every call
        self._row_key = (np.arange(self.block_tokens, dtype=np.intp) * self.num_experts)[:, None]
        self._pair_t = np.empty((self.k, self.block_tokens), np.uint16)
        self._pair_dup = np.empty((self.k, self.block_tokens), bool)
        self._pair_eq = np.empty(max(self.k - 1, 1) * self.block_tokens, bool)
        # the compiled loops where this process loaded them (synthesize: big enough traces), else numpy
        self._dedup_loop = jit.loaded("dedup")
        self._layer_loop = jit.loaded("layer") if self._dedup_loop is not None else None

    def sample(self, domain: np.ndarray, token_rank: np.ndarray, prev: np.ndarray, slot: np.ndarray,
               rngs: list[np.random.Generator] | None = None, theme_rng: np.random.Generator | None = None,
               prev_layer: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Top-k experts of ``n`` tokens in order, at this sampler's layers.

        ``domain`` int [n]; ``token_rank`` int [n] (Zipf rank of the token id); ``prev`` int [n]: the
        previous token of the same request: ``-1`` none, ``< num_slots`` the saved state of that running
        slot, else ``num_slots + i`` for token ``i`` (earlier) of this batch; ``slot`` int [n]: running
        slot of the token's request (the last token of each slot is saved for the next batch).
        ``rngs``: one stream per layer of the sampler and ``theme_rng`` the tokens' theme draws (else the
        sampler's one stream draws everything, in block and layer order); ``prev_layer`` uint16 ``[n, k]``:
        the experts of the layer before the first one drawn here (a pipeline's upstream worker drew them).
        Returns uint16 ``[n, layers, k]`` (into ``out`` when given).
        """
        n, num_slots = len(domain), self.num_slots
        # Rows [0, num_slots) hold the saved state, then the batch: copy sources index into it directly.
        big = np.empty((num_slots + n, len(self.layers), self.k), np.uint16)
        big[:num_slots] = self.state
        domain = np.asarray(domain, np.int32)
        prev = np.asarray(prev, np.int64)
        token_rank = np.asarray(token_rank, np.int64)
        for b0 in range(0, n, self.block_tokens):
            b1 = min(n, b0 + self.block_tokens)
            self._block(big, b0, b1, domain[b0:b1], token_rank[b0:b1], prev[b0:b1], rngs, theme_rng,
                        None if prev_layer is None else prev_layer[b0:b1])
        if out is not None:
            out[...] = big[num_slots:]
        out = big[num_slots:]
        last = np.full(num_slots, -1)
        last[slot] = np.arange(n)  # later tokens of a slot overwrite earlier ones
        live = last >= 0
        self.state[live] = out[last[live]]
        return out

    def _block(self, big, b0, b1, dom, rank, prev, rngs=None, theme_rng=None, prev_e=None) -> None:
        design, k, num_layers, num_slots = self.design, self.k, len(self.layers), self.num_slots
        nb = b1 - b0
        r0 = num_slots + b0
        dom_key = (dom.astype(np.uint32) << np.uint32(U_BITS))[:, None]
        shared_key = self.shared_key
        t_start = design.tok_start[rank][:, None]
        t_width = design.tok_width[rank][:, None]
        can_copy = (prev >= 0)[:, None]
        src_row = np.where(prev >= 0, prev, 0)
        row_key, slot_ids = self._row_key[:nb], self._slot_ids[:nb]
        bits = np.uint32(U_BITS)
        low = np.uint32(U_SIZE - 1)
        if self.theme_span:
            # the token's theme, the same at every layer: the theme under a random point of the token's
            # interval on the 2^32 Zipf circle (a token inside one theme's arc always gets that theme)
            r16 = ((theme_rng or self.rng).bit_generator.random_raw(nb) & np.uint64(U_SIZE - 1)).astype(np.uint32)
            point = t_start[:, 0] + r16 * t_width[:, 0]
            th = ((point.astype(np.uint64) * self.themes) >> np.uint64(32)).astype(np.intp)
            th_start = self.theme_bounds[th][:, None]
            th_width = (self.theme_bounds[th + 1] - self.theme_bounds[th])[:, None]
        if self.copy_cut:
            big_flat = big.reshape(-1)
            row_stride = num_layers * k
        if self._layer_loop is not None:
            self._block_compiled(big, b0, nb, dom_key[:, 0], t_start[:, 0], t_width[:, 0], prev, rngs,
                                 (th_start[:, 0], th_width[:, 0]) if self.theme_span else None, prev_e)
            return
        for j, li in enumerate(self.layers):  # j: this sampler's index of MoE layer li
            rng = self.rng if rngs is None else rngs[j]
            table = self.table[li]
            # one 64-bit draw per selection: its halves pick the source and the point
            raw = rng.bit_generator.random_raw(nb * k).view(np.uint32)
            comp = raw[: nb * k].reshape(nb, k)
            v = raw[nb * k:].reshape(nb, k)
            u = v >> bits  # base: uniform point
            v16 = v & low  # uniform inside an interval (affinity / token)
            # Branch-free selects (random masks make np.where mispredict): x ^ ((x ^ y) & mask).
            # which preferred point: the low 16 bits of the source draw, scaled to [0, m)
            pick = ((comp & low) * self.token_experts) >> bits
            # = slot_offset[li, pick]: the rotations are evenly spaced (uint32 arithmetic wraps alike)
            offset = pick * self.slot_step + design.slot_offset[li, 0]
            if self.theme_span:
                tok_u = self._token_in_theme(t_start + v16 * t_width, offset)
            else:
                tok_u = (t_start + offset + v16 * t_width) >> bits
            # (comp - lo) < (hi - lo) in uint32 arithmetic tests lo <= comp < hi in two passes
            mask = np.uint32(0) - ((comp - self.aff_cut) < self.tok_span).astype(np.uint32)
            u ^= (u ^ tok_u) & mask
            if self.theme_span:
                theme_u = th_start + ((v16 * th_width) >> bits)
                mask = np.uint32(0) - ((comp - self.tok_cut) < self.theme_span).astype(np.uint32)
                u ^= (u ^ theme_u) & mask
            if prev_e is not None:
                sw = np.take(self.start_width[li - 1], prev_e)
                aff_u = ((sw >> bits) + (((sw & low) * v16) >> bits)) & low
                mask = np.uint32(0) - ((comp - self.copy_cut) < self.aff_span).astype(np.uint32)
                u ^= (u ^ aff_u) & mask
                # affinity draws read the shared grid; base and token draws their domain's layout
                u += dom_key ^ ((dom_key ^ shared_key) & mask)
            else:
                u += dom_key
            if nb >= 512:
                # The layer's table (~0.8 MB) is cold (the other layers' tables evicted it): one sequential
                # read just before the random gather pulls it into cache, ~2x cheaper than the misses.
                np.bitwise_or.reduce(table.view(np.uint64))
            e = np.take(table, u)
            if self.copy_cut:
                flat = np.flatnonzero(((comp < self.copy_cut) & can_copy).ravel())
                if len(flat):
                    # a copying entry takes its source's settled value: sources before this block are
                    # final in `big`; sources inside it are entries of `e`, which may copy in turn
                    cr = flat // k
                    cc = flat - cr * k
                    src = src_row[cr]
                    inside = src >= r0
                    e_flat = e.reshape(-1)
                    vals = np.take(big_flat, src * row_stride + (j * k) + cc)
                    i_pos = np.flatnonzero(inside)
                    i_src = (src[i_pos] - r0) * k + cc[i_pos]
                    vals[i_pos] = np.take(e_flat, i_src)
                    while True:  # chains of copies inside the block settle in (chain length) rounds
                        e_flat[flat] = vals
                        nxt = np.take(e_flat, i_src)
                        if np.array_equal(nxt, vals[i_pos]):
                            break
                        vals[i_pos] = nxt
            e = self._dedup(li, e, dom_key, row_key, slot_ids, rng)
            big[r0:r0 + nb, j, :] = e
            prev_e = e

    def _block_compiled(self, big, b0, nb, dom_key, t_start, t_width, prev, rngs, theme, prev_e) -> None:
        """The layer loop of :meth:`_block` by the compiled loops (``traces.jit``): the same draws,
        the same experts. ``theme``: the tokens' theme intervals (start, width) when themes are on."""
        design, k, num_slots = self.design, self.k, self.num_slots
        r0 = num_slots + b0
        big_flat = big.reshape(-1)
        row_stride = len(self.layers) * k
        cuts = np.array([self.copy_cut, self.aff_cut, self.tok_cut, self.aff_span, self.tok_span,
                         self.theme_span, self.shared_key], np.uint64)
        if not self.theme_span:
            mode, th_start, th_width = 0, t_start, t_width  # unused
        else:
            mode = 1 if self.theme_bits is not None else 2
            th_start, th_width = (np.ascontiguousarray(x) for x in theme)
        theme_k = np.array([self.themes, self.theme_bits or 0, self.theme_keep or 0], np.uint64)
        copy_src = np.where(prev >= 0, prev, -1) if self.copy_cut else np.full(nb, -1, np.int64)
        dom_key, t_start, t_width = (np.ascontiguousarray(x) for x in (dom_key, t_start, t_width))
        if prev_e is not None:
            prev_e = np.ascontiguousarray(prev_e)
        no_prev = np.zeros(0, np.uint32)
        for j, li in enumerate(self.layers):
            rng = self.rng if rngs is None else rngs[j]
            table = self.table[li]
            raw = rng.bit_generator.random_raw(nb * k).view(np.uint32)
            if nb >= 512:
                np.bitwise_or.reduce(table.view(np.uint64))  # the cold table pulled in (see _block)
            e = np.empty((nb, k), np.uint16)
            tok = np.array([self.token_experts, self.slot_step, design.slot_offset[li, 0]], np.uint64)
            has_prev = prev_e is not None
            self._layer_loop(raw, e, t_start, t_width, cuts, tok, mode, theme_k, self.theme_bounds32, th_start,
                             th_width, prev_e if has_prev else e, self.start_width[li - 1] if has_prev else no_prev,
                             dom_key, table, copy_src, big_flat, j * k, row_stride, r0)
            e = self._dedup(li, e, dom_key[:, None], self._row_key[:nb], self._slot_ids[:nb], rng)
            big[r0:r0 + nb, j, :] = e
            prev_e = e

    def _token_in_theme(self, point: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """u of token draws when themes are on: the preferred points rotate *within* the theme arc that
        holds the token's point on the 2^32 circle (``offset`` scaled to the arc), so a token's preferred
        experts lie in its theme; the Zipf mass is uniform along each arc, so the marginal is kept."""
        if self.theme_bits is not None:  # T a power of two: arcs of 2^(32-b), all in uint32
            keep = self.theme_keep
            return ((point & ~keep) | ((point + (offset >> self.theme_bits)) & keep)) >> np.uint32(U_BITS)
        p = point.astype(np.uint64)
        th = (p * self.themes) >> np.uint64(32)
        lo = self.theme_bounds32[th]
        arc = self.theme_bounds32[th + np.uint64(1)] - lo
        rel = p - lo + ((offset.astype(np.uint64) * arc) >> np.uint64(32))
        rel -= arc * (rel >= arc)
        return ((lo + rel) >> np.uint64(U_BITS)).astype(np.uint32)

    def _duplicates(self, e: np.ndarray, row_key, slot_ids, tile: int = 512) -> np.ndarray:
        """bool [n, k]: entries repeating an expert of a later slot of the same row."""
        n = len(e)
        if n >= PAIRWISE_MIN_ROWS:
            return self._duplicates_pairwise(e)
        if n <= tile:
            flat = row_key[:n] + e
            self._scratch[flat] = slot_ids[:n]  # the last slot of each repeated expert wins
            return self._scratch[flat] != slot_ids[:n]
        # tiles of rows reuse one cache-sized part of the scratch
        out = np.empty(e.shape, bool)
        for t0 in range(0, n, tile):
            out[t0:t0 + tile] = self._duplicates(e[t0:t0 + tile], row_key, slot_ids, tile)
        return out

    def _duplicates_pairwise(self, e: np.ndarray) -> np.ndarray:
        """:meth:`_duplicates` by comparing the k(k-1)/2 slot pairs on the transposed rows (contiguous,
        vectorized: ~3x faster than the scratch's scattered writes and reads once a call has a few
        hundred rows; the scratch wins on the small re-checks of :meth:`_dedup`)."""
        n, k = e.shape
        out = np.empty((n, k), bool)
        for r0 in range(0, n, self.block_tokens):
            blk = e[r0:r0 + self.block_tokens]
            m = len(blk)
            t = self._pair_t[:, :m]
            np.copyto(t, blk.T)
            dup = self._pair_dup[:, :m]
            dup[:] = False
            for s in range(1, k):  # slot j repeats slot j + s
                eq = self._pair_eq[:(k - s) * m].reshape(k - s, m)
                np.equal(t[s:], t[:k - s], out=eq)
                dup[:k - s] |= eq
            out[r0:r0 + m] = dup.T
        return out

    def _dedup_compiled(self, li: int, e: np.ndarray, dom_key, rng: np.random.Generator) -> np.ndarray | None:
        """:meth:`_dedup` by the compiled loop (``traces.jit``): the same draws from ``rng``'s stream,
        the same experts. The loop takes a buffer of the stream's next draws; the stream is then moved back
        to just past the draws it used (PCG64 ``advance``), or the buffer grows and the loop runs again on
        the original ``e``. None (nothing done) for a stream that ``advance`` would change otherwise."""
        bg = rng.bit_generator
        if not hasattr(bg, "advance") or bg.state.get("has_uint32", 0):
            return None  # advance() also drops a buffered 32-bit half: keep the numpy path exact
        key = np.ascontiguousarray(dom_key[:, 0])
        table = self.table[li]
        size = max(1024, e.size // 4)
        e0 = e.copy()
        while True:
            raws = bg.random_raw(size)
            used = self._dedup_loop(e, key, table, self.shared_key, DEDUP_ROUNDS, raws)
            if used >= 0:
                bg.advance(used - size)
                return e
            bg.advance(-size)
            e[...] = e0
            size *= 4

    def _dedup(self, li: int, e: np.ndarray, dom_key, row_key, slot_ids, rng: np.random.Generator) -> np.ndarray:
        """Re-draw repeated experts within a row from the base source until every row is distinct.

        Each round re-draws the flagged entries in row-major order; only rows touched by the previous
        round are re-checked (an untouched row had no repeat and did not change). After
        ``DEDUP_ROUNDS`` rounds the rest come from the shared grid (every expert an equal share), so a
        layout with fewer than k experts of non-zero width cannot make this loop forever."""
        k = self.k
        if self._dedup_loop is not None:
            done = self._dedup_compiled(li, e, dom_key, rng)
            if done is not None:
                return done
        flat = np.flatnonzero(self._duplicates(e, row_key, slot_ids).ravel())
        if not len(flat):
            return e
        e_flat = e.reshape(-1)
        key = dom_key[:, 0]
        table = self.table[li]
        low = np.uint32(U_SIZE - 1)
        for r in itertools.count():
            if r == DEDUP_ROUNDS:
                key = np.full_like(key, self.shared_key)
            rows = flat // k  # ascending
            u = rng.bit_generator.random_raw(len(flat)).astype(np.uint32) & low
            e_flat[flat] = np.take(table, key[rows] + u)
            first = np.empty(len(rows), bool)
            first[0] = True
            np.not_equal(rows[1:], rows[:-1], out=first[1:])
            act = rows[first]  # rows re-drawn in this round, ascending
            dup = self._duplicates(e[act], row_key[:len(act)], slot_ids[:len(act)])
            local = np.flatnonzero(dup.ravel())
            if not len(local):
                return e
            lr = local // k
            flat = act[lr] * k + (local - lr * k)


def zipf_ranks(tok_cdf: np.ndarray, rng: np.random.Generator, shape) -> np.ndarray:
    """Zipf ranks of ``shape`` token draws (inverse CDF; clamped against the CDF's rounding at 1)."""
    return np.minimum(np.searchsorted(tok_cdf, rng.random(shape)), len(tok_cdf) - 1)
