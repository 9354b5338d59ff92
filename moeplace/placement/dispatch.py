"""Which physical slot each (token, expert) pair is sent to, for any replica rule.

A placement says where replicas live; the *engine's replica rule* decides which replica each token uses.
The rules themselves (vLLM, SGLang, TensorRT-LLM and the ideal split) live in
:mod:`moeplace.placement.rules`, one class each; this module is the rule-agnostic machinery around them:
engine steps and DP ranks (:func:`dp_ranks_round_robin`, :func:`batch_layout`), the slots of one batch
(:func:`choose_slots`) or of many (:func:`batch_slots`, :func:`token_slots`), and tokens per GPU
(:func:`token_gpu_loads`, :func:`expected_gpu_loads`). Every ``rule`` argument is a rule name or a
:class:`~moeplace.placement.rules.ReplicaRule`; ``vllm_rule`` / ``variant`` pick the version of the
rule they belong to and are ignored by the others.

Layers index ``placement.moe_layers`` (MoE layers only). Shapes use ``L`` MoE layers, ``E`` logical
experts, ``P`` slots, ``G`` GPUs (= EP ranks = attention-DP ranks), ``k`` top-k.
"""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement
from moeplace.placement.rules import ReplicaRule, get_rule, rule_names
from moeplace.placement.rules.ideal import check_loads

ENGINE_RULES = rule_names(per_token=True)  # what serving engines do (the simulator replays these)
ENGINES = rule_names()  # plus the LP optimum, which no engine implements


def _rule(rule: str | ReplicaRule, seed: int, vllm_rule: str | None = None,
          variant: str | None = None) -> ReplicaRule:
    return get_rule(rule, seed=seed, vllm_rule=vllm_rule, sglang_variant=variant)


