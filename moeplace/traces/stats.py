"""Streaming statistics of a routing trace: the Loads contract ``[windows, L, E]`` plus what placement
needs to know about the routing (skew, drift, inter-layer affinity, temporal locality, domain mix) and
a seeded token sample for co-activation objectives.

One pass over the Parquet row groups, validated as it reads (``traces.scan``: worker threads, a
bottom-N token sample), then the statistics of the counts and the sample (``traces.measures``).
**Windows** are by tokens in file (step) order: window ``w`` holds rows
``[w * W * L, (w + 1) * W * L)`` (``W`` = window tokens, ``L`` = MoE layers), i.e. exactly ``W`` tokens
when each token has its ``L`` rows, as ``place trace synth`` and captures write them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation import limits
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, register_kind, tagged_artifact
from moeplace.foundation.limits import fmt_count
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import bar
from moeplace.traces.loads import Loads
from moeplace.traces.measures import (  # noqa: F401  (affinity_lift, pair_counts, top_share: part of this module's API)
    AFFINITY_COVERAGE_PAIRS,
    affinity_arrays,
    affinity_jobs,
    affinity_lift,
    affinity_pair,
    pair_counts,
    skew_and_cv,
    token_locality,
    top_share,
    window_drift,
)
from moeplace.traces.scan import PassSpec, Sampler, partials, pass_workers, ray_reducer, worker_pool
from moeplace.traces.validate import Raise, RowOrder, open_trace

DEFAULT_WINDOW_TOKENS = 4096
DEFAULT_SAMPLE_TOKENS = 4096


@dataclass(frozen=True, eq=False)
class TraceStats:
    """Statistics of one trace. Arrays: ``layer_skew``/``layer_cv`` float ``[L]`` (whole trace);
    ``drift_corr``/``drift_js`` float ``[W-1]`` (consecutive windows, mean over layers);
    ``affinity_pairs`` int ``[P]`` (index ``l`` of pair ``(l, l+1)``), ``affinity_lift``,
    ``affinity_coverage``, ``affinity_coverage_shuffled`` float ``[P]``; ``domain_tokens`` float
    ``[W, D]``."""

    path: str
    loads: Loads
    num_rows: int
    num_tokens: int
    num_requests: int
    domains: tuple[str, ...]
    domain_tokens: np.ndarray
    layer_skew: np.ndarray
    layer_cv: np.ndarray
    drift_corr: np.ndarray
    drift_js: np.ndarray
    affinity_pairs: np.ndarray
    affinity_lift: np.ndarray
    affinity_coverage: np.ndarray
    affinity_coverage_shuffled: np.ndarray
    locality: float
    locality_pairs: int
    bytes_on_disk: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> ModelSpec:
        return self.loads.model

    @property
    def num_selections(self) -> int:
        return self.num_rows * self.model.top_k

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (no per-window loads)."""
        def f(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

        samples = self.loads.samples
        return {
            "path": self.path, "model": self.model.name, "rows": self.num_rows, "tokens": self.num_tokens,
            **({"layers": self.model.layers_label} if self.model.is_partial else {}),
            "selections": self.num_selections, "requests": self.num_requests,
            "windows": self.loads.num_windows, "window_tokens": self.loads.window_tokens,
            "domains": list(self.domains),
            "domain_mix_per_window": np.round(self.domain_tokens / np.maximum(
                self.domain_tokens.sum(axis=1, keepdims=True), 1), 4).tolist(),
            "skew_median": f(float(np.median(self.layer_skew))), "skew_max": f(float(self.layer_skew.max())),
            "skew_per_layer": np.round(self.layer_skew, 3).tolist(),
            "cv_median": f(float(np.median(self.layer_cv))), "cv_per_layer": np.round(self.layer_cv, 3).tolist(),
            "drift_corr_mean": f(float(self.drift_corr.mean())) if len(self.drift_corr) else None,
            "drift_js_mean": f(float(self.drift_js.mean())) if len(self.drift_js) else None,
            "drift_corr": np.round(self.drift_corr, 4).tolist(), "drift_js": np.round(self.drift_js, 5).tolist(),
            "affinity_lift_mean": (f(float(np.nanmean(self.affinity_lift)))
                                   if np.isfinite(self.affinity_lift).any() else None),
            "affinity_top20_coverage_mean": (f(float(np.nanmean(self.affinity_coverage)))
                                             if np.isfinite(self.affinity_coverage).any() else None),
            "affinity_top20_coverage_permuted_mean": (f(float(np.nanmean(self.affinity_coverage_shuffled)))
                                                      if np.isfinite(self.affinity_coverage).any() else None),
            "affinity_pairs": self.affinity_pairs.tolist(),
            "affinity_lift": np.round(self.affinity_lift, 4).tolist(),
            "locality": f(self.locality), "locality_pairs": self.locality_pairs,
            "sample_tokens": 0 if samples is None else int(samples.shape[0]),
            "bytes_on_disk": self.bytes_on_disk,
            "bytes_per_selection": self.bytes_on_disk / max(self.num_selections, 1),
            "seconds": self.seconds, "selections_per_s": self.num_selections / max(self.seconds, 1e-9),
            **self.extra,
        }


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def compute_stats(path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                  sample_tokens: int = DEFAULT_SAMPLE_TOKENS, seed: int = 0,
                  workers: int | None = None, loads_only: bool = False, ray: str | None = None
                  ) -> TraceStats | Loads:
    """One streaming pass over the trace at ``path`` (file or directory). See the module docstring.

    ``workers``: threads that decode and reduce row groups (1 = in this thread; default: one
    per core for traces of >= 16 M selections). The result does not depend on it: partials merge in trace
    order. ``ray``: reduce the row groups as Ray tasks instead (``"local"``: a local instance of
    ``workers`` CPUs, else the address of a running cluster whose nodes read ``path`` at the same path;
    :class:`traces.scan.RayReducer`): the same result. ``loads_only``: return just the :class:`Loads` (counts, token sample and, in its provenance,
    each window's dominant domain ``window_domains`` when the trace has domains), skipping the statistics
    (affinity, locality, drift), which cost more than the pass on small traces."""
    t0 = time.perf_counter()
    if window_tokens < 1:
        raise InputError(f"--window-tokens must be >= 1, got {window_tokens}")
    if sample_tokens < 0:
        raise InputError(f"--sample-tokens must be >= 0, got {sample_tokens}")
    trace = open_trace(path)  # the gate: file-level checks here, row checks on every decoded row group
    model, provenance = trace.model, trace.provenance
    num_layers = model.num_moe_layers
    # a log of some MoE layers only (an import records which) has that many rows per token
    covered = provenance.get("layers_covered") if isinstance(provenance, dict) else None
    rows_per_token = num_layers
    if isinstance(covered, list) and covered and set(covered) <= set(model.moe_layers):
        rows_per_token = len(set(covered))
    rows_per_window = window_tokens * rows_per_token
    jobs = trace.row_groups()
    total_rows = trace.num_rows
    num_windows = -(-total_rows // rows_per_window)
    extra = ("domain",) if "domain" in trace.columns else ()
    sampler = Sampler(sample_tokens, total_rows // rows_per_token, seed)
    with ray_reducer(ray, workers) as reducer:
        files = trace.file_paths
        num_layers, num_experts, k = model.num_moe_layers, model.num_experts, model.top_k
        num_workers = reducer.capacity if reducer is not None else pass_workers(workers, len(jobs), total_rows * k)
        # the counts grow with the window count (a tiny --window-tokens): refused before any is allocated
        est = limits.stats_estimate(
            num_windows=num_windows, num_layers=num_layers, num_experts=num_experts,
            workers=1 if reducer is not None else num_workers,  # Ray tasks hold their counts on their nodes
            mapped_bytes=max((_size(f) for f in files), default=0),
            group_windows=max((-(-n // rows_per_window) + 1 for f in trace.files for n in f.row_groups), default=1),
            what=f"{path} at --window-tokens {window_tokens} ({fmt_count(num_windows)} "
                 f"window{'s' if num_windows != 1 else ''})")
        # the decode buffers do not shrink with larger windows: then only a higher limit helps
        counts_dominate = est.bytes > 2 * limits.STATS_BASE_BYTES
        limits.require_memory(est, advice="choose a larger --window-tokens, or raise the memory limit"
                              if counts_dominate else "raise the memory limit (ulimit -v, the container's memory)")
        spec = PassSpec(trace=trace, jobs=tuple(jobs), extra_columns=extra, model=model,
                         rows_per_window=rows_per_window, num_windows=num_windows, sample_tokens=sample_tokens,
                         sample_threshold=int(sampler.threshold), seed=seed)

        counts = np.zeros((num_windows, num_layers, num_experts), np.int64)
        domain_ids: dict[str, int] = {}
        domain_rows: list[np.ndarray] = []  # per domain: rows per window
        requests: set[int] = set()
        order = RowOrder(Raise())
        local = 1 if reducer is not None else num_workers
        with worker_pool(local, len(jobs)) as pool, bar(len(jobs), "stats pass", "row group") as pb:
            parts = reducer.partials(spec) if reducer is not None else partials(spec, pool, num_workers)
            for j, part in enumerate(parts):
                pb.update(1)
                fi, rg, _ = jobs[j]
                order.feed(part.edge, f"the last row of {files[fi - 1].name}" if rg == 0 and fi > 0 else "the row before")
                if part.counts is not None:
                    counts[part.w0:part.w0 + len(part.counts)] += part.counts
                requests.update(part.requests.tolist())
                if part.domain_rows is not None:
                    # domains numbered by first appearance in trace order, as the rows come
                    for name, rows in zip(part.domain_names, part.domain_rows):
                        d = domain_ids.setdefault(name, len(domain_ids))
                        if d == len(domain_rows):
                            domain_rows.append(np.zeros(num_windows, np.int64))
                        domain_rows[d] += rows
                sampler.add_candidates(part.sample)
            order.finish()
            pb.close()

            # the drift needs only the counts: on a worker thread while this one merges the sample
            drift = pool.submit(window_drift, counts) if pool is not None and not loads_only else None
            samples, s_rid, s_pos, s_win = sampler.result(num_layers, k)
            if not loads_only:
                # the affinity pairs (the costly statistic) on the worker threads while this one does the rest
                aff_jobs = affinity_jobs(samples, seed)
                aff_args = [(samples[:, li:li + 2], num_experts, train, test, perm, i < AFFINITY_COVERAGE_PAIRS)
                            for i, (li, train, test, perm) in enumerate(aff_jobs)]
                aff_futures = [pool.submit(affinity_pair, *a) for a in aff_args] if pool is not None else None
            rows_per_layer = counts.sum(axis=(0, 2)) // k
            num_tokens = int(rows_per_layer.max())
            window_rows = np.minimum(rows_per_window, total_rows - np.arange(num_windows) * rows_per_window)
            labels = tuple(f"tokens {w * window_tokens}-{w * window_tokens + int(r) // rows_per_token}"
                           for w, r in enumerate(window_rows))
            loads = Loads(counts, model, window_tokens, labels,
                          {"kind": "trace", "path": str(path), "trace": provenance}, samples, s_win)
            if loads_only:  # the statistics below cost more than the pass itself on small traces
                if domain_rows:  # each window's dominant domain: the scenarios of the shift estimate
                    names = sorted(domain_ids, key=domain_ids.get)
                    per = np.stack(domain_rows, axis=1)  # [W, D] rows per window per domain
                    dom = [names[int(i)] for i in per.argmax(axis=1)]
                    # how pure each window is: the dominant tag's share of its rows (a window that mixes domains
                    # puts every domain's tokens into every scenario built from these tags)
                    share = [round(float(x), 4) for x in per.max(axis=1) / np.maximum(per.sum(axis=1), 1)]
                    loads = Loads(counts, model, window_tokens, labels,
                                  {**loads.provenance, "window_domains": dom, "window_domain_share": share},
                                  samples, s_win)
                return loads
            skew, cv = skew_and_cv(counts.sum(axis=0))
            locality, n_pairs = token_locality(samples, s_rid, s_pos)
            corr, js = drift.result() if drift is not None else window_drift(counts)
            aff_results = ([f.result() for f in aff_futures] if aff_futures is not None
                           else [affinity_pair(*a) for a in aff_args])
        pairs, lift, cov, cov_ind = affinity_arrays(aff_jobs, aff_results)
        domains = tuple(sorted(domain_ids, key=domain_ids.get))
        domain_tokens = (np.stack(domain_rows, axis=1) / rows_per_token if domain_rows
                         else np.zeros((num_windows, 0)))
        disk = sum(f.stat().st_size for f in files)
        return TraceStats(path=str(path), loads=loads, num_rows=total_rows, num_tokens=num_tokens,
                          num_requests=len(requests), domains=domains, domain_tokens=domain_tokens,
                          layer_skew=skew, layer_cv=cv, drift_corr=corr, drift_js=js, affinity_pairs=pairs,
                          affinity_lift=lift, affinity_coverage=cov, affinity_coverage_shuffled=cov_ind,
                          locality=locality, locality_pairs=n_pairs, bytes_on_disk=disk,
                          seconds=time.perf_counter() - t0,
                          extra={"workers": num_workers, **({"ray_cpus": num_workers} if reducer is not None else {})})


def trace_loads(path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                sample_tokens: int = DEFAULT_SAMPLE_TOKENS, seed: int = 0, workers: int | None = None,
                ray: str | None = None) -> Loads:
    """The Loads ``[windows, L, E]`` of a trace (with the token sample), by one streaming pass."""
    return compute_stats(path, window_tokens, sample_tokens, seed, workers, loads_only=True, ray=ray)


TRACE_STATS = register_kind(OutputKind("trace statistics JSON", False, tagged_artifact(
    "trace-stats", "path", "model", "tokens", "window_tokens", "skew_median")))
