"""What a run records and reports: per-iteration time series, per-request metrics, the summary, and
the side-by-side table of several placements."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, atomic_path, read_json, register_kind, write_text_atomic
from moeplace.foundation.formats import check, tag, tagged
from moeplace.sim.chrome_trace import LAYER_ITERATIONS, iteration_events, request_events
from moeplace.sim.fidelity import fidelity_doc, with_ranges
from moeplace.sim.measured import cost_source


class Recorder:
    """Collects a run's measurements (state of one simulation)."""

    def __init__(self, sim, chrome: bool = False) -> None:
        self.sim = sim
        self.requests: list = []
        self.preemptions = 0
        self.rejected = 0
        self.transfer_bytes = 0.0
        self.prefill_tokens_done = 0
        self.output_tokens_done = 0
        self.prompt_tokens_done = 0  # prompts (cache hits included) whose first token came in the window
        self.decode_tokens_done = 0  # tokens made by decoding sequences in the window
        self.decode_seq_time = 0.0  # sum over the window's decode iterations of sequences x duration
        # per pool (a deployment's prefill and decode pools): tokens prefilled and decoded, busy seconds
        self.by_pool: dict[str, dict[str, float]] = {}
        self.warmup = sim.config.warmup_s
        self.series: dict[str, list] = {k: [] for k in (
            "time", "pool", "iteration", "duration", "decode_seqs", "prefill_tokens", "batch_tokens",
            "attention_s", "experts_s", "comm_s", "straggler_s", "stall_s", "imbalance", "nvlink_bytes",
            "nic_bytes", "kv_occupancy", "state_occupancy", "running", "waiting")}
        self.layer_straggler: list[np.ndarray] = []
        self.chrome = chrome
        self.chrome_events: list[dict] = []
        self.layer_share: np.ndarray | None = None

    def iteration(self, pool, now: float, dt: float, st, work, moe, stall: float) -> None:
        s = self.series
        cost = pool.cost
        per_copy = cost.copy_bytes("dispatch") + cost.copy_bytes("combine")
        kv, state, running, waiting = pool.occupancy()
        mean = moe.tokens.mean(axis=1)
        imb = float(np.mean(moe.tokens.max(axis=1) / np.where(mean > 0, mean, 1.0)))
        for k, v in (("time", now), ("pool", pool.name), ("iteration", pool.iteration), ("duration", dt),
                     ("decode_seqs", int(work.dec_seqs.sum())), ("prefill_tokens", int(work.pre_tokens.sum())),
                     ("batch_tokens", int(work.tokens.sum())), ("attention_s", st.attention),
                     ("experts_s", st.experts), ("comm_s", st.comm), ("straggler_s", float(st.straggler.sum())),
                     ("stall_s", stall), ("imbalance", imb),
                     ("nvlink_bytes", float(moe.nvlink.sum()) * per_copy), ("nic_bytes", float(moe.nic.sum()) * per_copy),
                     ("kv_occupancy", kv), ("state_occupancy", state), ("running", running), ("waiting", waiting)):
            s[k].append(v)
        self.layer_straggler.append(st.straggler.astype(np.float32))
        if self.chrome and pool.iteration <= self.sim.config.chrome_trace_iterations:
            self.chrome_events += iteration_events(pool, now, dt, st, work, stall, self.sim.model,
                                                   layers=pool.iteration <= LAYER_ITERATIONS)

    def in_window(self, now: float) -> bool:
        """Steady-state window: after the warm-up, up to the end of the run."""
        return self.warmup <= now <= self.sim.config.duration

    def tokens_done(self, now: float, output: int, prefill: int, decoded: int = 0, decode_seqs: int = 0,
                    dt: float = 0.0, pool: str | None = None) -> None:
        if self.in_window(now):
            self.output_tokens_done += output
            self.prefill_tokens_done += prefill
            self.decode_tokens_done += decoded
            self.decode_seq_time += decode_seqs * dt
            if pool is not None:
                c = self.by_pool.setdefault(pool, {"prefill": 0.0, "decoded": 0.0, "output": 0.0, "busy": 0.0})
                c["prefill"] += prefill
                c["decoded"] += decoded
                c["output"] += output
                c["busy"] += min(dt, now - self.warmup)  # the part of the iteration inside the window

    def prompt_done(self, now: float, prompt_tokens: int) -> None:
        if self.in_window(now):
            self.prompt_tokens_done += prompt_tokens

    def result(self, wall: float) -> SimResult:
        sim = self.sim
        ts = pl.DataFrame(self.series, schema_overrides={"pool": pl.String})
        if self.layer_straggler:
            L = len(self.layer_straggler[0])
            arr = np.stack(self.layer_straggler)
            ts = ts.with_columns(pl.Series("layer_straggler_s", arr, dtype=pl.Array(pl.Float32, L)))
        reqs = request_frame(self.requests)
        summary = summarize(ts, reqs, self, wall)
        chrome = None
        if self.chrome:
            chrome = self.chrome_events + request_events(self.requests[:2000], sim.config.duration)
        return SimResult(sim.label, summary, reqs, ts, chrome)


