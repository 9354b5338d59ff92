"""The three stages of one sweep point: plan (in the driver; cheap), optimize (one task per optimize key)
and simulate (one task per point). The tasks run in worker processes (a process pool or Ray workers);
they take and return plain picklable values and report user errors as a status instead of raising, so
one bad point never stops a sweep.

This module is part of the application layer (like the CLI): the simulate stage imports ``sim`` inside
its function, so ``import moeplace.sweep`` does not pull the simulator in.
"""
from __future__ import annotations

import functools
import time
import traceback
from dataclasses import replace
from typing import Any

from moeplace.cli.sweep.spec import Point, SweepSpec, base_memory_config
from moeplace.foundation.cluster import ClusterSpec, make_cluster
from moeplace.foundation.errors import InputError, MoeplaceError
from moeplace.foundation.memory.config import Layout
from moeplace.foundation.memory.planner import plan_memory
from moeplace.placement.compare import compare_policies
from moeplace.placement.record import Placement
from moeplace.sim.runner import RunInputs, read_trace, simulate
from moeplace.sim.workload import TraceTokens
from moeplace.traces.loads import Loads


def point_cluster(point: Point) -> ClusterSpec:
    return make_cluster(point.gpus, point.gpu, point.gpus_per_node)


# ---------------------------------------------------------------------------- plan
def plan_point(spec: SweepSpec, point: Point) -> tuple[dict[str, Any], Layout | None]:
    """``place plan`` for one point: ``(row fields, layout)``. The fields carry ``status`` (``invalid``:
    the layout or cluster cannot exist; ``infeasible``: it does not fit, with the plan's reasons;
    ``unsupported``: it fits but the simulator cannot model it) or no status when the point goes on to
    optimize and simulate."""
    row: dict[str, Any] = {"index": point.index, "label": point.label(), "workload": point.workload,
                           "gpu": point.gpu, "gpus": point.gpus, "tp": point.tp, "ep": point.ep,
                           "redundant": str(point.redundant), "policy": point.policy,
                           "rebalance": point.rebalance,
                           "kv_dtype": point.kv_dtype, "engine": point.engine, "stage": "plan"}
    try:
        row["num_redundant"] = point.num_redundant
        cluster = point_cluster(point)
        row.update(nodes=cluster.num_nodes, gpus_per_node=cluster.gpus_per_node)
        config = replace(base_memory_config(spec.plan, spec.settings), tp=point.tp, ep=point.ep,
                         num_redundant=point.num_redundant, kv_dtype=point.kv_dtype)
        plan = plan_memory(spec.model, cluster, config, suggest=False)
    except InputError as exc:
        return {**row, "status": "invalid", "reason": str(exc)}, None
    lay = plan.layout
    row.update(tp=lay.tp, dp=lay.dp, ep=lay.ep, weights_gb_per_gpu=plan.weight_bytes / 1e9,
               free_gb_per_gpu=plan.free_bytes / 1e9, plan_context=plan.context,
               plan_concurrency=plan.concurrency,
               plan_max_context=plan.max_context)
    if not plan.fits:
        return {**row, "status": "infeasible", "reason": "; ".join(plan.reasons)}, lay
    if lay.ep != cluster.num_gpus:
        return {**row, "status": "unsupported",
                "reason": f"fits, but the simulator models EP over all {cluster.num_gpus} GPUs (one EP rank "
                          f"per GPU); EP{lay.ep} x MoE-TP{lay.moe_tp} was planned only"}, lay
    return row, lay


# ---------------------------------------------------------------------------- optimize
def _failure(stage: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, MoeplaceError):
        return {"status": "failed", "stage": stage, "reason": str(exc)}
    # A bug or a resource failure: keep the last frames so the row says where.
    tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return {"status": "error", "stage": stage, "reason": tb + at}


