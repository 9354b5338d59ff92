"""Traffic-aware refinement of one layer: co-locate experts that the same tokens use, so each token's
top-k touches fewer nodes, while balancedness stays above a floor.

Cost model (what dispatch pays between nodes): a sampled token ``t`` with experts ``e_1..e_k`` uses
replica ``t mod count_e`` of each (the even modulo split), and touches the set of nodes holding those
replicas; a token from a uniformly random node sends to every touched node but its own, so the expected
remote-node sends per token are ``span * (1 - 1/num_nodes)``. We minimize the mean span ("units" are
(expert, replica rank) pairs, which move with swaps).
"""
from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from moeplace.placement.optimizer.local_search import LayerState, aggregate


class TrafficModel:
    """Token/unit incidence of one layer. ``samples``: int ``[N, k]`` expert ids; ``p2l``: ``[P]``."""

    def __init__(self, samples: np.ndarray, p2l: np.ndarray, num_gpus: int, gpus_per_node: int):
        P = p2l.shape[0]
        self.S = P // num_gpus
        self.gpn = gpus_per_node
        self.num_nodes = num_gpus // gpus_per_node
        E = int(p2l.max()) + 1
        samples = np.asarray(samples, dtype=np.int64)
        N, k = samples.shape
        order = np.argsort(p2l, kind="stable")
        cnt = np.bincount(p2l, minlength=E)
        first = np.concatenate([[0], np.cumsum(cnt)[:-1]])
        # slot of the replica each (token, choice) uses: rank t mod count among that expert's slots
        rank = np.arange(N)[:, None] % cnt[samples]
        slot = order[first[samples] + rank]                           # [N, k]
        self.N = N
        # unit u == the slot it started in; unit2slot tracks where it is now
        self.A = sp.csr_matrix((np.ones(N * k, dtype=np.float32), (slot.ravel(), np.repeat(np.arange(N), k))),
                               shape=(P, N))
        self.A.sum_duplicates()
        self.A.data[:] = 1.0                                          # a token counts a unit once
        self.unit_at = np.arange(P)                                   # slot -> unit in it
        self._refresh()

    def node_of_slot(self) -> np.ndarray:
        return np.arange(len(self.unit_at)) // (self.S * self.gpn)

    def _refresh(self) -> None:
        unit_node = np.empty(len(self.unit_at), dtype=np.int64)
        unit_node[self.unit_at] = self.node_of_slot()
        self.unit_node = unit_node
        onehot = sp.csr_matrix((np.ones(len(unit_node), dtype=np.float32), (np.arange(len(unit_node)), unit_node)),
                               shape=(len(unit_node), self.num_nodes))
        self.C = np.asarray((self.A.T @ onehot).todense())           # [N, nodes] units of t per node

    def span(self) -> float:
        """Mean nodes touched per sampled token."""
        return float((self.C > 0).sum(axis=1).mean()) if self.N else 0.0

    def swap(self, i: int, j: int) -> None:
        ui, uj = self.unit_at[i], self.unit_at[j]
        self.unit_at[i], self.unit_at[j] = uj, ui
        self._refresh()

    def exact_gain(self, i: int, j: int) -> float:
        """Reduction of total span (over tokens) if slots ``i`` and ``j`` swap contents."""
        node = self.node_of_slot()
        a, b = node[i], node[j]
        if a == b:
            return 0.0
        ui, uj = self.unit_at[i], self.unit_at[j]
        ti = self.A.indices[self.A.indptr[ui]:self.A.indptr[ui + 1]]
        tj = self.A.indices[self.A.indptr[uj]:self.A.indptr[uj + 1]]
        toks = np.union1d(ti, tj)
        c = self.C[toks].copy()
        before = (c > 0).sum()
        ini = np.isin(toks, ti).astype(self.C.dtype)
        inj = np.isin(toks, tj).astype(self.C.dtype)
        c[:, a] += -ini + inj
        c[:, b] += ini - inj
        return float(before - (c > 0).sum())

    def gain_matrix(self) -> np.ndarray:
        """Approximate total-span reduction of swapping slots ``i`` and ``j`` (exact unless they share
        tokens), float ``[P, P]``."""
        M1 = sp.csr_matrix((self.C == 1).astype(np.float32))
        Z = sp.csr_matrix((self.C == 0).astype(np.float32))
        Au = self.A[self.unit_at]                                    # rows in slot order
        rem_all = np.asarray((Au @ M1).todense())                    # [P, nodes]
        add = np.asarray((Au @ Z).todense())                         # [P, nodes]
        node = self.node_of_slot()
        rem = rem_all[np.arange(len(node)), node]
        g = rem[:, None] + rem[None, :] - add[:, node] - add[:, node].T
        g[node[:, None] == node[None, :]] = 0.0
        return g


