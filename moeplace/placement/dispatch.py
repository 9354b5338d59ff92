"""The engines' replica-choice rules: which physical slot a (token, expert) pair is sent to.

A placement says where replicas live; the *engine* decides which replica each token uses. The same
placement balances very differently under different rules, so every score in moeplace goes through
the functions here. Three rules (``ENGINES``):

``vllm`` — a deterministic per-token choice inside the rank-local batch (vLLM
    ``eplb_map_to_physical_and_record``; ``vllm/model_executor/layers/fused_moe/router/base_router.py``
    and ``vllm/distributed/eplb/cuda_platform_backend.py``, read 2026). For the rank-local
    ``topk_ids [num_tokens, k]`` of one forward pass, element ``(t, j)`` with flat offset ``t*k + j``:

    - ``rule="hash"`` (vLLM main since PR #40810, Apr 2026, "Fix replica selection bias"): the Triton
      kernel computes ``token_idx = offset // k`` (= ``t``), ``hashed = (t * 2654435769) & 0xFFFFFFFF``
      (Knuth's multiplicative hash) and ``replica = hashed % logical_replica_count[e]``: all k experts
      of one token use the same hash.
    - ``rule="modulo"`` (PR #24573, Sep 2025, until #40810): ``replica = (t*k + j) % count``.

    ``slot = logical_to_physical_map[e, replica]``; vLLM builds that map by scanning physical slots in
    ascending order (``EplbState.build``), so replica ``r`` is the ``r``-th smallest slot of the expert
    — exactly :attr:`Placement.log2phy`. The index restarts at 0 in every forward pass on every rank:
    with the DeepEP / pplx / FlashInfer all-to-all backends routing runs on the rank's own tokens, so a
    "batch" here is one DP rank's tokens of one engine step. Over many tokens both rules are an even
    split ``load / replica_count`` per replica.

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

``ideal`` — a splittable split of each expert's tokens over its replicas that minimizes the most
    loaded GPU (an LP solved with OR-Tools GLOP; see :func:`ideal_split`). No engine does this; it
    is the best any replica-choice rule can do with this placement, so it is also a lower bound for
    the other two.

Layers index ``placement.moe_layers`` (MoE layers only). Shapes use ``L`` MoE layers, ``E`` logical
experts, ``P`` slots, ``G`` GPUs (= EP ranks = attention-DP ranks), ``k`` top-k.
"""
from __future__ import annotations

import random
from functools import lru_cache

import numpy as np
from ortools.linear_solver import pywraplp

from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement

ENGINE_RULES = ("vllm", "sglang")  # what serving engines do (the simulator replays these)
ENGINES = (*ENGINE_RULES, "ideal")  # plus the LP optimum, which no engine implements
SGLANG_VARIANTS = ("mainline", "legacy")
VLLM_RULES = ("hash", "modulo")
KNUTH_MULTIPLIER = 2654435769  # floor(2^32 / golden ratio), the constant in vLLM's kernel


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise InputError(f"unknown engine '{engine}' (expected one of {', '.join(ENGINES)})")
    return engine


# ---------------------------------------------------------------------------- vLLM
def vllm_replica_index(pos_in_batch: np.ndarray, k: int, replica_count: np.ndarray,
                       rule: str = "hash") -> np.ndarray:
    """vLLM's replica index, int64 ``[n, k]``, of tokens at batch positions ``pos_in_batch`` (int
    ``[n]``) whose selected experts have ``replica_count`` (int ``[n, k]``) replicas."""
    if rule not in VLLM_RULES:
        raise InputError(f"unknown vLLM replica rule '{rule}' (expected one of {VLLM_RULES})")
    t = np.asarray(pos_in_batch, dtype=np.int64)[:, None]
    if rule == "hash":
        return ((t * KNUTH_MULTIPLIER) & 0xFFFFFFFF) % replica_count
    return (t * k + np.arange(k)[None, :]) % replica_count


