"""SGLang's replica rule (static dispatch).

``sglang`` — static dispatch (``--ep-dispatch-algorithm static``;
``python/sglang/srt/eplb/expert_location.py`` ``compute_logical_to_rank_dispatch_physical_map``,
``_find_nearest_expert``, ``_fair_choices``). It is a map ``[ep_rank, layer, expert] -> slot``
built ONCE per placement from ``random.Random(seed=42)`` and then used for every token: a token on
DP/EP rank ``g`` always goes to ``map[g, l, e]``. Per (layer, expert), with the candidate slots in
ascending order:

1. one candidate -> that slot;
2. a candidate on rank ``g``'s own GPU -> the first such slot;
3. (SGLang PR #9849, Aug 2025, and later) a candidate on ``g``'s node, *only when that narrows the
   candidate set* (``0 < same_node < all``) -> the first such slot;
4. otherwise a "fair choice": all ranks still unresolved for this expert (``remaining``, ascending)
   get ``_fair_choices(candidates, k=len(remaining))`` = every candidate ``len(remaining) //
   len(candidates)`` times plus ``r.sample(candidates, remainder)``, shuffled with ``r`` — i.e.
   the unresolved ranks are spread as evenly as possible over all replicas, in a seeded random
   order. One ``random.Random(seed)`` stream runs over layers, then experts, in order.

Since PR #10874 (Oct 2025) each rank first narrows its *own* candidate list to its nearest
replica (steps 1–3) before building the map, and only keeps its own row. So rank ``g`` consumes
the random stream only at experts where it has no nearest replica; its random draws therefore
differ from the other ranks'. ``variant="mainline"`` reproduces this exactly (per-rank streams);
``variant="legacy"`` is the original code (same-GPU preference only, one shared stream, every rank
gets the same table) — still what the ``init_by_eplb`` path (SGLang running its own EPLB on a
``logical_count`` file) computes, minus step 3.
"""
from __future__ import annotations

import random
from functools import lru_cache

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import RuleMemory
from moeplace.placement.bounds import splittable_bound
from moeplace.placement.record import Placement
from moeplace.placement.rules.base import ReplicaRule, register
from moeplace.placement.rules.ideal import ideal_gpu_loads

SGLANG_VARIANTS = ("mainline", "legacy")


def _fair_choices(arr: list[int], k: int, r: random.Random) -> list[int]:
    """SGLang's ``_fair_choices``: ``k`` picks from ``arr``, each element ``k // len(arr)`` times plus a
    random sample for the remainder, in random order. Must call ``r`` exactly as SGLang does so that the
    stream (and so every later choice) matches."""
    quotient, remainder = divmod(k, len(arr))
    ans = arr * quotient + r.sample(arr, k=remainder)
    r.shuffle(ans)
    return ans


