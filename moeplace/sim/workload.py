"""Workload: the routing of trace tokens, and the requests that arrive at the simulated cluster.

Requests come from the trace (its request ids in order of first appearance, their prompt and output
lengths, and the expert routing of every one of their tokens) or from a length mixture (routing still
read from the trace, token by token, so the load statistics stay the trace's). Arrival times come from
an open process (Poisson, gamma-bursty, a linear rate ramp) or a closed loop that keeps a fixed number
of requests in the system.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.sim.config import LengthMix, WorkloadConfig
from moeplace.traces.format import PHASE_PREFILL
from moeplace.traces.validate import check_trace, read_expert_ids


@dataclass(frozen=True, eq=False)
class TraceTokens:
    """Every token of a trace with its routing at all MoE layers.

    ``expert_ids``: uint16 ``[T, L, k]`` (``L`` MoE layers in ``model.moe_layers`` order); tokens are
    grouped by request (requests in order of first ``step``), positions ascending. ``req_offset``: int64
    ``[R + 1]`` first token row of each request; ``prompt_len`` / ``output_len``: int64 ``[R]`` true lengths
    from the token positions (a synthetic trace may *represent* a long prompt by evenly spaced positions
    and a long output by its first tokens); ``prefill_rows``: int64 ``[R]`` rows of the prompt held
    (the rest of a request's rows are its decode tokens); ``request_ids``: int64 ``[R]``.
    """

    expert_ids: np.ndarray
    req_offset: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    prefill_rows: np.ndarray
    request_ids: np.ndarray
    model: ModelSpec
    path: str
    # expert distributions over simulated time (sim.timeline.Timeline) the statistical router draws from
    # instead of walking the tokens: Loads input, --phases, a comparison's long horizon; None: the tokens
    timeline: Any = None
    # a trace of some MoE layers only: how the other layers were routed (see :func:`stand_in_layers`)
    layers_note: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.request_ids.shape[0])

    def expert_counts(self) -> np.ndarray:
        """Selections per (MoE layer, expert) over the whole trace: int64 ``[L, E]``."""
        L = self.expert_ids.shape[1]
        E = self.model.num_experts
        key = (np.arange(L, dtype=np.int64)[None, :, None] * E + self.expert_ids).ravel()
        return np.bincount(key, minlength=L * E).reshape(L, E)


def load_trace_tokens(path: str | Path, max_tokens: int | None = None, from_token: int = 0) -> TraceTokens:
    """Read a trace (file or directory) into :class:`TraceTokens`. Whole requests are taken in order of
    first appearance until ``max_tokens`` tokens (memory: ``T x L x k x 2`` bytes). Every token must
    carry exactly one row per MoE layer. ``from_token``: only requests whose first row lies at or after
    token ``from_token`` of the file order (row ``from_token x L``) — the held-out part of a trace whose
    first tokens a placement was planned on (a request that started before it is left out whole)."""
    trace = check_trace(path)  # the gate: every row checked before any is used
    model, files = trace.model, trace.file_paths
    L = model.num_moe_layers
    lf = pl.scan_parquet([str(f) for f in files]).with_row_index("trace_row")  # expert ids come by row
    if from_token > 0:
        first_row = (lf.select("request_id").with_row_index("row").group_by("request_id")
                     .agg(pl.col("row").min().alias("first_row")))
        late = first_row.filter(pl.col("first_row") >= from_token * L).select("request_id")
        lf = lf.join(late, on="request_id", how="semi")
    per_req = (lf.group_by("request_id")
               .agg(pl.col("step").min().alias("first"), pl.len().alias("rows"),
                    (pl.col("phase") == PHASE_PREFILL).sum().alias("prefill_rows"),
                    pl.col("position").filter(pl.col("phase") == PHASE_PREFILL).max().alias("last_prefill"),
                    pl.col("position").filter(pl.col("phase") != PHASE_PREFILL).min().alias("first_decode"),
                    pl.col("position").filter(pl.col("phase") != PHASE_PREFILL).max().alias("last_decode"))
               .sort(["first", "request_id"]).collect())
    if per_req.height == 0:
        if from_token > 0:
            raise InputError(f"{path}: no request starts after token {from_token} (the held-out part the "
                             "placements were not planned on); pass --route-all to route on the whole trace")
        raise InputError(f"{path}: the trace has no rows")
    bad = per_req.filter(pl.col("rows") % L != 0)
    if bad.height:
        r = bad.row(0, named=True)
        raise InputError(f"{files[0]}: request {r['request_id']}: field 'layer': {r['rows']} rows is not a multiple "
                         f"of the model's {L} MoE layers (every token needs one row per MoE layer)")
    tokens = (per_req["rows"] // L).to_numpy()
    if max_tokens is not None and tokens.sum() > max_tokens:
        keep = max(1, int(np.searchsorted(np.cumsum(tokens), max_tokens, side="right")))
        per_req = per_req.head(keep)
        tokens = tokens[:keep]
    order = per_req.select("request_id").with_row_index("req_order")
    df = (lf.select("trace_row", "request_id", "position", "layer")
          .join(order.lazy(), on="request_id", how="inner")
          .sort(["req_order", "position", "layer"]).collect())
    n = df.height
    layers = df["layer"].to_numpy().reshape(-1, L)
    expected = np.asarray(model.moe_layers, dtype=layers.dtype)
    wrong = np.nonzero((layers != expected[None, :]).any(axis=1))[0]
    if wrong.size:
        row = int(wrong[0]) * L
        raise InputError(f"{files[0]}: request {df['request_id'][row]} position {df['position'][row]}: field 'layer': "
                         f"expected one row for each MoE layer {list(model.moe_layers)[:4]}...; got "
                         f"{layers[wrong[0]].tolist()[:4]}...")
    rows = df["trace_row"].to_numpy().astype(np.int64)
    by_row = np.argsort(rows)
    ids = np.empty((n, model.top_k), np.uint16)
    ids[by_row] = read_expert_ids(trace, rows[by_row])  # the id columns of these rows only
    ids = ids.reshape(n // L, L, model.top_k)
    if int(ids.max(initial=0)) >= model.num_experts:
        raise InputError(f"{files[0]}: field 'expert_ids': id {int(ids.max())} >= num_experts {model.num_experts}")
    offset = np.zeros(len(tokens) + 1, dtype=np.int64)
    offset[1:] = np.cumsum(tokens)
    pre_rows = (per_req["prefill_rows"].to_numpy() // L).astype(np.int64)
    # true lengths from positions: the prompt ends where decoding starts (or after its last position)
    last_pre = per_req["last_prefill"].fill_null(-1).to_numpy().astype(np.int64)
    last_dec = per_req["last_decode"].fill_null(-1).to_numpy().astype(np.int64)
    has_dec = per_req["first_decode"].is_not_null().to_numpy()
    first_dec = per_req["first_decode"].fill_null(0).to_numpy().astype(np.int64)
    prompt = np.maximum(np.where(has_dec, first_dec, last_pre + 1), pre_rows)
    output = np.where(has_dec, last_dec - prompt + 1, 0)
    note = ""
    if model.is_partial:
        # An iteration runs every MoE layer of the model: the layers the log did not hold take the routing of
        # the nearest held one (an estimate, said so), rather than being simulated as free or dense.
        held_label = model.layers_label
        ids = ids[:, stand_in_layers(model), :]
        note = (f"routing of {held_label} (the MoE layers the trace holds, {format_ranges(model.moe_layers)}); "
                "each other MoE layer replays its nearest held layer's routing (an estimate)")
        model = model.whole()
    return TraceTokens(ids, offset, prompt, np.maximum(output, tokens - pre_rows), pre_rows,
                       per_req["request_id"].to_numpy().astype(np.int64), model, str(path), layers_note=note)


def stand_in_layers(model: ModelSpec) -> np.ndarray:
    """For a spec of some MoE layers (:attr:`ModelSpec.is_partial`): int ``[M]``, for each of the model's M
    MoE layers the index (into ``model.moe_layers``) of the nearest held layer by decoder depth (the
    shallower one on a tie). Routing statistics drift smoothly with depth, so the nearest layer is the
    best available stand-in."""
    held = np.asarray(model.moe_layers)
    full = np.asarray(model.model_moe_layers)
    return np.abs(full[:, None] - held[None, :]).argmin(axis=1)


# ---------------------------------------------------------------------------- requests
class Request:
    """One request's lifecycle (mutable state owned by the engine; metrics read at the end).
    ``row_base``: trace token row of position 0 (position p routes like row ``(row_base + p) % T``)."""

    __slots__ = (
        "admitted",
        "arrival",
        "ctx",
        "finished",
        "first_token",
        "generated",
        "id",
        "kv",
        "n_dec",
        "n_pre",
        "output_len",
        "pool",
        "preemptions",
        "prefill_target",
        "prefilled",
        "prompt_len",
        "queue_time",
        "rank",
        "rejected",
        "row_base",
        "swapped",
        "template",
        "transfer_s",
    )

    def __init__(self, id: int, arrival: float, prompt_len: int, output_len: int, row_base: int,
                 template: int = -1, n_pre: int | None = None, n_dec: int | None = None) -> None:
        self.id = id
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = max(1, output_len)
        self.row_base = row_base
        # trace rows behind the prompt and the output (fewer than the lengths when the trace represents
        # a long request by a sample): see token_rows / decode_row
        self.n_pre = prompt_len if n_pre is None else max(1, n_pre)
        self.n_dec = self.output_len if n_dec is None else n_dec
        self.template = template
        self.rank = -1
        self.pool = ""
        self.admitted = float("nan")
        self.first_token = float("nan")
        self.finished = float("nan")
        self.prefilled = 0  # tokens whose KV is computed
        self.generated = 0
        self.preemptions = 0
        self.rejected = False
        self.swapped = False
        self.queue_time = 0.0
        self.prefill_target = prompt_len  # tokens to prefill (grows after a recompute preemption)
        self.ctx = 0  # tokens whose KV is in the cache
        self.kv = 0  # per-GPU KV token slots held for the next step while running (engine bookkeeping)
        self.transfer_s = float("nan")  # disaggregated: prefill -> decode KV hand-off, queueing on the link included


class RequestSource:
    """Produces requests in arrival order: lengths from trace templates (in trace order, cycling) or
    from a :class:`LengthMix`; ids from a per-run counter."""

    def __init__(self, trace: TraceTokens, lengths: LengthMix | None, rng: np.random.Generator) -> None:
        self.trace = trace
        self.lengths = lengths
        self.rng = rng
        self._next_id = 0
        self._cursor = 0

    def make(self, arrival: float) -> Request:
        rid = self._next_id
        self._next_id += 1
        t = self.trace
        if self.lengths is None:
            j = rid % t.num_requests
            n_pre = int(t.prefill_rows[j])
            n_dec = int(t.req_offset[j + 1] - t.req_offset[j]) - n_pre
            return Request(rid, arrival, int(max(1, t.prompt_len[j])), int(t.output_len[j]), int(t.req_offset[j]), j,
                           n_pre=n_pre, n_dec=n_dec)
        prompt, output = sample_lengths(self.lengths, self.rng, 1)
        base = self._cursor
        self._cursor = (self._cursor + int(prompt[0] + output[0])) % t.num_tokens
        return Request(rid, arrival, int(prompt[0]), int(output[0]), base)


def token_rows(q: Request, start: int, count: int) -> np.ndarray:
    """Trace rows (before ``% T``) routing positions ``start .. start+count-1`` of request ``q``, int64
    ``[count]``: prompt positions scale onto the prompt's rows, output positions walk the output's rows
    (cycling when the trace holds fewer than the request generates)."""
    pos = start + np.arange(count, dtype=np.int64)
    pre = q.row_base + (pos * q.n_pre) // q.prompt_len
    if q.n_dec > 0:
        dec = q.row_base + q.n_pre + (pos - q.prompt_len) % q.n_dec
        return np.where(pos < q.prompt_len, pre, dec)
    return np.where(pos < q.prompt_len, pre, q.row_base + (pos % q.prompt_len) * q.n_pre // q.prompt_len)


def decode_row(q: Request, pos: int) -> int:
    """:func:`token_rows` of one output position (the per-token hot path of decoding)."""
    if q.n_dec > 0:
        return q.row_base + q.n_pre + (pos - q.prompt_len) % q.n_dec
    return q.row_base + (pos % q.prompt_len) * q.n_pre // q.prompt_len


def sample_lengths(mix: LengthMix, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths, int64 ``[n]`` each: a component by weight, then log-normal around its
    length (median = the length), clipped to ``[1, max_len]``."""
    lens = np.array([c[0] for c in mix.components], dtype=np.float64)
    w = np.array([c[1] for c in mix.components], dtype=np.float64)
    comp = rng.choice(len(lens), size=n, p=w / w.sum())
    if mix.range_ratio is not None:  # benchmark lengths: uniform around the set lengths
        r = mix.range_ratio
        prompt = np.floor(rng.uniform(lens[comp] * (1 - r), lens[comp] * (1 + r) + 1))
        output = np.floor(rng.uniform(mix.output_mean * (1 - r), mix.output_mean * (1 + r) + 1))
        if r == 0:
            prompt, output = lens[comp], np.full(n, float(mix.output_mean))
        return (np.clip(prompt, 1, mix.max_len).astype(np.int64), np.clip(output, 1, mix.max_len).astype(np.int64))
    prompt = lens[comp] * np.exp(mix.sigma * rng.standard_normal(n))
    output = mix.output_mean * np.exp(mix.output_sigma * rng.standard_normal(n) - mix.output_sigma ** 2 / 2)
    prompt = np.clip(np.rint(prompt), 1, mix.max_len).astype(np.int64)
    output = np.clip(np.rint(output), 1, mix.max_len).astype(np.int64)
    return prompt, output


def arrival_times(cfg: WorkloadConfig, duration: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in ``[0, duration)`` (float64, ascending) of an open process.

    ``poisson``: exponential gaps at ``rate``. ``gamma``: gamma gaps with mean ``1/rate`` and coefficient
    of variation ``burstiness`` (1 = Poisson, > 1 = bursty). ``ramp``: an inhomogeneous Poisson process
    whose rate goes linearly from ``rate`` to ``rate_end`` (time-rescaling of unit-rate arrivals through
    the inverse of the cumulative rate)."""
    if cfg.arrival == "closed":
        raise ValueError("closed-loop workloads have no arrival process")
    cap = cfg.max_requests
    if cfg.arrival == "ramp":
        r0, r1 = cfg.rate, float(cfg.rate_end)
        total = (r0 + r1) / 2 * duration
        n = rng.poisson(total)
        u = np.sort(rng.uniform(0.0, total, size=n))  # unit-rate arrivals in cumulative-rate space
        a = (r1 - r0) / (2 * duration)  # Lambda(t) = r0 t + a t^2
        t = u / r0 if a == 0 else (-r0 + np.sqrt(r0 * r0 + 4 * a * u)) / (2 * a)
        out = t
    else:
        mean_n = int(cfg.rate * duration * 1.2 + 20 * np.sqrt(cfg.rate * duration + 1) + 10)
        if cfg.arrival == "poisson":
            gaps = rng.exponential(1.0 / cfg.rate, size=mean_n)
        else:
            shape = 1.0 / cfg.burstiness ** 2
            gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), size=mean_n)
        out = np.cumsum(gaps)
        while out[-1] < duration:  # extremely unlikely; keep drawing
            more = np.cumsum(rng.exponential(1.0 / cfg.rate, size=mean_n)) + out[-1]
            out = np.concatenate([out, more])
        out = out[out < duration]
    if cap is not None:
        out = out[:cap]
    return out
