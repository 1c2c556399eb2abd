"""Jobs: creation (idempotent), attempts, progress, finishing (counted against book chapters), cancelling,
listing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.db.models import (
    DONE_JOB_STATUSES,
    LIVE_JOB_STATUSES,
    Job,
    JobKind,
    JobStatus,
    PrepPath,
    utcnow,
)
from app.db.queries import chapters, paging
from app.db.queries._common import _clip, _insert, _rowcount
from app.db.queries.workers import is_held
from app.errors import NotFound
from app.speech import MEL_PER_TOKEN


def get_job(*, session: Session, job_id: str) -> Job | None:
    return session.get(Job, job_id, populate_existing=True)


def require_job(*, session: Session, job_id: str) -> Job:
    job = get_job(session=session, job_id=job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def get_job_by_idempotency_key(*, session: Session, idempotency_key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.idempotency_key == idempotency_key)).one_or_none()


def create_job(
    *,
    session: Session,
    job_id: str,
    voice_id: str,
    tokens: Sequence[int] | None,
    n_tokens: int,
    seed: int,
    output_format: str,
    priority: int = 0,
    idempotency_key: str | None = None,
    tokens_path: str | None = None,
    kind: str = JobKind.TOKENS,
    text: str | None = None,
    language: str | None = None,
) -> tuple[Job, bool]:
    """Insert a queued job. With an idempotency key already used, returns that job instead. A text job
    has no tokens yet (None, n_tokens 0) until `set_job_tokens`.

    Returns (job, created)."""
    now = utcnow()
    stmt = _insert(session, Job).values(
        id=job_id, voice_id=voice_id, status=JobStatus.QUEUED, kind=kind, text=text, language=language,
        tokens=list(tokens) if tokens is not None else None, tokens_path=tokens_path, n_tokens=n_tokens,
        seed=seed, output_format=output_format, priority=priority, idempotency_key=idempotency_key,
        frames_done=0, frames_total=MEL_PER_TOKEN * n_tokens, submitted_at=now, attempts=0, updated_at=now,
    )
    if idempotency_key is not None:
        stmt = stmt.on_conflict_do_nothing(index_elements=["idempotency_key"])
    created = session.execute(stmt.returning(Job.id)).first() is not None
    if created:
        return require_job(session=session, job_id=job_id), True
    existing = get_job_by_idempotency_key(session=session, idempotency_key=idempotency_key or "")
    assert existing is not None, "conflicting insert without a row to conflict with"
    return existing, False


def set_job_tokens(*, session: Session, job_id: str, tokens: Sequence[int] | None, n_tokens: int,
                   tokens_path: str | None = None) -> bool:
    """A text job's tokens, made on a CPU worker (inline, or in the artifact store at `tokens_path`);
    False when the job is no longer queued (cancelled meanwhile, or tokenized by an earlier delivery)."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED, Job.n_tokens == 0)
        .values(tokens=list(tokens) if tokens is not None else None, tokens_path=tokens_path,
                n_tokens=n_tokens, frames_total=MEL_PER_TOKEN * n_tokens, updated_at=utcnow())
    )
    return _rowcount(result) == 1


def is_tokenized(job: Job) -> bool:
    """Whether the job's tokens exist (always for a tokens job; for a text job once `job.tokenize` ran)."""
    return job.kind != JobKind.TEXT or job.n_tokens > 0


def add_job_note(*, session: Session, job_id: str, note: str) -> None:
    """Add a sentence to what the client is told about the job's audio (each sentence once)."""
    job = require_job(session=session, job_id=job_id)
    notes = list(job.notes or [])
    if note not in notes:
        job.notes = [*notes, note]


def claim_job_attempt(*, session: Session, job_id: str, worker: str, max_attempts: int) -> Job | None:
    """Start the next attempt of a live job on `worker`; None when it must not run.

    None means: finished or cancelled already, another worker claimed this
    attempt first, a live worker is streaming the job (a duplicate delivery:
    `workers.is_held`), or out of attempts (the job is then marked failed).
    Progress and timings restart with each attempt."""
    job = require_job(session=session, job_id=job_id)
    if job.status in DONE_JOB_STATUSES or is_held(session=session, job=job):
        return None
    if job.attempts >= max_attempts:
        finish_job(
            session=session,
            job_id=job_id,
            status=JobStatus.FAILED,
            error=f"gave up after {job.attempts} attempts" + (f": {job.error}" if job.error else ""),
        )
        return None
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempts == job.attempts, Job.status.in_(LIVE_JOB_STATUSES))
        .values(
            attempts=Job.attempts + 1,
            status=JobStatus.PREPARING,
            worker=worker,
            started_at=now,
            first_audio_at=None,
            finished_at=None,
            frames_done=0,
            prep_path=None,
            updated_at=now,
        )
    )
    if _rowcount(result) != 1:
        return None
    return require_job(session=session, job_id=job_id)