def optimize_task(loads: Loads, gpu: str, gpus: int, gpus_per_node: int | None, num_redundant: int,
                  policy: str, rule: str, seed: int, optimize: dict[str, Any]) -> dict[str, Any]:
    """Plan ``policy`` on the first ``plan_fraction`` of the windows of ``loads`` and score it there and
    on the held-out windows (:func:`placement.compare.compare_policies`). Returns ``{"status": "ok",
    "placement": Placement, "scores": {...}, "seconds": s}`` or a failure ``{"status", "stage",
    "reason"}``."""
    t0 = time.perf_counter()
    try:
        cluster = make_cluster(gpus, gpu, gpus_per_node)
        # One process per task already: the optimizer's own process pool would oversubscribe the cores.
        options = {"workers": 1, **optimize.get("options", {})}
        cmp = compare_policies(loads, cluster, num_redundant=num_redundant, policies=[policy], rule=rule,
                               plan_fraction=float(optimize["plan_fraction"]), seed=seed,
                               time_limit=optimize.get("time_limit"), options=options)
    except Exception as exc:  # noqa: BLE001 - reported in the point's row, the sweep goes on
        return _failure("optimize", exc)
    if not cmp.results:  # optimize.time_limit stopped a policy that has no partial answer
        return _failure("optimize", MoeplaceError("; ".join(cmp.notes)))
    r = cmp.results[0]
    held = r.held_out  # None with plan_fraction 1: nothing held out, so no held-out score
    scores = {"plan_balancedness": r.planning.balancedness,
              "held_out_balancedness": None if held is None else held.balancedness,
              "held_out_max_over_mean": None if held is None else held.max_over_mean,
              "held_out_cross_node_share": None if held is None else held.cross_node_share,
              "placement_fingerprint": r.placement.fingerprint()}
    return {"status": "ok", "placement": r.placement, "scores": scores, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------- simulate
def point_trace(path: str, max_tokens: int) -> TraceTokens:
    """What a point routes, read as ``place simulate`` reads it (:func:`sim.runner.read_trace`): the
    workload's trace, its first ``max_tokens`` tokens. The point's placement is an object, not a file, so
    no part is held out here (the optimize stage scores it on its held-out windows)."""
    return read_trace(RunInputs(trace=path, placements=(), max_trace_tokens=max_tokens))[0]


@functools.lru_cache(maxsize=2)
def _trace_tokens(path: str, max_tokens: int) -> TraceTokens:
    """A worker's copy of a trace's tokens (read once per process; local mode passes paths)."""
    return point_trace(path, max_tokens)


def simulate_task(trace: Any, placement: Placement, gpu: str, gpus: int, gpus_per_node: int | None,
                  config: Any, ensemble: Any = None) -> dict[str, Any]:
    """Run the simulator (:func:`sim.runner.simulate`) for one point. ``trace``: a
    :class:`sim.workload.TraceTokens` (Ray passes it through the object store) or ``(path, max_tokens)``;
    ``config``: a :class:`sim.config.SimConfig`; ``ensemble``: a calibration's members that price it (None:
    the shipped ensemble). Returns the table fields or a failure."""
    t0 = time.perf_counter()
    try:
        tokens = _trace_tokens(*trace) if isinstance(trace, tuple) else trace
        cluster = make_cluster(gpus, gpu, gpus_per_node)
        label = placement.provenance.get("policy", "placement")
        res = simulate(tokens, [(label, placement)], cluster, config, ensemble=ensemble)[0]
    except Exception as exc:  # noqa: BLE001 - reported in the point's row, the sweep goes on
        return _failure("simulate", exc)
    s = res.summary
    out = {k: s.get(k) for k in ("output_tok_s", "prefill_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                  "tpot_p99_s", "requests_finished", "requests_rejected", "preemptions",
                                  "mean_imbalance", "straggler_share", "kv_peak", "rebalances", "moved_bytes",
                                  "iterations")}
    out["output_tok_s_per_gpu"] = s["output_tok_s"] / gpus
    out["sim_duration_s"] = s["duration_s"]
    for key in ("output_tok_s", "tpot_p99_s"):  # the ensemble's intervals (sim.ensemble.price_run), where it priced
        if s.get(f"{key}_range"):
            out[f"{key}_lo"], out[f"{key}_hi"] = s[f"{key}_range"]
    if s.get("ensemble"):
        out["ensemble_near"] = s["ensemble"]["near"]
    return {"status": "ok", "fields": out, "seconds": time.perf_counter() - t0}
