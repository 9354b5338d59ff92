"""The sweep driver: plan every point, share the optimize work, simulate on a process pool or on Ray, stream
rows to the table, then compute the frontier and the recommended deployment.

Work sharing: the driver plans every point itself (``plan_memory`` is milliseconds), prepares each
workload once (synthesizes it into the cache, reduces it to Loads, and on Ray puts its tokens into the
object store once), runs one optimize task per distinct optimize key (topology, slot budget, policy,
engine, workload), and starts a point's simulation as soon as its placement exists. Placements are kept
in ``OUT/cache/placements/<key>.json``, so a resumed sweep does not optimize again either.

Executors: :class:`LocalExecutor` (``concurrent.futures`` process pool, spawn start method since polars
and pyarrow threads do not survive ``fork``) and :class:`RayExecutor` (``ray.init`` of a new local
instance with ``num_cpus=workers``, or attaching to ``address``; the instance it started is shut down on
exit, an attached cluster is only disconnected from). Both run the same task functions on the same
inputs, so both produce the same table.

"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import importlib.util
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from moeplace.cli.sim_settings import build_sim_config
from moeplace.cli.sweep.spec import (
    Point,
    SweepSpec,
    Workload,
    check_points,
    expand_points,
    optimize_key,
    point_hash,
    points_seconds,
    workload_fingerprint,
)
from moeplace.cli.sweep.stages import optimize_task, plan_point, point_trace, simulate_task
from moeplace.cli.sweep.store import ResultStore, make_row
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json, write_text_atomic
from moeplace.foundation.formats import check, tagged
from moeplace.foundation.limits import fmt_seconds
from moeplace.placement.export import capabilities, export_placement
from moeplace.placement.export.flags import FlagOptions, format_options, launch_spec, recommended_format
from moeplace.placement.record import Placement, load_placement
from moeplace.placement.windows import routing_windows
from moeplace.sim.calibrate import calibration_run
from moeplace.sim.config import SimConfig
from moeplace.sim.fidelity import fidelity_doc
from moeplace.sim.frontier import FRONTIER_FILE, SWEEP_RECOMMENDED, SWEEP_TABLE, frontier_report
from moeplace.traces.loads import Loads, load_loads
from moeplace.traces.synth import SynthConfig, synthesize

Log = Callable[[str], None]


# ---------------------------------------------------------------------------- executors
class LocalExecutor:
    """A process pool (state: the pool)."""

    name = "local"

    def __init__(self, workers: int) -> None:
        self.capacity = workers
        spawn = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=spawn)

    def put(self, obj: Any) -> Any:
        return obj

    def trace_handle(self, path: str, max_tokens: int) -> Any:
        return (path, max_tokens)  # each worker reads the trace once (stages._trace_tokens caches it)

    def submit(self, fn: Callable, *args: Any) -> cf.Future:
        return self.pool.submit(fn, *args)

    def wait_any(self, futures: list) -> list:
        done, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
        return list(done)

    def result(self, fut: cf.Future) -> Any:
        return fut.result()

    def shutdown(self, pending: list) -> None:
        self.pool.shutdown(wait=not pending, cancel_futures=True)


class RayExecutor:
    """Ray tasks (state: the connection). ``address`` ``None`` starts a local instance."""

    name = "ray"

    def __init__(self, address: str | None, workers: int, object_store_bytes: int, log: Log) -> None:
        try:
            import ray  # optional: the [sweep] extra
        except ImportError:
            raise InputError("Ray is not installed: pip install 'moeplace[sweep]' (or use --local)") from None
        self.ray = ray
        self.started = address is None
        # ERROR: Ray's start-up notices (token files, instance started) are not the sweep's output; task
        # failures come back as rows, so worker logs are not forwarded either.
        kw: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR,
                              "log_to_driver": False}
        try:
            if self.started:
                ray.init(num_cpus=workers, object_store_memory=object_store_bytes, **kw)
            else:
                ray.init(address=address, runtime_env=_ray_runtime_env(), **kw)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"--ray {address or '(local)'}: cannot start or attach to Ray: {exc}") from None
        res = ray.cluster_resources()
        self.capacity = max(1, int(res.get("CPU", 1)))  # tasks take one CPU each
        log(f"ray: {'started a local instance' if self.started else f'attached to {address}'} "
            f"({res.get('CPU', 0):g} CPUs, {len(ray.nodes())} node(s))")
        self._remote: dict[Callable, Any] = {}

    def put(self, obj: Any) -> Any:
        return self.ray.put(obj)

    def trace_handle(self, path: str, max_tokens: int) -> Any:
        return self.ray.put(point_trace(path, max_tokens))  # once; workers read it zero-copy

    def submit(self, fn: Callable, *args: Any) -> Any:
        if fn not in self._remote:
            self._remote[fn] = self.ray.remote(num_cpus=1, max_retries=1)(fn)
        return self._remote[fn].remote(*args)

    def wait_any(self, refs: list) -> list:
        done, _ = self.ray.wait(refs, num_returns=1)
        return done

    def result(self, ref: Any) -> Any:
        return self.ray.get(ref)

    def shutdown(self, pending: list) -> None:
        for r in pending:
            self.ray.cancel(r, force=True)
        self.ray.shutdown()  # stops the instance it started; only disconnects from an attached cluster


def _ray_runtime_env() -> dict[str, Any]:
    """Ship this checkout's packages to the cluster's workers (their third-party dependencies must be
    installed there); ``MOEPLACE_RAY_SHIP_CODE=0`` when moeplace is installed on the cluster."""
    if os.environ.get("MOEPLACE_RAY_SHIP_CODE", "1") == "0":
        return {}
    # Located, not imported: the tasks run moeplace.cli.sweep.stages, which reaches every layer below it.
    return {"py_modules": [importlib.util.find_spec("moeplace").submodule_search_locations[0]]}


class _TaskQueue:
    """Tasks waiting for a worker and tasks running (state). At most ``executor.capacity`` run at once, so
    the order in which they start is ours: simulations first (each one finishes a row), then optimize
    runs, each kind in the order added. Results come back as ``(kind, tag, result)`` in completion order;
    a task that died (a crashed worker) comes back as an ``error`` result."""

    def __init__(self, executor: LocalExecutor | RayExecutor) -> None:
        self.ex = executor
        self.waiting: dict[str, deque] = {"simulate": deque(), "optimize": deque()}
        self.running: dict[Any, tuple[str, Any]] = {}

    def add(self, kind: str, tag: Any, fn: Callable, *args: Any) -> None:
        self.waiting[kind].append((tag, fn, args))

    def in_flight(self) -> list:
        return list(self.running)

    def _fill(self) -> None:
        while len(self.running) < self.ex.capacity:
            kind = next((k for k in ("simulate", "optimize") if self.waiting[k]), None)
            if kind is None:
                return
            tag, fn, args = self.waiting[kind].popleft()
            self.running[self.ex.submit(fn, *args)] = (kind, tag)

    def results(self):
        self._fill()
        while self.running:
            for fut in self.ex.wait_any(list(self.running)):
                kind, tag = self.running.pop(fut)
                try:
                    res = self.ex.result(fut)
                except Exception as exc:  # noqa: BLE001 - a crashed worker: the point is retried on resume
                    res = {"status": "error", "stage": kind,
                           "reason": f"worker failed: {type(exc).__name__}: {exc}"}
                yield kind, tag, res  # the consumer may add follow-up tasks before the queue refills
                self._fill()


# ---------------------------------------------------------------------------- the sweep
@dataclass
class SweepOutcome:
    table: pl.DataFrame
    report: dict[str, Any]
    num_points: int
    num_resumed: int  # rows found finished in OUT/points and not recomputed
    num_run: int  # points that got a new row in this run
    num_optimized: int  # optimize tasks run in this run
    num_placements_reused: int  # optimize keys served from OUT/cache/placements
    backend: str
    wall_s: float
    table_path: Path
    frontier_path: Path


def object_store_bytes(spec: SweepSpec) -> int:
    """Object store of a local Ray instance: room for every workload's routing tokens (``max_trace_tokens``
    x MoE layers x top-k uint16) and Loads twice over, at least 512 MiB."""
    m = spec.model
    tokens = int(spec.simulate["max_trace_tokens"]) * m.num_moe_layers * m.top_k * 2
    windows = -(-int(spec.simulate["max_trace_tokens"]) // int(spec.optimize["window_tokens"])) + 1
    loads = windows * m.num_moe_layers * m.num_experts * 8
    return max(512 * 2**20, 2 * len(spec.workloads) * (tokens + loads))


def sim_config(spec: SweepSpec, point: Point, attention_tp: int) -> SimConfig:
    """The :class:`sim.config.SimConfig` of one point: the spec's shared :class:`SimSettings`, the point's
    axes and its workload's arrivals, through the mapping ``place simulate`` uses (raises InputError
    naming the spec and the point on bad values)."""
    w = spec.workload(point.workload)
    try:
        settings = dataclasses.replace(
            spec.settings, attention_tp=attention_tp, engine=point.engine, kv_dtype=point.kv_dtype,
            rebalance=None if point.rebalance == "static" else point.rebalance, **w.settings)
        config = build_sim_config(settings, spec.model.max_context, mix_what=f"workload {w.name}: context_mix")
    except InputError as exc:
        raise InputError(f"{spec.path}: point #{point.index} ({point.label()}): {exc}") from None
    if spec.cost:  # calibrated constants (place sweep --calibration)
        config = dataclasses.replace(config, cost=config.cost.replace(**spec.cost))
    if config.rebalance is not None and config.rebalance.decision_s is None:
        # a sweep must repeat: the policy's measured decision time varies from run to run, so a point
        # charges the decision only when its rebalance string fixes it (decision=S)
        config = dataclasses.replace(config, rebalance=dataclasses.replace(config.rebalance, decision_s=0.0))
    return config


def point_ranges(report: dict[str, Any]) -> None:
    """Each simulated point of ``report`` (its rows, shared by the frontier and the recommendation) gets,
    beside its output throughput and p99 TPOT, the ensemble's 80 % interval (``output_tok_s_range``,
    ``tpot_p99_s_range``: [lo, hi], from the table's ``*_lo`` / ``*_hi`` columns, sim.ensemble.price_run:
    the shipped ensemble's, or with ``place sweep --calibration`` the calibrated members' within-deployment
    interval); None where neither priced the point (another cost source)."""
    for w in report["workloads"].values():
        for r in w["points"]:
            for key in ("output_tok_s", "tpot_p99_s"):
                lo, hi = r.get(f"{key}_lo"), r.get(f"{key}_hi")
                r[f"{key}_range"] = None if lo is None or hi is None else [lo, hi]


def prepare_trace(spec: SweepSpec, w: Workload, fingerprint: str, cache: Path, log: Log) -> str:
    """The trace of a workload: its own path, or the synthetic trace generated once into the cache."""
    if w.trace is not None:
        return w.trace
    path = cache / "workloads" / fingerprint
    if not path.exists():
        t0 = time.perf_counter()
        info = synthesize(spec.model, SynthConfig(**w.synth), path)
        dt = time.perf_counter() - t0
        log(f"workload {w.name}: synthesized {info['tokens']:,} tokens into {path} ({dt:.1f} s)")
    return str(path)


def prepare_loads(spec: SweepSpec, trace: str, fingerprint: str, cache: Path) -> Loads:
    """Per-window expert loads of a workload (what every policy plans on), cached as a Loads file."""
    wt = int(spec.optimize["window_tokens"])
    path = cache / "loads" / f"{fingerprint}-w{wt}.npz"
    if path.exists():
        return load_loads(path)

    loads = routing_windows([trace], model=spec.model, window_tokens=wt)
    loads.save(path)
    return loads


def _fmt_row(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        tpot = row["tpot_p99_s"]
        return (f"ok: {row['output_tok_s']:,.0f} out tok/s, TPOT p99 "
                f"{'-' if tpot is None else f'{tpot * 1e3:.1f} ms'} (sim {row['wall_simulate_s']:.1f} s)")
    return f"{row['status']} at {row['stage']}: {row['reason']}"


Item = tuple[Point, str, dict[str, Any], SimConfig]  # a point to run: point, hash, plan fields, its SimConfig


def run_sweep(spec: SweepSpec, out: str | Path, *, backend: str = "ray", ray_address: str | None = None,
              workers: int | None = None, log: Log | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None,
              max_points: int | None = None, calibration=None) -> SweepOutcome:
    """Evaluate every point of ``spec`` into ``out`` (see :mod:`moeplace.sweep.store` for the layout).

    ``backend``: ``"ray"`` (``ray_address`` ``None``: start a local instance of ``workers`` CPUs; an
    address or ``"auto"``: attach) or ``"local"`` (a pool of ``workers`` processes). Finished points found
    in ``out`` are not recomputed. ``on_row`` sees every row as it is written (progress, tests).
    ``max_points``: the most points run (default :data:`limits.MAX_SWEEP_POINTS`; more are refused before
    any is expanded)."""
    if backend not in ("ray", "local"):
        raise ValueError(f"backend must be ray or local, got {backend!r}")
    log = log or (lambda msg: None)
    t_start = time.perf_counter()
    workers = max(1, workers or os.cpu_count() or 1)
    check_points(spec, max_points, workers)
    store = ResultStore(out)
    points = expand_points(spec)
    fps = {w.name: workload_fingerprint(spec, w) for w in spec.workloads}
    hashes = [point_hash(spec, p, fps[p.workload]) for p in points]
    index_of = {h: p.index for p, h in zip(points, hashes, strict=True)}
    if len(index_of) != len(points):
        raise InputError(f"{spec.path}: two points hash alike (the same deployment listed twice)")
    finished = store.finished()
    todo = [(p, h) for p, h in zip(points, hashes, strict=True) if h not in finished]
    log(f"{spec.name}: {len(points)} points, {len(points) - len(todo)} already finished in {store.out}; about "
        f"{fmt_seconds(points_seconds(len(todo), workers))} for the rest on {workers} worker(s) (an estimate)")
    emit = _row_writer(store, len(points), len(points) - len(todo), log, on_row)

    groups: dict[str, list[Item]] = {}
    for item in _plan_points(spec, todo, emit):
        groups.setdefault(optimize_key(spec, item[0], fps[item[0].workload]), []).append(item)
    cached = _cached_placements(store, groups)
    num_optimized = 0
    if groups:
        ex = (RayExecutor(ray_address, workers, object_store_bytes(spec), log) if backend == "ray"
              else LocalExecutor(workers))
        run = _Execution(spec, store, fps, groups, emit, ex, log)
        try:
            num_optimized = run.run(cached)
        finally:
            ex.shutdown(run.queue.in_flight())

    table = store.write_table(hashes, index_of)
    report = frontier_report(table, spec.objective)
    report.update({"spec": spec.path, "name": spec.name, "model": spec.model.name,
                   "table": str(store.out / SWEEP_TABLE)})
    report["recommended_launch"] = recommended_launch(spec, report, store)
    # its absolute figures are the simulator's: say how far they were off, and what no validation case
    # covers (the sweep's model, its GPU when it has one; regimes vary by point)
    gpus = sorted({p.gpu for p in points})
    ctx = {"model": spec.model.name, "gpu": gpus[0] if len(gpus) == 1 else None}
    if calibration is not None:
        ctx["calibration"] = calibration_run(calibration, calibration.deployment.gpus,
                                             calibration.deployment.attention_tp, calibration.deployment.engine)
    report["fidelity"] = fidelity_doc(ctx)
    point_ranges(report)
    frontier_path = store.out / FRONTIER_FILE
    write_text_atomic(frontier_path, json.dumps(report, indent=1, default=str) + "\n")
    return SweepOutcome(table=table, report=report, num_points=len(points),
                        num_resumed=len(points) - len(todo),
                        num_run=len(todo), num_optimized=num_optimized,
                        num_placements_reused=len([k for k in groups if k in cached]), backend=backend,
                        wall_s=time.perf_counter() - t_start, table_path=store.out / SWEEP_TABLE,
                        frontier_path=frontier_path)


def _row_writer(store: ResultStore, total: int, done: int, log: Log,
                on_row: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """``emit(fields)``: complete a row, write it to the store, log the progress line, tell ``on_row``."""
    count = [done]

    def emit(row: dict[str, Any]) -> None:
        full = make_row(**row)
        store.write_row(full)
        count[0] += 1
        log(f"[{count[0]:>{len(str(total))}}/{total}] #{full['index']} {full['label']}: {_fmt_row(full)}")
        if on_row is not None:
            on_row(full)

    return emit


def _plan_points(spec: SweepSpec, todo: list[tuple[Point, str]], emit: Callable[[dict[str, Any]], None]
                 ) -> list[Item]:
    """Plan every point here (rows of points that stop at the plan are written now); keep the others with
    their simulation config, built now so a bad simulation setting stops the sweep before any task runs."""
    runnable: list[Item] = []
    for p, h in todo:
        fields, lay = plan_point(spec, p)
        fields["point_hash"] = h
        if "status" in fields:
            emit(fields)
            continue
        runnable.append((p, h, fields, sim_config(spec, p, lay.tp)))
    return runnable


def _cached_placements(store: ResultStore, groups: dict[str, list[Item]]
                       ) -> dict[str, tuple[Placement, dict[str, Any]]]:
    """The placements (and their scores) an earlier run already optimized, by optimize key."""
    pl_dir = store.cache / "placements"
    cached: dict[str, tuple[Placement, dict[str, Any]]] = {}
    for key in groups:
        f, sf = pl_dir / f"{key}.json", pl_dir / f"{key}.scores.json"
        if f.exists() and sf.exists():
            cached[key] = (load_placement(f), read_scores(sf))
    return cached


class _Execution:
    """One sweep's tasks on an executor (state: the queue and what each workload was prepared into). A
    workload's trace, Loads and routing tokens are prepared once, on first use; one optimize task runs
    per optimize key; a point's simulation starts as soon as its placement exists."""

    def __init__(self, spec: SweepSpec, store: ResultStore, fps: dict[str, str], groups: dict[str, list[Item]],
                 emit: Callable[[dict[str, Any]], None], ex: LocalExecutor | RayExecutor, log: Log) -> None:
        self.spec, self.store, self.fps, self.groups, self.emit, self.ex, self.log = (
            spec, store, fps, groups, emit, ex, log)
        self.queue = _TaskQueue(ex)
        self.traces: dict[str, str] = {}
        self.handles: dict[str, Any] = {}
        self.loads: dict[str, Any] = {}

    def run(self, cached: dict[str, tuple[Placement, dict[str, Any]]]) -> int:
        """Queue every group (simulations of cached placements, optimize tasks for the rest), write every
        row as its result comes back. Returns the number of optimize tasks run."""
        num_optimized = 0
        for key, items in self.groups.items():
            if key in cached:
                self.add_sims(key, *cached[key], None)
            else:
                self.add_optimize(key, items[0][0])
                num_optimized += 1
        for kind, what, res in self.queue.results():
            if kind == "optimize":
                self.optimized(what, res)
            elif res["status"] == "ok":
                self.emit({**what, **res["fields"], "status": "ok", "stage": "done",
                           "wall_simulate_s": res["seconds"]})
            else:
                self.emit({**what, "status": res["status"], "stage": res["stage"], "reason": res["reason"]})
        return num_optimized

    def trace_of(self, name: str) -> str:
        if name not in self.traces:
            self.traces[name] = prepare_trace(self.spec, self.spec.workload(name), self.fps[name],
                                              self.store.cache, self.log)
        return self.traces[name]

    def handle_of(self, name: str) -> Any:
        if name not in self.handles:
            self.handles[name] = self.ex.trace_handle(self.trace_of(name),
                                                      int(self.spec.simulate["max_trace_tokens"]))
        return self.handles[name]

    def add_optimize(self, key: str, p: Point) -> None:
        if p.workload not in self.loads:
            ld = prepare_loads(self.spec, self.trace_of(p.workload), self.fps[p.workload], self.store.cache)
            self.loads[p.workload] = self.ex.put(ld)
        self.queue.add("optimize", key, optimize_task, self.loads[p.workload], p.gpu, p.gpus, p.gpus_per_node,
                       p.num_redundant, p.policy, p.engine, self.spec.seed, self.spec.optimize)

    def add_sims(self, key: str, placement: Placement, scores: dict[str, Any], opt_s: float | None) -> None:
        ref = self.ex.put(placement)  # once per placement, however many points simulate it
        for p, _h, fields, cfg in self.groups[key]:
            base = {**fields, "optimize_key": key, "wall_optimize_s": opt_s, **scores}
            self.queue.add("simulate", base, simulate_task, self.handle_of(p.workload), ref, p.gpu, p.gpus,
                           p.gpus_per_node, cfg, self.spec.ensemble)

    def optimized(self, key: str, res: dict[str, Any]) -> None:
        """An optimize task came back: cache its placement and simulate it, or fail its points."""
        if res["status"] == "ok":
            pl_dir = self.store.cache / "placements"
            # scores first: the placement file's existence marks a complete cache entry
            write_text_atomic(pl_dir / f"{key}.scores.json",
                              json.dumps(tagged("sweep-scores", {"scores": res["scores"]}), indent=1))
            res["placement"].save(pl_dir / f"{key}.json")
            self.add_sims(key, res["placement"], res["scores"], res["seconds"])
        else:
            for _p, _h, fields, _cfg in self.groups[key]:
                self.emit({**fields, "optimize_key": key, "status": res["status"],
                           "stage": res["stage"], "reason": res["reason"]})


