"""Greedy construction of one layer: replica counts by water-filling
(:func:`placement.bounds.minmax_replica_counts`, at most one replica per GPU), then replicas packed onto
GPUs heaviest first (LPT), never two replicas of one expert on one GPU, exactly ``P / G`` slots per GPU.

Loads arrive *normalized per scenario*: ``wn[w, e] = load[w, e] / (total_w / G)``, so a GPU's normalized
load is its max/mean ratio in that scenario and balancedness is ``1 / max``. Every function here is pure.
"""
from __future__ import annotations

import numpy as np

from moeplace.placement.bounds import minmax_replica_counts


def normalize_scenarios(loads_we: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[W, E]`` token counts -> float64 ``[W, E]`` with each row summing to ``num_gpus`` (so the mean
    GPU load is 1). Rows with no tokens are dropped (a scenario nobody routed says nothing); if every row
    is empty, one uniform row is returned (any placement is then perfectly balanced)."""
    loads = np.asarray(loads_we, dtype=np.float64)
    tot = loads.sum(axis=1)
    keep = tot > 0
    if not keep.any():
        return np.full((1, loads.shape[1]), num_gpus / loads.shape[1])
    return loads[keep] * (num_gpus / tot[keep])[:, None]


def count_bound(wn: np.ndarray, num_slots: int, num_gpus: int) -> float:
    """Lower bound on the normalized max GPU load (worst scenario) of *any* placement under the even
    split rule: ``max(1, min_counts max_{w,e} wn[w, e] / count_e)`` (water-filling is exact for that
    min-max, so its counts give the bound); with no redundancy also the
    "hottest expert plus the S-1 lightest others" bound (docs/design.md Sources §3)."""
    key = wn.max(axis=0)
    cnt = minmax_replica_counts(key[None], num_slots, max_count=num_gpus)[0]
    lb = max(1.0, float((key / cnt).max()))
    E = wn.shape[1]
    S = num_slots // num_gpus
    if num_slots == E and S > 1:
        for row in wn:
            srt = np.sort(row)
            lb = max(lb, float(srt[-1] + srt[:S - 1].sum()))
    return lb


def lpt_pack(rep_expert: np.ndarray, rep_weight: np.ndarray, num_gpus: int, num_experts: int,
             node_distinct: int | None = None) -> np.ndarray:
    """Pack replicas onto GPUs: heaviest first (by worst scenario), each into the GPU whose worst-scenario
    load after adding it is lowest among GPUs that still have a free slot and do not hold that expert.

    ``rep_expert``: int ``[P]`` expert of each replica; ``rep_weight``: float ``[W, P]`` its normalized load
    per scenario. ``node_distinct``: GPUs per node, to prefer one replica per node for experts with at
    most as many replicas as nodes (SGLang). Returns ``phy2log`` int64 ``[P]`` (GPU ``g`` owns slots ``g*S .. g*S+S-1``)."""
    P = rep_expert.shape[0]
    S = P // num_gpus
    W = rep_weight.shape[0]
    order = np.lexsort((rep_expert, -rep_weight.max(axis=0)))  # heaviest first; ties by expert id
    load = np.zeros((W, num_gpus))
    fill = np.zeros(num_gpus, dtype=np.int64)
    has = np.zeros((num_gpus, num_experts), dtype=bool)
    gpu_items: list[list[int]] = [[] for _ in range(num_gpus)]
    cnt = np.bincount(rep_expert, minlength=num_experts)
    gpn = node_distinct or num_gpus
    num_nodes = num_gpus // gpn
    for r in order:
        e = rep_expert[r]
        after = (load + rep_weight[:, r:r + 1]).max(axis=0)
        ok = (fill < S) & ~has[:, e]
        if node_distinct and 2 <= cnt[e] <= num_nodes:
            on_node = has[:, e].reshape(num_nodes, gpn).any(axis=1).repeat(gpn)
            if (ok & ~on_node).any():
                ok &= ~on_node
        if not ok.any():
            # Only GPUs already holding e have room: put it there, then trade it for a replica elsewhere.
            g = int(np.argmin(np.where(fill < S, after, np.inf)))
            g = _repair(g, r, rep_expert, rep_weight, has, gpu_items, load)
        else:
            g = int(np.argmin(np.where(ok, after, np.inf)))
        gpu_items[g].append(int(r))
        has[g, e] = True
        load[:, g] += rep_weight[:, r]
        fill[g] += 1
    phy2log = np.empty(P, dtype=np.int64)
    for g, items in enumerate(gpu_items):
        phy2log[g * S:(g + 1) * S] = rep_expert[items]
    return phy2log


def _repair(g, r, rep_expert, rep_weight, has, gpu_items, load) -> int:
    """GPU ``g`` has room but already holds expert ``rep_expert[r]``: move some replica ``q`` (expert
    ``b`` not on ``g``) from a GPU ``h`` that lacks ``e`` onto ``g``, and return ``h`` for ``r``."""
    e = rep_expert[r]
    for h in np.argsort(load.max(axis=0), kind="stable"):
        if h == g or has[h, e]:
            continue
        for q in gpu_items[h]:
            b = rep_expert[q]
            if not has[g, b]:
                gpu_items[h].remove(q)
                has[h, b] = False
                load[:, h] -= rep_weight[:, q]
                gpu_items[g].append(q)
                has[g, b] = True
                load[:, g] += rep_weight[:, q]
                return int(h)
    raise ValueError("no duplicate-free packing exists")  # cannot happen while count <= num_gpus


def replicas_of(cnt: np.ndarray) -> np.ndarray:
    """Expert id of each replica, ``[sum(cnt)]``, grouped by expert."""
    return np.repeat(np.arange(cnt.shape[0]), cnt)


def greedy_layer(wn: np.ndarray, num_slots: int, num_gpus: int, key: np.ndarray | None = None,
                 node_distinct: int | None = None) -> np.ndarray:
    """Counts by water-filling on ``key`` (default: the worst scenario per expert), then LPT packing.
    ``wn``: normalized ``[W, E]``. Returns ``phy2log`` int64 ``[P]``."""
    E = wn.shape[1]
    key = wn.max(axis=0) if key is None else key
    cnt = minmax_replica_counts(key[None], num_slots, max_count=num_gpus)[0]
    rep = replicas_of(cnt)
    return lpt_pack(rep, wn[:, rep] / cnt[rep], num_gpus, E, node_distinct)
