"""Optional compiled loops of the trace generator (numba: ``pip install 'moeplace[fast]'``): the sampler's
per-layer draws and duplicate re-draws (``traces.synth.sampler``).

Each loop computes exactly what the numpy code it stands in for computes — the same draws consumed from
the same random streams in the same order, the same experts — so a trace's bytes do not depend on whether
numba is installed (tests/test_synth.py compares both). Without numba, or with ``MOEPLACE_JIT=0``, the
numpy code runs. The loops are compiled on first use and kept in numba's on-disk cache (next to this file,
or numba's per-user cache directory when that is read-only): the first run on a machine pays the
compilation (~1 s), later processes load them (~0.5 s with numba's import), once per ``place trace synth``.
(Sorting each row for the writer's byte planes was tried as a loop too: numpy's vectorized sort is faster.)

The trace statistics' loops are C instead (:func:`native`: ``moeplace/traces/_loops.c``, built at install
where a C compiler is): they run in every ``place trace stats``, validation and optimizer read, where
numba's ~0.5 s start-up would cost more than the whole pass of a 100,000-token K3 trace.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

import numpy as np

_LOOPS: dict[str, Callable | None] = {}
_LOCK = threading.Lock()

LOW16 = np.uint64(0xFFFF)


def _dedup_rounds(e, key, table, shared_key, max_rounds, raws):  # pragma: no cover (compiled by numba)
    """:meth:`ExpertSampler._dedup` as one loop: ``e`` uint16 ``[n, k]`` (changed in place), ``key`` uint32
    ``[n]`` (each row's layout offset), ``raws`` uint64: the stream's next draws. Returns the draws used, or
    -1 when ``raws`` ran out (``e`` is then partly changed). A slot repeats when a later slot of its row
    holds the same expert; each round re-draws the repeated slots in row-major order, one draw each, from
    ``table[key + (draw & 0xFFFF)]`` (from round ``max_rounds`` on with ``shared_key``), and re-checks the
    rows it touched."""
    n, k = e.shape
    seen = np.zeros(65536, np.uint8)
    tmp = np.empty(k, np.int64)
    flagged = np.empty(n * k, np.int64)
    act = np.empty(n, np.int64)
    for i in range(n):
        act[i] = i
    na = n
    used = 0
    rnd = 0
    while True:
        nf = 0
        for a in range(na):
            r = act[a]
            cnt = 0
            for j in range(k - 1, -1, -1):
                x = e[r, j]
                if seen[x]:
                    tmp[cnt] = j
                    cnt += 1
                else:
                    seen[x] = 1
            for j in range(k):
                seen[e[r, j]] = 0
            for c in range(cnt - 1, -1, -1):
                flagged[nf] = r * k + tmp[c]
                nf += 1
        if nf == 0:
            return used
        if used + nf > len(raws):
            return -1
        shared = rnd >= max_rounds
        na = 0
        prev = -1
        for i in range(nf):
            f = flagged[i]
            r = f // k
            u = np.uint32(raws[used + i] & LOW16)
            kk = shared_key if shared else key[r]
            e[r, f - r * k] = table[kk + u]
            if r != prev:
                act[na] = r
                na += 1
                prev = r
        used += nf
        rnd += 1


M32 = np.uint64(0xFFFFFFFF)
LOW32 = np.uint64(0xFFFF)
SH16 = np.uint64(16)
SH32 = np.uint64(32)


def _layer_draws(raw, e, t_start, t_width, cuts, tok, theme_mode, theme, tb32, th_start, th_width,
                 prev_e, sw, dom_key, table, copy_src, big_flat, big_off, row_stride, r0):  # pragma: no cover
    """The middle of :meth:`ExpertSampler._block` for one layer, entry by entry (``raw``: the layer's draws
    as uint32 halves, as the numpy code views them): the source of each slot from the first half, the
    point ``u`` from the second, the expert ``table[u]`` into ``e``
    uint16 ``[n, k]``, then the copies (locality) settled in row order. The numpy code's uint32 arithmetic
    wraps modulo 2^32; here every such value is masked to 32 bits. ``cuts``: copy, affinity, token, theme
    cuts and the affinity / token / theme spans, shared key (uint64 ``[7]``); ``tok``: token experts, slot
    step, the layer's first slot offset; ``theme``: themes, theme bits, theme keep; ``theme_mode`` 0 no
    theme source, 1 T a power of two, 2 any T; ``prev_e`` ``[n, k]`` (``sw`` non-empty) the layer before;
    ``copy_src`` int64 ``[n]``: the row of ``big`` a copying slot of the row reads (-1: the row cannot
    copy)."""
    n, k = e.shape
    nk = n * k
    copy_cut, aff_cut, tok_cut, aff_span, tok_span, theme_span, shared_key = (
        cuts[0], cuts[1], cuts[2], cuts[3], cuts[4], cuts[5], cuts[6])
    te, slot_step, off0 = tok[0], tok[1], tok[2]
    themes, theme_bits, theme_keep = theme[0], theme[1], theme[2]
    has_prev = len(sw) > 0
    nkeep = M32 ^ theme_keep
    for r in range(n):
        ts = np.uint64(t_start[r])
        tw = np.uint64(t_width[r])
        th_s = np.uint64(th_start[r])
        th_w = np.uint64(th_width[r])
        dk = np.uint64(dom_key[r])
        src = copy_src[r]
        for c in range(k):
            # every source's point computed and one selected without a branch (the sources are random:
            # branches on them mispredict), as the numpy code does
            comp = np.uint64(raw[r * k + c])
            v = np.uint64(raw[nk + r * k + c])
            v16 = v & LOW32
            u = v >> SH16
            pick = (((comp & LOW32) * te) & M32) >> SH16
            offset = (pick * slot_step + off0) & M32
            if theme_mode == 0:
                tok_u = ((ts + offset + v16 * tw) & M32) >> SH16
            elif theme_mode == 1:
                point = (ts + v16 * tw) & M32
                tok_u = ((point & nkeep) | ((point + (offset >> theme_bits)) & theme_keep)) >> SH16
            else:
                point = (ts + v16 * tw) & M32
                th = (point * themes) >> SH32
                lo = tb32[th]
                arc = tb32[th + np.uint64(1)] - lo
                rel = point - lo + ((offset * arc) >> SH32)
                rel = rel - arc if rel >= arc else rel
                tok_u = ((lo + rel) >> SH16) & M32
            u = tok_u if ((comp - aff_cut) & M32) < tok_span else u
            theme_u = th_s + ((v16 * th_w) >> SH16)
            u = theme_u if (theme_mode != 0) & (((comp - tok_cut) & M32) < theme_span) else u
            key = dk
            if has_prev:
                s = np.uint64(sw[prev_e[r, c]])
                aff_u = ((s >> SH16) + (((s & LOW32) * v16) >> SH16)) & LOW32
                is_aff = ((comp - copy_cut) & M32) < aff_span
                u = aff_u if is_aff else u
                key = shared_key if is_aff else dk
            x = table[(u + key) & M32]
            if (src >= 0) & (comp < copy_cut):
                # a copy takes its source's value, settled: its sources are earlier rows
                x = big_flat[src * row_stride + big_off + c] if src < r0 else e[src - r0, c]
            e[r, c] = x


NATIVE_ABI = 1  # the ABI_VERSION of moeplace/traces/_loops.c this code calls
_NATIVE: list = []


def native():
    """The C loops of the trace statistics (module ``moeplace.traces._loops``: ``count_planes``,
    ``topk_hits``), or None: not built (no C compiler at install), built from older source (an editable
    checkout not rebuilt: ``pip install -e .`` again), or ``MOEPLACE_JIT=0`` (every compiled loop off). The
    numpy code they stand in for gives the same results (tests/test_stats.py compares them)."""
    if not _NATIVE:
        mod = None
        if os.environ.get("MOEPLACE_JIT", "1") != "0":
            try:
                from moeplace.traces import _loops as mod  # optional: a C extension (setup.py)
            except ImportError:
                mod = None
        _NATIVE.append(mod if getattr(mod, "ABI_VERSION", None) == NATIVE_ABI else None)
    return _NATIVE[0]


def loop(name: str) -> Callable | None:
    """The compiled loop ``name`` (``"dedup"``, ``"layer"``), or None (no numba, ``MOEPLACE_JIT=0``, or it failed to
    compile: the numpy code runs). Imports numba and compiles / loads the loop on first call per process:
    call it before forking workers, which then inherit it."""
    if name in _LOOPS:
        return _LOOPS[name]
    with _LOCK:
        if name not in _LOOPS:
            _LOOPS[name] = _load(name)
    return _LOOPS[name]


# numba's start-up (~0.5 s: import and loading the loops from its cache) pays for itself from ~25 M
# selections (the loops save ~20 ns of CPU per selection); smaller traces keep the numpy code
MIN_SELECTIONS = 32_000_000


def loaded(name: str) -> Callable | None:
    """The loop ``name`` if this process has loaded it (:func:`preload`, :func:`loop`), else None: never
    imports numba (the sampler uses the loops only where the caller decided they pay)."""
    return _LOOPS.get(name)


def preload() -> threading.Thread:
    """Load every loop on a background thread (numba's import and its cache's load run mostly in LLVM,
    outside the GIL: they overlap the planning that comes before the first sampler). Returns the thread."""
    t = threading.Thread(target=lambda: [loop(n) for n in ("dedup", "layer")], name="moeplace-jit", daemon=True)
    t.start()
    return t


def _load(name: str) -> Callable | None:
    fn = None
    if os.environ.get("MOEPLACE_JIT", "1") != "0":
        try:
            import numba  # optional (the [fast] extra): ~0.3 s to import, so only when a sampler is built
        except ImportError:
            numba = None
        if numba is not None:
            src = {"dedup": _dedup_rounds, "layer": _layer_draws}[name]
            try:
                fn = numba.njit(cache=True, nogil=True)(src)
                _warm(name, fn)
            except Exception as exc:  # noqa: BLE001 (any compiler failure: the numpy code is the reference)
                warnings.warn(f"moeplace: numba could not compile the sampler's {name} loop ({exc}); "
                              "using numpy", RuntimeWarning, stacklevel=2)
                fn = None
    return fn


def _warm(name: str, fn: Callable) -> None:
    """Compile (or load from the cache) the signature the sampler calls, now rather than mid-run."""
    if name == "layer":
        u32, u64 = np.zeros(2, np.uint32), np.zeros(2, np.uint64)
        e = np.zeros((2, 1), np.uint16)
        fn(np.zeros(4, np.uint32), e, u32, u32, np.zeros(7, np.uint64), np.zeros(3, np.uint64), 0,
           np.zeros(3, np.uint64), u64, u32, u32, e, np.zeros(0, np.uint32), u32, np.zeros(4, np.uint16),
           np.full(2, -1, np.int64), np.zeros(2, np.uint16), 0, 1, 0)
    if name == "dedup":
        e = np.zeros((2, 2), np.uint16)
        e[0, 1] = 1
        fn(e, np.zeros(2, np.uint32), np.arange(4, dtype=np.uint16), np.uint32(0), 64, np.zeros(4, np.uint64))
