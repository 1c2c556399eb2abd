"""Scheduling policy, without a model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.engine.scheduler import Scheduler, StreamView


def view(job_id: str, *, ready: bool = True, chunk: int = 1, priority: int = 0, arrival: float = 0.0,
         voice: str = "v") -> StreamView:
    return StreamView(job_id=job_id, voice_id=voice, ready=ready, chunk_index=chunk, priority=priority,
                      arrival=arrival)


def ids(views: list[StreamView]) -> list[str]:
    return [v.job_id for v in views]


def test_picks_at_most_micro_batch_size_rows_one_per_stream() -> None:
    sched = Scheduler(micro_batch_size=3)
    streams = [view(f"j{i}", arrival=i) for i in range(5)]
    picked = sched.pick(streams)
    assert ids(picked) == ["j0", "j1", "j2"]
    assert len(set(ids(picked))) == len(picked)


def test_round_robin_serves_every_stream_equally_over_time() -> None:
    sched = Scheduler(micro_batch_size=2)
    streams = [view(f"j{i}", arrival=i) for i in range(5)]
    served: Counter[str] = Counter()
    for _ in range(10):
        served.update(ids(sched.pick(streams)))
    assert set(served.values()) == {4}


def test_round_robin_order_rotates() -> None:
    sched = Scheduler(micro_batch_size=2)
    streams = [view(f"j{i}", arrival=i) for i in range(3)]
    assert ids(sched.pick(streams)) == ["j0", "j1"]
    assert ids(sched.pick(streams)) == ["j2", "j0"]
    assert ids(sched.pick(streams)) == ["j1", "j2"]


def test_streams_not_ready_are_skipped_and_keep_their_place() -> None:
    sched = Scheduler(micro_batch_size=1)
    a, b = view("a", arrival=0), view("b", arrival=1)
    assert ids(sched.pick([view("a", ready=False, arrival=0), b])) == ["b"]
    # a waited (was never served): it goes before b, which was just served
    assert ids(sched.pick([a, b])) == ["a"]


def test_nothing_ready_picks_nothing() -> None:
    sched = Scheduler(micro_batch_size=4)
    assert sched.pick([view("a", ready=False), view("b", ready=False)]) == []
    assert sched.pick([]) == []


def test_higher_priority_goes_first() -> None:
    sched = Scheduler(micro_batch_size=2)
    streams = [view("low0", arrival=0), view("low1", arrival=1), view("high", priority=5, arrival=2)]
    for _ in range(3):
        assert ids(sched.pick(streams))[0] == "high"


def test_new_job_queues_behind_streams_that_waited_longer() -> None:
    sched = Scheduler(micro_batch_size=2)
    old = [view(f"j{i}", arrival=i) for i in range(3)]
    assert ids(sched.pick(old)) == ["j0", "j1"]
    # every old stream was queued before the new job arrived
    streams = [*old, view("new", chunk=0, arrival=10)]
    assert ids(sched.pick(streams)) == ["j2", "j0"]
    assert ids(sched.pick(streams)) == ["j1", "new"]


def test_first_chunks_go_beside_continuing_rows() -> None:
    sched = Scheduler(micro_batch_size=4)
    picked = sched.pick([view("cont", chunk=7, arrival=0), view("fresh", chunk=0, arrival=1)])
    assert ids(picked) == ["cont", "fresh"]


def test_arrival_orders_streams_first_seen_together() -> None:
    sched = Scheduler(micro_batch_size=1)
    assert ids(sched.pick([view("late", arrival=2.0), view("early", arrival=1.0)])) == ["early"]


def test_forget_drops_a_finished_stream() -> None:
    sched = Scheduler(micro_batch_size=1)
    sched.pick([view("a", arrival=0), view("b", arrival=1)])
    sched.forget("a")
    assert sched._tickets.keys() == {"b"}
    # a job id seen again after forget starts at the back of the queue
    assert ids(sched.pick([view("a", arrival=0), view("b", arrival=1)])) == ["b"]


def test_rejects_bad_sizes_and_duplicate_streams() -> None:
    with pytest.raises(ValueError):
        Scheduler(micro_batch_size=0)
    with pytest.raises(ValueError):
        Scheduler(micro_batch_size=2).pick([view("a"), view("a")])


# -- properties over random workloads ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), batch=st.integers(1, 5), steps=st.integers(1, 25))
def test_no_ready_stream_waits_longer_than_one_round(n: int, batch: int, steps: int) -> None:
    sched = Scheduler(micro_batch_size=batch)
    streams = [view(f"j{i}", arrival=i) for i in range(n)]
    waited = dict.fromkeys(ids(streams), 0)
    for _ in range(steps):
        picked = ids(sched.pick(streams))
        assert len(picked) == min(n, batch) == len(set(picked))
        waited = {j: 0 if j in picked else w + 1 for j, w in waited.items()}
        assert max(waited.values()) <= -(-n // batch) - 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=15),
       st.integers(1, 6))
def test_picks_are_ready_work_conserving_and_priority_ordered(specs, batch: int) -> None:
    sched = Scheduler(micro_batch_size=batch)
    streams = [view(f"j{i}", ready=r, priority=p, chunk=c, arrival=i) for i, (r, p, c) in enumerate(specs)]
    for _ in range(3):
        picked = sched.pick(streams)
        ready = [s for s in streams if s.ready]
        assert all(s.ready for s in picked)
        assert len(picked) == min(batch, len(ready))
        if picked:
            left = [s for s in ready if s not in picked]
            assert all(s.priority <= min(p.priority for p in picked) for s in left)


def test_an_idle_engine_gathers_half_a_window_after_the_last_arrival_at_most_a_window() -> None:
    from gpu_worker.engine.scheduler import gather_until

    def until(**kw):
        base = {"window_s": 0.5, "micro_batch_size": 8, "ready": [10.0], "arrived": [10.0], "started": False,
                "now": 10.1}
        return gather_until(**{**base, **kw})

    assert until() == 10.25  # half a window after the only arrival
    assert until(ready=[10.0, 10.2], arrived=[10.0, 10.2, 10.4], now=10.45) == 10.5  # the window has the say
    assert until(now=10.3) is None  # its time has come
    assert until(window_s=0) is None  # no window: start at once
    assert until(ready=[10.0] * 8, arrived=[10.0] * 8) is None  # a full batch does not wait
    assert until(started=True) is None  # a busy engine does not wait
    assert until(ready=[]) is None  # nothing to start
