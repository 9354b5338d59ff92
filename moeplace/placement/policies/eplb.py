"""DeepSeek's Expert Parallelism Load Balancer (EPLB), reimplemented from its description (README
of github.com/deepseek-ai/EPLB; its ``eplb.py`` read to confirm tie-breaking and arithmetic).

Hierarchical mode (used when the expert groups divide evenly over the nodes):
  1. pack expert *groups* onto nodes with :func:`balanced_packing` (exactly groups/nodes per node);
  2. inside each node, add the node's share of redundant replicas one at a time to the expert with the
     largest ``load / replica_count`` (:func:`replicate_experts`);
  3. pack each node's replicas (each carrying ``load / count``) onto the node's GPUs with
     :func:`balanced_packing` (exactly slots-per-GPU per GPU).
Global mode (otherwise): the same with one group and one node. Kimi K3 has no expert groups
(``n_group = 1``), so on 4 nodes it runs global; DeepSeek-V3 (8 groups) on 4 nodes runs hierarchical.

Arithmetic is float32 like the original (``weight.float()``), so ties break the same way: items are
taken heaviest first (ties by lower index), a pack/replica choice takes the first minimum/maximum.
Known weakness kept on purpose: two replicas of one expert can land on the same GPU.
"""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.policies import Deadline, PlacementProblem, declare_options, register_policy
from moeplace.placement.record import Placement


def balanced_packing(weight: np.ndarray, num_packs: int, check=None) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each:
    heaviest item first, into the lightest pack that still has room.

    ``weight``: float ``[X, n]``. Returns ``(pack_index, rank_in_pack)``, int64 ``[X, n]`` each
    (``rank_in_pack`` = the order the item entered its pack). ``check()``, if given, is called once per
    row (it raises to stop: a time limit)."""
    w = np.asarray(weight, dtype=np.float32)
    X, n = w.shape
    if n % num_packs:
        raise InputError(f"balanced packing: {n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (X, n)).copy(), np.zeros((X, n), dtype=np.int64)
    pack_index = np.full((X, n), -1, dtype=np.int64)
    rank_in_pack = np.full((X, n), -1, dtype=np.int64)
    for i in range(X):
        if check is not None:
            check()
        order = np.argsort(-w[i], kind="stable")  # descending, ties by lower index
        pack_w = np.zeros(num_packs, dtype=np.float32)
        pack_n = np.zeros(num_packs, dtype=np.int64)
        for item in order:
            room = np.where(pack_n < per_pack, pack_w, np.float32(np.inf))
            pack = int(np.argmin(room))  # first lightest pack with room
            pack_index[i, item] = pack
            rank_in_pack[i, item] = pack_n[pack]
            pack_w[pack] += w[i, item]
            pack_n[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int, check=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add ``num_phy - num_log`` replicas one at a time, each to the expert with the largest
    ``load / count`` (first on ties). ``weight``: float ``[X, num_log]``.

    Returns ``phy2log`` int64 ``[X, num_phy]`` (the first ``num_log`` physical ids are the experts
    themselves, then the replicas in the order added), ``rank`` int64 ``[X, num_phy]`` (replica rank)
    and ``logcnt`` int64 ``[X, num_log]``. ``check()``, if given, is called once per replica added."""
    w = np.asarray(weight, dtype=np.float32)
    X, num_log = w.shape
    if num_phy < num_log:
        raise InputError(f"{num_phy} physical slots cannot hold {num_log} experts")
    phy2log = np.broadcast_to(np.arange(num_phy), (X, num_phy)).copy()
    rank = np.zeros((X, num_phy), dtype=np.int64)
    logcnt = np.ones((X, num_log), dtype=np.int64)
    rows = np.arange(X)
    for i in range(num_log, num_phy):
        if check is not None:
            check()
        best = np.argmax(w / logcnt.astype(np.float32), axis=1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                                   num_gpus: int, check=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's hierarchical policy. ``weight``: float ``[L, E]``. Returns ``(phy2log [L, P], phyrank
    [L, P], logcnt [L, E])``, int64; slot ``p`` is on GPU ``p // (P / num_gpus)``."""
    w = np.asarray(weight, dtype=np.float32)
    L, E = w.shape
    if E % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_physical % num_gpus:
        raise InputError(f"EPLB hierarchical needs experts ({E}) % groups ({num_groups}), groups % nodes "
                         f"({num_nodes}), GPUs ({num_gpus}) % nodes and slots ({num_physical}) % GPUs "
                         "all zero")
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    # Step 1: groups -> nodes. "mlog" renumbers experts so that each node's experts are contiguous.
    tokens_per_group = w.reshape(L, num_groups, group_size).sum(-1, dtype=np.float32)
    g_pack, g_rank = balanced_packing(tokens_per_group, num_nodes, check)
    log2mlog = (((g_pack * groups_per_node + g_rank) * group_size)[:, :, None]
                + np.arange(group_size)[None, None, :]).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # Step 2: replicas within each node: rows are (layer, node)
    tokens_per_mlog = np.take_along_axis(w, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes, check)
    # Step 3: each node's replicas -> its GPUs
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes, check)
    phy2pphy = pack * per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1)
                 + np.arange(0, E, E // num_nodes)[None, :, None]).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, check=None) -> tuple[np.ndarray, np.ndarray, str]:
    """EPLB entry point: hierarchical when ``num_groups % num_nodes == 0``, else global.
    Returns ``(phy2log int64 [L, P], logcnt int64 [L, E], mode)``. ``check``: see :func:`balanced_packing`."""
    if num_groups % num_nodes == 0:
        p2l, _, cnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus, check)
        return p2l, cnt, "hierarchical"
    p2l, _, cnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus, check)
    return p2l, cnt, "global"


declare_options({"eplb_groups": int})  # expert groups for the hierarchical variant


@register_policy("eplb")
def eplb(problem: PlacementProblem) -> Placement:
    """DeepSeek EPLB on the planning windows' summed loads. Groups: ``options["eplb_groups"]`` or the
    model's ``n_group``; nodes: the cluster's. EPLB has no partial answer: past ``problem.time_limit`` it
    stops with :class:`TimeLimitReached`."""
    groups = int(problem.options.get("eplb_groups") or problem.model.n_group or 1)
    weight = problem.loads.sum(axis=0)
    deadline = Deadline(problem.time_limit, "eplb")
    # EPLB places each layer from that layer's loads alone: layers with equal loads (e.g. the empty layers
    # of a log that holds only some MoE layers) get one answer, computed once
    rows, inverse = np.unique(weight, axis=0, return_inverse=True)
    p2l, _, mode = rebalance_experts(rows, problem.num_slots, groups, problem.cluster.num_nodes,
                                     problem.cluster.num_gpus, deadline.check)
    return problem.placement(p2l[inverse.reshape(-1)], "eplb", mode=mode, num_groups=groups)
