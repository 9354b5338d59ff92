"""The event kernel: a heap of ``(time, priority, seq, event)``.

This module is the one place that defines the order of events. Two events at the same time run in
ascending ``priority`` (the ``PRIORITY`` table below), then in the order they were scheduled (``seq``, a
per-queue counter), so a run is a deterministic function of its inputs. Handlers return the follow-up
events they want scheduled; they never push onto the heap themselves.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Same-time ordering. Work that frees resources (an iteration ending, a transfer landing, a rebalance
# finishing) runs before new arrivals, so an arrival at time t sees the state after everything that
# completed at t; the end-of-run marker runs last.
PRIORITY: dict[str, int] = {
    "iteration_end": 0,
    "transfer_done": 1,
    "rebalance_done": 2,
    "arrival": 3,
    "wake": 4,
    "stop": 9,
}


@dataclass(frozen=True)
class Event:
    """Something that happens at ``time`` (seconds of simulated time). ``kind`` selects the handler and
    the same-time priority; ``data`` is the handler's payload."""

    time: float
    kind: str
    data: Any = None
    id: int = field(default=-1, compare=False)


Handler = Callable[[Event], Iterable[Event] | None]


class EventQueue:
    """Deterministic discrete-event loop. Ids come from this queue's own counter (never a global)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.now = 0.0
        self.num_processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, event: Event) -> Event:
        if event.kind not in PRIORITY:
            raise ValueError(f"event kind '{event.kind}' has no priority in sim.events.PRIORITY")
        if event.time < self.now:
            raise ValueError(f"event '{event.kind}' scheduled at {event.time} before now={self.now}")
        seq = self._seq
        self._seq += 1
        ev = Event(event.time, event.kind, event.data, seq)
        heapq.heappush(self._heap, (ev.time, PRIORITY[ev.kind], seq, ev))
        return ev

    def pop(self) -> Event:
        _, _, _, ev = heapq.heappop(self._heap)
        self.now = ev.time
        self.num_processed += 1
        return ev

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def run(self, handlers: dict[str, Handler], until: float = float("inf"),
            on_advance: Callable[[float], None] | None = None) -> None:
        """Pop and dispatch events until the heap is empty or the next event lies after ``until``.
        ``on_advance(now)`` is called after each event (progress bars)."""
        while self._heap and self._heap[0][0] <= until:
            ev = self.pop()
            follow = handlers[ev.kind](ev)
            if follow:
                for f in follow:
                    self.push(f)
            if on_advance is not None:
                on_advance(self.now)
