"""A job's life: every change of a job's state is made here (a book's, chapter's and segment's:
`app.lifecycle.books`).

    queued --claim--> preparing --running--> running --finish--> succeeded | failed
       ^                 |                      |
       +----release------+----------------------+         any live state --cancel--> cancelled
       (the lease passed, the worker sent it back, or its process started again)

The database is the truth; a broker message (a Celery task carrying the job id) is a *doorbell*: it
says "there may be work for this job", nothing more. Whoever receives one claims the job here, and a
claim succeeds only for a job that is queued, or claimed by an attempt whose lease has passed. So a
duplicate message costs one cheap claim that finds the job taken, finished or cancelled (the task is
acknowledged as `skipped`), and a lost one costs at most one reconciler period (`app.reconcile`
rings the job's bell again: `ring`).

Leases. A claim makes the job its worker's until `lease_until` (`Settings.job_lease_s` from now); the
running attempt renews it with every progress report (`renew`, each `progress_interval_s`); finishing,
failing, cancelling and releasing clear it. Renewing and marking running name the attempt (the job's
`attempts` when it was claimed), so an attempt whose job was taken by another after its lease passed
finds out at its next report and stops.

Rings. `ring` sends a queued job's doorbell: `job.tokenize` to a CPU worker for a text job without
tokens, else `synth` where `app.submission.routing` says (the voice's holder's own queue, or the shared one),
and records when the bell is due again if the job is still queued then: `stuck_job_after_s` after the
first ring, doubling with each further one (`RING_BACKOFF_MAX`), so a job waiting its turn behind a
long queue gets a few duplicate messages, not one per period.

Finishing a job counts it, in the same transaction, against the chapters of the live books whose
segment it renders (`settle`, through `app.lifecycle.books.count_outcome`; docs/BOOKS.md). Every
function takes `session=` and flushes; the caller owns the transaction, except `ring`, which commits
before it sends (the route is on the row before the message can be delivered). State changes that may
race are single conditional UPDATEs: of two processes, one wins.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, update
from sqlalchemy.orm import Session

from app.broker.wire import TaskSender, one_round, send_synth, send_tokenize
from app.db import queries
from app.db.models import DONE_JOB_STATUSES, LIVE_JOB_STATUSES, Job, JobStatus, PrepPath, utcnow
from app.db.queries import chapters
from app.db.queries._common import _clip, _rowcount
from app.lifecycle.books import count_outcome
from app.settings import Settings
from app.submission.routing import Route, route_voice, send_routed

CLAIMED = (JobStatus.PREPARING, JobStatus.RUNNING)
RING_BACKOFF_MAX = 5  # the wait between rings doubles up to 2**5 times stuck_job_after_s


def claim(*, session: Session, job_id: str, worker: str, max_attempts: int, lease_s: float) -> Job | None:
    """Start the next attempt of a live job on `worker`, leased for `lease_s`; None when it must not run:
    finished or cancelled already, leased to an attempt (here or elsewhere) whose lease has not passed,
    claimed by another process first, or out of attempts (the job is then marked failed). Progress and
    timings restart with each attempt."""
    job = queries.require_job(session=session, job_id=job_id)
    now = utcnow()
    if job.status in DONE_JOB_STATUSES or is_leased(job, now):
        return None
    if job.attempts >= max_attempts:
        finish(session=session, job_id=job_id, status=JobStatus.FAILED,
               error=f"gave up after {job.attempts} attempts" + (f": {job.error}" if job.error else ""))
        return None
    claimable = or_(Job.status == JobStatus.QUEUED, Job.lease_until.is_(None), Job.lease_until <= now)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempts == job.attempts, Job.status.in_(LIVE_JOB_STATUSES), claimable)
        .values(attempts=Job.attempts + 1, status=JobStatus.PREPARING, worker=worker, started_at=now,
                first_audio_at=None, finished_at=None, frames_done=0, prep_path=None,
                lease_until=now + timedelta(seconds=lease_s), rings=0, ring_due_at=None, updated_at=now)
    )
    if _rowcount(result) != 1:
        return None
    return queries.require_job(session=session, job_id=job_id)


def is_leased(job: Job, now: datetime | None = None) -> bool:
    """Is an attempt of this job working on it under a lease that has not passed?"""
    return (job.status in CLAIMED and job.lease_until is not None
            and job.lease_until > (now or utcnow()))


def mark_running(*, session: Session, job_id: str, prep_path: PrepPath | str,
                 attempt: int | None = None) -> bool:
    """The job's voice is installed (by `prep_path`) and its rows are being decoded (by `attempt`)."""
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES))
    if attempt is not None:
        stmt = stmt.where(Job.attempts == attempt)
    values = {"status": JobStatus.RUNNING, "prep_path": str(prep_path), "updated_at": utcnow()}
    return _rowcount(session.execute(stmt.values(**values))) == 1


