"""Requests and the engine loop: arrivals, prompt/output lengths with long-request representation, the
continuous-batching schedule that gives the ``step`` column, and the chunks of rows it yields."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moeplace.foundation.model import ModelSpec
from moeplace.traces.format import PHASE_DECODE, PHASE_PREFILL
from moeplace.traces.synth.config import SynthConfig
from moeplace.traces.synth.popularity import mix_at
from moeplace.traces.synth.sampler import ExpertSampler, SynthDesign, zipf_ranks

# A config without max_position_embeddings (max_context 0: unknown) is drawn against a 1 M-token context,
# the length the simulator assumes for it too; a context shorter than 2 tokens leaves no room for a prompt
# token and an output token, so it is taken as 2.
UNKNOWN_CONTEXT = 1 << 20


def context_tokens(model: ModelSpec) -> int:
    """The context lengths are drawn under: the model's, or :data:`UNKNOWN_CONTEXT` when it states none."""
    return max(model.max_context or UNKNOWN_CONTEXT, 2)


@dataclass
class _Request:
    rid: int
    arrival: float
    domain: int
    prompt_len: int
    prefill_pos: np.ndarray  # represented prompt positions
    num_decode: int  # represented decode tokens
    done_prefill: int = 0
    done_decode: int = 0
    slot: int = -1


def _request_stream(cfg: SynthConfig, model: ModelSpec, anchors: np.ndarray, rng: np.random.Generator
                    ) -> Iterator[_Request]:
    """Requests in arrival order until the token budget (represented tokens) is spent exactly."""
    budget = cfg.num_tokens
    used, t, rid = 0, 0.0, 0
    max_ctx = context_tokens(model)  # prompt in [1, max_ctx - 1], output >= 1: every request adds a token
    while used < budget:
        t += rng.exponential(1.0 / cfg.arrival_rate)
        if rng.random() < cfg.long_fraction:  # Pareto tail of long-context prompts
            prompt = int(min(cfg.long_min * (1 - rng.random()) ** (-1 / cfg.long_alpha), max_ctx - 1))
        else:
            prompt = int(np.clip(rng.lognormal(math.log(cfg.prompt_median), cfg.prompt_sigma), 1, max_ctx - 1))
        output = int(np.clip(rng.lognormal(math.log(cfg.output_median), cfg.output_sigma), 1,
                             min(cfg.output_max, max_ctx - prompt)))
        n_pre = min(prompt, cfg.max_prefill_tokens)
        n_dec = min(output, cfg.max_decode_tokens)
        take = min(n_pre + n_dec, budget - used)
        n_pre, n_dec = min(n_pre, take), max(0, take - n_pre)
        if prompt <= cfg.max_prefill_tokens:
            pos = np.arange(n_pre, dtype=np.int64)
        else:  # evenly spaced sample of a long prompt, true positions kept
            pos = np.unique(np.linspace(0, prompt - 1, cfg.max_prefill_tokens).astype(np.int64))[:n_pre]
        mix = mix_at(anchors, np.array([used / budget]))[0]
        domain = int(rng.choice(len(mix), p=mix))
        yield _Request(rid, t, domain, prompt, pos, n_dec)
        used += take
        rid += 1