def request_frame(requests: list) -> pl.DataFrame:
    nan = float("nan")
    rows = {
        "request_id": [q.id for q in requests],
        "pool": [q.pool for q in requests],
        "dp_rank": [q.rank for q in requests],
        "arrival_s": [q.arrival for q in requests],
        "prompt_tokens": [q.prompt_len for q in requests],
        "output_tokens": [q.output_len for q in requests],
        "generated_tokens": [q.generated for q in requests],
        "queue_s": [q.queue_time if not math.isnan(q.admitted) else nan for q in requests],
        "first_token_s": [q.first_token for q in requests],
        "finished_s": [q.finished if not q.rejected else nan for q in requests],
        "preemptions": [q.preemptions for q in requests],
        "rejected": [q.rejected for q in requests],
        "kv_transfer_s": [q.transfer_s for q in requests],
    }
    df = pl.DataFrame(rows, schema_overrides={"pool": pl.String, "queue_s": pl.Float64,
                                              "first_token_s": pl.Float64, "finished_s": pl.Float64,
                                              "arrival_s": pl.Float64, "kv_transfer_s": pl.Float64})
    return df.with_columns(
        ttft_s=pl.col("first_token_s") - pl.col("arrival_s"),
        tpot_s=pl.when(pl.col("output_tokens") > 1)
        .then((pl.col("finished_s") - pl.col("first_token_s")) / (pl.col("output_tokens") - 1))
        .otherwise(None),
    ).with_columns(pl.col(c).fill_nan(None) for c in ("queue_s", "first_token_s", "finished_s", "ttft_s", "tpot_s",
                                                      "kv_transfer_s"))


def _pct(s: pl.Series, q: float) -> float | None:
    s = s.drop_nulls()
    if s.len() == 0:
        return None
    return float(np.percentile(s.to_numpy(), q))


def latency_window(reqs: pl.DataFrame, warmup_s: float) -> tuple[pl.DataFrame, str]:
    """The requests a run's latency figures are taken over, and which window that is: those finished after
    the warm-up ("steady"), or every finished request where none did ("all")."""
    done = reqs.filter(pl.col("finished_s").is_not_null())
    steady = done.filter(pl.col("finished_s") >= warmup_s)
    return (steady, "steady") if steady.height else (done, "all")