def renew(*, session: Session, job_id: str, frames_done: int, frames_total: int | None = None,
          attempt: int | None = None, lease_s: float | None = None) -> bool:
    """Record decoded mel frames (the first call with frames stamps first_audio_at) and push the lease of
    `attempt` on by `lease_s`. False when the job is no longer live, or no longer this attempt's (taken by
    another after its lease passed): stop working on it."""
    now = utcnow()
    values: dict[str, Any] = {"frames_done": frames_done, "updated_at": now}
    if frames_total is not None:
        values["frames_total"] = frames_total
    if frames_done > 0:
        values["first_audio_at"] = func.coalesce(Job.first_audio_at, now)
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES))
    if attempt is not None:
        stmt = stmt.where(Job.attempts == attempt, Job.status.in_(CLAIMED))
    if lease_s is not None:
        values["lease_until"] = now + timedelta(seconds=lease_s)
    return _rowcount(session.execute(stmt.values(**values))) == 1


def release(*, session: Session, job_id: str, attempts: int | None = None, worker: str | None = None,
            expired_by: datetime | None = None, claimed_before: datetime | None = None) -> bool:
    """A claimed job nobody works on goes back to `queued` (its attempts stay counted), so that the next
    doorbell claims it at once. Only the attempt `attempts`, only while `worker` holds it, only once its
    lease passed `expired_by`, only if claimed before `claimed_before`, when given; False if the job
    moved on meanwhile (claimed again, finished, cancelled)."""
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(CLAIMED))
    if attempts is not None:
        stmt = stmt.where(Job.attempts == attempts)
    if worker is not None:
        stmt = stmt.where(Job.worker == worker)
    if expired_by is not None:
        stmt = stmt.where(or_(Job.lease_until.is_(None), Job.lease_until <= expired_by))
    if claimed_before is not None:
        stmt = stmt.where(Job.started_at < claimed_before)
    values = {"status": JobStatus.QUEUED, "lease_until": None, "ring_due_at": None, "updated_at": utcnow()}
    return _rowcount(session.execute(stmt.values(**values))) == 1


@dataclass(frozen=True)
class Settled:
    finished: bool  # the job moved to its final status here (False: it was final already)
    # (book id, index) of the chapters whose last open segment this job was: their `book.chapter` is sent
    # after the commit (`app.lifecycle.outbox`; the reconciler sends it again if that send is lost)
    chapters_ready: list[tuple[str, int]] = field(default_factory=list)


def settle(*, session: Session, job_id: str, status: JobStatus, output_path: str | None = None,
           error: str | None = None) -> Settled:
    """Move a live job to a final status (first finisher wins; the lease is cleared) and, in the same
    transaction, count it against the chapters of the live books whose segment it renders
    (`app.lifecycle.books.count_outcome`: the counters a book's status reads, and the chapter's ready
    record)."""
    assert status in DONE_JOB_STATUSES, f"{status} is not a final status"
    now = utcnow()
    values: dict[str, Any] = {"status": status, "finished_at": now, "updated_at": now, "lease_until": None,
                              "ring_due_at": None}
    if output_path is not None:
        values["output_path"] = output_path
    if error is not None:
        values["error"] = _clip(error)
    if status == JobStatus.SUCCEEDED:
        values["frames_done"] = Job.frames_total
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES)).values(**values)
    )
    if _rowcount(result) != 1:
        return Settled(False)
    ready: list[tuple[str, int]] = []
    for key in chapters.lock_job_segments(session=session, job_id=job_id):
        ready += count_outcome(session=session, key=key, before=chapters.Outcome(chapters.OPEN),
                                        after=chapters.read_outcome(session=session, key=key))
    return Settled(True, ready)


