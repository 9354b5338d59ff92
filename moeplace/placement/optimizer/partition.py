"""Partition-first start for the traffic objective: group the experts that the same tokens use onto the
same node before balancing the GPUs inside each node.

Swapping replicas one pair at a time from a balanced placement (:mod:`.traffic`) cannot find this: a
balanced placement spreads every group of co-activated experts over all nodes, and no single swap that
keeps the balance reduces the nodes a token touches by much. Building the node groups first can:

1. **Co-activation** ``C[i, j]``: sampled tokens that use both experts ``i`` and ``j`` (within the layer).
2. **Spectral embedding**: the leading non-trivial eigenvectors of ``D^-1/2 C D^-1/2`` (normalized
   co-activation), rows normalized; groups of experts used together are near each other there.
3. **Balanced assignment** to nodes: k-means-like rounds where each expert, most certain first, goes to
   the nearest node centroid whose load stays within ``tol`` of the mean and whose slots are not full.
4. **Refinement**: pairwise swaps between nodes that raise the co-activation kept inside nodes
   (Kernighan-Lin style gains), keeping slot counts (swaps of experts with equal replica counts) and
   node loads within ``tol`` (or closer to the mean than before).
5. **Packing**: each node's replicas onto its GPUs (LPT), the replica counts of the balance plan kept.

The caller then balances GPUs inside each node (traffic unchanged), repairs balance across nodes if
needed, and refines with the exact token-level swap search.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from moeplace.placement.optimizer.greedy import lpt_pack

REFINE_CANDIDATES = 200


def coactivation(samples: np.ndarray, num_experts: int) -> np.ndarray:
    """``C`` float64 ``[E, E]``: number of sampled tokens (rows of ``samples [N, k]``) using both experts;
    zero diagonal."""
    N, k = samples.shape
    A = sp.csr_matrix((np.ones(N * k, dtype=np.float64), (np.repeat(np.arange(N), k), samples.ravel())),
                      shape=(N, num_experts))
    A.sum_duplicates()
    A.data[:] = 1.0
    C = np.asarray((A.T @ A).todense())
    np.fill_diagonal(C, 0.0)
    return C


def spectral_embedding(C: np.ndarray, dims: int) -> np.ndarray:
    """Rows of the ``dims`` leading non-trivial eigenvectors of the normalized co-activation, each row
    scaled to unit length, ``[E, dims]``."""
    deg = C.sum(axis=1)
    inv = 1.0 / np.sqrt(np.maximum(deg, 1e-12))
    _, vecs = np.linalg.eigh(C * inv[:, None] * inv[None, :])
    dims = min(dims, C.shape[0] - 1)
    X = vecs[:, -dims - 1:-1]
    return X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)


def node_partition(C: np.ndarray, w: np.ndarray, cnt: np.ndarray, num_nodes: int, node_slots: int,
                   tol: float = 0.004, rounds: int = 15, max_swaps: int = 4000) -> np.ndarray:
    """Node of every expert, ``[E]`` int64, such that each node holds exactly ``node_slots`` replicas
    (``cnt`` per expert), node loads (``w`` per expert) stay within ``tol`` of the mean where the
    granularity allows, and co-activated experts (``C``) share nodes."""
    E = C.shape[0]
    if int(cnt.sum()) != num_nodes * node_slots:
        raise ValueError("replica counts must fill the nodes' slots exactly")
    X = spectral_embedding(C, 2 * num_nodes)
    target = w.sum() / num_nodes
    # farthest-point seeds: the heaviest expert, then the expert farthest from the seeds so far
    seeds = [int(np.argmax(w))]
    for _ in range(num_nodes - 1):
        dist = np.min([((X - X[s]) ** 2).sum(axis=1) for s in seeds], axis=0)
        seeds.append(int(np.argmax(np.where(w > 0, dist, -1.0))))
    cen = X[seeds]
    node = np.zeros(E, dtype=np.int64)
    for _ in range(rounds):
        node = _assign(X @ cen.T, w, cnt, node_slots, target, tol)
        new = np.stack([X[node == n].mean(axis=0) if (node == n).any() else cen[n] for n in range(num_nodes)])
        if np.allclose(new, cen):
            break
        cen = new
    _fix_slots(node, C, cnt, num_nodes, node_slots)
    _refine(node, C, w, cnt, num_nodes, target, tol, max_swaps)
    return node


def _assign(sim: np.ndarray, w: np.ndarray, cnt: np.ndarray, node_slots: int, target: float,
            tol: float) -> np.ndarray:
    """Most certain expert first (margin between its two nearest centroids, then heavier first): the
    nearest node with load and slot room, else the least loaded node with slot room."""
    E, num_nodes = sim.shape
    pref = np.argsort(-sim, axis=1, kind="stable")
    srt = np.sort(sim, axis=1)
    margin = srt[:, -1] - srt[:, -2] if num_nodes > 1 else np.zeros(E)
    node = np.full(E, -1, dtype=np.int64)
    nl = np.zeros(num_nodes)
    ns = np.zeros(num_nodes, dtype=np.int64)
    for e in np.lexsort((np.arange(E), -w, -margin)):
        for n in pref[e]:
            if ns[n] + cnt[e] <= node_slots and nl[n] + w[e] <= target * (1 + tol):
                break
        else:
            room = ns + cnt[e] <= node_slots
            n = int(np.argmin(np.where(room, nl, np.inf))) if room.any() else int(np.argmin(ns))
        node[e] = n
        nl[n] += w[e]
        ns[n] += cnt[e]
    return node


def _fix_slots(node: np.ndarray, C: np.ndarray, cnt: np.ndarray, num_nodes: int, node_slots: int) -> None:
    """Move single-replica experts from over-full to under-full nodes (least co-activation lost first)
    until every node holds exactly ``node_slots`` replicas."""
    while True:
        ns = np.bincount(node, weights=cnt, minlength=num_nodes).astype(np.int64)
        if (ns == node_slots).all():
            return
        a, b = int(np.argmax(ns)), int(np.argmin(ns))
        movable = np.flatnonzero((node == a) & (cnt == 1))
        if not len(movable):
            raise ValueError("cannot even out the nodes' slots: no single-replica expert to move")
        loss = C[movable][:, node == a].sum(axis=1) - C[movable][:, node == b].sum(axis=1)
        node[movable[np.argmin(loss)]] = b


def _refine(node: np.ndarray, C: np.ndarray, w: np.ndarray, cnt: np.ndarray, num_nodes: int, target: float,
            tol: float, max_swaps: int) -> None:
    """Best-gain swaps of two experts on different nodes (equal replica counts), in place."""
    E = len(node)
    M = np.stack([C[:, node == n].sum(axis=1) for n in range(num_nodes)], axis=1)  # [E, nodes]
    nl = np.bincount(node, weights=w, minlength=num_nodes)
    band = tol * target
    for _ in range(max_swaps):
        gain_move = M - M[np.arange(E), node][:, None]          # co-activation gained moving e to n
        cand = np.argsort(-gain_move.ravel(), kind="stable")[:REFINE_CANDIDATES]
        best, best_gain = None, 1e-9
        for c in cand:
            i, b = divmod(int(c), num_nodes)
            a = node[i]
            if a == b or gain_move[i, b] <= best_gain / 2:
                continue
            js = np.flatnonzero((node == b) & (cnt == cnt[i]))
            if not len(js):
                continue
            g = gain_move[i, b] + gain_move[js, a] - 2 * C[i, js]
            la = nl[a] - w[i] + w[js]
            lb = nl[b] + w[i] - w[js]
            ok = ((np.abs(la - target) <= band) | (np.abs(la - target) <= abs(nl[a] - target))) & \
                 ((np.abs(lb - target) <= band) | (np.abs(lb - target) <= abs(nl[b] - target)))
            g = np.where(ok, g, -np.inf)
            top = int(np.argmax(g))
            if g[top] > best_gain:
                best_gain, best = float(g[top]), (i, int(js[top]))
        if best is None:
            return
        i, j = best
        a, b = node[i], node[j]
        M[:, a] += C[:, j] - C[:, i]
        M[:, b] += C[:, i] - C[:, j]
        node[i], node[j] = b, a
        nl[a] += w[j] - w[i]
        nl[b] += w[i] - w[j]


def pack_nodes(node: np.ndarray, cnt: np.ndarray, wn: np.ndarray, num_nodes: int, gpus_per_node: int,
               slots_per_gpu: int) -> np.ndarray:
    """``phy2log`` ``[P]``: each node's replicas LPT-packed onto its own GPUs (``wn``: ``[W, E]``)."""
    span = gpus_per_node * slots_per_gpu
    p2l = np.empty(num_nodes * span, dtype=np.int64)
    for n in range(num_nodes):
        ex = np.flatnonzero(node == n)
        rep = np.repeat(ex, cnt[ex])
        local = lpt_pack(np.repeat(np.arange(len(ex)), cnt[ex]), wn[:, rep] / cnt[rep], gpus_per_node, len(ex))
        p2l[n * span:(n + 1) * span] = ex[local]
    return p2l


def partition_start(samples: np.ndarray, wn: np.ndarray, cnt: np.ndarray, num_gpus: int,
                    gpus_per_node: int) -> np.ndarray | None:
    """A co-activation-grouped placement with the replica counts ``cnt``, or ``None`` where it cannot
    exist (an expert with more replicas than a node has GPUs)."""
    num_nodes = num_gpus // gpus_per_node
    P = int(cnt.sum())
    if num_nodes < 2 or P % num_gpus or cnt.max() > gpus_per_node:
        return None
    C = coactivation(samples, wn.shape[1])
    node = node_partition(C, wn.mean(axis=0), cnt, num_nodes, P // num_nodes)
    return pack_nodes(node, cnt, wn, num_nodes, gpus_per_node, P // num_gpus)