def summarize(ts: pl.DataFrame, reqs: pl.DataFrame, rec: Recorder, wall: float) -> dict[str, Any]:
    sim = rec.sim
    dur = sim.config.duration
    window = dur - rec.warmup
    busy = float(ts["duration"].sum()) if ts.height else 0.0
    strag = float(ts["straggler_s"].sum()) if ts.height else 0.0
    per_layer = (np.stack(rec.layer_straggler).sum(axis=0) if rec.layer_straggler
                 else np.zeros(sim.model.num_moe_layers))
    lat, lat_window = latency_window(reqs, rec.warmup)
    out_tok_s = rec.output_tokens_done / window
    # decode speed each sequence sees: tokens made per second of decoding, token-weighted over the window
    per_user = rec.decode_tokens_done / rec.decode_seq_time if rec.decode_seq_time > 0 else None
    return {**routing_coverage(sim),
        "label": sim.label,
        "mode": sim.config.mode,
        "duration_s": dur,
        "wall_s": wall,
        "route_wall_s": sim.route_wall,
        "iterations": int(ts.height),
        "requests_arrived": int(reqs.height),
        "requests_finished": int(reqs["finished_s"].is_not_null().sum()),
        "requests_rejected": rec.rejected,
        "preemptions": rec.preemptions,
        "warmup_s": rec.warmup,
        "latency_window": lat_window,
        "output_tok_s": out_tok_s,
        "prefill_tok_s": rec.prefill_tokens_done / window,
        "input_tok_s": rec.prompt_tokens_done / window,
        "num_gpus": sim.num_gpus,
        "cost_model": cost_source(sim.cost),
        "output_tok_s_per_gpu": out_tok_s / sim.num_gpus,
        "input_tok_s_per_gpu": rec.prompt_tokens_done / window / sim.num_gpus,
        "per_user_tok_s": per_user,
        "itl_s": 1.0 / per_user if per_user else None,
        "ttft_p50_s": _pct(lat["ttft_s"], 50),
        "ttft_p99_s": _pct(lat["ttft_s"], 99),
        "tpot_p50_s": _pct(lat["tpot_s"], 50),
        "tpot_p99_s": _pct(lat["tpot_s"], 99),
        "queue_p50_s": _pct(reqs["queue_s"], 50),
        "queue_p99_s": _pct(reqs["queue_s"], 99),
        "busy_s": busy,
        "straggler_s": strag,
        "straggler_share": strag / busy if busy else 0.0,
        "straggler_per_layer_ms": float(per_layer.mean() / max(ts.height, 1) * 1e3),
        "straggler_by_layer_s": per_layer.tolist(),
        "experts_s": float(ts["experts_s"].sum()) if ts.height else 0.0,
        "comm_s": float(ts["comm_s"].sum()) if ts.height else 0.0,
        "attention_s": float(ts["attention_s"].sum()) if ts.height else 0.0,
        "stall_s": float(ts["stall_s"].sum()) if ts.height else 0.0,
        "mean_imbalance": float(ts["imbalance"].mean()) if ts.height else 0.0,
        "mean_batch_tokens": float(ts["batch_tokens"].mean()) if ts.height else 0.0,
        "mean_decode_seqs": float(ts["decode_seqs"].mean()) if ts.height else 0.0,
        "nvlink_bytes": float(ts["nvlink_bytes"].sum()) if ts.height else 0.0,
        "nic_bytes": float(ts["nic_bytes"].sum()) if ts.height else 0.0,
        "kv_transfer_bytes": rec.transfer_bytes,
        "kv_peak": float(ts["kv_occupancy"].max()) if ts.height else 0.0,
        "state_peak": float(ts["state_occupancy"].max()) if ts.height else 0.0,
        "rebalances": sum(p.rebalancer.count for p in sim.pools_list if p.rebalancer is not None),
        "moved_bytes": sum(p.rebalancer.moved_bytes for p in sim.pools_list if p.rebalancer is not None),
        **(pool_figures(rec, lat, window) if getattr(sim, "deployment", False) else {}),
    }