def finish(*, session: Session, job_id: str, status: JobStatus, output_path: str | None = None,
           error: str | None = None) -> bool:
    """`settle`; False if the job was already final. Its chapters' `book.chapter` is left to the
    reconciler (`app.reconcile.books`): callers that can send it after the commit use `settle_and_send`."""
    return settle(session=session, job_id=job_id, status=status, output_path=output_path,
                  error=error).finished


def cancel(*, session: Session, job_id: str) -> bool:
    """Cancel a live job; False if it had already finished. Raises NotFound for an unknown id."""
    queries.require_job(session=session, job_id=job_id)
    return finish(session=session, job_id=job_id, status=JobStatus.CANCELLED, error="cancelled")


def ring(*, session: Session, sender: TaskSender, settings: Settings, job_id: str,
         route_note: str | None = None, speech_stored: bool = False) -> str | None:
    """Ring a queued job's doorbell again (module docstring) and note when it is next due; commits, then
    sends. -> "tokenize" or "synth" (what was sent), None when the job is not queued any more.
    `speech_stored`: the caller just stored a text job's guide speech, so its `synth` goes at once (the
    GPU worker tokenizes it); a later ring of a job still without tokens sends `job.tokenize`, which
    speaks it again if its speech is gone."""
    job = queries.get_job(session=session, job_id=job_id)
    if job is None or job.status != JobStatus.QUEUED:
        return None
    now = utcnow()
    wait_s = settings.stuck_job_after_s * 2 ** min(job.rings, RING_BACKOFF_MAX)
    session.execute(update(Job).where(Job.id == job_id)
                    .values(rings=Job.rings + 1, ring_due_at=now + timedelta(seconds=wait_s)))
    if not queries.is_tokenized(job) and not speech_stored:
        session.commit()
        send_tokenize(sender, settings, job_id, job.priority)
        return "tokenize"
    route = send_routed(session=session, sender=sender, settings=settings, job_id=job_id,
                        voice_id=job.voice_id, priority=job.priority)
    if route_note is not None and route.worker is None:
        queries.set_job_route(session=session, job_ids=[job_id], routed_to=None, route=route_note)
        session.commit()
    return "synth"


def ring_many(*, session: Session, sender: TaskSender, settings: Settings, job_ids: list[str],
              speech_stored: Collection[str] = ()) -> dict[str, str]:
    """`ring` for a group of jobs at once (a `book.tokenize` group; the reconciler's due jobs, a few at a
    time): one UPDATE of their rings for each ring count among them, one routing decision per voice (as
    a batch submission routes), the routes recorded and committed once, then their messages in one
    broker round. `speech_stored`: ids of text jobs whose guide speech is stored (their `synth` goes, as
    `ring`'s `speech_stored`). Jobs no longer queued are left alone. -> job id: what was sent
    ("tokenize" or "synth"), for each job rung."""
    jobs = queries.get_jobs(session=session, job_ids=job_ids)
    queued = [job for job in jobs if job.status == JobStatus.QUEUED]
    if not queued:
        return {}
    now = utcnow()
    for rings in sorted({job.rings for job in queued}):
        wait_s = settings.stuck_job_after_s * 2 ** min(rings, RING_BACKOFF_MAX)
        ids = [job.id for job in queued if job.rings == rings]
        session.execute(update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED)
                        .values(rings=Job.rings + 1, ring_due_at=now + timedelta(seconds=wait_s)))
    stored = set(speech_stored)
    sent = {job.id: "synth" if queries.is_tokenized(job) or job.id in stored else "tokenize"
            for job in queued}
    routes: dict[str, Route] = {}
    for job in queued:
        if sent[job.id] == "synth" and job.voice_id not in routes:
            routes[job.voice_id] = route_voice(session=session, settings=settings, voice_id=job.voice_id)
    for route in set(routes.values()):
        queries.set_job_route(session=session, routed_to=route.worker, route=route.reason,
                              job_ids=[job.id for job in queued
                                       if sent[job.id] == "synth" and routes[job.voice_id] == route])
    session.commit()  # the routes are on the rows before any message can be delivered
    with one_round(sender) as one:
        for job in queued:
            if sent[job.id] == "synth":
                send_synth(one, settings, job.id, job.priority, queue=routes[job.voice_id].queue)
            else:
                send_tokenize(one, settings, job.id, job.priority)
    return sent