def engine_batches(cfg: SynthConfig, model: ModelSpec, anchors: np.ndarray, rng: np.random.Generator
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Continuous batching: each iteration decodes one token of every running request in decode, then
    fills the rest of ``max_batch_tokens`` with prefill chunks (FIFO). Yields per-iteration arrays
    ``request_id, position, phase, step, domain, slot, seq`` (``seq`` = represented index of the token in
    its request)."""
    arrivals = _request_stream(cfg, model, anchors, rng)
    pending: _Request | None = next(arrivals, None)
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    free_slots = list(range(cfg.max_running - 1, -1, -1))
    clock, step = 0.0, 0
    while pending is not None or waiting or running:
        while pending is not None and pending.arrival <= clock:
            waiting.append(pending)
            pending = next(arrivals, None)
        while waiting and free_slots:
            r = waiting.popleft()
            r.slot = free_slots.pop()
            running.append(r)
        if not running:
            if pending is not None:
                clock = max(clock, pending.arrival)
            continue
        parts = []
        budget = cfg.max_batch_tokens
        for r in running:  # decode first: one token each
            if r.done_prefill == len(r.prefill_pos) and r.done_decode < r.num_decode:
                parts.append((r, np.array([r.prompt_len + r.done_decode]), PHASE_DECODE,
                              len(r.prefill_pos) + r.done_decode))
                r.done_decode += 1
                budget -= 1
        for r in running:
            if budget <= 0:
                break
            left = len(r.prefill_pos) - r.done_prefill
            if left > 0:
                take = min(left, budget)
                parts.append((r, r.prefill_pos[r.done_prefill:r.done_prefill + take], PHASE_PREFILL,
                              r.done_prefill))
                r.done_prefill += take
                budget -= take
        if parts:
            sizes = [len(p[1]) for p in parts]
            yield {
                "request_id": np.repeat([p[0].rid for p in parts], sizes),
                "position": np.concatenate([p[1] for p in parts]),
                "phase": np.repeat([p[2] for p in parts], sizes).astype(np.uint8),
                "step": np.full(sum(sizes), step, np.int64),
                "domain": np.repeat([p[0].domain for p in parts], sizes),
                "slot": np.repeat([p[0].slot for p in parts], sizes),
                "seq": np.concatenate([p[3] + np.arange(s) for p, s in zip(parts, sizes)]),
            }
            step += 1
            clock += cfg.iter_base_s + cfg.iter_token_s * sum(sizes)
        still = []
        for r in running:
            if r.done_prefill == len(r.prefill_pos) and r.done_decode >= r.num_decode:
                free_slots.append(r.slot)
            else:
                still.append(r)
        running = still


def _concat_batches(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def chunk_streams(seed: int, chunk: int, layers: range) -> tuple[list[np.random.Generator], np.random.Generator]:
    """The random streams of one chunk of tokens: one per MoE layer in ``layers`` (every draw of that
    layer: sources, points, re-drawn duplicates) and one for the tokens' themes. Keyed by (seed, chunk,
    layer), so whichever process draws a layer, the trace is the same (generator version 3)."""
    def stream(*key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xE4, chunk, *key])))

    return [stream(li) for li in layers], stream(1 << 16)


def chunk_tokens(design: SynthDesign) -> Iterator[dict[str, np.ndarray]]:
    """The token batches of the synthetic trace in step order, without their experts: the engine-loop
    arrays plus ``prev`` (the copy source of :meth:`ExpertSampler.sample`), ``rank`` (Zipf rank),
    ``token_id`` int32 [n] (and ``gate_weights`` float32 ``[n, L, k]`` when configured). A chunk holds
    at least ``chunk_tokens`` tokens and less than one more engine iteration."""
    cfg, model = design.config, design.model
    rng = np.random.default_rng([cfg.seed, 0x7A11])
    buf: list[dict[str, np.ndarray]] = []
    buffered = 0
    shape = (model.num_moe_layers, model.top_k)

    def flush() -> dict[str, np.ndarray]:
        b = _concat_batches(buf)
        n = len(b["slot"])
        # previous token of the same request: earlier in this chunk, else the slot's saved state
        order = np.lexsort((np.arange(n), b["request_id"]))
        same = np.zeros(n, bool)
        same[1:] = b["request_id"][order[1:]] == b["request_id"][order[:-1]]
        prev = np.where(b["seq"] > 0, b["slot"], -1)
        prev[order[1:][same[1:]]] = cfg.max_running + order[:-1][same[1:]]
        b["prev"] = prev
        b["rank"] = zipf_ranks(design.tok_cdf, rng, n)
        b["token_id"] = design.rank2token[b["rank"]]
        if cfg.gate_weights:
            # sigmoid router, renormalized top-k: weights in the router's (descending) order
            g = -np.sort(-rng.exponential(1.0, (n, *shape)).astype(np.float32), axis=-1)
            b["gate_weights"] = g / g.sum(axis=-1, keepdims=True)
        return b

    for batch in engine_batches(cfg, model, design.anchors, rng):
        buf.append(batch)
        buffered += len(batch["slot"])
        if buffered >= cfg.chunk_tokens:
            yield flush()
            buf, buffered = [], 0
    if buf:
        yield flush()


def sample_chunk(sampler: ExpertSampler, seed: int, chunk: int, b: dict[str, np.ndarray],
                 prev_layer: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The experts of chunk ``chunk`` (tokens ``b`` of :func:`chunk_tokens`) at ``sampler``'s layers."""
    rngs, theme_rng = chunk_streams(seed, chunk, sampler.layers)
    return sampler.sample(b["domain"], b["rank"], b["prev"], b["slot"], rngs, theme_rng, prev_layer, out)


def synth_chunks(design: SynthDesign) -> Iterator[dict[str, np.ndarray]]:
    """Token batches of the synthetic trace in step order (:func:`chunk_tokens`) with ``experts`` uint16
    ``[n, L, k]``, sampled in this process (``traces.synth.pipeline`` draws the same on several)."""
    cfg = design.config
    sampler = ExpertSampler(design, None, cfg.max_running, design.copy_prob)
    for c, b in enumerate(chunk_tokens(design)):
        b["experts"] = sample_chunk(sampler, cfg.seed, c, b)
        yield b
