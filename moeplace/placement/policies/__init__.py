"""Placement policies. Each policy is one module in this package that registers itself with
``@register_policy("name")``; adding a policy touches only its own file.

A policy is a pure function ``fn(problem: PlacementProblem) -> Placement``. With
``problem.time_limit`` set, a policy registered ``anytime=True`` returns its best placement within that
many seconds (a valid one however small the limit); any other policy either finishes within it or
raises :class:`TimeLimitReached`.
"""
from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.settings import parse_keys
from moeplace.placement.record import Placement


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """What a policy is asked to solve.

    ``loads``: float ``[W, L, E]`` token counts of the planning windows (scenarios); policies that do not
    care about windows use ``loads.sum(0)``. ``samples``: optional int ``[N, L, k]`` expert ids of sampled
    tokens (for co-activation / traffic objectives; ``L`` over MoE layers). ``num_redundant``: R, so the
    slot budget is ``P = E + R`` (must be divisible by the GPU count). ``rule``: the replica-choice rule
    the placement will be served under (``vllm``, ``sglang``, ``ideal``).
    """

    loads: np.ndarray
    model: ModelSpec
    cluster: ClusterSpec
    num_redundant: int = 0
    rule: str = "vllm"
    seed: int = 0
    time_limit: float | None = None
    samples: np.ndarray | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loads.ndim != 3 or self.loads.shape[1:] != (self.model.num_moe_layers, self.model.num_experts):
            raise InputError(f"loads must be [windows, {self.model.num_moe_layers}, {self.model.num_experts}], "
                             f"got {self.loads.shape}")
        if self.num_redundant < 0:
            raise InputError(f"--redundant must be >= 0, got {self.num_redundant}")
        E, G = self.model.num_experts, self.cluster.num_gpus
        if self.num_slots > E * G:  # more slots than one replica of every expert on every GPU
            raise InputError(f"--redundant {self.num_redundant}: {self.num_slots} slots on {G} GPUs need "
                             f"{self.num_slots // G} slots per GPU, but a GPU can usefully hold each of the {E} "
                             f"experts once; use --redundant <= {E * (G - 1)}")
        if self.num_slots % self.cluster.num_gpus:
            raise InputError(
                f"{self.model.num_experts} experts + {self.num_redundant} redundant = {self.num_slots} slots do "
                f"not divide evenly over {self.cluster.num_gpus} GPUs; choose --redundant so that "
                f"E + R is a multiple of the GPU count")

    @property
    def num_slots(self) -> int:
        return self.model.num_experts + self.num_redundant

    def placement(self, phy2log: np.ndarray, policy: str, **params: Any) -> Placement:
        """Wrap a policy's ``phy2log`` into a validated :class:`Placement` with provenance."""
        prov = {"policy": policy, "engine": self.rule, "num_redundant": self.num_redundant, "seed": self.seed,
                "params": params, "cluster": self.cluster.to_dict()}
        return Placement.from_phy2log(phy2log, self.model, self.cluster.num_gpus, self.cluster.gpus_per_node, prov)


class TimeLimitReached(Exception):
    """A policy that cannot stop early ran out of its ``time_limit`` (no placement)."""


class Deadline:
    """``time_limit`` seconds from now (``None``: never); :meth:`check` raises :class:`TimeLimitReached`
    once passed. For policies whose loops can stop between steps but cannot return a partial answer."""

    def __init__(self, time_limit: float | None, what: str) -> None:
        self.at = None if time_limit is None else time.monotonic() + time_limit
        self.what = what

    def check(self) -> None:
        if self.at is not None and time.monotonic() > self.at:
            raise TimeLimitReached(self.what)


PolicyFn = Callable[[PlacementProblem], Placement]
_REGISTRY: dict[str, PolicyFn] = {}
_ANYTIME: set[str] = set()
# The keys of ``PlacementProblem.options`` the policies read, with their types: each policy module declares
# its own (:func:`declare_options`); :func:`check_options` refuses every other key.
_OPTIONS: dict[str, Any] = {}


def declare_options(types: dict[str, Any]) -> None:
    """Called by a policy module: the options it reads and their types (``place optimize`` flags' names)."""
    _OPTIONS.update(types)


def option_types() -> dict[str, Any]:
    _load_all()
    return dict(_OPTIONS)


def check_options(where: str, raw: Any) -> dict[str, Any]:
    """The policies' options from user input (``place optimize`` flags, a sweep spec's ``optimize.options``):
    unset (``None``) values dropped, every other key known to some policy and of its type, else an
    :class:`InputError` naming the key and the nearest valid one."""
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if v is not None}
    return parse_keys(where, raw, option_types(), what="option")
_QUICK: set[str] = set()
_PHASE: dict[str, str] = {}  # policies that plan for one phase's traffic only (and need its options)


def register_policy(name: str, anytime: bool = False, quick: bool = False,
                    phase: str | None = None) -> Callable[[PolicyFn], PolicyFn]:
    """``anytime``: the policy honours ``problem.time_limit`` by returning its best placement so far.
    ``quick``: it plans in one pass over the slots, no search (a time limit runs it first). ``phase``: the
    policy plans one phase's traffic (``"decode"``) and is listed only for it (:func:`policy_names`)."""
    def deco(fn: PolicyFn) -> PolicyFn:
        if name in _REGISTRY:
            raise RuntimeError(f"policy '{name}' registered twice")
        _REGISTRY[name] = fn
        if anytime:
            _ANYTIME.add(name)
        if quick:
            _QUICK.add(name)
        if phase is not None:
            _PHASE[name] = phase
        return fn
    return deco


def is_anytime(name: str) -> bool:
    _load_all()
    return name in _ANYTIME


def is_quick(name: str) -> bool:
    _load_all()
    return name in _QUICK


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def policy_names(phase: str | None = None) -> list[str]:
    """The registered policies for traffic of ``phase`` (``None``: any traffic; a policy registered for
    one phase is listed only for that phase)."""
    _load_all()
    return [n for n in _REGISTRY if _PHASE.get(n, phase) == phase]


def get_policy(name: str) -> PolicyFn:
    _load_all()
    if name not in _REGISTRY:
        raise InputError(f"unknown policy '{name}' (expected one of {', '.join(_REGISTRY)})")
    return _REGISTRY[name]
