"""The gate's checks that span row groups and files (``traces.validate``), fed every row group's order
facts in trace order: ``step`` never decreases; the rows of one token — a (``step``, ``request_id``,
``position``) — are consecutive with strictly ascending MoE layers; after the last row group, a
(``request_id``, ``position``) appears in one step only, every token has a row in every MoE layer the
trace holds, and the trace holds every MoE layer its model declares."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeplace.foundation.model import format_ranges
from moeplace.traces.gate.rows import MAX_DEFERRED, Edge, layer_order_message, resume_message


class RowOrder:
    """The checks that span row groups and files, fed every row group's :class:`RowGroup` ``edge`` in trace
    order (:meth:`feed`): ``step`` never decreases; a token's rows are consecutive with ascending layers.
    Problems go to ``sink`` in row order, step order first — as :func:`check_row_group` defers them.
    :meth:`finish` checks what needs the whole trace: one step per token, one row per held MoE layer, and
    rows in every MoE layer the model declares."""

    def __init__(self, sink, spill_bytes: int | None = None) -> None:
        self.sink = sink
        self.prev: Edge | None = None
        self.prev_where = ""
        self.open_step: int | None = None
        # tokens of the open step seen in earlier row groups: request ids, positions, first row, file
        self.open_tokens: list[tuple[np.ndarray, np.ndarray, np.ndarray, str]] = []
        # every token run so far (packed (request_id, position), step, trace row, file, rows), for
        # :meth:`finish`: in memory, past ``spill_bytes`` in sorted temporary files
        self.store = _RunStore(spill_bytes)
        # rows per MoE layer of the model so far: the layers the trace holds are those with rows
        self.layer_rows: np.ndarray | None = None
        self.moe_layers: tuple[int, ...] = ()
        self.partial = False  # the trace declares the layers it holds (then a missing one is missing still)

    def feed(self, edge: Edge, where_before: str) -> None:
        """Check ``edge`` against what came before. ``where_before`` words the row before its first row
        (``"the row before"`` or ``"the last row of part-00000.parquet"``) for the step message."""
        if edge.first is None:
            return
        self._steps(edge, where_before)
        probs = self._token_problems(edge)
        probs.sort(key=lambda t: t[0])
        for r, kind, fld, msg in probs:
            self.sink.add(kind, edge.path, edge.row0 + r, fld, msg)
        for kind, n in edge.token_total.items():
            self.sink.more(kind, n - min(n, MAX_DEFERRED))
        # the open step's tokens, for the groups after
        trid, tpos, tstart = edge.tail
        tail = (trid, tpos, tstart.astype(np.int64) + edge.row0, edge.path)
        if edge.last[0] == edge.first[0] and edge.first[0] == self.open_step:
            self.open_tokens.append(tail)
        else:
            self.open_step = edge.last[0]
            self.open_tokens = [tail]
        if edge.run_keys.size:
            self.store.add(edge.run_keys, edge.run_steps, edge.run_rows + edge.row0, edge.path, edge.run_lens)
        if edge.layer_rows is not None:
            self.layer_rows = edge.layer_rows.copy() if self.layer_rows is None else self.layer_rows + edge.layer_rows
            self.moe_layers = edge.moe_layers
            self.partial = edge.partial
        self.prev = edge

    def finish(self) -> None:
        """After the last row group: a token (request_id, position) is processed in one step only, so it
        names one token wherever it appears (the replay in ``place evaluate`` and the simulator rely on it),
        reported at the later step's first row; then every token has a row in each MoE layer the trace
        holds (those rows are consecutive and ascending, so counting them suffices), reported at the
        token's first row in trace order. Token runs spilled to disk (:class:`_RunStore`) are merged by
        ranges of tokens: the same problems, in the same order, in bounded memory."""
        try:
            if self.store.num_runs:
                held = int((self.layer_rows > 0).sum()) if self.layer_rows is not None else 0
                incomplete: list[tuple] = []
                total_short = 0
                for arrays in self.store.ranges():
                    self._twice(arrays)
                    found, n = self._incomplete(arrays, held)
                    incomplete = sorted(incomplete + found)[:MAX_DEFERRED]
                    total_short += n
                if self.layer_rows is not None:
                    self._report_incomplete(incomplete, total_short, held)
                first_file = self.store.paths[0]
            else:
                first_file = None
        finally:
            self.store.close()
        if first_file is not None:
            self._missing_layers(first_file)

    def _missing_layers(self, path: str) -> None:
        """Every MoE layer the model declares has rows: a trace missing one would be read as a model without
        it (no skew, no load, no traffic for that layer) by every reader alike. A trace of some layers only
        declares them (its model spec's ``declared_moe_layers``); then ``moe_layers`` are the held ones."""
        if self.layer_rows is None:
            return
        missing = [self.moe_layers[i] for i in np.flatnonzero(self.layer_rows == 0)]
        if missing:
            m = len(self.moe_layers)
            self.sink.add("missing_layer", path, None, "layer",
                          f"no rows for MoE layer{'s' if len(missing) > 1 else ''} {format_ranges(missing)} "
                          f"({len(missing)} of the {m} the {'trace declares it holds' if self.partial else 'model declares'}: "
                          f"{format_ranges(list(self.moe_layers))}); a trace holds every MoE layer of its model or "
                          "declares the ones it holds (a capture that missed a layer is incomplete)")

    def _twice(self, a: dict[str, np.ndarray]) -> None:
        """One problem per (token, later step) of a token seen in two steps (``a``: runs sorted by token,
        step and trace order), in token order."""
        k, st = a["keys"], a["steps"]
        if len(k) < 2:
            return
        new = np.ones(len(k), bool)
        new[1:] = (k[1:] != k[:-1]) | (st[1:] != st[:-1])
        run_start = np.maximum.accumulate(np.where(new, np.arange(len(k)), 0))
        hits = np.flatnonzero((k[1:] == k[:-1]) & (st[1:] != st[:-1]))
        paths = self.store.paths
        seen: set[tuple[int, int]] = set()
        for h in hits.tolist():
            i, j = int(run_start[h]), h + 1  # the earlier step's first run, the later step's
            key, step = int(k[j]), int(st[j])
            if (key, step) in seen:
                continue
            seen.add((key, step))
            rid, pos = key >> 24, key & ((1 << 24) - 1)
            pa_, pb = paths[int(a["src"][i])], paths[int(a["src"][j])]
            first = f"row {int(a['rows'][i])}" + ("" if pa_ == pb else f" of {Path(pa_).name}")
            self.sink.add("token_twice", pb, int(a["rows"][j]), "position",
                          f"token (request {rid}, position {pos}) in step {step} was already in step "
                          f"{int(st[i])} ({first}): a (request_id, position) is one token, processed in "
                          "one step")

    def _incomplete(self, a: dict[str, np.ndarray], held: int) -> tuple[list[tuple], int]:
        """Tokens of ``a`` (runs sorted by token, step, trace order) with fewer rows than the ``held`` MoE
        layers (runs of one (token, step) summed: a token cut by a row-group boundary is whole again); a
        token also seen in another step is reported as that, not again as this. Returns the first
        ``MAX_DEFERRED`` in trace order as ``(run index, key, step, row, src, rows)`` and how many there are."""
        k, st = a["keys"], a["steps"]
        if not len(k) or self.layer_rows is None:
            return [], 0
        new = np.ones(len(k), bool)
        new[1:] = (k[1:] != k[:-1]) | (st[1:] != st[:-1])
        first = np.flatnonzero(new)
        total = np.add.reduceat(a["lens"].astype(np.int64), first)
        short = total < held
        if not short.any():
            return [], 0
        key_new = np.ones(len(k), bool)
        key_new[1:] = k[1:] != k[:-1]
        key_of = (np.cumsum(key_new) - 1)[first]
        short &= np.bincount(key_of)[key_of] == 1
        at = first[short]
        at = at[np.argsort(a["idx"][at], kind="stable")][:MAX_DEFERRED]
        tot = total[short][np.argsort(a["idx"][first[short]], kind="stable")][:MAX_DEFERRED]
        found = [(int(a["idx"][i]), int(k[i]), int(st[i]), int(a["rows"][i]), int(a["src"][i]), int(t))
                 for i, t in zip(at.tolist(), tot.tolist())]
        return found, int(short.sum())

    def _report_incomplete(self, found: list[tuple], total: int, held: int) -> None:
        if not total:
            return
        held_layers = np.flatnonzero(self.layer_rows > 0)
        layers = format_ranges([self.moe_layers[i] for i in held_layers])
        for _idx, key, step, row, src, n in found:
            rid, pos = key >> 24, key & ((1 << 24) - 1)
            self.sink.add("incomplete_token", self.store.paths[src], row, "layer",
                          f"token (request {rid}, position {pos}, step {step}) has rows in {n} "
                          f"of the {held} MoE layers the trace holds ({layers}); a token needs one row in each")
        self.sink.more("incomplete_token", total - len(found))

    def _steps(self, edge: Edge, where_before: str) -> None:
        """Step order: the boundary row, then the group's own decreases, in row order."""
        prev = self.prev
        rows = [(int(r), int(v), int(p), "the row before") for r, v, p in
                zip(edge.step_rows, edge.step_vals, edge.step_prev)]
        if prev is not None and prev.last is not None and edge.first[0] < prev.last[0]:
            rows.insert(0, (0, edge.first[0], prev.last[0], where_before))
        for r, v, p, wb in rows:
            if r == 0:
                msg = f"step {v} decreases from step {p} ({wb}); steps must be non-decreasing"
            else:
                msg = f"step {v} decreases from step {p} in the row before; steps must be non-decreasing"
            self.sink.add("step_order", edge.path, edge.row0 + r, "step", msg)
        self.sink.more("step_order", edge.step_total - len(edge.step_rows))

    def _token_problems(self, edge: Edge) -> list[tuple[int, str, str, str]]:
        """The group's own token-row problems, plus: its first row continuing the previous group's last
        token with a layer not above it; a token of the open step (seen in earlier groups) starting again."""
        prev = self.prev
        probs = list(edge.token_problems)
        rid, pos, start = edge.head
        skip = 0
        if prev is not None and prev.last is not None and edge.first[:3] == prev.last[:3]:
            skip = 1  # the first run continues the previous group's last token
            if edge.first[3] <= prev.last[3]:
                step, rid0, pos0, layer0 = edge.first
                kind = "duplicate_row" if layer0 == prev.last[3] else "row_order"
                probs.append((0, kind, "layer", layer_order_message(layer0, prev.last[3], rid0, pos0, step)))
        if self.open_step is None or edge.first[0] != self.open_step or not self.open_tokens or len(rid) <= skip:
            return probs
        orid, opos, orow = (np.concatenate(x) for x in zip(*(t[:3] for t in self.open_tokens)))
        opath = [t[3] for t in self.open_tokens]
        src_of = np.concatenate([np.full(len(t[0]), j) for j, t in enumerate(self.open_tokens)])
        hr, hp, hs = rid[skip:], pos[skip:], start[skip:]
        allr, allp = np.concatenate([orid, hr]), np.concatenate([opos, hp])
        src = np.concatenate([np.full(len(orid), -1, np.int64), np.arange(len(hr))])
        order = np.lexsort((src, allp, allr))  # per token: the open step's entries first
        same = (allr[order][1:] == allr[order][:-1]) & (allp[order][1:] == allp[order][:-1])
        hit = same & (src[order][1:] >= 0) & (src[order][:-1] < 0)
        for a, b in zip(order[:-1][hit], order[1:][hit]):
            i, j = int(src[b]), int(src_of[a])
            first = f"row {int(orow[a])}" + ("" if opath[j] == edge.path else f" of {Path(opath[j]).name}")
            probs.append((int(hs[i]), "row_order", "position",
                          resume_message(int(hr[i]), int(hp[i]), edge.first[0], first)))
        return probs


SPILL_BYTES = 64 << 20  # token runs held in memory (40 B each) before they go to a sorted temporary file
RANGE_RUNS = 1 << 21  # runs per merged range of tokens at finish (their arrays: ~80 MB)


class _RunStore:
    """Every token run of a trace (packed (request_id, position), step, trace row, rows, file, run index)
    for :meth:`RowOrder.finish`: in memory while they take less than ``spill_bytes``, then sorted by
    (token, step, run index) into temporary ``.npy`` files (a trace larger than memory is checked in
    bounded memory: 40 bytes a token on disk instead). :meth:`ranges` gives them back sorted, one range of
    tokens at a time, each token whole in one range."""

    FIELDS = ("keys", "steps", "rows", "lens", "src", "idx")

    def __init__(self, spill_bytes: int | None = None) -> None:
        self.spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        self.paths: list[str] = []
        self._path_index: dict[str, int] = {}
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.held = 0
        self.num_runs = 0
        self.chunks: list[dict[str, np.ndarray]] = []
        self.dir: str | None = None
        self._cleanup = None

    def add(self, keys, steps, rows, path: str, lens) -> None:
        src = self._path_index.setdefault(path, len(self.paths))
        if src == len(self.paths):
            self.paths.append(path)
        n = len(keys)
        self.parts.append((keys.astype(np.int64, copy=False), steps.astype(np.int64, copy=False),
                           rows.astype(np.int64, copy=False), lens.astype(np.uint32), np.full(n, src, np.uint32),
                           np.arange(self.num_runs, self.num_runs + n, dtype=np.int64)))
        self.num_runs += n
        self.held += n
        if self.held * 40 > self.spill_bytes:
            self._spill()

    def _sorted_parts(self) -> dict[str, np.ndarray]:
        cols = {f: np.concatenate([p[i] for p in self.parts]) for i, f in enumerate(self.FIELDS)}
        order = np.lexsort((cols["idx"], cols["steps"], cols["keys"]))
        return {f: c[order] for f, c in cols.items()}

    def _spill(self) -> None:
        import shutil  # function-local: only a trace past spill_bytes writes temporary files
        import tempfile  # function-local: as above
        import weakref  # function-local: as above

        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="moeplace-gate-runs-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        arrays = self._sorted_parts()
        i = len(self.chunks)
        chunk = {}
        for f, a in arrays.items():
            path = f"{self.dir}/{i}-{f}.npy"
            np.save(path, a)
            chunk[f] = np.load(path, mmap_mode="r")
        self.chunks.append(chunk)
        self.parts, self.held = [], 0

    def ranges(self):
        """The runs sorted by (token, step, run index), in ranges of tokens (dicts of arrays)."""
        if not self.chunks:
            if self.parts:
                yield self._sorted_parts()
            return
        if self.parts:
            self._spill()
        # range boundaries from every chunk's keys at regular steps: ~RANGE_RUNS runs per range
        step = max(1, RANGE_RUNS // (2 * len(self.chunks)))
        marks = np.unique(np.concatenate([np.asarray(c["keys"][::step]) for c in self.chunks]))
        bounds = [*marks[len(self.chunks)::len(self.chunks)].tolist(), None]
        lo = None
        for hi in bounds:
            parts = []
            for c in self.chunks:
                k = c["keys"]
                a = 0 if lo is None else int(np.searchsorted(k, lo))
                b = len(k) if hi is None else int(np.searchsorted(k, hi))
                if b > a:
                    parts.append({f: np.asarray(c[f][a:b]) for f in self.FIELDS})
            lo = hi
            if not parts:
                continue
            cols = {f: np.concatenate([p[f] for p in parts]) for f in self.FIELDS}
            order = np.lexsort((cols["idx"], cols["steps"], cols["keys"]))
            yield {f: c[order] for f, c in cols.items()}

    def close(self) -> None:
        self.parts, self.chunks = [], []
        if self._cleanup is not None:
            self._cleanup()
