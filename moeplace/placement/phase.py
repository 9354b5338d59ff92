"""``place optimize --phase prefill|decode``: plan every policy on one phase's tokens and score it on the
held-out ones. Prefill is judged as every placement is (per-GPU token balance, cross-node bytes:
:func:`placement.compare.compare_policies` on the prompt tokens). Decode adds the decode figure
(:mod:`placement.decode`): on held-out decode steps formed the way the engine batches them, the slots the
busiest GPU reads per step and its max / mean, next to token balance, for every policy — the engines'
defaults (vLLM ``linear``, ``round_robin``), EPLB, the token-balance optimizer and ``moeplace-decode``
(:mod:`placement.policies.decode`), which plans on that figure."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.placement.compare import Comparison, compare_policies
from moeplace.placement.decode import (
    DecodeFigures,
    DecodeSteps,
    PhaseTokens,
    decode_steps,
    phase_loads,
    read_phase_tokens,
    score_decode,
)
from moeplace.placement.windows import routing_windows, split_windows


@dataclass(frozen=True)
class DecodePool:
    """The decode pool a placement is scored for: ``dp`` attention-DP ranks of ``attention_tp`` GPUs,
    ``batch`` running sequences per rank (a step sends ``dp x batch`` tokens through every MoE layer)."""

    dp: int
    batch: int
    attention_tp: int = 1

    @property
    def step_tokens(self) -> int:
        return self.dp * self.batch


@dataclass(frozen=True, eq=False)
class PhaseComparison:
    """A comparison on one phase's tokens; for decode, each policy's decode figure (``decode``, by policy)
    on ``steps`` of the held-out decode tokens."""

    phase: str
    comparison: Comparison
    decode: dict[str, DecodeFigures] = field(default_factory=dict)
    steps: DecodeSteps | None = None
    pool: DecodePool | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"phase": self.phase}
        if self.decode:
            d["decode"] = {"pool": {"dp": self.pool.dp, "batch": self.pool.batch, "attention_tp": self.pool.attention_tp},
                           "steps": self.steps.num_steps, "tokens_per_step": self.steps.tokens_per_step,
                           "requests": self.steps.requests, "how": self.steps.describe(),
                           "rows": {k: v.to_dict() for k, v in self.decode.items()}}
        if self.note:
            d["note"] = self.note
        return d


def compare_phase(inputs: list[str], phase: str, cluster: ClusterSpec, *, num_redundant: int,
                  policies: list[str], rule: str = "vllm", plan_fraction: float = 0.5, seed: int = 0,
                  options: dict[str, Any] | None = None, model: ModelSpec | None = None,
                  window_tokens: int = 4096, max_tokens: int | None = None, pool: DecodePool | None = None,
                  shift: bool = False, deadline: float | None = None,
                  shift_sample: int | str = "auto", tags: dict[str, dict[str, str]] | None = None) -> PhaseComparison:
    """Plan ``policies`` on the ``phase`` tokens of the traces ``inputs`` (at most ``max_tokens`` of each)
    and score them (:func:`compare_policies`); for decode, also on the held-out decode steps of ``pool``
    (:func:`decode_steps`, :func:`score_decode`). Each placement's ``planned_on`` records the phase and, for
    one input, the first held-out token in the trace's own order (what ``place simulate`` routes from).
    ``tags``: ``--tag``'s inputs' tags (:func:`routing_windows`), what the shift estimate leaves out."""
    if phase == "decode" and pool is None:
        raise InputError("--phase decode scores on the decode pool's steps: give its batch (and DP ranks)")
    tokens: dict[Path, PhaseTokens] = {}

    def read(p: Path, wt: int):
        pt = read_phase_tokens(p, phase, max_tokens)
        if model is not None:
            pt = replace(pt, model=model)
        tokens[p] = pt
        return phase_loads(pt, wt)

    options = dict(options or {})
    if phase == "decode":
        options.setdefault("decode_step_tokens", pool.step_tokens)
    loads = routing_windows(inputs, model=model, window_tokens=window_tokens, read=read, tags=tags)
    cmp = compare_policies(loads, cluster, num_redundant=num_redundant, policies=policies, rule=rule,
                           plan_fraction=plan_fraction, seed=seed, options=options, shift=shift, deadline=deadline,
                           shift_sample=shift_sample)
    # the held-out tokens of each input: its windows among the held-out ones, in file order
    planning_idx, held_idx, single = split_windows(loads.num_windows, plan_fraction)
    win_input = np.asarray(loads.provenance["window_inputs"])
    held_parts: list[PhaseTokens] = []
    offset = 0
    pts = list(tokens.values())
    for i, pt in enumerate(pts):
        n_win = int((win_input == i).sum())
        mine = np.arange(offset, offset + n_win)
        local = np.isin(mine, held_idx if held_idx.size else planning_idx)
        tok_win = np.arange(pt.num_tokens) // window_tokens
        held_parts.append(pt.take(np.flatnonzero(local[tok_win])))
        offset += n_win
    if len(pts) == 1 and held_idx.size and not single:
        first = int(np.flatnonzero(np.arange(pts[0].num_tokens) // window_tokens >= held_idx[0])[0])
        for r in cmp.results:
            on = r.placement.provenance.setdefault("planned_on", {})
            on["phase"] = phase
            on["held_out_from_token"] = int(pts[0].file_tokens[first])
            on["phase_tokens"] = [0, int(first)]
    else:
        for r in cmp.results:
            on = r.placement.provenance.setdefault("planned_on", {})
            on["phase"] = phase
            on.pop("held_out_from_token", None)  # windows of phase tokens: no one token of the file splits them
    trunc = [pt.path for pt in pts if pt.truncated]
    note = (f"read the first {max_tokens:,} {phase} tokens of {', '.join(trunc)} (--max-trace-tokens)"
            if trunc else "")
    if phase != "decode":
        return PhaseComparison(phase, cmp, note=note)
    held = _concat(held_parts)
    if held.num_tokens == 0:
        raise InputError("no held-out decode tokens to score on (lower --plan-fraction)")
    steps = decode_steps(held, pool.dp, pool.batch)
    scores = {r.policy: score_decode(r.placement, held, steps, rule, pool.attention_tp, seed) for r in cmp.results}
    how = "held-out" if held_idx.size and not single else "planning (nothing held out)"
    note = "; ".join(x for x in (note, f"decode figures on {how} decode tokens") if x)
    return PhaseComparison(phase, cmp, scores, steps, pool, note)


def _concat(parts: list[PhaseTokens]) -> PhaseTokens:
    """One token set of several inputs (request ids kept apart per input)."""
    if len(parts) == 1:
        return parts[0]
    shift = 0
    rids = []
    for pt in parts:
        rids.append(pt.request_ids + shift)
        shift += int(pt.request_ids.max(initial=-1)) + 1
    files = []
    base = 0
    for pt in parts:  # inputs one after another in "file order"
        files.append(pt.file_tokens + base)
        base += pt.source_tokens
    p0 = parts[0]
    return PhaseTokens(np.concatenate([p.expert_ids for p in parts]), np.concatenate(rids),
                       np.concatenate([p.positions for p in parts]), np.concatenate(files), p0.model,
                       ", ".join(p.path for p in parts), p0.phase, base, any(p.truncated for p in parts))


def format_decode(pc: PhaseComparison) -> list[str]:
    """The decode figure of every policy, under the comparison table."""
    if not pc.decode:
        return []
    s = pc.steps
    out = [(f"decode figure ({s.describe()}, {s.tokens_per_step:.0f} tokens per step; slots read per step on the "
           "busiest GPU, mean over steps and MoE layers):"),
           (f"  {'policy':<16} {'act max':>8} {'act mean':>8} {'act max/mean':>12} {'tok max/mean':>12} "
           f"{'active/step':>11}")]
    for name, f in pc.decode.items():
        out.append(f"  {name:<16} {f.active_max:>8.2f} {f.active_mean:>8.2f} {f.active_ratio:>12.4f} "
                   f"{f.token_ratio:>12.4f} {f.experts_per_step:>11.1f}")
    out.append("  act = expert weight copies (slots) a GPU reads in one step: at least one token of the step is sent "
               "to them under the engine's replica rule; the busiest GPU's count sets a memory-bound decode "
               "step's MoE time. tok = tokens per GPU per step. Lower is better for both")
    return out