def pool_figures(rec: Recorder, lat: pl.DataFrame, window: float) -> dict[str, Any]:
    """A deployment's per-pool figures (flat keys, so they are table rows like the others): the prefill
    pool's prompt tokens per second (and per GPU) and busy share; the KV hand-off (prefill end to the decode
    rank holding the cache, queueing on the link included); the decode pool's decode tokens per second per GPU
    and busy share. The run's TTFT is the prefill pool's and its TPOT the decode pool's (no second copy: the
    ensemble prices those once). Also, under ``pool_figures``, each pool's GPUs, layout and counters."""
    sim = rec.sim
    pre, dec = sim.pools_list[0], sim.pools_list[-1]
    cp = rec.by_pool.get(pre.name, {})
    cd = rec.by_pool.get(dec.name, {})
    out = {
        "prefill_pool_tok_s": cp.get("prefill", 0.0) / window,
        "prefill_pool_tok_s_per_gpu": cp.get("prefill", 0.0) / window / pre.num_gpus,
        "prefill_pool_busy": cp.get("busy", 0.0) / window,
        "kv_transfer_p50_s": _pct(lat["kv_transfer_s"], 50),
        "kv_transfer_p99_s": _pct(lat["kv_transfer_s"], 99),
        "decode_pool_tok_s_per_gpu": cd.get("decoded", 0.0) / window / dec.num_gpus,
        "decode_pool_busy": cd.get("busy", 0.0) / window,
    }
    out["pool_figures"] = {p.name: {"gpus": p.num_gpus, "attention_tp": p.engine.attention_tp,
                                    "dp": len(p.ranks), "moe_tp": p.engine.moe_tp,
                                    "max_batched_tokens": p.engine.max_batched_tokens, "max_seqs": p.engine.max_seqs,
                                    "kv_link": p.engine.kv_link, **rec.by_pool.get(p.name, {})}
                           for p in sim.pools_list}
    return out


def routing_coverage(sim) -> dict[str, Any]:
    """How far the run outlived its trace (:mod:`sim.routing`): ``routed_tokens`` (token routings of all
    pools), ``trace_passes`` (that over the trace's tokens), ``routing_repeat_share`` (routed tokens that
    repeat a trace token already routed in this run), with a rebalancer ``rebalanced_repeat_share`` (the
    same over the tokens routed from its first decision on: what it is scored on), and ``trace_note``: a
    warning when the run routed more than its trace (None otherwise)."""
    routed = sum(p.router.routed_tokens for p in sim.pools_list)
    repeated = sum(p.router.repeated_tokens for p in sim.pools_list)
    T = sim.trace.num_tokens
    tl = getattr(sim.trace, "timeline", None)
    if tl is not None:  # drawn from distributions over time (sim.timeline): no trace token is walked
        how = ("the expert loads (per-window distributions, no per-token routes)" if tl.drawn
               else "the input's per-window expert distributions")
        return {"trace_tokens": T, "routed_tokens": routed, "routing_repeat_share": 0.0, "trace_note": None,
                "routing_source": (f"routes drawn from {how}, {tl.num_windows} windows over {tl.duration_s:g} "
                                   "simulated s: an estimate")}
    out: dict[str, Any] = {"trace_tokens": T, "routed_tokens": routed, "trace_passes": routed / T,
                           "routing_repeat_share": repeated / routed if routed else 0.0}
    firsts = [(p.router, p.rebalancer.routed_at_first) for p in sim.pools_list
              if p.rebalancer is not None and p.rebalancer.routed_at_first is not None]
    if firsts:
        r_after = sum(r.routed_tokens - a for r, (a, _) in firsts)
        rep_after = sum(r.repeated_tokens - b for r, (_, b) in firsts)
        out["rebalanced_repeat_share"] = rep_after / r_after if r_after else 0.0
    note = None
    if routed > T:
        note = (f"the run routed {routed / T:.1f}x its trace's {T:,} tokens ({routed:,} token routings): "
                f"{out['routing_repeat_share']:.1%} of them repeat routing already simulated")
        if "rebalanced_repeat_share" in out:
            note += (f", {out['rebalanced_repeat_share']:.1%} of those after the first rebalance (the rebalancer "
                     "is scored on traffic it may have observed)")
        note += "; a longer trace (or a shorter --duration) keeps every routed token unseen"
    out["trace_note"] = note
    return out


@dataclass
class SimResult:
    label: str
    summary: dict[str, Any]
    requests: pl.DataFrame
    timeseries: pl.DataFrame
    chrome_events: list[dict] | None = field(default=None, repr=False)
    pools: list | None = field(default=None, repr=False)  # the run's pools, with their iteration samples


# ---------------------------------------------------------------------------- output
def file_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "run"


