"""The comparison behind ``place optimize``: plan every policy on the first part of the routing, score
it on that part and on the windows it did not see. A library function so the CLI and the dashboard
print the same rows.

Inputs reduce to Loads windows (:func:`routing_windows`): traces through ``traces.stats.trace_loads``,
Loads ``.npz`` files as they are;
several inputs are concatenated window-wise (labels prefixed with the input's name).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import placement_estimate, require_memory
from moeplace.foundation.progress import bar, track
from moeplace.placement.evaluate import Metrics, evaluate
from moeplace.placement.policies import (
    TimeLimitReached,
    get_policy,
    is_anytime,
    is_quick,
    policy_names,
)
from moeplace.placement.record import Placement
from moeplace.placement.rules import get_rule
from moeplace.placement.shift import (
    EstimateCut,
    _plan,
    cost_line,
    fold_windows,
    public,
    shift_estimate,
    shift_groupings,
    shift_layers,
    time_needed,
    versus,
)
from moeplace.placement.windows import loads_tokens, planned_on, split_samples, split_windows
from moeplace.traces.loads import Loads


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True, eq=False)
class PolicyResult:
    policy: str
    placement: Placement
    seconds: float
    planning: Metrics  # scored on the planning windows
    held_out: Metrics | None
    shift: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """Flat table row (JSON-ready)."""
        return {
            "policy": self.policy,
            "seconds": self.seconds,
            "plan": self.planning.summary(),
            "held_out": None if self.held_out is None else self.held_out.summary(),
            "duplicate_on_gpu_layers": duplicate_layers(self.placement, self.planning),
        }


def duplicate_layers(placement: Placement, scored: Metrics) -> int:
    """Scored MoE layers whose placement puts two replicas of one expert on one GPU."""
    return int((placement.duplicate_on_gpu() & scored.scored_wl.any(axis=0)).sum())


@dataclass(frozen=True, eq=False)
class Comparison:
    results: list[PolicyResult]
    planning_windows: np.ndarray
    held_windows: np.ndarray
    single_window: bool
    rule: str
    cluster: ClusterSpec
    num_redundant: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    scored_layers: int = 0
    moe_layers: int = 0
    shift_method: str | None = None
    shift_scenarios: tuple[str, ...] = ()
    shift_groupings: tuple[dict, ...] = ()  # every grouping the estimate left out (the first: the table's)
    shift_cost: str = ""  # the estimate's work, stated before it ran
    planning_sample_tokens: int = 0
    held_sample_tokens: int = 0
    tokens: int = 0
    layers_label: str = ""  # "5 of 24 layers" when the input holds some of the model's MoE layers only
    # (label, result, redundant slots): the written policy planned with other slots, shown under the table
    # (place optimize's "what replicas would add" row for a model the engines serve only replica-free)
    replica_rows: tuple[tuple[str, PolicyResult, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {"engine": self.rule, "cluster": self.cluster.to_dict(), "num_redundant": self.num_redundant,
             "plan_windows": self.planning_windows.tolist(), "held_out_windows": self.held_windows.tolist(),
             "single_window": self.single_window, "notes": list(self.notes),
             "scored_layers": self.scored_layers, "moe_layers": self.moe_layers, "tokens": self.tokens,
             "sample_tokens": {"plan": self.planning_sample_tokens, "held_out": self.held_sample_tokens},
             "rows": [r.row() for r in self.results]}
        if self.layers_label:
            d["layers"] = self.layers_label
        if self.replica_rows:
            d["replica_rows"] = [{**r.row(), "label": label, "num_redundant": slots}
                                 for label, r, slots in self.replica_rows]
        if self.shift_method is not None:
            d["shift"] = {r.policy: r.shift for r in self.results if r.shift is not None}
            d["shift_scenarios"] = list(self.shift_scenarios)
            d["shift_groupings"] = list(self.shift_groupings)
            d["shift_cost"] = self.shift_cost
        return d


def _check_objective(names, options: dict[str, Any], planning_samples: np.ndarray | None, loads: Loads) -> None:
    obj = options.get("objective") or "balance"
    if obj != "balance" and "moeplace" in names and (planning_samples is None or not len(planning_samples)):
        src = ", ".join(map(str, loads.provenance.get("inputs", []))) or "the input"
        raise InputError(f"--objective {obj} needs a token sample of the planning windows (a trace, or a Loads "
                         f"file written by 'place trace stats'); {src} has none")


EVAL_GUESS = 0.2  # seconds to score one policy, reserved before any scoring has been timed


def compare_policies(loads: Loads, cluster: ClusterSpec, *, num_redundant: int,
                     policies: list[str] | None = None, rule: str = "vllm", plan_fraction: float = 0.5,
                     seed: int = 0, time_limit: float | None = None, options: dict[str, Any] | None = None,
                     samples: np.ndarray | None = None, shift: bool = False,
                     deadline: float | None = None, shift_sample: int | str = "auto",
                     announce: Callable[[str], None] | None = None) -> Comparison:
    """Plan each policy on the planning windows, score it (``evaluate``, Loads-level, ``rule``)
    on the planning and on the held-out windows. ``policies``: registry names (default: all).
    The token sample is split by window: policies plan on the planning windows' tokens only and the
    held-out traffic columns replay the held-out windows' tokens only. ``samples`` overrides the
    planning sample (the caller vouches that it holds no held-out token).
    ``shift``: also run the leave-one-group-out estimate (:func:`shift_estimate`, one extra plan per
    left-out group and policy) on the planning windows, over the groupings :func:`shift_groupings` finds
    (tags, else clustering), on the MoE layers :func:`shift_layers` picks with ``shift_sample`` and
    ``seed`` (``"auto"``: as many as keep its work within the main plan's); ``announce`` gets the
    estimate's cost before any planning starts. Each policy's estimate carries ``versus``: its paired
    difference to every other policy estimated.

    ``time_limit``: seconds for the whole comparison, planning and scoring every policy, counted from this
    call, or ``deadline`` (a ``time.monotonic()`` instant: a command's start plus its limit). Policies that
    cannot stop early run first (the one-pass baselines, then EPLB) with what is left, each reserving only
    its own scoring, so a short limit still runs the cheap ones; anytime policies (``moeplace``) then share
    the rest, less the time scoring takes; the shift estimate runs in what remains after that, whole or not
    at all (a limit that would cut it omits it, named in ``notes``: it never changes what is computed). A policy the limit
    leaves no time for, or that runs past it, is left out of the results and named in ``notes`` ("eplb
    skipped: time limit"), as is every stage an anytime policy skipped or cut short."""
    options = dict(options or {})
    names = policies or policy_names()
    fns = {n: get_policy(n) for n in names}  # fails early on an unknown name
    # every placement is kept for the table: refuse what cannot fit before planning any (docs/design.md)
    m = loads.model
    require_memory(placement_estimate(m.num_moe_layers, m.num_experts, cluster.num_gpus, num_redundant,
                                      num_placements=len(fns), num_windows=loads.num_windows,
                                      rule=get_rule(rule).planning_memory(m.num_moe_layers, m.num_experts,
                                                                          cluster.num_gpus)))
    if deadline is None and time_limit is not None:
        deadline = time.monotonic() + time_limit
    planning_idx, held_idx, single = split_windows(loads.num_windows, plan_fraction)
    planning_samples, held_samples, sample_note = split_samples(loads, planning_idx, held_idx)
    if samples is not None:
        planning_samples = samples
    _check_objective(names, options, planning_samples, loads)
    planning_counts = loads.counts[planning_idx].astype(np.float64)
    held = loads.counts[held_idx].astype(np.float64)
    # the estimate comes from the planning windows alone, so it is a prediction the held-out columns check
    planning = loads.select(planning_idx)
    groupings, shift_notes = shift_groupings(planning, seed) if shift else ([], [])
    groupings = [g for g in groupings if len(g.names) >= 2]
    active_layers = int((planning.counts.sum(axis=(0, 2)) > 0).sum())
    notes = []
    if single:
        notes.append("only one window: the held-out columns score the planning window itself")
    if sample_note:
        notes.append(sample_note)
    notes += [f"shift estimate: {n}" for n in shift_notes]
    if shift and not groupings:
        notes.append("one planning window only: no shift estimate")
    folds = fold_windows(groupings)
    sampled = shift_layers(planning, len(folds), shift_sample, seed) if groupings else np.zeros(0, np.int64)
    cost = cost_line(len(folds), sampled.size, active_layers, seed, len(fns)) if groupings else ""
    if cost and announce is not None:
        announce(f"shift estimate: {cost}")

    def share(name: str, rest: list[str], reserve: float) -> float | None:
        """Seconds for ``name`` out of what the deadline leaves (``None``: no limit); <= 0: none left."""
        if deadline is None:
            return None
        left = deadline - time.monotonic() - reserve
        if is_anytime(name):  # always returns a valid placement, however small its share
            return max(0.01, left / sum(is_anytime(n) for n in rest))
        return left

    done: dict[str, tuple] = {}
    eval_cost = EVAL_GUESS
    # stable: one-pass baselines first, then the other fixed-cost policies, anytime ones last
    order = sorted(names, key=lambda n: (is_anytime(n), not is_quick(n)))
    pb = bar(len(order), "policies", "policy")
    for i, name in enumerate(order):
        pb.set_description(f"policy {name}", refresh=False)
        pb.update(0 if i == 0 else 1)
        # a fixed-cost policy (the baselines: milliseconds to a second) reserves only its own scoring, so a
        # short limit still runs them; anytime policies reserve the scoring of every policy left
        limit = share(name, order[i:], (len(order[i:]) if is_anytime(name) else 1) * eval_cost)
        if limit is not None and limit <= 0:
            notes.append(f"{name} skipped: time limit (no time left to run it)")
            continue
        try:
            placement, dt = _plan(fns[name], name, loads, planning_idx, planning_samples, cluster, num_redundant,
                                  rule, seed, limit, options)
        except TimeLimitReached:
            notes.append(f"{name} skipped: time limit (not finished after {limit:.2f} s)")
            continue
        placement.provenance["planned_on"] = planned_on(loads, planning_idx)
        t1 = time.perf_counter()
        m_planning = evaluate(placement, planning_counts, rule, model=loads.model, cluster=cluster, samples=planning_samples)
        m_held = (evaluate(placement, held, rule, model=loads.model, cluster=cluster, samples=held_samples)
                  if held_idx.size else None)
        eval_cost = max(eval_cost, time.perf_counter() - t1)
        done[name] = (placement, dt, m_planning, m_held)
        notes += [f"{name}: {line}" for line in time_limit_lines(placement)]
    pb.close()
    shifts: dict[str, dict] = {}
    if groupings:
        todo = [n for n in order if n in done]
        for name in track(todo, "shift estimate", "policy"):
            limit = None
            if deadline is not None:
                # the limit decides whether the estimate runs, never what it computes
                limit = deadline - time.monotonic()
                need = time_needed(done[name][1], len(folds) * sampled.size, active_layers)
                if limit <= 0 or need > limit:
                    notes.append(f"{name}: shift estimate omitted: it needs about {need:.0f} s ({cost}) and the time "
                                 f"limit leaves {max(0.0, limit):.0f} s; raise --time-limit or lower --shift-layers")
                    continue
            try:
                shifts[name] = shift_estimate(fns[name], name, planning, cluster, num_redundant=num_redundant,
                                              rule=rule, seed=seed, options=options, groupings=groupings,
                                              layers=sampled, time_limit=limit)
            except EstimateCut:
                notes.append(f"{name}: shift estimate omitted: the time limit would have cut it short (it is "
                             "computed whole or not at all); raise --time-limit or lower --shift-layers")
        for name, sh in shifts.items():
            sh["versus"] = {other: versus(sh, shifts[other], active_layers) for other in shifts if other != name}
        shifts = {n: public(sh) for n, sh in shifts.items()}
    results = [PolicyResult(n, *done[n], shifts.get(n)) for n in names if n in done]
    scored = int((loads.counts.sum(axis=(0, 2)) > 0).sum())
    return Comparison(results, planning_idx, held_idx, single, rule, cluster, num_redundant, tuple(notes),
                      scored, loads.model.num_moe_layers, groupings[0].how if groupings else None,
                      tuple(groupings[0].names) if groupings else (), tuple(g.describe() for g in groupings),
                      cost, 0 if planning_samples is None else len(planning_samples),
                      0 if held_samples is None else len(held_samples), loads_tokens(loads),
                      loads.model.layers_label)


def time_limit_lines(placement: Placement) -> list[str]:
    """What the time limit skipped or cut short in an anytime policy's run (from its provenance's
    ``params.summary.time_limited``: ``{"skipped"|"cut": {stage: layers}}``), e.g. ``traffic refinement
    skipped: time limit (92 of 92 layers)``; empty when it changed nothing."""
    summary = placement.provenance.get("params", {}).get("summary") or {}
    lim = summary.get("time_limited") or {}
    planned = summary.get("planned_layers", placement.num_layers)
    lines = [f"{stage} {'skipped' if kind == 'skipped' else 'cut short'}: time limit ({n} of {planned} layers)"
             for kind in ("skipped", "cut") for stage, n in lim.get(kind, {}).items()]
    if lines:
        lines.append("the time limit changed this placement: the same seed can give another one (it would not "
                     "without a binding limit)")
    return lines
