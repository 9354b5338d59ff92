"""Local search on one layer: replica swaps between GPUs and replica re-counting (a redundant slot moves
from one expert to another), descending the lexicographic potential (worst-scenario max/mean, sum of
squared GPU loads). Strict descent, so it cannot cycle; deterministic (no randomness at all).

:class:`LayerState` is real state (the incremental GPU loads of a placement being improved); the search
functions are plain functions over it.
"""
from __future__ import annotations

import time

import numpy as np

TOL = 1e-12


def aggregate(m_w: np.ndarray, cvar: float, axis: int = 0) -> np.ndarray:
    """Scenario aggregate of per-scenario max/mean values ``m_w`` along ``axis``: the worst one
    (``cvar = 0``) or the mean of the worst ``ceil(cvar * W)`` (a CVaR)."""
    W = m_w.shape[axis]
    q = W if cvar <= 0 else max(1, int(np.ceil(cvar * W)))
    if q == W and cvar > 0:
        return m_w.mean(axis=axis)
    if cvar <= 0:
        return m_w.max(axis=axis)
    top = -np.sort(-m_w, axis=axis)
    return np.take(top, np.arange(q), axis=axis).mean(axis=axis)


class LayerState:
    """A layer's placement under the even-split rule, with its GPU loads kept up to date.

    ``wn``: normalized loads ``[W, E]`` (each row sums to G). ``p2l``: int64 ``[P]``. ``cnt``: ``[E]``.
    ``has``: bool ``[G, E]`` (expert on GPU). ``load``: ``[W, G]`` normalized GPU loads. ``had0``: the
    membership of the migration origin (``None`` without a budget); ``moves`` counts (GPU, expert) pairs
    that are new relative to it. ``node_distinct``: GPUs per node when replicas of an expert must sit on
    distinct nodes (while its count is at most the node count) — SGLang's static dispatch sends a node's
    ranks to their node's first replica, so only then is its expected split even (see :mod:`.layer`).
    ``cap_rows``/``cap``: the first ``cap_rows`` scenarios are constraints (their max/mean must stay
    ``<= cap``), the objective aggregates the others (the hedged default: the union stays near-optimal
    while the windows' worst case improves).
    """

    def __init__(self, wn: np.ndarray, p2l: np.ndarray, num_gpus: int, cvar: float = 0.0,
                 origin: np.ndarray | None = None, max_moves: int | None = None,
                 node_distinct: int | None = None, cap_rows: int = 0, cap: float = np.inf):
        self.wn = np.asarray(wn, dtype=np.float64)
        self.W, self.E = self.wn.shape
        self.G = num_gpus
        self.P = p2l.shape[0]
        self.S = self.P // num_gpus
        self.cvar = cvar
        self.cap_rows = cap_rows
        self.cap = cap
        self.slot_gpu = np.arange(self.P) // self.S
        self.max_moves = max_moves
        self.gpn = node_distinct
        self.num_nodes = num_gpus // node_distinct if node_distinct else 1
        self.had0 = None
        if origin is not None:
            self.had0 = np.zeros((self.G, self.E), dtype=bool)
            self.had0[self.slot_gpu, origin] = True
        self.set(p2l)

    def set(self, p2l: np.ndarray) -> None:
        self.p2l = np.array(p2l, dtype=np.int64)
        self.cnt = np.bincount(self.p2l, minlength=self.E).astype(np.int64)
        self.has = np.zeros((self.G, self.E), dtype=bool)
        self.has[self.slot_gpu, self.p2l] = True
        self._recompute()

    def _recompute(self) -> None:
        self.wr = self.wn[:, self.p2l] / self.cnt[self.p2l]
        self.load = np.zeros((self.W, self.G))
        np.add.at(self.load.T, self.slot_gpu, self.wr.T)

    # ------------------------------------------------------------------ objective
    def value(self) -> float:
        """Scenario-aggregated max/mean (1 = perfect balance in every scenario)."""
        return float(aggregate(self.load[self.cap_rows:].max(axis=1), self.cvar))

    def capped_value(self) -> float:
        """max/mean of the constraint scenarios (``-inf`` without any)."""
        return float(self.load[:self.cap_rows].max()) if self.cap_rows else -np.inf

    def sumsq(self) -> float:
        return float((self.load[self.cap_rows:] ** 2).sum())

    def node_has(self) -> np.ndarray:
        """bool ``[nodes, E]``: expert has a replica on the node."""
        return self.has.reshape(self.num_nodes, -1, self.E).any(axis=1)

    def limited(self, experts: np.ndarray) -> np.ndarray:
        """bool: experts whose replicas must stay on distinct nodes."""
        c = self.cnt[experts]
        return (c >= 2) & (c <= self.num_nodes) if self.gpn else np.zeros(np.shape(experts), dtype=bool)

    @property
    def moves(self) -> int:
        if self.had0 is None:
            return 0
        return int((self.has & ~self.had0).sum())

    # ------------------------------------------------------------------ moves
    def swap(self, i: int, j: int) -> None:
        a, b = self.p2l[i], self.p2l[j]
        ga, gb = self.slot_gpu[i], self.slot_gpu[j]
        self.p2l[i], self.p2l[j] = b, a
        self.has[ga, a] = False
        self.has[gb, b] = False
        self.has[ga, b] = True
        self.has[gb, a] = True
        d = self.wr[:, i] - self.wr[:, j]
        self.load[:, ga] -= d
        self.load[:, gb] += d
        self.wr[:, [i, j]] = self.wr[:, [j, i]]

    def recount(self, i: int, y: int) -> None:
        """Slot ``i`` (expert x with >= 2 replicas) now holds a new replica of expert ``y``."""
        x = self.p2l[i]
        g = self.slot_gpu[i]
        self.p2l[i] = y
        self.has[g, x] = False
        self.has[g, y] = True
        self.cnt[x] -= 1
        self.cnt[y] += 1
        self._recompute()


