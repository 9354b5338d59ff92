"""``place sweep``: design-space search over deployments (GPU count and kind, TP/EP sizes, redundant
experts, placement policy, static vs online rebalancing, KV dtype, engine) for one or more workloads.

``spec`` (the YAML/TOML spec and its points), ``stages`` (plan, optimize and simulate of one point),
``store`` (the streamed Parquet table and resume), ``frontier`` (Pareto frontier and recommendation),
``run`` (the driver on a process pool or Ray). Nothing here imports ``sim`` at module level.
"""
from placement.sweep.frontier import format_frontier, frontier_report, pareto_mask
from placement.sweep.run import SweepOutcome, run_sweep
from placement.sweep.spec import Point, SweepSpec, expand_points, load_spec
from placement.sweep.store import ResultStore, comparable

__all__ = ["Point", "ResultStore", "SweepOutcome", "SweepSpec", "comparable", "expand_points",
           "format_frontier", "frontier_report", "load_spec", "pareto_mask", "run_sweep"]
