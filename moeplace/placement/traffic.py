"""Dispatch traffic of a placement: how many sends a token makes per MoE layer, and what share of its
expert selections crosses a node boundary (definitions in :mod:`placement.evaluate`).

Exact when the destination GPU of every selection is known (:func:`traffic_from_dest`, and
:func:`sample_traffic` for a token sample replayed under an engine's rule); from Loads alone
(:func:`traffic_from_loads`) the share is exact under uniform sources and the per-token counts use the
independence approximation."""
from __future__ import annotations

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement
from moeplace.placement.rules import ReplicaRule

TRAFFIC_MODES = ("node", "gpu", "expert")


def distinct_remote(dest: np.ndarray, src: np.ndarray) -> np.ndarray:
    """Number of distinct values in each row of ``dest`` [n, k] other than ``src`` [n]: int64 [n]."""
    if dest.max(initial=0) < 64 and src.max(initial=0) < 64:  # a set of small ints is a 64-bit mask
        mask = np.bitwise_or.reduce(np.left_shift(np.uint64(1), dest.astype(np.uint64)), axis=1)
        mask &= ~np.left_shift(np.uint64(1), src.astype(np.uint64))
        return np.bitwise_count(mask).astype(np.int64)
    srt = np.sort(dest, axis=1)
    new = np.ones_like(srt, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (new & (srt != src[:, None])).sum(axis=1)


def traffic_from_dest(dest: np.ndarray, src_gpu: np.ndarray,
                       gpus_per_node: int) -> tuple[float, float, float, float]:
    """Exact traffic of selections with destination GPUs ``dest`` int ``[n, k]`` from ``src_gpu``
    ``[n]``: (remote-node selections, remote nodes touched, remote GPUs touched, remote selections),
    each summed over tokens."""
    src_node = src_gpu // gpus_per_node
    dnode = dest // gpus_per_node
    remote_node_sel = float((dnode != src_node[:, None]).sum())
    remote_sel = float((dest != src_gpu[:, None]).sum())
    return (remote_node_sel, float(distinct_remote(dnode, src_node).sum()),
            float(distinct_remote(dest, src_gpu).sum()), remote_sel)


def traffic_from_loads(placement: Placement, w: np.ndarray, rule: ReplicaRule, k: int,
                        dmap: np.ndarray | None, gpu_loads: np.ndarray) -> tuple[float, dict[str, float]]:
    """Loads-level traffic for one window ``w`` [L, E]: tokens of every expert come evenly from all G
    ranks. Returns (cross-node share, sends per token per layer by mode) — the share is exact under
    that assumption, the per-token counts use the independence approximation."""
    L, G = placement.num_layers, placement.num_gpus
    gpn = placement.gpus_per_node
    node = np.arange(G) // gpn
    total = w.sum(axis=1)  # [L]
    if not rule.source_dependent_shares:
        return _traffic_same_sources(placement, w, gpu_loads, k, node, total)
    # q[l, s, g]: share of rank s's selections that land on GPU g
    q = rule.source_shares(placement, w, gpu_loads, dmap)
    same_node = node[:, None] == node[None, :]
    has = total > 0
    # cross-node share over all selections = sum_l total_l * share_l / sum_l total_l
    per_layer_cross = (q * ~same_node[None]).sum(axis=(1, 2)) / G
    cross = float((per_layer_cross * total).sum() / total.sum()) if total.sum() > 0 else 0.0
    remote = ~np.eye(G, dtype=bool)
    touch = 1.0 - (1.0 - q) ** k  # P(at least one of k independent selections lands on g)
    gpus = (touch * remote[None]).sum(axis=2).mean(axis=1)  # [L]
    qn = np.zeros((L, G, placement.num_nodes))
    for n_ in range(placement.num_nodes):
        qn[:, :, n_] = q[:, :, node == n_].sum(axis=2)
    touch_n = 1.0 - (1.0 - qn) ** k
    other_node = node[:, None] != np.arange(placement.num_nodes)[None, :]
    nodes = (touch_n * other_node[None]).sum(axis=2).mean(axis=1)
    sel_remote = (q * remote[None]).sum(axis=2).mean(axis=1) * k
    n_has = max(int(has.sum()), 1)  # per token per layer: over the layers with tokens only
    return cross, {"node": float(nodes[has].sum() / n_has), "gpu": float(gpus[has].sum() / n_has),
                   "expert": float(sel_remote[has].sum() / n_has)}


def _traffic_same_sources(placement: Placement, w: np.ndarray, gpu_loads: np.ndarray, k: int,
                           node: np.ndarray, total: np.ndarray) -> tuple[float, dict[str, float]]:
    """:func:`traffic_from_loads` for a rule whose shares do not depend on the source rank
    (``q[l, s, g] = share[l, g]`` for every ``s``): the same sums in ``[L, G]`` and ``[L, nodes]`` instead of
    ``[L, G, G]`` (which is 7 TB at 100,000 GPUs). With ``m(g)`` the ranks on ``g``'s node: a selection of
    any rank lands on ``g`` with ``share[l, g]``, and ``G - m(g)`` of the ``G`` ranks are on another node;
    each rank is remote to all GPUs but itself, so the mean over ranks of ``sum_{g != s}`` is
    ``(1 - 1/G) sum_g``."""
    G, N = placement.num_gpus, placement.num_nodes
    share = np.divide(gpu_loads, total[:, None], out=np.zeros_like(gpu_loads, dtype=np.float64),
                      where=total[:, None] > 0)                      # [L, G]
    node_size = np.bincount(node, minlength=N).astype(np.float64)    # [N]
    per_layer_cross = (share * (G - node_size[node])[None, :]).sum(axis=1) / G
    cross = float((per_layer_cross * total).sum() / total.sum()) if total.sum() > 0 else 0.0
    touch = 1.0 - (1.0 - share) ** k
    gpus = touch.sum(axis=1) - touch.sum(axis=1) / G                  # mean over s of sum_{g != s}
    qn = np.stack([share[:, node == n_].sum(axis=1) for n_ in range(N)], axis=1)  # [L, N]
    touch_n = 1.0 - (1.0 - qn) ** k
    nodes = (touch_n * (G - node_size)[None, :]).sum(axis=1) / G      # mean over s of sum_{n != node(s)}
    sel_remote = (share.sum(axis=1) - share.sum(axis=1) / G) * k
    has = total > 0
    n_has = max(int(has.sum()), 1)
    return cross, {"node": float(nodes[has].sum() / n_has), "gpu": float(gpus[has].sum() / n_has),
                   "expert": float(sel_remote[has].sum() / n_has)}


def sample_traffic(placement: Placement, samples: np.ndarray, rule: ReplicaRule,
                   dmap: np.ndarray | None) -> tuple[float, dict[str, float]]:
    """Exact traffic of a token sample ``[N, L, k]`` (-1 rows skipped per layer): token ``i`` runs on DP
    rank ``i % G`` at batch position ``i // G``. Returns (cross-node share, sends per token per layer)."""
    N, L, _ = samples.shape
    G = placement.num_gpus
    src_all = np.arange(N) % G
    pos_all = np.arange(N) // G
    acc = dict.fromkeys(("cross", *TRAFFIC_MODES), 0.0)
    sel = tok = 0
    for l in range(L):
        ok = (samples[:, l, :] >= 0).all(axis=1)
        if not ok.any():
            continue
        src = src_all[ok]
        slots = rule.batch_slots(placement, l, samples[ok, l, :].astype(np.int64), src_gpu=src,
                                 pos_in_batch=pos_all[ok], state=dmap)
        a, b, c, d = traffic_from_dest(placement.slot_gpu[slots], src, placement.gpus_per_node)
        for key, v in zip(("cross", "node", "gpu", "expert"), (a, b, c, d)):
            acc[key] += v
        sel += slots.size
        tok += int(ok.sum())
    if tok == 0:
        raise InputError("the token sample has no complete rows")
    return acc["cross"] / sel, {key: acc[key] / tok for key in TRAFFIC_MODES}