def traffic_search(st: LayerState, tm: TrafficModel, cap: float, weight: float | None, deadline: float,
                   max_iters: int = 400, top: int = 256) -> int:
    """Swap replicas across nodes to cut the mean span, keeping the scenario-aggregated max/mean
    ``<= cap``. ``weight=None``: pure traffic (lexicographic traffic only); otherwise minimize
    ``value + weight * span / span0`` (relative traffic traded against imbalance). Returns swaps made."""
    span0 = max(tm.span(), 1e-9)
    made = 0
    while made < max_iters and time.monotonic() < deadline:
        gain = tm.gain_matrix() / tm.N                               # mean-span reduction
        S = st.S
        slot_gpu = st.slot_gpu
        a, b = st.p2l[:, None], st.p2l[None, :]
        ok = ~st.has[slot_gpu[None, :], a] & ~st.has[slot_gpu[:, None], b] & (gain > 1e-12)
        ok = np.triu(ok, 1)
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            break
        idx = idx[np.argsort(-gain.ravel()[idx], kind="stable")[:top]]
        ii, jj = np.unravel_index(idx, gain.shape)
        ga, gb = slot_gpu[ii], slot_gpu[jj]
        keep = _rules_ok(st, ii, jj)
        ii, jj, ga, gb, idx = ii[keep], jj[keep], ga[keep], gb[keep], idx[keep]
        if idx.size == 0:
            break
        d = st.wr[:, ii] - st.wr[:, jj]                              # [W, C]
        L = st.load
        new = L[:, :, None].repeat(len(ii), axis=2)                  # [W, G, C]
        cols = np.arange(len(ii))
        new[:, ga, cols] -= d
        new[:, gb, cols] += d
        val = aggregate(new.max(axis=1), st.cvar, axis=0)            # [C]
        if weight is None:
            score = -gain.ravel()[idx]
        else:
            score = val + weight * (-gain.ravel()[idx]) / span0
        score = np.where(val <= cap + 1e-12, score, np.inf)
        cur_val = st.value()
        done = False
        for c in np.argsort(score, kind="stable"):
            if not np.isfinite(score[c]):
                break
            ex = tm.exact_gain(int(ii[c]), int(jj[c])) / tm.N
            if ex <= 1e-12:
                continue
            if weight is not None and val[c] + weight * (-ex) / span0 >= cur_val - 1e-12:
                continue
            st.swap(int(ii[c]), int(jj[c]))
            tm.swap(int(ii[c]), int(jj[c]))
            done = True
            break
        if not done:
            break
        made += 1
        del S
    return made


def _rules_ok(st: LayerState, ii: np.ndarray, jj: np.ndarray) -> np.ndarray:
    """bool ``[C]``: candidate swaps that respect the migration budget and SGLang's node rule."""
    a, b = st.p2l[ii], st.p2l[jj]
    g, h = st.slot_gpu[ii], st.slot_gpu[jj]
    ok = np.ones(len(ii), dtype=bool)
    if st.had0 is not None and st.max_moves is not None:
        h0 = st.had0
        delta = (~h0[g, b]).astype(int) - ~h0[g, a] + ~h0[h, a] - ~h0[h, b]
        ok &= st.moves + delta <= st.max_moves
    if st.gpn:
        nhas = st.node_has()
        ng, nh = g // st.gpn, h // st.gpn
        ok &= ~((ng != nh) & ((st.limited(a) & nhas[nh, a]) | (st.limited(b) & nhas[ng, b])))
    return ok


def same_node(st: LayerState, gpus_per_node: int):
    """Partner mask for balance moves that cannot change traffic: GPUs on ``g``'s own node."""
    node = np.arange(st.G) // gpus_per_node
    return lambda g: node == node[g]
