"""The event kernel: ordering by (time, priority, sequence), follow-up events, determinism."""
import pytest

from moeplace.sim.events import PRIORITY, Event, EventQueue


def test_same_time_runs_by_priority_then_schedule_order():
    q = EventQueue()
    seen = []
    q.push(Event(1.0, "arrival", "a1"))
    q.push(Event(1.0, "iteration_end", "i1"))
    q.push(Event(0.5, "arrival", "a0"))
    q.push(Event(1.0, "arrival", "a2"))
    q.push(Event(1.0, "transfer_done", "t1"))
    q.run({k: (lambda ev: seen.append(ev.data)) for k in PRIORITY})
    # iteration_end (0) < transfer_done (1) < arrival (3); arrivals keep their scheduling order
    assert seen == ["a0", "i1", "t1", "a1", "a2"]
    assert q.now == 1.0 and q.num_processed == 5


def test_handlers_return_follow_ups_and_run_stops_at_until():
    q = EventQueue()
    times = []

    def tick(ev):
        times.append(ev.time)
        return [Event(ev.time + 0.25, "arrival")]

    q.push(Event(0.0, "arrival"))
    q.run({"arrival": tick}, until=1.0)
    assert times == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len(q) == 1 and q.peek_time() == 1.25  # the next one stays queued


def test_ids_come_from_the_queue_counter_and_past_events_are_refused():
    q1, q2 = EventQueue(), EventQueue()
    a = q1.push(Event(0.0, "arrival"))
    b = q1.push(Event(0.0, "arrival"))
    c = q2.push(Event(0.0, "arrival"))
    assert (a.id, b.id, c.id) == (0, 1, 0)  # per queue, not global
    q1.pop()
    q1.push(Event(2.0, "arrival"))
    q1.run({"arrival": lambda ev: None})
    with pytest.raises(ValueError):
        q1.push(Event(1.0, "arrival"))
    with pytest.raises(ValueError):
        q1.push(Event(3.0, "no-such-kind"))
