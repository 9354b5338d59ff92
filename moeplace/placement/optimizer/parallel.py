"""All layers of a model, in parallel processes, under one hard wall-clock budget.

Each layer gets an equal share of the budget (``time_limit * workers / layers``) and the global deadline;
a layer whose process has not answered by the deadline plus a grace period is replaced by its greedy
start (recorded as ``skipped``), so the run always ends with a valid placement. A budget too small to
start worker processes runs the layers in this process: each then gets its greedy start and whatever
stages fit."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import numpy as np

from moeplace.foundation.files import worker_signals
from moeplace.foundation.progress import bar
from moeplace.placement.optimizer.config import OptimizerConfig
from moeplace.placement.optimizer.greedy import count_bound, greedy_layer
from moeplace.placement.optimizer.groups import solve_grouped_layer
from moeplace.placement.optimizer.layer import LayerResult, scenario_loads, solve_layer
from moeplace.placement.optimizer.local_search import LayerState

DEFAULT_BUDGET = 3600.0   # with no --time-limit: a safety net only; the default effort ends far sooner
GRACE = 1.0       # after the deadline: for a worker to hand back what it has before it is replaced
MIN_PARALLEL = 2.0  # a budget below this (seconds) is not worth starting worker processes for


def _job(args) -> LayerResult:
    layer, loads_we, P, G, gpn, cfg, deadline, budget, samples, origin = args
    mine = min(deadline, time.time() + budget)
    if cfg.keep_groups > 1:
        return solve_grouped_layer(layer, loads_we, P, G, gpn, cfg, mine)
    return solve_layer(layer, loads_we, P, G, gpn, cfg, mine, samples, origin)


def _context():
    """``fork`` where there is one: no re-import of the caller's ``__main__`` (scripts and notebooks need
    no ``if __name__ == "__main__"`` guard) and no import cost per worker. The parent runs no solver
    threads before forking (it only slices arrays), so forking is safe here."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def optimize_layers(loads_wle: np.ndarray, num_slots: int, num_gpus: int, gpus_per_node: int,
                    cfg: OptimizerConfig, samples_nlk: np.ndarray | None = None,
                    origin_lp: np.ndarray | None = None,
                    layer_ids: np.ndarray | None = None) -> list[LayerResult]:
    """Solve every layer. ``loads_wle``: ``[W, L, E]``; ``samples_nlk``: ``[N, L, k]`` or None;
    ``origin_lp``: current ``phy2log [L, P]`` or None; ``layer_ids``: int ``[L]``, the MoE layer each column is (default
    ``0..L-1``) — a layer's search is seeded by its id, so planning some layers of a model gives each
    exactly the placement planning them all does. Returns one :class:`LayerResult` per layer, in column
    order, each with its id."""
    t0 = time.time()
    L = loads_wle.shape[1]
    ids = np.arange(L) if layer_ids is None else np.asarray(layer_ids, dtype=np.int64)
    limit = cfg.time_limit or DEFAULT_BUDGET
    deadline = t0 + limit
    workers = cfg.workers or (os.cpu_count() or 1)
    workers = max(1, min(workers, L))
    if limit < MIN_PARALLEL:
        workers = 1
    # Startup of a worker process costs ~1-2 s of imports; keep it out of the per-layer share.
    overhead = (0.5 if _context().get_start_method() == "fork" else 2.5) if workers > 1 else 0.0
    budget = max(0.05, (limit - overhead - 0.5) * workers / L * 0.9)
    jobs = [(int(ids[l]), loads_wle[:, l, :], num_slots, num_gpus, gpus_per_node, cfg, deadline - 0.3, budget,
             None if samples_nlk is None else samples_nlk[:, l, :],
             None if origin_lp is None else origin_lp[l]) for l in range(L)]
    results: dict[int, LayerResult] = {}  # by column
    pb = bar(L, "layers solved", "layer")
    if workers == 1:
        for l, j in enumerate(jobs):
            results[l] = _job(j)
            pb.update(1)
    else:
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=_context(), initializer=worker_signals)
        try:
            futs = {ex.submit(_job, j): l for l, j in enumerate(jobs)}
            pending = set(futs)
            while pending:
                left = deadline + GRACE - time.time()
                if left <= 0:
                    break
                done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
                for f in done:
                    results[futs[f]] = f.result()
                    pb.update(1)
        finally:
            if len(results) < L:  # a hung worker must not hang the run
                for p in list(getattr(ex, "_processes", {}).values()):
                    p.terminate()
            ex.shutdown(wait=len(results) == L, cancel_futures=True)
    pb.close()
    for l in range(L):  # fallback: the greedy start for any layer that did not come back
        if l not in results:
            wn = scenario_loads(loads_wle[:, l, :], cfg, num_gpus)
            if origin_lp is not None:
                p2l = origin_lp[l]
            elif cfg.keep_groups > 1:  # the model's own order keeps its routing groups whole
                p2l = np.arange(num_slots, dtype=np.int64)
            else:
                p2l = greedy_layer(wn, num_slots, num_gpus)
            v = LayerState(wn, p2l, num_gpus, cfg.cvar).value()
            results[l] = LayerResult(int(ids[l]), p2l, v, count_bound(wn, num_slots, num_gpus), v, 0.0,
                                     skipped=["layer search (greedy start kept)"])
    return [results[l] for l in range(L)]
