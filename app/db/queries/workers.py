"""GPU workers: each node name's current incarnation and heartbeat (a job's claim is a lease on the job's
own row: `app.lifecycle`).

The routing queries (`app.submission.routing`) read the same rows: which workers are live, what each has to
get through, which hold a voice; where each job's `synth` was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select, union, union_all, update
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus, Worker, WorkerVoice, utcnow
from app.db.queries._common import _insert, _rowcount

CLAIMED = (JobStatus.PREPARING, JobStatus.RUNNING)


def register_worker(*, session: Session, name: str, slots: int | None = None,
                    dummy_weights: bool | None = None) -> Worker:
    """A worker process starting under `name` with `slots` (jobs it streams at once), on dummy weights or
    not: a new incarnation (started now, beating now)."""
    now = utcnow()
    values = {"started_at": now, "heartbeat_at": now, "slots": slots, "dummy_weights": dummy_weights,
              "last_install_at": None}  # a new process holds no voice yet
    stmt = _insert(session, Worker).values(name=name, **values)
    session.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=values))
    worker = session.get(Worker, name, populate_existing=True)
    assert worker is not None
    return worker


def beat(*, session: Session, name: str, started_at: datetime) -> bool:
    """This incarnation is alive; False when another process has taken the name since."""
    result = session.execute(update(Worker).where(Worker.name == name, Worker.started_at == started_at)
                             .values(heartbeat_at=utcnow()))
    return _rowcount(result) == 1


def mark_worker_stopped(*, session: Session, name: str, started_at: datetime) -> None:
    """This incarnation stopped (a warm shutdown): it holds nothing any more."""
    session.execute(update(Worker).where(Worker.name == name, Worker.started_at == started_at)
                    .values(heartbeat_at=None))


def get_worker(*, session: Session, name: str) -> Worker | None:
    return session.get(Worker, name, populate_existing=True)


# Routing (`app.submission.routing`)
# ------------------------------------------------------------------------------

def live_workers(*, session: Session, beat_after: datetime) -> list[str]:
    """Node names of the GPU workers that beat since `beat_after` (and did not stop), by name."""
    stmt = select(Worker.name).where(Worker.heartbeat_at.is_not(None), Worker.heartbeat_at >= beat_after)
    return list(session.scalars(stmt.order_by(Worker.name)))


def live_workers_on_dummy_weights(*, session: Session, beat_after: datetime) -> int:
    """How many of the GPU workers that beat since `beat_after` run dummy weights."""
    stmt = select(func.count()).select_from(Worker).where(
        Worker.heartbeat_at.is_not(None), Worker.heartbeat_at >= beat_after, Worker.dummy_weights.is_(True))
    return int(session.scalar(stmt) or 0)


def worker_backlogs(*, session: Session, workers: Sequence[str]) -> dict[str, int]:
    """Live jobs each worker has to get through: claimed by it, or queued on its own queue. One statement
    over the live jobs (ix_jobs_status_priority), every worker's counted and `workers`' kept: naming 64
    workers in the query cost more to render than the database took to count (scripts/bench_routing.py)."""
    backlog = dict.fromkeys(workers, 0)
    if not workers:
        return backlog
    claimed = (select(Job.worker, func.count()).where(Job.status.in_(CLAIMED), Job.worker.is_not(None))
               .group_by(Job.worker))
    queued = (select(Job.routed_to, func.count())
              .where(Job.status == JobStatus.QUEUED, Job.routed_to.is_not(None)).group_by(Job.routed_to))
    for name, n in session.execute(union_all(claimed, queued)):
        if name in backlog:
            backlog[name] += int(n)
    return backlog


def worker_slots(*, session: Session, workers: Sequence[str]) -> dict[str, int | None]:
    """The slots each worker recorded as it registered (None: a row from before they were recorded)."""
    slots: dict[str, int | None] = dict.fromkeys(workers)
    if workers:
        stmt = select(Worker.name, Worker.slots).where(Worker.name.in_(workers))
        slots.update((name, n) for name, n in session.execute(stmt).tuples())
    return slots


@dataclass(frozen=True)
class LiveWorker:
    name: str
    slots: int | None  # as it registered (None: a row from before they were recorded)
    last_install: datetime | None  # this incarnation's latest install; None: it installed none


def live_worker_rows(*, session: Session, beat_after: datetime) -> list[LiveWorker]:
    """The GPU workers that beat since `beat_after` (and did not stop), by name, with their slots and
    latest install (`workers.last_install_at`, kept by `record_install`): the workers' rows alone, so the
    cost does not grow with the voices installed."""
    stmt = (select(Worker.name, Worker.slots, Worker.last_install_at)
            .where(Worker.heartbeat_at.is_not(None), Worker.heartbeat_at >= beat_after).order_by(Worker.name))
    return [LiveWorker(name, slots, last) for name, slots, last in session.execute(stmt).tuples()]


def live_worker_beats(*, session: Session, beat_after: datetime) -> list[tuple[LiveWorker, datetime]]:
    """`live_worker_rows` with each worker's latest heartbeat, for a reader that keeps them a while and
    judges liveness again at each use (`app.submission.routing.LiveWorkers`)."""
    stmt = (select(Worker.name, Worker.slots, Worker.last_install_at, Worker.heartbeat_at)
            .where(Worker.heartbeat_at.is_not(None), Worker.heartbeat_at >= beat_after).order_by(Worker.name))
    rows = session.execute(stmt).tuples()
    return [(LiveWorker(name, slots, last), beat) for name, slots, last, beat in rows if beat is not None]


def voice_holders(*, session: Session, voice_id: str, workers: Sequence[str]) -> set[str]:
    """Of `workers`, those that hold the voice: installed (`worker_voices`), or with live jobs of it
    claimed or queued on their own queue (the install is under way, or will be); one statement."""
    if not workers:
        return set()
    installed = select(WorkerVoice.worker_id.label("name")).where(WorkerVoice.voice_id == voice_id)
    claimed = select(Job.worker).where(Job.voice_id == voice_id, Job.status.in_(CLAIMED))
    queued = select(Job.routed_to).where(Job.voice_id == voice_id, Job.status == JobStatus.QUEUED)
    live = set(workers)
    return {name for name in session.scalars(union(installed, claimed, queued)) if name in live}


def set_job_route(*, session: Session, job_ids: Sequence[str], routed_to: str | None, route: str) -> None:
    """Record where the jobs' `synth` went (a worker's own queue, or None: the shared one) and why."""
    if job_ids:
        session.execute(update(Job).where(Job.id.in_(list(job_ids)))
                        .values(routed_to=routed_to, route=route))


def list_gone_workers(*, session: Session, silent_before: datetime) -> list[str]:
    """Node names of the GPU workers that stopped or have not beaten since `silent_before`."""
    stmt = select(Worker.name).where(or_(Worker.heartbeat_at.is_(None), Worker.heartbeat_at < silent_before))
    return list(session.scalars(stmt.order_by(Worker.name)))


def list_worker_names(*, session: Session) -> list[str]:
    return list(session.scalars(select(Worker.name).order_by(Worker.name)))


def count_jobs_by_route(*, session: Session) -> dict[str, int]:
    """Jobs in the database by the route of their latest `synth` (`app.submission.routing.ROUTES`)."""
    stmt = select(Job.route, func.count()).where(Job.route.is_not(None)).group_by(Job.route)
    return {str(route): int(n) for route, n in session.execute(stmt)}