# ---------------------------------------------------------------------------- one batch
def choose_slots(placement: Placement, layer: int, expert_ids: np.ndarray, rule: str | ReplicaRule, *,
                 src_gpu: int | np.ndarray | None = None, seed: int = 42,
                 dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Physical slots, int64 ``[n, k]``, for the tokens of ONE rank-local batch of MoE layer
    ``layer`` (index into ``placement.moe_layers``). ``expert_ids``: int ``[n, k]``, in the batch's
    token order. ``src_gpu``: the DP rank the tokens run on (an int, or int ``[n]`` per token), needed
    by the rules whose choice depends on it (SGLang; TensorRT-LLM under attention DP); pass
    ``dispatch_map`` (the rule's :meth:`~ReplicaRule.dispatch_state`) to avoid rebuilding it. The ideal
    split has no per-token choice and raises.
    """
    rule = _rule(rule, seed, vllm_rule)
    ids = np.asarray(expert_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise InputError(f"expert_ids must be [tokens, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= placement.num_experts):
        raise InputError(f"expert id out of range [0, {placement.num_experts})")
    if src_gpu is None:
        if rule.per_token and rule.uses_source_rank:
            raise InputError(f"replica rule '{rule.name}' needs src_gpu (the DP rank the tokens run on)")
        src_gpu = 0
    src = np.broadcast_to(np.asarray(src_gpu, dtype=np.int64).reshape(-1), (ids.shape[0],))
    return rule.batch_slots(placement, layer, ids, src_gpu=src, pos_in_batch=np.arange(ids.shape[0]),
                            state=dispatch_map)


# ---------------------------------------------------------------------------- Loads-level
def expected_gpu_loads(placement: Placement, loads_LE: np.ndarray, rule: str | ReplicaRule, *,
                       seed: int = 42, dispatch_map: np.ndarray | None = None, sglang_exact: bool = True,
                       variant: str = "mainline") -> np.ndarray:
    """Tokens per GPU, float64 ``[L, G]``, when expert loads ``loads_LE`` (float ``[L, E]``) are
    served with ``placement`` under the rule ``rule`` (each rule's
    :meth:`~ReplicaRule.expected_gpu_loads`: vLLM and TensorRT-LLM the even split ``load / count``;
    SGLang each rank's share to its dispatch-map slot, or with ``sglang_exact=False`` the seed-averaged
    map; ideal the LP optimum). Token mass is preserved: ``out.sum(1) == loads_LE.sum(1)``.
    """
    rule = _rule(rule, seed, variant=variant)
    w = check_loads(placement, loads_LE)
    return rule.expected_gpu_loads(placement, w, dispatch_map, seed_averaged=not sglang_exact)


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


def batch_slots(placement: Placement, layer: int, expert_ids: np.ndarray, rule: str | ReplicaRule, *,
                src_gpu: np.ndarray, pos_in_batch: np.ndarray, step: np.ndarray | None = None,
                dispatch_map: np.ndarray | None = None, seed: int = 42, vllm_rule: str = "hash") -> np.ndarray:
    """Slots int64 ``[n, k]`` of MoE layer ``layer`` for tokens from MANY rank-local batches at once:
    token ``t`` runs on DP rank ``src_gpu[t]`` at index ``pos_in_batch[t]`` of engine step ``step[t]``
    (from :func:`batch_layout`; default one step). Same rules as :func:`choose_slots`."""
    rule = _rule(rule, seed, vllm_rule)
    return rule.batch_slots(placement, layer, np.asarray(expert_ids, dtype=np.int64),
                            src_gpu=np.asarray(src_gpu, dtype=np.int64), pos_in_batch=pos_in_batch,
                            batch_id=step, state=dispatch_map)


def token_slots(placement: Placement, expert_ids: np.ndarray, rule: str | ReplicaRule, *, src_gpu: np.ndarray,
                batch_tokens: int | None = None, seed: int = 42,
                dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Physical slot of every (token, MoE layer, k), int32 ``[n, L, k]``, under a per-token rule.

    ``expert_ids``: int ``[n, L, k]``; ``src_gpu``: int ``[n]`` DP rank of each token (see
    :func:`dp_ranks_round_robin`); ``batch_tokens``: tokens per rank per step (vLLM's modulo index
    restarts every step on every rank); ``vllm_rule``: ``hash`` (vLLM main) or ``modulo``.
    """
    rule = _rule(rule, seed, vllm_rule)
    ids = np.asarray(expert_ids)
    n, L, k = ids.shape
    if L != placement.num_layers:
        raise InputError(f"expert_ids has {L} MoE layers, the placement {placement.num_layers}")
    if not rule.per_token:
        raise InputError(f"replica rule '{rule.name}' has no per-token slot choice")
    step, pos = batch_layout(src_gpu, placement.num_gpus, batch_tokens)
    if dispatch_map is None:
        dispatch_map = rule.dispatch_state(placement)
    out = np.empty((n, L, k), dtype=np.int32)
    for l in range(L):
        out[:, l, :] = rule.batch_slots(placement, l, ids[:, l, :].astype(np.int64), src_gpu=src_gpu,
                                        pos_in_batch=pos, batch_id=step, state=dispatch_map)
    return out


def token_gpu_loads(placement: Placement, expert_ids: np.ndarray, rule: str | ReplicaRule, *,
                    src_gpu: np.ndarray,
                    batch_tokens: int | None = None, seed: int = 42,
                    dispatch_map: np.ndarray | None = None, vllm_rule: str = "hash") -> np.ndarray:
    """Per-step tokens per GPU, float64 ``[S, L, G]``, for token-level routing ``expert_ids`` (int
    ``[n, L, k]``) whose tokens run on DP ranks ``src_gpu`` (int ``[n]``), ``batch_tokens`` per rank
    per step. A rule without a per-token choice (the ideal split) is solved on each step's expert loads."""
    rule = _rule(rule, seed, vllm_rule)
    ids = np.asarray(expert_ids)
    n, L, _ = ids.shape
    if L != placement.num_layers:
        raise InputError(f"expert_ids has {L} MoE layers, the placement {placement.num_layers}")
    G, E = placement.num_gpus, placement.num_experts
    step, pos = batch_layout(src_gpu, G, batch_tokens)
    S = int(step.max()) + 1 if n else 1
    if not rule.per_token:
        counts = np.zeros((S, L, E))
        for l in range(L):
            key = step[:, None] * E + ids[:, l, :].astype(np.int64)
            counts[:, l, :] = np.bincount(key.ravel(), minlength=S * E).reshape(S, E)
        return np.stack([rule.expected_gpu_loads(placement, counts[s]) for s in range(S)])
    if dispatch_map is None:
        dispatch_map = rule.dispatch_state(placement)
    out = np.zeros((S, L, G))
    for l in range(L):
        slots = rule.batch_slots(placement, l, ids[:, l, :].astype(np.int64), src_gpu=src_gpu,
                                 pos_in_batch=pos, batch_id=step, state=dispatch_map)
        key = step[:, None] * G + placement.slot_gpu[slots]
        out[:, l, :] = np.bincount(key.ravel(), minlength=S * G).reshape(S, G)
    return out
