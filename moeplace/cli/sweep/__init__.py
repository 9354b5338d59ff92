"""``place sweep``: design-space search over deployments (GPU count and kind, TP/EP sizes, redundant
experts, placement policy, static vs online rebalancing, KV dtype, engine) for one or more workloads.

``spec`` (the YAML/TOML spec and its points), ``stages`` (plan, optimize and simulate of one point),
``store`` (the streamed Parquet table and resume), ``sim.frontier`` (Pareto frontier and recommendation),
``run`` (the driver on a process pool or Ray)..
"""
from moeplace.cli.sweep.run import SweepOutcome, run_sweep
from moeplace.cli.sweep.spec import Point, SweepSpec, expand_points, load_spec
from moeplace.cli.sweep.store import ResultStore, comparable
from moeplace.sim.frontier import format_frontier, frontier_report, pareto_mask

__all__ = ["Point", "ResultStore", "SweepOutcome", "SweepSpec", "comparable", "expand_points",
           "format_frontier", "frontier_report", "load_spec", "pareto_mask", "run_sweep"]