def _nearest(cands: np.ndarray, slot_gpu: np.ndarray, G: int, gpus_per_node: int,
             prefer_same_node: bool) -> np.ndarray:
    """SGLang ``_find_nearest_expert`` for every rank at once: int64 ``[G]`` slot or -1.

    ``cands``: ascending slots of one expert (>= 2 of them)."""
    gpus = slot_gpu[cands]  # [c]
    ranks = np.arange(G)
    out = np.full(G, -1, dtype=np.int64)
    same_gpu = gpus[None, :] == ranks[:, None]  # [G, c]
    has = same_gpu.any(axis=1)
    out[has] = cands[same_gpu[has].argmax(axis=1)]
    if prefer_same_node:
        same_node = (gpus[None, :] // gpus_per_node) == (ranks[:, None] // gpus_per_node)
        n_same = same_node.sum(axis=1)
        narrows = (~has) & (n_same > 0) & (n_same < len(cands))
        out[narrows] = cands[same_node[narrows].argmax(axis=1)]
    return out


def sglang_dispatch_map(placement: Placement, seed: int = 42, *, variant: str = "mainline") -> np.ndarray:
    """SGLang's static dispatch map, exactly as SGLang builds it: int32 ``[G, L, E]``, the physical
    slot rank ``g`` sends expert ``e``'s tokens of layer ``l`` to (see the module docstring for the
    rule and the two variants). Cached per placement content.

    Cost: experts with one replica are vectorized; the random part replays Python's ``random`` once per
    rank (mainline) over the multi-replica experts, ~G x (multi-replica experts) x G draws. Measured for
    K3 with EPLB placements (2 shared cores, loaded): 1.8 s at 32 GPUs / 32 redundant, 10 s at 64 / 64,
    77 s at 128 / 128 (legacy: 0.2 / 0.5 / 1.5 s). Inside optimization loops use
    :func:`sglang_mean_fractions` (``expected_gpu_loads(..., sglang_exact=False)``) instead.
    """
    if variant not in SGLANG_VARIANTS:
        raise InputError(f"unknown SGLang dispatch variant '{variant}' (expected one of {SGLANG_VARIANTS})")
    return _sglang_map_cached(placement.fingerprint(), _Key(placement), int(seed), variant).copy()


class _Key:
    """Carries the placement into the lru_cache keyed by its fingerprint only."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key)


@lru_cache(maxsize=8)
def _sglang_map_cached(fingerprint: str, key: _Key, seed: int, variant: str) -> np.ndarray:
    placement = key.placement
    L, E, G = placement.num_layers, placement.num_experts, placement.num_gpus
    slot_gpu = placement.slot_gpu
    cnt, l2p = placement.logcnt, placement.log2phy
    out = np.empty((G, L, E), dtype=np.int32)
    out[:] = l2p[None, :, :, 0]  # single-replica experts: the only slot, for every rank
    prefer_node = variant == "mainline"
    # Events that consume the random stream, in SGLang's (layer, expert) order.
    events: list[tuple[list[int], np.ndarray, int, int]] = []  # (candidates, remaining ranks, layer, expert)
    for l, e in np.argwhere(cnt > 1):
        cands = l2p[l, e, :cnt[l, e]].astype(np.int64)
        near = _nearest(cands, slot_gpu, G, placement.gpus_per_node, prefer_node)
        resolved = near >= 0
        out[resolved, l, e] = near[resolved]
        remaining = np.flatnonzero(~resolved)
        if remaining.size:
            events.append((cands.tolist(), remaining, int(l), int(e)))
    if variant == "legacy":
        r = random.Random(seed)
        for cands, remaining, l, e in events:
            out[remaining, l, e] = _fair_choices(cands, len(remaining), r)
        return out
    # mainline: every rank replays the stream over the events where it is itself unresolved (elsewhere
    # its own candidate list collapsed to one slot, which consumes no randomness).
    for g in range(G):
        r = random.Random(seed)
        for cands, remaining, l, e in events:
            i = np.searchsorted(remaining, g)
            if i < remaining.size and remaining[i] == g:
                out[g, l, e] = _fair_choices(cands, len(remaining), r)[i]
    return out


def sglang_mean_fractions(placement: Placement, *, variant: str = "mainline") -> np.ndarray:
    """The seed-averaged SGLang map, float64 ``[G, L, P]``: the probability that rank ``g`` sends
    expert ``phy2log[l, p]``'s tokens to slot ``p``. Deterministic steps 1–3 give probability 1; a
    fair choice is uniform over the candidates (every position of a shuffled fair list is). Fast
    (no random stream); what an optimizer can use inside its loop instead of one seed's draw."""
    L, G, P = placement.num_layers, placement.num_gpus, placement.num_slots
    cnt, l2p, slot_gpu = placement.logcnt, placement.log2phy, placement.slot_gpu
    frac = np.zeros((G, L, P))
    single = cnt == 1
    ls, es = np.nonzero(single)
    frac[:, ls, l2p[ls, es, 0]] = 1.0
    for l, e in np.argwhere(~single):
        cands = l2p[l, e, :cnt[l, e]].astype(np.int64)
        near = _nearest(cands, slot_gpu, G, placement.gpus_per_node, variant == "mainline")
        res = near >= 0
        frac[np.flatnonzero(res), l, near[res]] = 1.0
        frac[np.ix_(np.flatnonzero(~res), [l], cands)] = 1.0 / len(cands)
    return frac


@register
class SglangRule(ReplicaRule):
    """SGLang: a token on rank ``g`` always goes to the dispatch map's slot ``map[g, l, e]``."""

    source_dependent_shares = True

    name = "sglang"
    listing_order = 1
    engine = "SGLang"
    even_split = False  # the map can send more ranks to one replica than to another
    node_distinct = True
    variants = SGLANG_VARIANTS
    version_option = "sglang_variant"

    @property
    def uses_source_rank(self) -> bool:
        return True

    def dispatch_state(self, placement):
        return sglang_dispatch_map(placement, self.seed, variant=self.variant)

    def batch_slots(self, placement, layer, expert_ids, *, src_gpu, pos_in_batch, batch_id=None, state=None):
        dmap = self.dispatch_state(placement) if state is None else state
        e = np.asarray(expert_ids, dtype=np.int64)
        return dmap[np.asarray(src_gpu, dtype=np.int64)[:, None], layer, e].astype(np.int64)

    def slot_loads(self, placement, loads_LE, state=None):
        """Each expert's tokens come evenly from all G ranks (``load / G`` per rank); each rank sends its
        share to its dispatch-map slot."""
        L, G, P = placement.num_layers, placement.num_gpus, placement.num_slots
        dmap = self.dispatch_state(placement) if state is None else state
        slot_load = np.zeros((L, P))
        rows = np.broadcast_to(np.arange(L)[None, :, None], dmap.shape)
        np.add.at(slot_load, (rows.ravel(), dmap.ravel().astype(np.int64)),
                  np.broadcast_to(np.asarray(loads_LE, dtype=np.float64)[None] / G, dmap.shape).ravel())
        return slot_load

    def mean_slot_loads(self, placement, loads_LE):
        """:meth:`slot_loads` averaged over seeds (:func:`sglang_mean_fractions`): what an optimizer can
        use inside its loop instead of one seed's draw."""
        frac = sglang_mean_fractions(placement, variant=self.variant)  # [G, L, P]
        per_slot_w = np.take_along_axis(np.asarray(loads_LE, dtype=np.float64), placement.phy2log, axis=1)
        return frac.sum(0) * per_slot_w / placement.num_gpus

    def source_shares(self, placement, loads_LE, gpu_loads, state=None):
        L, G = placement.num_layers, placement.num_gpus
        dmap = self.dispatch_state(placement) if state is None else state
        w = np.asarray(loads_LE, dtype=np.float64)
        total = w.sum(axis=1)
        q = np.zeros((L, G, G))
        slot_gpu = placement.slot_gpu
        for l in range(L):
            dest = slot_gpu[dmap[:, l, :]]  # [G_src, E]
            key = np.arange(G)[:, None] * G + dest
            q[l] = np.bincount(key.ravel(), weights=np.broadcast_to(w[l], dest.shape).ravel(),
                               minlength=G * G).reshape(G, G)
        return np.divide(q, total[:, None, None], out=np.zeros_like(q), where=total[:, None, None] > 0)

    def planning_memory(self, num_layers, num_experts, num_gpus):
        L, E, G = num_layers, num_experts, num_gpus  # each placement caches its dispatch map, int32 [G, L, E]
        # scoring from Loads also holds the source shares q, float64 [L, G, G], and about three
        # temporaries of that shape (placement.traffic.traffic_from_loads)
        return RuleMemory(per_placement=4.0 * G * L * E, once=4 * 8.0 * L * G * G,
                          what=f" and its SGLang dispatch map ({G:,} ranks x {L} x {E} x 4 B), and the source "
                               f"shares of scoring ({L} x {G:,} x {G:,} x 8 B, four copies)")

    def placement_bound(self, placement, loads_LE):
        return ideal_gpu_loads(placement, loads_LE)[1]

    def budget_bound(self, loads_LE, num_gpus, num_slots):
        return splittable_bound(loads_LE, num_gpus)