def summaries_doc(results: list[SimResult], run: dict[str, Any] | None = None,
                  settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``moeplace.sim-summary`` document: ``{"format", "summaries": [one summary per placement],
    "fidelity", "settings"}`` (``summary.json``, and what ``place simulate --json`` prints); ``fidelity``: how
    far the simulator's absolute figures were from published deployments, for the run's context ``run``
    (:func:`sim.fidelity.fidelity_doc`); ``settings``: the run's resolved flags, when a command line made it
    (what ``--config`` reads back). Where the shipped ensemble priced the run, each throughput and per-token
    time of a summary is its members' median with its 80 % interval beside it (``output_tok_s_range:
    [lo, hi]``, :func:`sim.ensemble.price_run`) and ``ensemble`` says how it was priced; a figure that has no
    value because what it measures never ran is null and named under ``not_simulated`` with the reason
    (:func:`not_simulated`)."""
    fid = fidelity_doc(run)
    doc = {"summaries": [{**with_ranges(r.summary),
                          **({"not_simulated": ns} if (ns := not_simulated(r.summary)) else {})} for r in results],
           "fidelity": fid}
    if settings is not None:
        doc["settings"] = settings
    return tagged("sim-summary", doc)


CONFIG_FILE = "config.json"  # the files of a simulation output directory (write_outputs)
SUMMARY_FILE = "summary.json"
REQUESTS_SUFFIX = ".requests.parquet"
TIMESERIES_SUFFIX = ".timeseries.parquet"


def write_outputs(out: str | Path, results: list[SimResult], config: dict[str, Any],
                  run: dict[str, Any] | None = None) -> None:
    """``out/``: ``config.json`` (the resolved config, a ``moeplace.sim-config`` document),
    ``summary.json`` (:func:`summaries_doc`, with ``run``: the label's run context), and per placement
    ``<label>.requests.parquet`` and ``<label>.timeseries.parquet``. Written atomically as a directory."""
    with atomic_path(out, directory=True) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(tagged("sim-config", config), indent=1, default=str) + "\n")
        (tmp / SUMMARY_FILE).write_text(json.dumps(summaries_doc(results, run, config.get("settings")), indent=1)
                                        + "\n")
        for r in results:
            name = file_label(r.label)
            r.requests.write_parquet(tmp / f"{name}{REQUESTS_SUFFIX}")
            r.timeseries.write_parquet(tmp / f"{name}{TIMESERIES_SUFFIX}")


def write_chrome_trace(path: str | Path, results: list[SimResult]) -> None:
    """One Chrome trace-event JSON (Perfetto / chrome://tracing); one process per placement."""
    events = []
    for pid, r in enumerate(results):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": r.label}})
        for e in r.chrome_events or []:
            events.append({**e, "pid": pid})
    # the tag goes in the trace-event format's own metadata field, first, so that the file is recognised by
    # its first bytes (it can be large); viewers ignore it
    doc = {"otherData": {"format": tag("chrome-trace")}, "traceEvents": events, "displayTimeUnit": "ms"}
    write_text_atomic(path, json.dumps(doc))  # json.dumps keeps key order: the tag leads the file


def _is_sim_run(p: Path) -> bool:
    """What :func:`write_outputs` writes, and nothing else."""
    names = {f.name for f in p.iterdir()}
    rest = {n for n in names if n.endswith((REQUESTS_SUFFIX, TIMESERIES_SUFFIX))}
    return {CONFIG_FILE, SUMMARY_FILE} <= names and names - rest == {CONFIG_FILE, SUMMARY_FILE}


_CHROME_HEAD = ('{"otherData": {"format": "' + tag("chrome-trace").split("/")[0] + "/").encode()  # any version


def _is_chrome_trace(p: Path) -> bool:
    """What :func:`write_chrome_trace` writes: its tag leads the file (read at the start only: the file can
    be large); untagged, the previous release's ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` (read at
    both ends)."""
    with open(p, "rb") as fh:
        head = fh.read(len(_CHROME_HEAD))
        fh.seek(max(0, p.stat().st_size - 64))
        tail = fh.read()
    if head == _CHROME_HEAD:
        return True
    return head.startswith(b'{"traceEvents":') and tail.rstrip().endswith(b'"displayTimeUnit": "ms"}')


SIM_OUTPUT = register_kind(OutputKind("simulation output directory", True, _is_sim_run))
CHROME_TRACE = register_kind(OutputKind("Chrome trace", False, _is_chrome_trace))


def read_summaries(path: str | Path) -> list[dict[str, Any]]:
    """The summaries of a ``summary.json`` (a ``moeplace.sim-summary`` document, or the bare list of
    summaries the previous release wrote); each a JSON object with a ``label``."""
    p = Path(path)
    d = read_json(p)
    if isinstance(d, list):  # the previous release wrote the bare list, which has no room for a tag
        summaries = d
    elif check(d, "sim-summary", str(p)) == 0:  # untagged, and not that list: not a summary file
        raise InputError(f"{p}: field 'format' missing, expected a moeplace.sim-summary file")
    else:
        summaries = d.get("summaries")
    if not isinstance(summaries, list) or not all(isinstance(s, dict) and "label" in s for s in summaries):
        raise InputError(f"{p}: field 'summaries' is not a list of summaries with field 'label' "
                         "(written by `place simulate --out`)")
    return summaries


def read_sim_config(path: str | Path) -> dict[str, Any]:
    """The resolved configuration of a ``config.json`` (a ``moeplace.sim-config`` document; the previous
    release's untagged one is read as it is)."""
    p = Path(path)
    d = read_json(p)
    check(d, "sim-config", str(p))
    return d


def read_outputs(out: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, pl.DataFrame],
                                           dict[str, pl.DataFrame]]:
    """What :func:`write_outputs` wrote into ``out``: ``(resolved config ({} when there is none),
    summaries, per-request frames, time-series frames)``, the frames by placement label. A missing or
    unreadable file is an :class:`InputError` naming it."""
    d = Path(out)
    summaries = read_summaries(d / SUMMARY_FILE)
    config = read_sim_config(d / CONFIG_FILE) if (d / CONFIG_FILE).exists() else {}
    reqs: dict[str, pl.DataFrame] = {}
    ts: dict[str, pl.DataFrame] = {}
    for s in summaries:
        lab = s["label"]
        for suffix, into in ((REQUESTS_SUFFIX, reqs), (TIMESERIES_SUFFIX, ts)):
            f = d / f"{file_label(lab)}{suffix}"
            if not f.exists():
                raise InputError(f"{f}: missing ({SUMMARY_FILE} lists placement '{lab}')")
            try:
                into[lab] = pl.read_parquet(f)
            except Exception as exc:  # noqa: BLE001  polars raises several types for damaged files
                raise InputError(f"{f}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    return config, summaries, reqs, ts


# ---------------------------------------------------------------------------- the table
def _fmt(v, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "ms":
        return f"{v * 1e3:.1f}"
    if unit == "s":
        return f"{v:.2f}"
    if unit == "%":
        return f"{v * 100:.1f}%"
    if unit == "GB":
        return f"{v / 1e9:,.1f}"
    if unit == "int":
        return f"{int(v):,}"
    if unit == "x":
        return f"{v:.3f}"
    return f"{v:,.0f}"


ROWS = [
    ("output tok/s", "output_tok_s", "n"),
    ("output tok/s per GPU", "output_tok_s_per_gpu", "n"),
    # a deployment's pools (place simulate --pools): each pool's own figures
    ("prefill pool: prefill tok/s", "prefill_pool_tok_s", "n"),
    ("prefill pool: prefill tok/s per GPU", "prefill_pool_tok_s_per_gpu", "n"),
    ("prefill pool: busy", "prefill_pool_busy", "%"),
    ("KV hand-off p50 (ms)", "kv_transfer_p50_s", "ms"),
    ("KV hand-off p99 (ms)", "kv_transfer_p99_s", "ms"),
    ("decode pool: decode tok/s per GPU", "decode_pool_tok_s_per_gpu", "n"),
    ("decode pool: busy", "decode_pool_busy", "%"),
    ("decode tok/s per user", "per_user_tok_s", "n1"),
    ("prefill tok/s", "prefill_tok_s", "n"),
    ("TTFT p50 (ms)", "ttft_p50_s", "ms"),
    ("TTFT p99 (ms)", "ttft_p99_s", "ms"),
    ("TPOT p50 (ms)", "tpot_p50_s", "ms"),
    ("TPOT p99 (ms)", "tpot_p99_s", "ms"),
    ("queue p99 (ms)", "queue_p99_s", "ms"),
    ("MoE max/mean tokens", "mean_imbalance", "x"),
    ("straggler / MoE layer (ms)", "straggler_per_layer_ms", "n3"),
    ("straggler total (s)", "straggler_s", "s"),
    ("straggler share of step", "straggler_share", "%"),
    ("expert GEMM time (s)", "experts_s", "s"),
    ("all-to-all time (s)", "comm_s", "s"),
    ("NVLink bytes (GB)", "nvlink_bytes", "GB"),
    ("NIC bytes (GB)", "nic_bytes", "GB"),
    ("KV pool peak", "kv_peak", "%"),
    ("state pool peak", "state_peak", "%"),
    ("preemptions", "preemptions", "int"),
    ("rejected", "requests_rejected", "int"),
    ("requests finished", "requests_finished", "int"),
    ("routed / trace tokens", "trace_passes", "x"),
    ("repeated routing", "routing_repeat_share", "%"),
    ("iterations", "iterations", "int"),
    ("rebalances", "rebalances", "int"),
    ("moved expert bytes (GB)", "moved_bytes", "GB"),
    ("stall (s)", "stall_s", "s"),
]
# shown only when some placement has them (routing repeats: only a run that outlived its trace)
OPTIONAL_ROWS = {"rebalances", "moved_bytes", "stall_s", "trace_passes", "routing_repeat_share"}
# shown only for a deployment's runs (their summaries carry them)
POOL_ROWS = {key for _, key, _ in ROWS if key.startswith(("prefill_pool_", "decode_pool_", "kv_transfer_"))}


# figures that exist only when a request produced a second output token (a decode step timed)
DECODE_FIGURES = ("per_user_tok_s", "tpot_p50_s", "tpot_p99_s")


def not_simulated(summary: dict[str, Any]) -> dict[str, str]:
    """Figures of a run's summary that have no value because what they measure never ran, with the reason
    (``place simulate`` prints it under the table and puts it in ``--json``): a prefill-only run (``--phase
    prefill``, or outputs of one token) times no decode step, so TPOT and decode tok/s per user are not
    simulated figures of zero or of anything."""
    if all(summary.get(k) is None for k in DECODE_FIGURES) and summary.get("requests_finished"):
        why = ("not simulated: no finished request produced a second output token (a prefill-only run: --phase "
               "prefill or 1-token outputs), so no decode step was timed")
        return {k: why for k in DECODE_FIGURES}
    return {}


def format_table(results: list[SimResult], run: dict[str, Any] | None = None) -> str:
    """Placements side by side: one column each, one metric per row; each throughput and per-token time
    the ensemble priced followed by its 80 % interval ``[lo-hi]`` (:func:`sim.ensemble.price_run`). ``run``:
    the label's run context (kept for the callers; the intervals are in the summaries)."""
    ranges = [r.summary for r in results]
    head = ["metric"] + [r.label for r in results]
    rows = [head]
    for name, key, unit in ROWS:
        if key in OPTIONAL_ROWS and not any(r.summary.get(key) for r in results):
            continue
        if key in POOL_ROWS and all(key not in r.summary for r in results):
            continue
        vals = []
        for r, rng in zip(results, ranges):
            v = r.summary.get(key)
            if unit in ("n3", "n1") and v is not None:
                cell = f"{v:.{unit[1]}f}"
            else:
                cell = _fmt(v, unit)
            if rng.get(f"{key}_range"):
                ends = [f"{x:.1f}" if unit == "n1" else _fmt(x, unit) for x in rng[f"{key}_range"]]
                cell += f" [{ends[0]}-{ends[1]}]"
            vals.append(cell)
        rows.append([name] + vals)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        missing = not_simulated(r.summary)
        if missing:
            names = [name for name, key, _ in ROWS if key in missing]
            who = f"{r.label}: " if len(results) > 1 else ""
            lines.append(f"{who}{', '.join(names)} '-' = {next(iter(missing.values()))}")
    return "\n".join(lines)
