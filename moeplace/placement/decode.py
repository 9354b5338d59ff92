"""Per-phase traffic for ``place optimize --phase``: the prompt (prefill) or generated (decode) tokens of a
trace as Loads windows, and the decode figure every policy is scored on.

**Phase tokens** (:func:`read_phase_tokens`): the rows of one phase, in file order, with each token's
request, position and index among *all* tokens of the file (so the first held-out token can be named in
the trace's own order, which ``place simulate`` routes from). An input whose provenance says it cannot tell
prompt from generated tokens (:func:`traces.phases.phase_knowledge`) is refused, as is a Loads file.

**Decode steps** (:func:`decode_steps`): held-out decode tokens formed into engine steps the way continuous
batching forms them: ``dp x batch`` sequence slots (``batch`` running sequences on each of ``dp``
attention-DP ranks); requests in order of first appearance each take the slot that frees first, and emit one
generated token per step, in position order, until their tokens run out; slot ``s`` is on DP rank ``s % dp``
and a rank's tokens are numbered in slot order (the index the replica rule sees). Steps count from the first
one and stop at the first step that is not full (the queue ran dry), so every scored step holds
``dp x batch`` tokens; when the input holds fewer requests than slots, every step is short and the figures
say the batch they were measured at.

**Decode figure** (:func:`score_decode`): per step and MoE layer, the slots (expert weight copies) on each GPU
that at least one token of the step is sent to under the engine's replica rule (``batch_slots``): a GPU reads
the weights of every such slot once per step, so the busiest GPU's count sets the MoE weight-read time of a
memory-bound decode step. Reported: the mean over steps and layers of the maximum over GPUs (``act max``),
of max / mean over GPUs (``act max/mean``), and the tokens-per-GPU max / mean of the same steps.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule
from moeplace.traces.format import PHASE_DECODE, PHASE_PREFILL
from moeplace.traces.loads import Loads, is_loads_file
from moeplace.traces.phases import phase_knowledge
from moeplace.traces.validate import check_trace, read_expert_ids, read_trace_meta

PHASE_CODES = {"prefill": PHASE_PREFILL, "decode": PHASE_DECODE}
SAMPLE_TOKENS = 8192  # tokens of the phase kept as the Loads' token sample (traffic objective, scoring)
MAX_STEP_TOKENS = 1 << 19  # decode tokens scored per policy at most (steps x tokens per step)


@dataclass(frozen=True, eq=False)
class PhaseTokens:
    """The tokens of one phase of one trace, in file order.

    ``expert_ids`` uint16 ``[T, L, k]``; ``request_ids`` int64 ``[T]``; ``positions`` int64 ``[T]``;
    ``file_tokens`` int64 ``[T]``: each token's index among all tokens of the file (every phase), in file
    order; ``source_tokens``: tokens of the file (every phase)."""

    expert_ids: np.ndarray
    request_ids: np.ndarray
    positions: np.ndarray
    file_tokens: np.ndarray
    model: ModelSpec
    path: str
    phase: str
    source_tokens: int
    truncated: bool = False
    trace_provenance: dict[str, Any] = field(default_factory=dict)  # the trace's own metadata (its tags, ...)

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    def take(self, idx: np.ndarray) -> PhaseTokens:
        return replace(self, expert_ids=self.expert_ids[idx], request_ids=self.request_ids[idx],
                       positions=self.positions[idx], file_tokens=self.file_tokens[idx])


def read_phase_tokens(path: str | Path, phase: str, max_tokens: int | None = None) -> PhaseTokens:
    """The ``phase`` tokens of the trace at ``path`` (at most ``max_tokens``, the first in file order).
    Memory: ``T x L x k x 2`` bytes plus the columns polars reads."""
    if phase not in PHASE_CODES:
        raise InputError(f"--phase '{phase}' unknown (expected prefill or decode)")
    p = Path(path)
    if is_loads_file(p):
        raise InputError(f"{p}: a Loads file holds expert counts of every phase together; --phase {phase} needs a "
                         "trace, whose rows say which tokens were prompt and which generated")
    _model, prov = read_trace_meta(p)
    known, why = phase_knowledge(prov)
    if not known:
        raise InputError(f"{p}: the trace cannot tell prompt tokens from generated ones (provenance: {why}); "
                         f"--phase {phase} needs a source that records them (a capture, a synthetic trace, vLLM's "
                         "routed experts, SGLang's per-token recorder)")
    trace = check_trace(p)  # the gate: every row checked before any is used
    L = trace.model.num_moe_layers
    lf = pl.scan_parquet([str(f) for f in trace.file_paths]).with_row_index("row")
    total_rows = trace.num_rows  # the footers say it; no scan
    sel = lf.filter(pl.col("phase") == PHASE_CODES[phase]).select("row", "request_id", "position")
    if max_tokens is not None:
        sel = sel.head(max_tokens * L)
    df = sel.collect()
    n = df.height - df.height % L
    if n == 0:
        raise InputError(f"{p}: no {phase} tokens (the phase column marks none of its {total_rows // L:,} tokens "
                         f"{phase}; provenance: {why})")
    rows = df["row"].to_numpy()[:n:L].astype(np.int64)
    # the id columns of these rows only (either format version: sorted ids, trace.read_expert_ids)
    all_rows = df["row"].to_numpy()[:n].astype(np.int64)
    ids = read_expert_ids(trace, all_rows).reshape(n // L, L, trace.model.top_k)
    return PhaseTokens(ids, df["request_id"].to_numpy()[:n:L].astype(np.int64),
                       df["position"].to_numpy()[:n:L].astype(np.int64), rows // L, trace.model, str(p), phase,
                       total_rows // L, truncated=max_tokens is not None and n // L >= max_tokens,
                       trace_provenance=dict(prov))


def phase_loads(pt: PhaseTokens, window_tokens: int) -> Loads:
    """The phase's tokens as Loads windows of ``window_tokens`` tokens (file order) with a token sample
    of at most :data:`SAMPLE_TOKENS`, evenly spaced, each with its window."""
    T, L, _k = pt.expert_ids.shape
    E = pt.model.num_experts
    W = max(1, -(-T // window_tokens))
    win = np.arange(T) // window_tokens
    counts = np.zeros((W, L, E), dtype=np.int64)
    base = (win[:, None] * L + np.arange(L)[None, :]) * E  # [T, L]
    flat = (base[:, :, None] + pt.expert_ids.astype(np.int64)).ravel()
    counts.ravel()[:] = np.bincount(flat, minlength=W * L * E)
    step = max(1, -(-T // SAMPLE_TOKENS))
    pick = np.arange(0, T, step)
    labels = tuple(f"{pt.phase} tokens {w * window_tokens}-{min((w + 1) * window_tokens, T)}" for w in range(W))
    prov: dict[str, Any] = {"inputs": [pt.path], "phase": pt.phase, "phase_tokens": T,
                            "source_tokens": pt.source_tokens, "trace": pt.trace_provenance}
    return Loads(counts, pt.model, window_tokens, labels, prov, pt.expert_ids[pick].astype(np.int32), win[pick])


# ---------------------------------------------------------------------------- decode steps
@dataclass(frozen=True, eq=False)
class DecodeSteps:
    """Decode tokens formed into engine steps: token ``i`` (row ``rows[i]`` of the tokens) runs at step
    ``step[i]`` on DP rank ``rank[i]`` at index ``pos[i]`` of that rank's batch. ``num_steps`` steps of
    ``tokens_per_step`` tokens (``dp x batch`` when the input held enough requests)."""

    rows: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    pos: np.ndarray
    num_steps: int
    tokens_per_step: float
    dp: int
    batch: int
    requests: int

    def describe(self) -> str:
        full = self.dp * self.batch
        short = (f" (the held-out part has {self.requests} decode requests for {full} slots: steps of "
                 f"{self.tokens_per_step:.0f} tokens)" if self.tokens_per_step < full else "")
        return (f"{self.num_steps} held-out decode steps of {self.dp} DP ranks x {self.batch} sequences"
                f"{short}")


def decode_steps(pt: PhaseTokens, dp: int, batch: int, max_tokens: int = MAX_STEP_TOKENS) -> DecodeSteps:
    """Continuous batching of the decode tokens ``pt`` into steps (see the module docstring)."""
    if pt.num_tokens == 0:
        raise InputError("no decode tokens to form steps from")
    slots = dp * batch
    # requests in order of first appearance, each one's tokens in position order
    order = np.lexsort((pt.positions, pt.request_ids))
    rid = pt.request_ids[order]
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    lengths = np.diff(np.r_[starts, rid.size])
    first = np.array([pt.file_tokens[order[s:s + n]].min() for s, n in zip(starts, lengths)])
    req_order = np.argsort(first, kind="stable")
    n_req = len(req_order)
    # each request takes the slot that frees first (ties: the lowest slot)
    heap = [(0, s) for s in range(min(slots, n_req))]
    heapq.heapify(heap)
    start_step = np.empty(n_req, dtype=np.int64)
    slot_of = np.empty(n_req, dtype=np.int64)
    for j, r in enumerate(req_order):
        t, s = heapq.heappop(heap)
        start_step[j], slot_of[j] = t, s
        heapq.heappush(heap, (t + int(lengths[r]), s))
    lens = lengths[req_order]
    tok_rows = np.concatenate([order[starts[r]:starts[r] + lengths[r]] for r in req_order])
    tok_step = np.repeat(start_step, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
    tok_slot = np.repeat(slot_of, lens)
    per_step = np.bincount(tok_step)
    width = min(slots, n_req)
    full = np.flatnonzero(per_step < width)
    num_steps = int(full[0]) if full.size else per_step.size  # up to the first step that is not full
    num_steps = max(1, min(num_steps, max_tokens // max(width, 1)))
    keep = tok_step < num_steps
    rows, step, slot = tok_rows[keep], tok_step[keep], tok_slot[keep]
    o = np.lexsort((slot, step))
    rows, step, slot = rows[o], step[o], slot[o]
    rank = slot % dp
    # index within each (step, rank) batch, in slot order
    o2 = np.lexsort((slot, rank, step))
    key = step[o2] * dp + rank[o2]
    grp_start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    idx_sorted = np.arange(key.size) - np.repeat(grp_start, np.diff(np.r_[grp_start, key.size]))
    pos = np.empty_like(idx_sorted)
    pos[o2] = idx_sorted
    return DecodeSteps(rows, step, rank, pos, num_steps, rows.size / num_steps, dp, batch, n_req)


# ---------------------------------------------------------------------------- the decode figure
@dataclass(frozen=True)
class DecodeFigures:
    """What :func:`score_decode` measures (means over steps and scored MoE layers): ``active_max``: slots
    a step reads on its busiest GPU; ``active_mean``: on the average GPU; ``active_ratio``: the mean of max /
    mean; ``token_ratio``: tokens per GPU, max / mean; ``experts_per_step``: distinct slots a step reads
    over all GPUs."""

    active_max: float
    active_mean: float
    active_ratio: float
    token_ratio: float
    experts_per_step: float
    steps: int
    tokens_per_step: float

    def to_dict(self) -> dict[str, Any]:
        return {"active_max": self.active_max, "active_mean": self.active_mean, "active_max_over_mean":
                self.active_ratio, "token_max_over_mean": self.token_ratio,
                "active_slots_per_step": self.experts_per_step, "steps": self.steps,
                "tokens_per_step": self.tokens_per_step}


def score_decode(placement: Placement, pt: PhaseTokens, steps: DecodeSteps, rule: str, attention_tp: int = 1,
                 seed: int = 0) -> DecodeFigures:
    """The decode figure of ``placement`` on ``steps`` of the tokens ``pt`` under replica rule ``rule``
    (tokens of DP rank r leave from GPU ``r x attention_tp``, which the SGLang rule's local preference reads)."""
    r = get_rule(rule, seed=seed)
    state = r.dispatch_state(placement)
    G, P, S = placement.num_gpus, placement.num_slots, steps.num_steps
    per_gpu = P // G
    src = steps.rank * attention_tp
    act_max = act_mean = act_ratio = tok_ratio = act_all = 0.0
    scored = 0
    for li in range(placement.num_layers):
        ids = pt.expert_ids[steps.rows, li].astype(np.int64)
        if ids.size == 0:
            continue
        slots = r.batch_slots(placement, li, ids, src_gpu=src, pos_in_batch=steps.pos, batch_id=steps.step,
                              state=state)
        hits = np.bincount((steps.step[:, None] * P + slots).ravel(), minlength=S * P).reshape(S, G, per_gpu)
        active = (hits > 0).sum(axis=2).astype(np.float64)  # [S, G]
        tokens = hits.sum(axis=2).astype(np.float64)
        m = active.mean(axis=1)
        act_max += float(active.max(axis=1).mean())
        act_mean += float(m.mean())
        act_ratio += float((active.max(axis=1) / np.where(m > 0, m, 1)).mean())
        tm = tokens.mean(axis=1)
        tok_ratio += float((tokens.max(axis=1) / np.where(tm > 0, tm, 1)).mean())
        act_all += float(active.sum(axis=1).mean())
        scored += 1
    n = max(scored, 1)
    return DecodeFigures(act_max / n, act_mean / n, act_ratio / n, tok_ratio / n, act_all / n, S,
                         steps.tokens_per_step)