def read_scores(path: Path) -> dict[str, Any]:
    """The scores cached next to a placement (``<key>.scores.json``, a ``moeplace.sweep-scores`` document;
    the previous release wrote the bare scores object, read as it is)."""
    d = read_json(path)
    scores = d if check(d, "sweep-scores", str(path)) == 0 else d.get("scores")
    if not isinstance(scores, dict):
        raise InputError(f"{path}: field 'scores' is not an object (delete the file to optimize again)")
    return scores


# ---------------------------------------------------------------------------- recommendation -> launch flags
def recommended_launch(spec: SweepSpec, report: dict[str, Any], store: ResultStore) -> dict[str, Any]:
    """Per workload with a recommendation: export its placement as the file of the engine whose replica
    rule it was optimized for (:func:`placement.export.flags.recommended_format`) into
    ``OUT/recommended/<workload>/`` and build the launch command (:mod:`placement.export.flags`)."""
    out: dict[str, Any] = {}
    for name, w in report["workloads"].items():
        best = w["recommended"]
        if best is None:
            continue
        src = store.cache / "placements" / f"{best['optimize_key']}.json"
        if not src.exists():
            out[name] = {"error": f"{src}: the placement of the recommended point is missing from the cache"}
            continue
        exported = recommended_format(best["engine"])
        if exported is None:
            out[name] = {"error": f"no serving engine loads a placement for the {best['engine']} replica rule"}
            continue
        fmt, fname = exported
        placement = load_placement(src)
        rb = best["rebalance"]
        every = window = None
        if rb != "static":
            kv = dict(x.split("=", 1) for x in rb.split(","))
            every, window = int(kv["every"]), int(kv.get("window", kv["every"]))
        opts = FlagOptions(kv_cache_dtype="fp8" if best["kv_dtype"] == "fp8" else "bf16",
                           max_model_len=best["plan_context"],
                           gpu=best["gpu"], online_eplb=rb != "static", eplb_window=window or 1000,
                           eplb_interval=every or 3000, tp=best["tp"], dp=best["dp"])
        d = store.out / SWEEP_RECOMMENDED / name
        opts = dataclasses.replace(opts, placement_path=str(d / "placement.json"))  # what the vLLM plugin reads
        try:
            extra = format_options(placement, fmt, opts)  # a layout the engine cannot express is refused
        except InputError as exc:
            out[name] = {"error": f"point #{best['index']}: {exc}"}
            continue
        placement.save(d / "placement.json")
        warnings = export_placement(placement, spec.model, fmt, d / fname, **extra)
        launch = launch_spec(placement, spec.model, fmt, d / fname, opts)
        cmd = launch.text()
        # what the engines lack for this model, from the capability table (the same lines place optimize prints)
        warnings = [*warnings, *(w for w in capabilities.advice(spec.model, placement.num_redundant) if w not in warnings)]
        notes = []
        if best["kv_dtype"] not in ("fp8", "bf16"):
            notes.append(f"# simulated with KV {best['kv_dtype']}; the engines' flag takes fp8 or bf16/auto")
        cmd = "\n".join(notes + [cmd.rstrip("\n")]) + "\n"
        write_text_atomic(d / "launch.sh", cmd)
        out[name] = {"point": best["index"], "label": best["label"], "format": fmt,
                     "placement": str(d / "placement.json"), "engine_file": str(d / fname),
                     "launch_script": str(d / "launch.sh"), "command": cmd, "warnings": warnings,
                     "applies_placement": launch.applies_placement}
    return out
