"""Configuration of the moeplace optimizer (a frozen record; validated, no I/O)."""
from __future__ import annotations

from dataclasses import dataclass

from moeplace.foundation.errors import InputError
from moeplace.placement.rules import get_rule

OBJECTIVES = ("balance", "traffic", "balance+traffic")


@dataclass(frozen=True)
class OptimizerConfig:
    """Knobs of one optimizer run.

    ``robust``: plan for the worst planning window (scenario) instead of their sum. ``cvar``: with
    ``robust``, minimize the mean of the worst ``ceil(cvar * W)`` scenarios' max/mean instead of the single
    worst (``cvar = 0`` means the worst). ``objective``/``traffic_weight``/``balance_floor``: the traffic
    objective (remote nodes per token) subject to balancedness >= ``balance_floor`` (default: the balance
    plan's own balancedness minus 0.01). ``max_moves``: the
    migration budget (slots whose expert changes) per layer when a ``current`` placement is given.
    ``lns_rounds``: CP-SAT neighbourhood solves per layer after local search stalls (stopping after
    ``lns_patience`` fruitless ones in a row); ``lns_gpus``: GPUs per
    neighbourhood; ``lns_dtime``: CP-SAT *deterministic* time per neighbourhood (so results repeat per seed).
    ``hedge`` (without ``robust``, given >= 2 planning windows): after planning the windows' sum, spend
    up to ``hedge_iters`` moves improving the worst single window while the sum stays within ``hedge_tol``
    (relative) of what was reached — many placements balance the sum equally well; pick one that also
    balances each window, which is what held-out traffic rewards. ``keep_groups``: routing groups
    (``n_group``) kept whole on contiguous blocks of slots, replica-free, so a relabelled checkpoint serves
    the plan exactly under group-limited top-k (:mod:`.groups`; 1 = no constraint). ``gap_tol``: stop searching a layer once within this relative gap of its bound. ``time_limit``: hard wall-clock budget of the whole run, seconds. ``workers``: processes for layers.
    """

    rule: str = "vllm"
    robust: bool = False
    cvar: float = 0.0
    objective: str = "balance"
    traffic_weight: float = 1.0
    balance_floor: float | None = None
    pareto: bool = False
    max_moves: int | None = None
    lns_rounds: int = 8
    lns_gpus: int = 4
    lns_patience: int = 2
    lns_dtime: float = 0.05
    gap_tol: float = 1e-4
    exact_max_vars: int = 6000
    hedge: bool = True
    hedge_tol: float = 2e-5
    hedge_iters: int = 100
    time_limit: float | None = None
    workers: int = 0
    seed: int = 0
    max_traffic_samples: int = 8192
    keep_groups: int = 1

    def __post_init__(self) -> None:
        get_rule(self.rule)  # an unknown rule is an InputError naming the nearest one
        if self.objective not in OBJECTIVES:
            raise InputError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not 0.0 <= self.cvar < 1.0:
            raise InputError(f"cvar must be in [0, 1), got {self.cvar}")
        if self.traffic_weight < 0:
            raise InputError(f"--traffic-weight must be >= 0, got {self.traffic_weight}")
        if self.balance_floor is not None and not 0.0 < self.balance_floor <= 1.0:
            raise InputError(f"balance floor must be in (0, 1], got {self.balance_floor}")
        if self.max_moves is not None and self.max_moves < 0:
            raise InputError(f"--max-moves must be >= 0, got {self.max_moves}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise InputError(f"--time-limit must be > 0 seconds, got {self.time_limit}")
        if self.lns_rounds < 0 or self.lns_gpus < 2 or self.lns_dtime <= 0:
            raise InputError("lns_rounds must be >= 0, lns_gpus >= 2 and lns_dtime > 0")
        if self.seed < 0:
            raise InputError(f"--seed must be >= 0, got {self.seed}")
        if self.keep_groups < 1:
            raise InputError(f"keep_groups must be >= 1, got {self.keep_groups}")
        if self.keep_groups > 1 and (self.objective != "balance" or self.max_moves is not None):
            raise InputError("--keep-groups plans for balance from scratch: --objective traffic / --max-moves "
                             "do not apply")
        if self.workers < 0:
            raise InputError(f"--workers must be >= 0 (0 = one per core), got {self.workers}")