def _other_max(load: np.ndarray, g_fixed: int) -> np.ndarray:
    """``out[w, h]`` = max of ``load[w, g]`` over GPUs ``g`` other than ``g_fixed`` and ``h``; ``[W, G]``."""
    W, G = load.shape
    masked = load.copy()
    masked[:, g_fixed] = -np.inf
    if G <= 2:
        out = np.full((W, G), -np.inf)
        for h in range(G):
            rest = [g for g in range(G) if g not in (g_fixed, h)]
            if rest:
                out[:, h] = load[:, rest].max(axis=1)
        return out
    top2 = np.argsort(-masked, axis=1)[:, :2]
    first = np.take_along_axis(masked, top2[:, :1], axis=1)[:, 0]
    second = np.take_along_axis(masked, top2[:, 1:2], axis=1)[:, 0]
    out = np.repeat(first[:, None], G, axis=1)
    rows = np.arange(W)
    out[rows, top2[:, 0]] = second
    return out


PARTNERS = 8  # hedging: first try the GPUs lightest in the window where GPU g is heaviest


def best_swap(st: LayerState, g: int, allowed_gpus: np.ndarray | None = None):
    """Best swap of a replica on GPU ``g`` with one on another GPU by the potential (value, sumsq).
    ``allowed_gpus``: bool ``[G]`` partner GPUs allowed (``None``: all). Returns ``(i, j, value, dsq)`` or
    ``None`` when no swap strictly improves the potential.

    In the hedged default (constraint rows present) the ``[W, S, P]`` evaluation dominates the run
    time, so the partners are first the :data:`PARTNERS` GPUs lightest in the window where ``g`` is
    heaviest; only if none of them helps are all GPUs tried (several times faster; ``--robust`` keeps
    the full search)."""
    if st.cap_rows and st.W - st.cap_rows > 1 and st.G > 2 * PARTNERS:
        rows = st.load[st.cap_rows:]
        crit = rows[int(np.argmax(rows[:, g]))]
        ok = np.ones(st.G, dtype=bool) if allowed_gpus is None else allowed_gpus.copy()
        ok[g] = False
        light = [int(x) for x in np.argsort(crit, kind="stable") if ok[x]][:PARTNERS]
        sub = np.zeros(st.G, dtype=bool)
        sub[light] = True
        found = _best_swap(st, g, sub, np.flatnonzero(sub[st.slot_gpu]))
        if found is not None:
            return found
    return _best_swap(st, g, allowed_gpus, np.arange(st.P))