def mark_job_running(*, session: Session, job_id: str, prep_path: PrepPath | str) -> bool:
    """The job's voice is installed (by `prep_path`) and its rows are being decoded."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES))
        .values(status=JobStatus.RUNNING, prep_path=str(prep_path), updated_at=utcnow())
    )
    return _rowcount(result) == 1


def update_progress(
    *, session: Session, job_id: str, frames_done: int, frames_total: int | None = None
) -> bool:
    """Record decoded mel frames; the first call with frames stamps first_audio_at.

    False when the job is no longer live (cancelled or finished): stop working on it."""
    now = utcnow()
    values: dict[str, Any] = {"frames_done": frames_done, "updated_at": now}
    if frames_total is not None:
        values["frames_total"] = frames_total
    if frames_done > 0:
        values["first_audio_at"] = func.coalesce(Job.first_audio_at, now)
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES)).values(**values)
    )
    return _rowcount(result) == 1


@dataclass(frozen=True)
class Settled:
    finished: bool  # the job moved to its final status here (False: it was final already)
    # (book id, index) of the chapters whose last segment this job was: their `book.chapter` is sent
    # after the commit (the sweep sends it again if that send is lost)
    chapters_ready: list[tuple[str, int]] = field(default_factory=list)


def settle_job(*, session: Session, job_id: str, status: JobStatus, output_path: str | None = None,
               error: str | None = None) -> Settled:
    """Move a live job to a final status (first finisher wins) and, in the same transaction, count it
    against the chapters of the live books whose segment it renders (`chapters.count_outcome`)."""
    if not _finish_row(session=session, job_id=job_id, status=status, output_path=output_path, error=error):
        return Settled(False)
    ready: list[tuple[str, int]] = []
    for key in chapters.lock_job_segments(session=session, job_id=job_id):
        ready += chapters.count_outcome(session=session, key=key, before=chapters.Outcome(chapters.OPEN),
                                        after=chapters.read_outcome(session=session, key=key))
    return Settled(True, ready)


def finish_job(*, session: Session, job_id: str, status: JobStatus, output_path: str | None = None,
               error: str | None = None) -> bool:
    """`settle_job`; False if the job was already final. Its chapters' `book.chapter` is left to the
    sweep (`app.maintenance` part 6): callers that can send it after the commit use `settle_job`."""
    return settle_job(session=session, job_id=job_id, status=status, output_path=output_path,
                      error=error).finished


def _finish_row(
    *,
    session: Session,
    job_id: str,
    status: JobStatus,
    output_path: str | None = None,
    error: str | None = None,
) -> bool:
    """The job's row alone (`settle_job` counts it too): live -> final; False if it was already final."""
    assert status in DONE_JOB_STATUSES, f"{status} is not a final status"
    values: dict[str, Any] = {"status": status, "finished_at": utcnow(), "updated_at": utcnow()}
    if output_path is not None:
        values["output_path"] = output_path
    if error is not None:
        values["error"] = _clip(error)
    if status == JobStatus.SUCCEEDED:
        values["frames_done"] = Job.frames_total
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(LIVE_JOB_STATUSES)).values(**values)
    )
    return _rowcount(result) == 1


def cancel_job(*, session: Session, job_id: str) -> bool:
    """Cancel a live job; False if it had already finished. Raises NotFound for an unknown id."""
    require_job(session=session, job_id=job_id)
    return finish_job(session=session, job_id=job_id, status=JobStatus.CANCELLED, error="cancelled")


def list_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              limit: int = 100) -> list[Job]:
    """Newest first, optionally of one status and one voice."""
    return page_jobs(session=session, status=status, voice_id=voice_id, limit=limit)[0]


def page_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              after: str | None = None, limit: int = 100) -> tuple[list[Job], str | None]:
    """A page of jobs newest first after the cursor `after`, and the next page's cursor (None: last)."""
    stmt = paging.page(select(Job), Job, after, limit)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if voice_id is not None:
        stmt = stmt.where(Job.voice_id == voice_id)
    return paging.split(list(session.scalars(stmt)), limit)


def count_jobs_by_status(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status))
    return {str(status): int(count) for status, count in rows}


def job_ids_with_prefix(*, session: Session, prefix: str, limit: int = 10) -> list[str]:
    """Ids starting with `prefix` (lowercase hex and hyphens, checked by the caller), at most `limit`."""
    stmt = select(Job.id).where(Job.id.startswith(prefix, autoescape=True)).order_by(Job.id).limit(limit)
    return list(session.scalars(stmt))
