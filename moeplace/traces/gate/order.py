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

    def __init__(self, sink) -> None:
        self.sink = sink
        self.prev: Edge | None = None
        self.prev_where = ""
        self.open_step: int | None = None
        # tokens of the open step seen in earlier row groups: request ids, positions, first row, file
        self.open_tokens: list[tuple[np.ndarray, np.ndarray, np.ndarray, str]] = []
        # every token run so far: packed (request_id, position), step, trace row, file, rows; for :meth:`finish`
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray]] = []
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
            self.runs.append((edge.run_keys, edge.run_steps, edge.run_rows + edge.row0, edge.path, edge.run_lens))
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
        token's first row in trace order."""
        if not self.runs:
            return
        keys = np.concatenate([r[0] for r in self.runs])
        steps = np.concatenate([r[1] for r in self.runs])
        rows = np.concatenate([r[2] for r in self.runs])
        lens = np.concatenate([r[4] for r in self.runs])
        src = np.concatenate([np.full(len(r[0]), j) for j, r in enumerate(self.runs)])
        order = np.lexsort((np.arange(len(keys)), steps, keys))
        k, st = keys[order], steps[order]
        twice = (k[1:] == k[:-1]) & (st[1:] != st[:-1])
        hits = np.flatnonzero(twice)
        # the first run of each (token, step): a token cut by a row-group boundary is two runs
        new = np.ones(len(k), bool)
        new[1:] = (k[1:] != k[:-1]) | (st[1:] != st[:-1])
        run_start = np.maximum.accumulate(np.where(new, np.arange(len(k)), 0))
        self._twice(hits, order, run_start, keys, steps, rows, src)
        self._incomplete(order, new, k, lens, keys, steps, rows, src)
        first_file = self.runs[0][3]
        self.runs = []
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

    def _twice(self, hits, order, run_start, keys, steps, rows, src) -> None:
        """One problem per (token, later step) of a token seen in two steps."""
        seen: set[tuple[int, int]] = set()
        for h in hits.tolist():
            a, b = int(order[run_start[h]]), int(order[h + 1])
            if (int(keys[b]), int(steps[b])) in seen:
                continue
            seen.add((int(keys[b]), int(steps[b])))
            rid, pos = int(keys[b]) >> 24, int(keys[b]) & ((1 << 24) - 1)
            first = f"row {int(rows[a])}" + ("" if self.runs[src[a]][3] == self.runs[src[b]][3] else f" of {Path(self.runs[src[a]][3]).name}")
            self.sink.add("token_twice", self.runs[src[b]][3], int(rows[b]), "position",
                          f"token (request {rid}, position {pos}) in step {int(steps[b])} was already in step "
                          f"{int(steps[a])} ({first}): a (request_id, position) is one token, processed in "
                          "one step")

    def _incomplete(self, order, new, k, lens, keys, steps, rows, src) -> None:
        """Tokens with fewer rows than the MoE layers the trace holds (runs of one (token, step) summed:
        a token cut by a row-group boundary is whole again). A token also seen in another step is reported
        as that, not again as this."""
        if self.layer_rows is None:
            return
        held = np.flatnonzero(self.layer_rows > 0)
        m = int(held.size)
        first = np.flatnonzero(new)
        total = np.add.reduceat(lens[order], first) if first.size else first
        short = total < m
        if not short.any():
            return
        key_new = np.ones(len(k), bool)
        key_new[1:] = k[1:] != k[:-1]
        key_of = (np.cumsum(key_new) - 1)[first]
        short &= np.bincount(key_of)[key_of] == 1
        at = np.sort(order[first[short]])  # trace order: the runs are numbered in it
        n_at = np.zeros(len(keys), np.int64)
        n_at[order[first]] = total
        layers = format_ranges([self.moe_layers[i] for i in held])
        for i in at[:MAX_DEFERRED].tolist():
            rid, pos = int(keys[i]) >> 24, int(keys[i]) & ((1 << 24) - 1)
            self.sink.add("incomplete_token", self.runs[src[i]][3], int(rows[i]), "layer",
                          f"token (request {rid}, position {pos}, step {int(steps[i])}) has rows in {int(n_at[i])} "
                          f"of the {m} MoE layers the trace holds ({layers}); a token needs one row in each")
        self.sink.more("incomplete_token", at.size - min(at.size, MAX_DEFERRED))

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
