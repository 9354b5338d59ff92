"""The sweep's result table: one Parquet part file per finished point, streamed as points finish, and the
consolidated table written at the end.

Layout of ``OUT/``::

    points/<point_hash>.parquet   one row per finished point, written atomically when the point ends
    sweep.parquet                 all rows of the current spec, ordered by point index (atomic replace)
    frontier.json                 the Pareto frontier and the recommendation (sim.frontier)
    cache/                        shared work: synthetic traces, Loads, placements (keyed by hash)

A part file exists only for a finished point (atomic rename), so an interrupted sweep leaves either a
complete row or none; a resumed sweep skips every point whose hash has a part with a final status.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import atomic_path
from moeplace.sim.frontier import SWEEP_CACHE, SWEEP_POINTS, SWEEP_TABLE

# Statuses. Final ones are never recomputed on resume; ``error`` (an unexpected exception: a bug or a
# crashed worker) is retried.
STATUSES = ("ok", "infeasible", "invalid", "unsupported", "failed", "error")
FINAL_STATUSES = ("ok", "infeasible", "invalid", "unsupported", "failed")

SCHEMA: dict[str, pl.DataType] = {
    # the point
    "index": pl.Int32, "point_hash": pl.String, "label": pl.String, "workload": pl.String, "gpu": pl.String,
    "gpus": pl.Int32, "nodes": pl.Int32, "gpus_per_node": pl.Int32, "tp": pl.Int32, "dp": pl.Int32,
    "ep": pl.Int32, "redundant": pl.String, "num_redundant": pl.Int32, "policy": pl.String,
    "rebalance": pl.String, "kv_dtype": pl.String, "engine": pl.String,
    # what happened: status, the stage it ended in (plan / optimize / simulate / done), why
    "status": pl.String, "stage": pl.String, "reason": pl.String,
    # place plan
    "weights_gb_per_gpu": pl.Float64, "free_gb_per_gpu": pl.Float64, "plan_context": pl.Int64,
    "plan_concurrency": pl.Int64, "plan_max_context": pl.Int64,
    # optimize (Loads-level scores of the placement, planning and held-out windows)
    "optimize_key": pl.String, "placement_fingerprint": pl.String, "plan_balancedness": pl.Float64,
    "held_out_balancedness": pl.Float64, "held_out_max_over_mean": pl.Float64,
    "held_out_cross_node_share": pl.Float64,
    # simulate
    "output_tok_s": pl.Float64, "output_tok_s_per_gpu": pl.Float64, "prefill_tok_s": pl.Float64,
    "ttft_p50_s": pl.Float64, "ttft_p99_s": pl.Float64, "tpot_p50_s": pl.Float64, "tpot_p99_s": pl.Float64,
    "requests_finished": pl.Int64, "requests_rejected": pl.Int64, "preemptions": pl.Int64,
    "mean_imbalance": pl.Float64, "straggler_share": pl.Float64, "kv_peak": pl.Float64,
    "rebalances": pl.Int64,
    "moved_bytes": pl.Float64, "iterations": pl.Int64, "sim_duration_s": pl.Float64,
    # the shipped ensemble's 80 % intervals (sim.ensemble) and how near published cases are
    "output_tok_s_lo": pl.Float64, "output_tok_s_hi": pl.Float64, "tpot_p99_s_lo": pl.Float64,
    "tpot_p99_s_hi": pl.Float64, "ensemble_near": pl.Float64,
    # wall-clock seconds (differ between runs; everything above is a function of the spec)
    "wall_optimize_s": pl.Float64, "wall_simulate_s": pl.Float64,
}
TIMING_COLUMNS = ("wall_optimize_s", "wall_simulate_s")


def make_row(**values: Any) -> dict[str, Any]:
    """A full row: every schema column, ``None`` where not given; unknown keys are a bug."""
    unknown = set(values) - set(SCHEMA)
    if unknown:
        raise KeyError(f"not sweep table columns: {sorted(unknown)}")
    if values.get("status") not in STATUSES:
        raise ValueError(f"status {values.get('status')!r} not one of {STATUSES}")
    return {k: values.get(k) for k in SCHEMA}


def rows_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=SCHEMA, orient="row") if rows else pl.DataFrame(schema=SCHEMA)


class ResultStore:
    """The part files of one output directory (state: the directory)."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.parts = self.out / SWEEP_POINTS
        self.cache = self.out / SWEEP_CACHE

    def write_row(self, row: dict[str, Any]) -> Path:
        """Write one finished point atomically; returns the part's path."""
        path = self.parts / f"{row['point_hash']}.parquet"
        with atomic_path(path) as tmp:
            rows_frame([row]).write_parquet(tmp)
        return path

    def read_parts(self) -> pl.DataFrame:
        """Every part in the directory (rows of earlier specs included)."""
        files = sorted(self.parts.glob("*.parquet")) if self.parts.is_dir() else []
        frames = []
        for f in files:
            try:
                df = pl.read_parquet(f)
            except (OSError, pl.exceptions.PolarsError) as exc:  # a foreign or damaged file: say which
                raise InputError(f"{f}: not a readable sweep part file ({exc}); remove it to recompute that "
                                 "point") from None
            missing = set(SCHEMA) - set(df.columns)
            if missing:
                raise InputError(f"{f}: field '{min(missing)}': missing; this part was written by another "
                                 "version of place sweep (remove it, or use another --out)")
            frames.append(df.select(list(SCHEMA)).cast(SCHEMA))
        return pl.concat(frames) if frames else pl.DataFrame(schema=SCHEMA)

    def finished(self) -> dict[str, dict[str, Any]]:
        """``point_hash -> row`` of the points with a final status."""
        df = self.read_parts().filter(pl.col("status").is_in(FINAL_STATUSES))
        return {r["point_hash"]: r for r in df.iter_rows(named=True)}

    def write_table(self, hashes: list[str], index_of: dict[str, int] | None = None) -> pl.DataFrame:
        """``OUT/sweep.parquet``: the rows of ``hashes`` (the current spec's points) in point order, with
        ``index`` renumbered to the current spec (a resumed row may come from a spec whose points were
        listed in another order). Returns the table."""
        df = self.read_parts().filter(pl.col("point_hash").is_in(hashes)).unique("point_hash", keep="last")
        if index_of is not None:
            index = pl.col("point_hash").replace_strict(index_of, return_dtype=pl.Int32)
            df = df.with_columns(index.alias("index"))
        df = df.sort("index")
        with atomic_path(self.out / SWEEP_TABLE) as tmp:
            df.write_parquet(tmp)
        return df


def comparable(df: pl.DataFrame) -> pl.DataFrame:
    """The table without its wall-clock columns (what two runs of one spec must agree on)."""
    return df.drop(list(TIMING_COLUMNS)).sort("index")
