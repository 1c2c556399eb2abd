"""Voice-affinity routing (`app.submission.routing`) on the database every process shares, SQLite and
PostgreSQL: which worker a job of a voice goes to, when it falls back to the shared queue and why, and what is
recorded on the job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from app import lifecycle
from app.db import queries as q
from app.db.models import Job, JobStatus, Worker, utcnow
from app.settings import Settings
from app.submission import routing
from tests.app.db.helpers import new_job, vid

A, B = "gpu-a@host", "gpu-b@host"


class Sent:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        self.calls.append((name, {"args": args, **options}))


@pytest.fixture
def voices(session: Session) -> list[str]:
    for n in range(3):
        q.get_or_create_voice(session=session, voice_id=vid(n), reference_path=f"references/{n}.wav")
    session.commit()
    return [vid(n) for n in range(3)]


def live(session: Session, *names: str) -> None:
    for name in names:
        q.register_worker(session=session, name=name)
    session.commit()


def silent_for(session: Session, name: str, seconds: float) -> None:
    session.execute(update(Worker).where(Worker.name == name)
                    .values(heartbeat_at=utcnow() - timedelta(seconds=seconds)))
    session.commit()


def route(session: Session, settings: Settings, voice: str, **changes: Any) -> routing.Route:
    return routing.route_voice(session=session, settings=settings.model_copy(update=changes), voice_id=voice)


def claimed_by(session: Session, voice: str, worker: str, n: int = 1) -> None:
    for _ in range(n):
        job, _ = new_job(session, voice)
        lifecycle.claim(session=session, job_id=job.id, worker=worker, max_attempts=3, lease_s=30)
    session.commit()


def test_a_voice_installed_on_a_live_worker_goes_to_that_workers_own_queue(session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=B, voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[1], B, n=3)  # B is the busier one: affinity still wins
    got = route(session, settings, voices[0])
    assert got == routing.Route(f"{settings.queue_gpu}.{B}", B, "affinity")


def test_a_voice_nobody_holds_is_placed_on_the_least_busy_worker_and_its_next_jobs_follow(
        session, settings, voices):
    live(session, A, B)
    claimed_by(session, voices[1], A, n=2)
    first = route(session, settings, voices[0])
    assert (first.worker, first.reason) == (B, "placed")
    job, _ = new_job(session, voices[0])  # sent there, not installed yet: the burst's next job follows
    q.set_job_route(session=session, job_ids=[job.id], routed_to=B, route=first.reason)
    claimed_by(session, voices[2], B, n=3)  # now B is busier, but it holds the voice
    second = route(session, settings, voices[0])
    assert (second.worker, second.reason) == (B, "affinity")


def test_the_shared_queue_when_affinity_is_off_there_is_one_worker_or_none(session, settings, voices):
    live(session, A)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    shared = settings.queue_gpu
    assert route(session, settings, voices[0]) == routing.Route(shared, None, "shared_single")  # auto
    assert route(session, settings, voices[0], voice_affinity="on").reason == "affinity"  # on: even one
    live(session, B)
    off = route(session, settings, voices[0], voice_affinity="off")
    assert off == routing.Route(shared, None, "shared_off")
    silent_for(session, A, 3600)
    silent_for(session, B, 3600)
    assert route(session, settings, voices[0], voice_affinity="on").reason == "shared_no_worker"


def test_a_stale_or_stopped_worker_gets_nothing_by_affinity(session, settings, voices):
    live(session, A, B, "gpu-c@host")
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    silent_for(session, A, routing.LIVE_BEAT_S + 5)  # three missed beats
    got = route(session, settings, voices[0])
    assert got.worker != A and got.reason == "placed"
    worker = q.get_worker(session=session, name=B)
    q.mark_worker_stopped(session=session, name=B, started_at=worker.started_at)
    session.commit()
    assert route(session, settings, voices[0]).reason == "shared_single"  # auto: one worker is left
    assert route(session, settings, voices[0], voice_affinity="on").worker == "gpu-c@host"


def test_a_saturated_holder_sends_the_job_to_the_shared_queue(session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[0], A, n=2)
    queued, _ = new_job(session, voices[0])
    q.set_job_route(session=session, job_ids=[queued.id], routed_to=A, route="affinity")
    session.commit()
    assert q.worker_backlogs(session=session, workers=[A, B]) == {A: 3, B: 0}
    assert route(session, settings, voices[0], affinity_max_backlog=4).reason == "affinity"
    assert route(session, settings, voices[0], affinity_max_backlog=3) == routing.Route(
        settings.queue_gpu, None, "shared_saturated")


def live_with_slots(session: Session, slots: int, *names: str) -> None:
    for name in names:
        q.register_worker(session=session, name=name, slots=slots)
    session.commit()


def test_a_holder_with_every_slot_taken_spills_the_job_to_a_worker_with_a_free_slot(
        session, settings, voices):
    live_with_slots(session, 2, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[0], A, n=1)
    assert route(session, settings, voices[0]).worker == A  # one slot of A's two is free: affinity
    claimed_by(session, voices[1], A, n=1)  # now both are taken, and B has two free
    spilled = route(session, settings, voices[0])
    assert spilled == routing.Route(f"{settings.queue_gpu}.{B}", B, "spilled")
    job, _ = new_job(session, voices[0])  # sent there: B holds the voice too from now on
    q.set_job_route(session=session, job_ids=[job.id], routed_to=B, route=spilled.reason)
    session.commit()
    assert q.voice_holders(session=session, voice_id=voices[0], workers=[A, B]) == {A, B}
    assert route(session, settings, voices[0]) == routing.Route(f"{settings.queue_gpu}.{B}", B, "affinity")


def test_a_full_holder_keeps_the_voice_when_no_other_worker_has_a_free_slot(session, settings, voices):
    live_with_slots(session, 2, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[0], A, n=2)
    claimed_by(session, voices[1], B, n=2)
    assert route(session, settings, voices[0]) == routing.Route(f"{settings.queue_gpu}.{A}", A, "affinity")
    claimed_by(session, voices[0], A, n=1)  # A is busier than B now, but B has no free slot either
    assert route(session, settings, voices[0]).reason == "affinity"


def test_slots_a_worker_did_not_record_are_the_routers_own_setting(session, settings, voices):
    live(session, A, B)  # no slots recorded: the router assumes settings.worker_slots
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[0], A, n=2)
    assert route(session, settings, voices[0], worker_slots=3).reason == "affinity"
    assert route(session, settings, voices[0], worker_slots=2).reason == "spilled"
    assert q.worker_slots(session=session, workers=[A, B]) == {A: None, B: None}
    live_with_slots(session, 4, A)  # a new incarnation records its own
    assert q.worker_slots(session=session, workers=[A, B]) == {A: 4, B: None}


def test_new_voices_on_idle_workers_go_to_the_one_whose_latest_install_is_oldest(session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[1], nbytes=1)  # idle, but holds one
    assert route(session, settings, voices[0]) == routing.Route(f"{settings.queue_gpu}.{B}", B, "placed")
    q.record_install(session=session, worker_id=B, voice_id=voices[0], nbytes=1)
    q.record_install(session=session, worker_id=B, voice_id=voices[2], nbytes=1)
    session.commit()
    rows = {row.name: row for row in q.live_worker_rows(session=session, beat_after=utcnow() - timedelta(1))}
    assert rows[A].last_install is not None and rows[B].last_install is not None
    assert rows[A].last_install < rows[B].last_install
    assert route(session, settings, vid(7)).worker == A  # A installed nothing since B did
    claimed_by(session, voices[1], A, n=1)  # busier comes first: live jobs, then the latest install
    assert route(session, settings, vid(7)).worker == B


def test_a_voices_holders_are_only_live_workers_whatever_else_holds_it(session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    q.record_install(session=session, worker_id="gpu-gone@host", voice_id=voices[0], nbytes=1)
    claimed_by(session, voices[0], "gpu-other@host", n=1)
    session.commit()
    assert q.voice_holders(session=session, voice_id=voices[0], workers=[A, B]) == {A}
    assert q.voice_holders(session=session, voice_id=voices[0], workers=[B]) == set()


def test_finished_jobs_are_no_backlog_and_hold_no_voice(session, settings, voices):
    live(session, A, B)
    claimed_by(session, voices[0], A, n=2)
    session.execute(update(Job).values(status=JobStatus.SUCCEEDED))
    session.commit()
    assert q.worker_backlogs(session=session, workers=[A, B]) == {A: 0, B: 0}
    assert q.voice_holders(session=session, voice_id=voices[0], workers=[A, B]) == set()
    assert route(session, settings, voices[0]) == routing.Route(f"{settings.queue_gpu}.{A}", A, "placed")


def test_send_routed_records_the_route_then_sends_synth_there(session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    job, _ = new_job(session, voices[0])
    session.commit()
    sender = Sent()
    got = routing.send_routed(session=session, sender=sender, settings=settings, job_id=job.id,
                              voice_id=voices[0], priority=7)
    ((name, options),) = sender.calls
    assert name == "synth" and options["queue"] == got.queue == f"{settings.queue_gpu}.{A}"
    assert options["task_id"] == job.id and options["args"] == [job.id] and options["priority"] == 2
    row = q.require_job(session=session, job_id=job.id)
    assert (row.routed_to, row.route) == (A, "affinity")
    assert q.count_jobs_by_route(session=session) == {"affinity": 1}


def test_a_workers_latest_install_is_kept_on_its_row_and_a_new_incarnation_starts_with_none(
        session, settings, voices):
    live(session, A, B)
    q.record_install(session=session, worker_id=A, voice_id=voices[0], nbytes=1)
    session.commit()
    installed = q.get_worker_voice(session=session, worker_id=A, voice_id=voices[0])
    assert installed is not None
    rows = {row.name: row for row in q.live_worker_rows(session=session, beat_after=utcnow() - timedelta(1))}
    assert rows[A].last_install == installed.installed_at and rows[B].last_install is None
    live(session, A)  # restarted: its device memory, and so its installs, are gone
    rows = {row.name: row for row in q.live_worker_rows(session=session, beat_after=utcnow() - timedelta(1))}
    assert rows[A].last_install is None


def test_a_processs_live_workers_are_read_at_most_once_a_second_and_a_dead_one_is_dropped_at_once(
        session: Session, settings: Settings, voices: list[str], monkeypatch: pytest.MonkeyPatch):
    """The API's cache (`routing.LiveWorkers`): a worker whose last beat passes LIVE_BEAT_S between two
    reads is no longer chosen; a worker that starts is seen at the next read, a second later."""
    settings = settings.model_copy(update={"voice_affinity": "auto"})
    t0 = utcnow()
    clock = [t0]
    monkeypatch.setattr(routing, "utcnow", lambda: clock[0])
    live(session, A, B)
    session.execute(update(Worker).where(Worker.name == A)
                    .values(heartbeat_at=t0 - timedelta(seconds=routing.LIVE_BEAT_S - 0.5)))
    session.commit()
    cache = routing.LiveWorkers()

    def decide(voice: str) -> routing.Route:
        return routing.route_voice(session=session, settings=settings, voice_id=voice, live_workers=cache)

    assert (decide(voices[0]).worker, decide(voices[0]).reason) == (A, "placed")  # both idle: A by name
    live(session, "gpu-c@host")
    clock[0] = t0 + timedelta(seconds=0.9)  # not read again: A's beat is 30.4 s old now, C not seen yet
    assert decide(voices[0]).reason == "shared_single"
    clock[0] = t0 + timedelta(seconds=1.0)  # read again: B and C
    assert decide(voices[1]).worker in (B, "gpu-c@host")