def vllm_slots(placement: Placement, layer: int, expert_ids: np.ndarray, rule: str = "hash") -> np.ndarray:
    """vLLM's rule for ONE rank-local batch of one MoE layer.

    ``expert_ids``: int ``[n, k]`` logical ids of the batch's tokens, in the batch's token order.
    Returns int64 ``[n, k]`` physical slots ``log2phy[layer, e, replica]``.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    rep = vllm_replica_index(np.arange(ids.shape[0]), ids.shape[1], placement.logcnt[layer][ids], rule)
    return placement.log2phy[layer][ids, rep].astype(np.int64)


# ---------------------------------------------------------------------------- SGLang
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


# ---------------------------------------------------------------------------- one batch
def choose_slots(placement: Placement, layer: int, expert_ids: np.ndarray, engine: str, *,
                 src_gpu: int | np.ndarray | None = None, seed: int = 42,
                 dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Physical slots, int64 ``[n, k]``, for the tokens of ONE rank-local batch of MoE layer
    ``layer`` (index into ``placement.moe_layers``). ``expert_ids``: int ``[n, k]``.

    ``vllm``: the token's hashed batch index ``% logcnt`` (``vllm_rule="modulo"``: the flat index; the
    batch's own token order matters). ``sglang``: the
    dispatch map row of ``src_gpu`` (the DP rank the tokens run on; an int, or int ``[n]`` per token);
    pass ``dispatch_map`` (from :func:`sglang_dispatch_map`) to avoid rebuilding it. ``ideal`` has no
    per-token choice (it is a fractional split) and raises.
    """
    check_engine(engine)
    ids = np.asarray(expert_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise InputError(f"expert_ids must be [tokens, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= placement.num_experts):
        raise InputError(f"expert id out of range [0, {placement.num_experts})")
    if engine == "vllm":
        return vllm_slots(placement, layer, ids, vllm_rule)
    if engine == "sglang":
        if src_gpu is None:
            raise InputError("engine 'sglang' needs src_gpu (the DP rank the tokens run on)")
        dmap = sglang_dispatch_map(placement, seed) if dispatch_map is None else dispatch_map
        src = np.broadcast_to(np.asarray(src_gpu, dtype=np.int64).reshape(-1, 1), ids.shape) \
            if np.ndim(src_gpu) else np.full(ids.shape, int(src_gpu), dtype=np.int64)
        return dmap[src, layer, ids].astype(np.int64)
    raise InputError("engine 'ideal' splits tokens fractionally; it has no per-token slot choice "
                     "(use token_gpu_loads / expected_gpu_loads)")


# ---------------------------------------------------------------------------- Loads-level
def expected_gpu_loads(placement: Placement, loads_LE: np.ndarray, engine: str, *, seed: int = 42,
                       dispatch_map: np.ndarray | None = None, sglang_exact: bool = True,
                       variant: str = "mainline") -> np.ndarray:
    """Tokens per GPU, float64 ``[L, G]``, when expert loads ``loads_LE`` (float ``[L, E]``) are
    served with ``placement`` under ``engine``.

    ``vllm``: every replica gets ``load / logcnt`` (the even split both vLLM rules tend to).
    ``sglang``: each expert's tokens come evenly from all G DP ranks (``load / G`` per rank) and each
    rank sends its share to its dispatch-map slot (``sglang_exact=False``: the seed-averaged map).
    ``ideal``: the LP-optimal split (:func:`ideal_gpu_loads`).
    Token mass is preserved: ``out.sum(1) == loads_LE.sum(1)``.
    """
    check_engine(engine)
    w = _check_loads(placement, loads_LE)
    L, G, P = placement.num_layers, placement.num_gpus, placement.num_slots
    if engine == "ideal":
        return ideal_gpu_loads(placement, w)[0]
    if engine == "vllm":
        p2l = placement.phy2log
        slot_load = np.take_along_axis(w, p2l, axis=1) / np.take_along_axis(placement.logcnt, p2l, axis=1)
    else:
        if sglang_exact:
            dmap = dispatch_map if dispatch_map is not None else sglang_dispatch_map(placement, seed,
                                                                                      variant=variant)
            slot_load = np.zeros((L, P))
            share = w / G  # [L, E] tokens each rank sends
            rows = np.broadcast_to(np.arange(L)[None, :, None], dmap.shape)
            np.add.at(slot_load, (rows.ravel(), dmap.ravel()),
                      np.broadcast_to(share[None], dmap.shape).ravel())
        else:
            frac = sglang_mean_fractions(placement, variant=variant)  # [G, L, P]
            per_slot_w = np.take_along_axis(w, placement.phy2log, axis=1)  # [L, P]
            slot_load = frac.sum(0) * per_slot_w / G
    return slot_load.reshape(L, G, P // G).sum(axis=2)


def _check_loads(placement: Placement, loads_LE: np.ndarray) -> np.ndarray:
    w = np.asarray(loads_LE, dtype=np.float64)
    if w.shape != (placement.num_layers, placement.num_experts):
        raise InputError(f"loads must be [{placement.num_layers}, {placement.num_experts}] "
                         "(MoE layers x experts) "
                         f"for this placement, got {w.shape}")
    if (w < 0).any():
        raise InputError("loads must be non-negative")
    return w


def ideal_gpu_loads(placement: Placement, loads_LE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The splittable optimum of ``placement`` (:func:`ideal_split`) on expert loads ``loads_LE``
    (float ``[L, E]``): ``(gpu_loads float64 [L, G], makespan float64 [L])``."""
    return ideal_split(placement.phy2log, _check_loads(placement, loads_LE), placement.num_gpus)


def ideal_split(phy2log: np.ndarray, loads_LE: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """The splittable optimum: each expert's load may be split in any proportion over the GPUs that
    hold one of its replicas; minimize the most loaded GPU, per layer. ``phy2log``: int ``[L, P]`` (slot
    ``p`` on GPU ``p // (P / num_gpus)``); ``loads_LE``: float ``[L, E]``, non-negative.

    Returns ``(gpu_loads float64 [L, G], makespan float64 [L])``. Experts whose replicas all sit on one
    GPU are fixed; the rest form a small LP per layer (variables: one per (expert, GPU holding it),
    plus the layer's makespan T; constraints: the expert's load is fully assigned, every GPU's load
    <= T). All layers go into one OR-Tools GLOP model minimizing sum_l T_l — the layers share no
    variables, so the sum is minimal exactly when every T_l is. GLOP's answer is then polished: loads
    are recomputed from the split and the makespan is their max, so mass is conserved exactly.
    """
    w = np.asarray(loads_LE, dtype=np.float64)
    L, G, E = w.shape[0], num_gpus, w.shape[1]
    gpu_of = np.asarray(phy2log).reshape(L, G, -1)
    # holds[l, e, g]: expert e has a replica on GPU g
    holds = np.zeros((L, E, G), dtype=bool)
    holds[np.arange(L)[:, None, None], gpu_of, np.arange(G)[None, :, None]] = True
    num_gpus_holding = holds.sum(2)
    fixed = num_gpus_holding == 1
    base = np.zeros((L, G))
    lf, ef = np.nonzero(fixed)
    np.add.at(base, (lf, holds[lf, ef].argmax(1)), w[lf, ef])
    out = base.copy()
    flex_layers = [l for l in range(L) if (~fixed[l] & (w[l] > 0)).any()]
    if flex_layers:
        solver = pywraplp.Solver.CreateSolver("GLOP")
        splits = []  # (layer, expert, gpus, vars)
        T = {}
        scale = {}
        for l in flex_layers:
            # Scale each layer to ~1 so GLOP's absolute tolerances are relative ones.
            scale[l] = max(w[l].sum() / G, 1e-12)
            T[l] = solver.NumVar(0.0, solver.infinity(), f"T_{l}")
            per_gpu: list[list] = [[] for _ in range(G)]
            for e in np.flatnonzero(~fixed[l] & (w[l] > 0)):
                gpus = np.flatnonzero(holds[l, e])
                xs = [solver.NumVar(0.0, solver.infinity(), f"x_{l}_{e}_{g}") for g in gpus]
                # the expert's whole load is served
                solver.Add(solver.Sum(xs) == w[l, e] / scale[l])
                for g, x in zip(gpus, xs):
                    per_gpu[g].append(x)
                splits.append((l, e, gpus, xs))
            # every GPU's load is at most the layer's makespan
            for g in range(G):
                solver.Add(base[l, g] / scale[l] + solver.Sum(per_gpu[g]) <= T[l])
        solver.Minimize(solver.Sum(T.values()))
        status = solver.Solve()
        if status != pywraplp.Solver.OPTIMAL:
            raise RuntimeError(f"GLOP did not solve the ideal split (status {status})")
        for l, e, gpus, xs in splits:
            vals = np.maximum([x.solution_value() for x in xs], 0.0)
            tot = vals.sum()
            vals = vals / tot * w[l, e] if tot > 0 else np.full(len(gpus), w[l, e] / len(gpus))
            out[l, gpus] += vals
    return out, out.max(axis=1)


# ---------------------------------------------------------------------------- token-level
def dp_ranks_round_robin(request_id: np.ndarray, num_gpus: int) -> np.ndarray:
    """Attention-DP rank of each token: requests go to ranks round-robin in order of first
    appearance (what a DP load balancer does with equal-cost requests). int64 ``[n]``."""
    rid = np.asarray(request_id)
    _, first, inv = np.unique(rid, return_index=True, return_inverse=True)
    order_of_request = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # arrival rank
    return (order_of_request[inv] % num_gpus).astype(np.int64)


def batch_layout(src_gpu: np.ndarray, num_gpus: int,
                 batch_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Engine steps: every DP rank processes its own tokens in order, ``batch_tokens`` per step (all of
    them in one step when ``None``); step ``s`` is batch ``s`` of every rank, and the EP ranks
    synchronize per step. Returns ``(step int64 [n], position_in_batch int64 [n])``."""
    src = np.asarray(src_gpu, dtype=np.int64)
    n = src.size
    order = np.argsort(src, kind="stable")
    counts = np.bincount(src, minlength=num_gpus)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    idx_in_rank = np.empty(n, dtype=np.int64)
    idx_in_rank[order] = np.arange(n) - np.repeat(starts, counts)
    if batch_tokens is None or batch_tokens <= 0:
        return np.zeros(n, dtype=np.int64), idx_in_rank
    return idx_in_rank // batch_tokens, idx_in_rank % batch_tokens


def batch_slots(placement: Placement, layer: int, expert_ids: np.ndarray, engine: str, *,
                src_gpu: np.ndarray, pos_in_batch: np.ndarray, dispatch_map: np.ndarray | None = None,
                seed: int = 42, vllm_rule: str = "hash") -> np.ndarray:
    """Slots int64 ``[n, k]`` of MoE layer ``layer`` for tokens from MANY rank-local batches at once:
    token ``t`` runs on DP rank ``src_gpu[t]`` at index ``pos_in_batch[t]`` of its batch (from
    :func:`batch_layout`). Same rules as :func:`choose_slots`."""
    check_engine(engine)
    e = np.asarray(expert_ids, dtype=np.int64)
    k = e.shape[1]
    if engine == "vllm":
        rep = vllm_replica_index(pos_in_batch, k, placement.logcnt[layer][e], vllm_rule)
        return placement.log2phy[layer][e, rep].astype(np.int64)
    if engine == "sglang":
        dmap = sglang_dispatch_map(placement, seed) if dispatch_map is None else dispatch_map
        return dmap[np.asarray(src_gpu, dtype=np.int64)[:, None], layer, e].astype(np.int64)
    raise InputError("engine 'ideal' has no per-token slot choice")


def token_slots(placement: Placement, expert_ids: np.ndarray, engine: str, *, src_gpu: np.ndarray,
                batch_tokens: int | None = None, seed: int = 42,
                dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Physical slot of every (token, MoE layer, k), int32 ``[n, L, k]``, under ``vllm`` or ``sglang``.

    ``expert_ids``: int ``[n, L, k]``; ``src_gpu``: int ``[n]`` DP rank of each token (see
    :func:`dp_ranks_round_robin`); ``batch_tokens``: tokens per rank per step (vLLM's modulo index
    restarts every step on every rank); ``vllm_rule``: ``hash`` (vLLM main) or ``modulo``.
    """
    check_engine(engine)
    ids = np.asarray(expert_ids)
    n, L, k = ids.shape
    if L != placement.num_layers:
        raise InputError(f"expert_ids has {L} MoE layers, the placement {placement.num_layers}")
    if engine == "ideal":
        raise InputError("engine 'ideal' has no per-token slot choice")
    _, pos = batch_layout(src_gpu, placement.num_gpus, batch_tokens)
    if engine == "sglang" and dispatch_map is None:
        dispatch_map = sglang_dispatch_map(placement, seed)
    out = np.empty((n, L, k), dtype=np.int32)
    for l in range(L):
        out[:, l, :] = batch_slots(placement, l, ids[:, l, :], engine, src_gpu=src_gpu, pos_in_batch=pos,
                                   dispatch_map=dispatch_map, vllm_rule=vllm_rule)
    return out


def token_gpu_loads(placement: Placement, expert_ids: np.ndarray, engine: str, *, src_gpu: np.ndarray,
                    batch_tokens: int | None = None, seed: int = 42,
                    dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Per-step tokens per GPU, float64 ``[S, L, G]``, for token-level routing ``expert_ids`` (int
    ``[n, L, k]``) whose tokens run on DP ranks ``src_gpu`` (int ``[n]``), ``batch_tokens`` per rank
    per step. ``ideal`` solves the splittable LP on each step's expert loads."""
    check_engine(engine)
    ids = np.asarray(expert_ids)
    n, L, _ = ids.shape
    if L != placement.num_layers:
        raise InputError(f"expert_ids has {L} MoE layers, the placement {placement.num_layers}")
    G, E = placement.num_gpus, placement.num_experts
    step, pos = batch_layout(src_gpu, G, batch_tokens)
    S = int(step.max()) + 1 if n else 1
    if engine == "ideal":
        counts = np.zeros((S, L, E))
        for l in range(L):
            key = step[:, None] * E + ids[:, l, :].astype(np.int64)
            counts[:, l, :] = np.bincount(key.ravel(), minlength=S * E).reshape(S, E)
        return np.stack([ideal_gpu_loads(placement, counts[s])[0] for s in range(S)])
    if engine == "sglang" and dispatch_map is None:
        dispatch_map = sglang_dispatch_map(placement, seed)
    out = np.zeros((S, L, G))
    for l in range(L):
        slots = batch_slots(placement, l, ids[:, l, :], engine, src_gpu=src_gpu, pos_in_batch=pos,
                            dispatch_map=dispatch_map, vllm_rule=vllm_rule)
        key = step[:, None] * G + placement.slot_gpu[slots]
        out[:, l, :] = np.bincount(key.ravel(), minlength=S * G).reshape(S, G)
    return out
