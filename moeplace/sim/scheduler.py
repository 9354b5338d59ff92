"""The engines' batching rules on one attention-DP rank, one class each (Vidur's replica schedulers): what a
running sequence holds in the KV pool, whether that grows as it decodes, and which waiting prefill chunks
join an iteration.

- :class:`OnDemandScheduler` (vLLM, SGLang): a sequence holds its KV so far plus the token being made; the
  newest running sequence is preempted when the pool fills; chunked prefill fills the iteration's token
  budget (or, with ``chunked_prefill=False``, whole prompts only).
- :class:`ReserveScheduler` (TensorRT-LLM's ``GUARANTEED_NO_EVICT``, its default): a request is admitted only
  when its whole prompt + output fits, so a running one never grows past what it reserved and is never
  preempted; its prefill chunks follow the same budget rule.
- Either: with ``prefill_batches="separate"`` (SGLang's default) a rank's decodes wait while its prompt
  chunks run (:meth:`Scheduler.decodes_wait`).

The pool (:class:`moeplace.sim.engine.Pool`) asks its scheduler, found by ``EngineConfig.admission`` in
:data:`SCHEDULERS`; adding an engine behaviour is one class here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

from moeplace.foundation.memory.pools import CachePools
from moeplace.sim.config import EngineConfig


class Scheduler(ABC):
    """One engine's batching rules (see the module docstring)."""

    admission: ClassVar[str]
    #: a running sequence's KV grows with each token it makes (else it holds its reservation throughout)
    grows: ClassVar[bool] = True

    def __init__(self, engine: EngineConfig, pools: CachePools) -> None:
        self.engine = engine
        self.pools = pools

    @abstractmethod
    def need(self, q: Any) -> int:
        """Token slots the sequence ``q`` holds for its next step."""

    def held_after_prefill(self, q: Any) -> int:
        """KV tokens ``q`` holds once a prefill chunk has run (``q.ctx`` already advanced)."""
        return self.pools.kv_tokens(max(q.prefill_target, q.ctx) + 1)

    def prefill_chunks(self, prefilling: list, budget: int) -> Iterator[tuple[Any, int]]:
        """``(request, tokens)`` of the prefill chunks that join an iteration whose decode steps left
        ``budget`` of ``max_batched_tokens``, in admission order: chunked prefill cuts the last one to the
        budget; without it a prompt waits for an emptier batch rather than run cut."""
        cfg = self.engine
        for q in prefilling:
            if budget <= 0:
                return
            left = q.prefill_target - q.ctx
            if not cfg.chunked_prefill and left > budget and budget < cfg.max_batched_tokens:
                return  # whole prompts only: wait for an emptier batch
            c = left if not cfg.chunked_prefill else min(left, budget)
            budget -= c
            yield q, c


    def decodes_wait(self, prefilling: list) -> bool:
        """Whether a rank's decoding sequences sit out this iteration for its prompt chunks: with
        ``prefill_batches="separate"`` (SGLang's default), when a chunk of ``prefilling`` can run — its
        scheduler runs a prefill batch alone whenever one can be formed."""
        return (self.engine.prefill_batches == "separate" and bool(prefilling)
                and next(self.prefill_chunks(prefilling, self.engine.max_batched_tokens), None) is not None)


class OnDemandScheduler(Scheduler):
    """vLLM / SGLang: KV on demand, the newest sequence preempted when the pool fills."""

    admission = "on_demand"

    def need(self, q: Any) -> int:
        return max(q.prefill_target, q.ctx) + 1


class ReserveScheduler(Scheduler):
    """TensorRT-LLM ``GUARANTEED_NO_EVICT``: the whole sequence reserved at admission (capped at the
    model's context), never grown, never preempted."""

    admission = "reserve"
    grows = False

    def need(self, q: Any) -> int:
        return min(q.prompt_len + q.output_len, self.pools.max_model_len)

    def held_after_prefill(self, q: Any) -> int:
        return q.kv


SCHEDULERS: dict[str, type[Scheduler]] = {c.admission: c for c in (OnDemandScheduler, ReserveScheduler)}


def make_scheduler(engine: EngineConfig, pools: CachePools) -> Scheduler:
    """The scheduler of ``engine.admission`` (validated by :class:`EngineConfig`)."""
    return SCHEDULERS[engine.admission](engine, pools)
