"""The moeplace optimizer: per MoE layer, replica counts and placement together for the target engine's
replica rule, greedy + local search + CP-SAT large-neighbourhood search, robust over scenarios, optional
traffic (co-location) objective and migration budget; layers in parallel under a hard time budget.

Entry points: :func:`placement.optimizer.parallel.optimize_layers` (arrays in, per-layer results out) and
the ``moeplace`` policy (``placement/policies/moeplace.py``)."""
from moeplace.placement.optimizer.config import OptimizerConfig
from moeplace.placement.optimizer.layer import LayerResult, solve_layer
from moeplace.placement.optimizer.parallel import optimize_layers

__all__ = ["LayerResult", "OptimizerConfig", "optimize_layers", "solve_layer"]
