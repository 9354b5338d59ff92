"""What the memory model answers: a :class:`MemoryPlan` (per-GPU lines, pools, concurrency, the
verdict and, when it does not fit, :class:`Suggestion` s), and the rows of a sweep (:class:`SweepRow`).
``MemoryPlan.to_dict`` is the ``place plan --report`` / ``--json`` document."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.memory.components import MemoryLine
from moeplace.foundation.memory.config import Layout, MemoryConfig
from moeplace.foundation.memory.pools import CachePools


@dataclass(frozen=True)
class Suggestion:
    """A change that makes a non-fitting plan fit, found by re-planning with the same model."""

    kind: str  # "fp8 KV" | "fewer redundant" | "larger EP" | "larger attention TP" | "more GPUs"
    change: str
    gpus: int
    config: MemoryConfig
    concurrency: int


@dataclass(frozen=True)
class MemoryPlan:
    """The answer of :func:`plan_memory`: per-GPU lines, pools, concurrency and the verdict.

    Concurrency figures are totals over the ``dp`` DP ranks (``*_per_rank`` per DP rank)."""

    model_name: str
    cluster: ClusterSpec
    config: MemoryConfig
    layout: Layout
    lines: tuple[MemoryLine, ...]
    hbm_bytes: float
    budget_bytes: float
    pools: CachePools
    context: int
    concurrency_per_rank: int
    concurrency_ceiling: str
    mix_concurrency_per_rank: int | None
    mix_ceiling: str | None
    max_context: int  # longest single sequence: the pool's limit capped at the model's maximum context
    pool_max_context: int  # what the pool alone would hold
    fits: bool
    reasons: tuple[str, ...]
    suggestions: tuple[Suggestion, ...] = ()

    def section_bytes(self, section: str) -> float:
        return sum(x.bytes for x in self.lines if x.section == section)

    @property
    def weight_bytes(self) -> float:
        return self.section_bytes("weights")

    @property
    def reserve_bytes(self) -> float:
        return self.section_bytes("runtime")

    @property
    def free_bytes(self) -> float:
        """Per-GPU bytes left for the caches (negative when weights and reserve do not fit)."""
        return self.budget_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def concurrency(self) -> int:
        return self.concurrency_per_rank * self.layout.dp

    @property
    def mix_concurrency(self) -> int | None:
        return None if self.mix_concurrency_per_rank is None else self.mix_concurrency_per_rank * self.layout.dp

    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg["context_mix"] = [list(x) for x in self.config.context_mix] if self.config.context_mix else None
        p = self.pools
        return {
            "model": self.model_name,
            "cluster": {**self.cluster.to_dict(), "num_gpus": self.cluster.num_gpus},
            "config": cfg,
            "layout": asdict(self.layout),
            "per_gpu": {
                "hbm_bytes": self.hbm_bytes,
                "budget_bytes": self.budget_bytes,
                "lines": [asdict(x) for x in self.lines],
                "weight_bytes": self.weight_bytes,
                "reserve_bytes": self.reserve_bytes,
                "free_bytes": self.free_bytes,
            },
            "pools": {**asdict(p), "state_slots": p.state_slots, "kv_token_capacity": p.kv_token_capacity},
            "context": self.context,
            "concurrency": self.concurrency,
            "concurrency_per_dp_rank": self.concurrency_per_rank,
            "concurrency_ceiling": self.concurrency_ceiling,
            "mix_concurrency": self.mix_concurrency,
            "mix_ceiling": self.mix_ceiling,
            "max_context": self.max_context,
            "pool_max_context": self.pool_max_context,
            "model_max_context": p.max_model_len,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "suggestions": [{"kind": s.kind, "change": s.change, "gpus": s.gpus, "concurrency": s.concurrency,
                             "tp": s.config.tp, "dp": s.config.dp, "ep": s.config.ep,
                             "num_redundant": s.config.num_redundant, "kv_dtype": s.config.kv_dtype}
                            for s in self.suggestions],
        }


@dataclass(frozen=True)
class SweepRow:
    """One (GPU count, EP size, redundant count) of a sweep: its plan, or why its layout is invalid."""

    gpus: int
    tp: int | None
    dp: int | None
    ep: int
    num_redundant: int
    plan: MemoryPlan | None
    error: str | None = None
