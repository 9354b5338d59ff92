"""What a simulation routes: a routing trace, a Loads file (per-window expert counts from ``place trace stats``
or an engine's statistics dump: SGLang, vLLM, TensorRT-LLM), or a sequence of either as phases with
durations (``--phases morning.npz:600,evening.npz:900``: a morning-to-evening mix).

A trace alone is routed token by token as before (:mod:`sim.routing`). Loads and phases become a
:class:`sim.timeline.Timeline`: the statistical router draws each iteration's routing from the window of
its simulated second. Loads hold no per-token routes, so the few tokens the router needs (the link copies
per selection, measured by replaying a sample) are the file's sampled tokens when it keeps complete ones,
else drawn from its expert distributions; request lengths then come from ``--context-mix`` (default
:data:`LOADS_PROMPT` / :data:`LOADS_OUTPUT` tokens, said in the output).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.sim.timeline import Timeline, phase_timeline, token_windows
from moeplace.sim.workload import TraceTokens, load_trace_tokens, stand_in_layers
from moeplace.traces.loads import Loads, is_loads_file, load_loads

LOADS_PROMPT, LOADS_OUTPUT = 2048, 512  # request lengths of a Loads input without --context-mix
# tokens per window a trace is first cut into (sim.timeline.merge_windows then merges them until the
# sampling noise is low enough)
BASE_WINDOW_TOKENS = 256
DRAWN_TOKENS = 1024  # tokens drawn from Loads that keep no sample (the link copies per selection)
_REQ_ROWS = 128  # rows per drawn request template (96 prompt + 32 output rows stand for the lengths)
# --phases entries at most: each is a part of the timeline and of the run's description; a source named by
# several entries is read once (read_workload)
MAX_PHASES = 100


@dataclass(frozen=True)
class Phase:
    """One input and the simulated seconds it lasts (``None``: spread over the run)."""

    source: str
    seconds: float | None = None


def parse_phases(text: str) -> tuple[Phase, ...]:
    """``--phases SRC:SECONDS[,SRC:SECONDS...]`` (each SRC a trace or a Loads ``.npz``), or ``SRC[,SRC...]``
    with no seconds at all (the inputs one after the other, each lasting in proportion to its traffic, over
    the run's duration, or the horizon a comparison chooses, as one input's windows do); at most
    :data:`MAX_PHASES` entries."""
    items = text.split(",")
    if len(items) > MAX_PHASES:
        raise InputError(f"--phases: {len(items):,} entries, more than the ceiling of {MAX_PHASES} (a day in "
                         "quarter hours is 96): give fewer, longer phases")
    out = []
    for item in items:
        src, sep, sec = item.strip().rpartition(":")
        if not sep:  # no seconds: the phase lasts in proportion to its traffic
            if not sec:
                raise InputError(f"--phases: an empty entry in '{text}' (expected SRC:SECONDS,... or SRC,...)")
            out.append(Phase(sec, None))
            continue
        if not src:
            raise InputError(f"--phases: '{item.strip()}' is not SRC:SECONDS (e.g. morning.npz:600)")
        try:
            s = float(sec)
        except ValueError:
            raise InputError(f"--phases: '{item.strip()}': '{sec}' is not a number of seconds") from None
        if not np.isfinite(s) or s <= 0:
            raise InputError(f"--phases: '{item.strip()}': the seconds must be > 0, got {sec}")
        out.append(Phase(src, s))
    timed = {ph.seconds is not None for ph in out}
    if len(timed) > 1:
        raise InputError("--phases: give every entry its seconds (SRC:SECONDS) or none (SRC: the inputs last in "
                         "proportion to their traffic), not some of each")
    return tuple(out)


@dataclass(frozen=True)
class Workload:
    """A run's routing input: ``trace`` (tokens: request templates and the link-copy sample; with
    ``trace.timeline`` set when routed from distributions over time), ``timeline`` (every input's windows;
    its seconds are the phases' when ``fixed_time``, else proportional to traffic, to be stretched), ``drawn``
    (routes drawn from loads, an estimate), ``what`` (how to name it)."""

    trace: TraceTokens
    timeline: Timeline
    fixed_time: bool
    drawn: bool
    what: str

    def on_timeline(self, duration: float | None = None) -> TraceTokens:
        """The trace routed from the timeline; stretched over ``duration`` unless the phases fix the time."""
        tl = self.timeline if self.fixed_time or duration is None else self.timeline.stretched(duration)
        return dataclasses.replace(self.trace, timeline=tl)

    def note(self) -> str:
        if self.drawn:
            return (f"routes drawn from the expert loads of {self.what} (per-window distributions, no per-token "
                    "routes: an estimate)")
        return f"routes drawn from the per-window expert distributions of {self.what} over simulated time (an estimate)"


def _read_one(source: str, max_tokens: int | None, seed: int) -> tuple[TraceTokens, np.ndarray, np.ndarray, bool]:
    """``(tokens, counts [W, L, E], weights [W] tokens per window, drawn)`` of one input."""
    if is_loads_file(source):
        loads = load_loads(source)
        note = ""
        if loads.model.is_partial:  # every MoE layer runs: the others take the nearest held layer's counts
            idx = stand_in_layers(loads.model)
            note = (f"routing of {loads.model.layers_label} (the MoE layers {source} holds); each other MoE layer "
                    "replays its nearest held layer's loads (an estimate)")
            loads = Loads(loads.counts[:, idx], loads.model.whole(), loads.window_tokens, loads.labels,
                          loads.provenance, None if loads.samples is None else loads.samples[:, idx],
                          loads.sample_windows)
        m = loads.model
        counts = loads.counts.astype(np.float64)
        weights = counts.sum(axis=2).mean(axis=1) / m.top_k  # tokens each window stands for
        return dataclasses.replace(drawn_tokens(loads, source, seed), layers_note=note), counts, weights, True
    if not Path(source).exists():
        raise InputError(f"{source}: no such trace or Loads file")
    trace = load_trace_tokens(source, max_tokens)
    counts = token_windows(trace.expert_ids, trace.model.num_experts, BASE_WINDOW_TOKENS)
    weights = np.diff(np.minimum(np.arange(counts.shape[0] + 1) * BASE_WINDOW_TOKENS, trace.num_tokens)).astype(float)
    return trace, counts, weights, False


def read_workload(source: str | None, phases: tuple[Phase, ...] = (), max_tokens: int | None = None,
                  seed: int = 0) -> Workload:
    """The input a run names: ``source`` (a trace or a Loads file) or ``phases`` (in order)."""
    if (source is None) == (not phases):
        raise InputError("give a trace or Loads file, or --phases SRC:SECONDS,... (one of the two)")
    items = phases or (Phase(source, None),)
    read: dict[str, tuple] = {}  # a source named by several phases is read once, its arrays shared
    parts = []
    for ph in items:
        if ph.source not in read:
            read[ph.source] = _read_one(ph.source, max_tokens, seed)
        parts.append((ph, *read[ph.source]))
    m0 = parts[0][1].model
    for ph, tr, *_ in parts[1:]:
        m = tr.model
        if (m.moe_layers, m.num_experts, m.top_k) != (m0.moe_layers, m0.num_experts, m0.top_k):
            raise InputError(f"--phases: {ph.source} is {m.name} ({m.num_moe_layers} MoE layers x {m.num_experts} "
                             f"experts top-{m.top_k}); {parts[0][0].source} is {m0.name}: phases must share a model")
    drawn = any(p[4] for p in parts)
    fixed = bool(phases) and phases[0].seconds is not None  # entries without seconds: by traffic, as one input
    tl = phase_timeline([(ph.source, c, w, ph.seconds if fixed else float(w.sum())) for ph, _, c, w, _ in parts],
                        drawn)
    # the tokens (request templates, the link-copy sample) of each distinct source once
    sources = list(read)
    trace = read[sources[0]][0] if len(sources) == 1 else concat_tokens([read[s][0] for s in sources],
                                                                        ",".join(sources))
    what = (f"{len(parts)} phases ({', '.join(f'{p.source} {p.seconds:g} s' for p in items)})" if fixed
            else f"{len(parts)} phases ({', '.join(p.source for p in items)}; each by its traffic)" if phases
            else items[0].source)
    return Workload(trace, tl, fixed, drawn, what)


def concat_tokens(traces: list[TraceTokens], path: str) -> TraceTokens:
    """Several inputs' tokens one after the other (request templates and link-copy sample of phases)."""
    offs, base = [np.zeros(1, dtype=np.int64)], 0
    for t in traces:
        offs.append(t.req_offset[1:] + base)
        base += t.num_tokens
    return TraceTokens(np.concatenate([t.expert_ids for t in traces]), np.concatenate(offs),
                       np.concatenate([t.prompt_len for t in traces]), np.concatenate([t.output_len for t in traces]),
                       np.concatenate([t.prefill_rows for t in traces]),
                       np.arange(sum(t.num_requests for t in traces), dtype=np.int64), traces[0].model, path)


def drawn_tokens(loads, path: str, seed: int) -> TraceTokens:
    """Tokens standing for a Loads file: its sampled tokens when it keeps complete ones, else
    :data:`DRAWN_TOKENS` tokens drawn from its whole-file expert distribution (per layer, top-k distinct
    experts by weight: Gumbel top-k); grouped in request templates of :data:`LOADS_PROMPT` /
    :data:`LOADS_OUTPUT` tokens."""
    m = loads.model
    L, E, k = m.num_moe_layers, m.num_experts, m.top_k
    s = loads.samples
    if s is not None and s.shape[0] >= _REQ_ROWS and (s >= 0).all():
        ids = s.astype(np.uint16)
    else:
        rng = np.random.default_rng(seed)
        tot = loads.counts.sum(axis=0).astype(np.float64)  # [L, E]
        with np.errstate(divide="ignore"):
            logf = np.log(tot / np.maximum(tot.sum(axis=1, keepdims=True), 1e-300))
        ids = np.empty((DRAWN_TOKENS, L, k), dtype=np.uint16)
        for layer in range(L):
            keys = logf[layer][None, :] + rng.gumbel(size=(DRAWN_TOKENS, E))
            ids[:, layer, :] = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    n_req = ids.shape[0] // _REQ_ROWS
    ids = ids[:n_req * _REQ_ROWS]
    offset = np.arange(n_req + 1, dtype=np.int64) * _REQ_ROWS
    pre = _REQ_ROWS * 3 // 4
    return TraceTokens(ids, offset, np.full(n_req, LOADS_PROMPT, dtype=np.int64),
                       np.full(n_req, LOADS_OUTPUT, dtype=np.int64), np.full(n_req, pre, dtype=np.int64),
                       np.arange(n_req, dtype=np.int64), m, str(path))


def workload_of(trace: TraceTokens, fixed_time: bool = False, what: str | None = None) -> Workload:
    """The :class:`Workload` of an already read trace: its own timeline when it has one (Loads or phases),
    else its token windows in time order."""
    tl = trace.timeline
    if tl is None:
        counts = token_windows(trace.expert_ids, trace.model.num_experts, BASE_WINDOW_TOKENS)
        weights = np.diff(np.minimum(np.arange(counts.shape[0] + 1) * BASE_WINDOW_TOKENS,
                                     trace.num_tokens)).astype(float)
        tl = phase_timeline([(trace.path, counts, weights, float(weights.sum()))], False)
    return Workload(trace, tl, fixed_time, tl.drawn, what or trace.path)
