"""The replica-rule interface and its registry.

A placement says where replicas live; the serving engine's *replica rule* decides which replica each
(token, expert) pair is sent to. Everything that differs between engines' rules lives in one
:class:`ReplicaRule` subclass per rule (one file each, registered with :func:`register`): the slot of
each token, the expected load of each slot, the lower bounds that hold under the rule and the hints the
optimizer takes from it. No other module compares rule names.

Shapes: ``L`` MoE layers, ``E`` logical experts, ``P`` slots, ``G`` GPUs (= EP ranks = attention-DP
ranks), ``k`` top-k, ``n`` tokens. Layers index ``placement.moe_layers``.
"""
from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import RuleMemory
from moeplace.placement.bounds import even_split_bound, minmax_replica_counts, splittable_bound
from moeplace.placement.record import Placement

_REGISTRY: dict[str, type[ReplicaRule]] = {}


class ReplicaRule(ABC):
    """One engine's replica-choice rule. Instances carry the rule's version knobs (``variant``) and the
    seed of rules that draw random numbers; they are cheap to build and hold no per-placement state
    except caches keyed by the placement's content."""

    #: registry key and the ``--engine`` value users type
    name: ClassVar[str]
    #: the engine, for sentences
    engine: ClassVar[str]
    #: a real engine's per-token choice (the simulator replays it); ``False`` for a fractional split
    per_token: ClassVar[bool] = True
    # whether :meth:`source_shares` depends on the source rank (a ``[L, G, G]`` array; otherwise the
    # traffic sums run on ``[L, G]``: placement.traffic)
    source_dependent_shares: ClassVar[bool] = False
    #: over many tokens every replica of an expert carries ``load / replica_count`` (so the even-split
    #: bounds hold and the optimizer's exact counts+placement model describes the rule)
    even_split: ClassVar[bool] = True
    #: the optimizer's hint: the rule sends a node's tokens to that node's replica, so keep an expert's
    #: replicas on distinct nodes
    node_distinct: ClassVar[bool] = False
    #: where the rule appears in listings (``--engine`` choices; the first is every command's default)
    listing_order: ClassVar[int] = 100
    #: the rule's versions (the first is the default) and the keyword (CLI: flag) that picks one
    variants: ClassVar[tuple[str, ...]] = ("default",)
    version_option: ClassVar[str | None] = None

    def __init__(self, variant: str | None = None, seed: int = 42) -> None:
        variant = variant or self.variants[0]
        if variant not in self.variants:
            raise InputError(f"unknown {self.engine} rule version '{variant}' "
                             f"(expected one of {', '.join(self.variants)})")
        self.variant = variant
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(variant={self.variant!r}, seed={self.seed})"

    # ------------------------------------------------------------------------------ per token
    @property
    def uses_source_rank(self) -> bool:
        """Whether a token's slot depends on the DP rank it runs on (then callers must say which)."""
        return False

    def dispatch_state(self, placement: Placement) -> np.ndarray | None:
        """What the rule precomputes once per placement (SGLang's dispatch map); ``None`` when nothing."""
        return None

    @abstractmethod
    def batch_slots(self, placement: Placement, layer: int, expert_ids: np.ndarray, *, src_gpu: np.ndarray,
                    pos_in_batch: np.ndarray, batch_id: np.ndarray | None = None,
                    state: np.ndarray | None = None) -> np.ndarray:
        """Physical slots, int64 ``[n, k]``, of MoE layer ``layer`` for tokens from many rank-local
        batches: token ``t`` (expert ids ``expert_ids[t]``, int ``[n, k]``) runs on DP rank ``src_gpu[t]``
        at index ``pos_in_batch[t]`` of its batch; ``batch_id[t]`` (int ``[n]``, default all 0) numbers
        the engine step, so (``batch_id``, ``src_gpu``) names one rank-local batch."""

    # ------------------------------------------------------------------------------ expected loads
    def slot_loads(self, placement: Placement, loads_LE: np.ndarray,
                   state: np.ndarray | None = None) -> np.ndarray:
        """Expected tokens per slot, float64 ``[L, P]``, when expert loads ``loads_LE`` (float ``[L, E]``)
        come evenly from all G ranks. Default: the even split ``load / replica_count``."""
        p2l = placement.phy2log
        return np.take_along_axis(loads_LE, p2l, axis=1) / np.take_along_axis(placement.logcnt, p2l, axis=1)

    def mean_slot_loads(self, placement: Placement, loads_LE: np.ndarray) -> np.ndarray:
        """:meth:`slot_loads` averaged over the rule's random seeds (cheap; what an optimizer's inner loop
        uses). Default: the rule draws no random numbers, so the same."""
        return self.slot_loads(placement, loads_LE)

    def expected_gpu_loads(self, placement: Placement, loads_LE: np.ndarray, state: np.ndarray | None = None,
                           *, seed_averaged: bool = False) -> np.ndarray:
        """Expected tokens per GPU, float64 ``[L, G]`` (token mass preserved)."""
        L, G, P = placement.num_layers, placement.num_gpus, placement.num_slots
        slots = self.mean_slot_loads(placement, loads_LE) if seed_averaged else self.slot_loads(
            placement, loads_LE, state)
        return slots.reshape(L, G, P // G).sum(axis=2)

    def source_shares(self, placement: Placement, loads_LE: np.ndarray, gpu_loads: np.ndarray,
                      state: np.ndarray | None = None) -> np.ndarray:
        """``q[l, s, g]``, float64 ``[L, G, G]``: the share of rank ``s``'s selections that land on GPU
        ``g`` (expected, tokens spread evenly over ranks). Default: independent of the source rank."""
        total = loads_LE.sum(axis=1)
        share = np.divide(gpu_loads, total[:, None], out=np.zeros_like(gpu_loads), where=total[:, None] > 0)
        L, G = gpu_loads.shape
        return np.broadcast_to(share[:, None, :], (L, G, G))

    def planning_memory(self, num_layers: int, num_experts: int, num_gpus: int) -> RuleMemory:
        """What the rule adds to the memory of planning and scoring placements
        (:func:`~moeplace.foundation.limits.placement_estimate`). Default: nothing."""
        return RuleMemory()

    # ------------------------------------------------------------------------------ bounds
    def placement_bound(self, placement: Placement, loads_LE: np.ndarray) -> np.ndarray:
        """Lower bound on the busiest GPU for THIS placement under the rule: float64 ``[L]``.
        Default (even split): :func:`~moeplace.placement.bounds.even_split_bound` with its counts."""
        return even_split_bound(loads_LE, placement.logcnt, placement.num_gpus, placement.slots_per_gpu)

    def budget_bound(self, loads_LE: np.ndarray, num_gpus: int, num_slots: int) -> np.ndarray:
        """The best bound for ``num_slots`` slots on ``num_gpus`` GPUs over all placements: float64
        ``[L]``. Default (even split): ``max(total / G, min_c max_e w_e / c_e)``."""
        w = np.asarray(loads_LE, dtype=np.float64)
        c = minmax_replica_counts(w, num_slots)
        return np.maximum(splittable_bound(w, num_gpus), (w / c).max(axis=1))


def register(cls: type[ReplicaRule]) -> type[ReplicaRule]:
    """Class decorator: make a rule findable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"replica rule '{cls.name}' registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def rule_names(*, per_token: bool | None = None) -> tuple[str, ...]:
    """Registered rule names (``per_token=True``: the rules a serving engine implements)."""
    names = [n for n, c in _REGISTRY.items() if per_token is None or c.per_token == per_token]
    return tuple(sorted(names, key=lambda n: (_REGISTRY[n].listing_order, n)))


def get_rule(rule: str | ReplicaRule, *, variant: str | None = None, seed: int = 42,
             **versions: str | None) -> ReplicaRule:
    """The rule named ``rule`` (an instance passes through). Its version is ``variant``, else the value of
    its own ``version_option`` among ``versions`` (e.g. ``vllm_rule="modulo"``, ``sglang_variant="legacy"``;
    the other rules' options are ignored), else its default. An unknown name is an :class:`InputError`
    naming the nearest registered one."""
    if isinstance(rule, ReplicaRule):
        return rule
    cls = _REGISTRY.get(rule)
    if cls is None:
        near = difflib.get_close_matches(str(rule), list(_REGISTRY), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise InputError(f"unknown replica rule (--engine) '{rule}' (expected one of "
                         f"{', '.join(_REGISTRY)}){hint}")
    if variant is None and cls.version_option is not None:
        variant = versions.get(cls.version_option)
    return cls(variant, seed)