def _best_swap(st: LayerState, g: int, allowed_gpus, J: np.ndarray):
    S = st.S
    own = np.arange(g * S, (g + 1) * S)
    a = st.p2l[own]                                   # [S]
    b = st.p2l[J]                                     # [J]
    h = st.slot_gpu[J]                                # [J]
    la = st.load[:, g][:, None, None]                  # [W, 1, 1]
    lb = st.load[:, h][:, None, :]                     # [W, 1, P]
    d = st.wr[:, own][:, :, None] - st.wr[:, J][:, None, :]  # [W, S, J] load moving from g to h
    m = la - d                                         # new load of g ...
    np.maximum(m, lb + d, out=m)                       # ... and of h
    np.maximum(m, _other_max(st.load, g)[:, h][:, None, :], out=m)  # per-scenario max after the swap
    c = st.cap_rows
    val = aggregate(m[c:], st.cvar, axis=0)            # [S, P]
    # change of the sum of squared loads: (la - d)^2 + (lb + d)^2 - la^2 - lb^2 = 2 d (lb - la + d)
    d2 = lb[c:] - la[c:]
    d2 = d2 + d[c:]
    d2 *= d[c:]
    dsq = 2.0 * d2.sum(axis=0)
    bad = (h == g)[None, :] | st.has[:, a][h].T | st.has[g][b][None, :]
    if c:
        bad = bad | (m[:c] > st.cap + TOL).any(axis=0)
    if allowed_gpus is not None:
        bad = bad | ~allowed_gpus[h][None, :]
    if st.gpn:
        nh, ng = h // st.gpn, g // st.gpn
        nhas = st.node_has()
        cross = (nh != ng)[None, :]
        bad = bad | cross & ((st.limited(a)[:, None] & nhas[nh][:, a].T) | (st.limited(b) & nhas[ng][b])[None, :])
    if st.had0 is not None and st.max_moves is not None:
        hz0 = st.had0
        delta = ((~hz0[g, b])[None, :].astype(int) - (~hz0[g, a])[:, None]
                 + (~hz0[h][:, a].T).astype(int) - (~hz0[h, b])[None, :])
        bad = bad | (st.moves + delta > st.max_moves)
    cur = st.value()
    better = (val < cur - TOL) | ((val <= cur + TOL) & (dsq < -1e-9))
    better &= ~bad
    if not better.any():
        return None
    # lexicographic best: lowest value, then most negative dsq
    key = np.where(better, val, np.inf)
    vmin = key.min()
    cand = better & (key <= vmin + TOL)
    dsq_c = np.where(cand, dsq, np.inf)
    i, j = np.unravel_index(int(np.argmin(dsq_c)), dsq_c.shape)
    return int(own[i]), int(J[j]), float(val[i, j]), float(dsq[i, j])


def best_recount(st: LayerState, g: int):
    """Best change of a replica count on GPU ``g``: a slot holding expert ``x`` (>= 2 replicas) takes a
    new replica of expert ``y`` (not on ``g``, fewer than G replicas). Returns ``(i, y, value)`` or None."""
    S, G = st.S, st.G
    cur = st.value()
    best = None
    for i in range(g * S, (g + 1) * S):
        x = st.p2l[i]
        c = st.cnt[x]
        if c < 2:
            continue
        lx = st.load.copy()
        hosts = st.has[:, x]
        lx[:, hosts] += (st.wn[:, x] * (1.0 / (c - 1) - 1.0 / c))[:, None]
        lx[:, g] -= st.wn[:, x] / (c - 1)
        cy = st.cnt.astype(np.float64)
        dec = st.wn * (1.0 / cy - 1.0 / (cy + 1.0))          # [W, E]
        inc = st.wn / (cy + 1.0)                             # [W, E]
        ly = lx[None, :, :] - st.has.T[:, None, :] * dec.T[:, :, None]   # [E, W, G]
        ly[:, :, g] += inc.T
        lmax = ly.max(axis=2)                                # [E, W]
        val = aggregate(lmax[:, st.cap_rows:], st.cvar, axis=1)     # [E]
        ok = ~st.has[g] & (st.cnt < G)
        if st.cap_rows:
            ok &= (lmax[:, :st.cap_rows] <= st.cap + TOL).all(axis=1)
        ok[x] = False
        if st.gpn:
            ok &= ~(st.node_has()[g // st.gpn] & (st.cnt + 1 <= st.num_nodes))
        if st.had0 is not None and st.max_moves is not None:
            delta = (~st.had0[g]).astype(int) - int(~st.had0[g, x])
            ok &= st.moves + delta <= st.max_moves
        val = np.where(ok, val, np.inf)
        y = int(np.argmin(val))
        if val[y] < cur - 1e-9 and (best is None or val[y] < best[2] - TOL):
            best = (i, y, float(val[y]))
    return best


def local_search(st: LayerState, deadline: float, max_iters: int = 4000, top_gpus: int = 4,
                 allowed=None, on_swap=None) -> int:
    """Descend until no swap or recount on the ``top_gpus`` most loaded GPUs improves, ``max_iters``
    moves were made, or ``deadline`` (``time.monotonic()``) passes. ``allowed(g) -> bool [G] | None``
    restricts swap partners (and disables recounts); ``on_swap(i, j)`` is told of every swap (and also
    disables recounts: a re-count changes which expert a slot holds, which a swap observer cannot follow).
    Returns the number of moves made."""
    made = 0
    while made < max_iters and time.monotonic() < deadline:
        order = np.argsort(-st.load[st.cap_rows:].max(axis=0), kind="stable")[:top_gpus]
        moved = False
        for g in order:
            sw = best_swap(st, int(g), None if allowed is None else allowed(int(g)))
            if sw is not None:
                st.swap(sw[0], sw[1])
                if on_swap is not None:
                    on_swap(sw[0], sw[1])
                moved = True
                break
        if not moved and allowed is None and on_swap is None:
            rc = best_recount(st, int(order[0]))
            if rc is not None:
                st.recount(rc[0], rc[1])
                moved = True
        if not moved:
            break
        made += 1
    return made
