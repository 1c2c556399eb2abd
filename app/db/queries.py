"""Keyword-only data access over `app.db.models`.

Every function takes `session=` and flushes its work; the caller owns the
transaction (`app.db.session.session_scope`). State changes that may race
(claims, progress, finishing) are single conditional UPDATEs, so two
processes never both win. Inserts that may race use INSERT .. ON CONFLICT
DO NOTHING (SQLite and PostgreSQL both have it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.models import (
    DONE_JOB_STATUSES,
    LIVE_JOB_STATUSES,
    Job,
    JobKind,
    JobStatus,
    PrepPath,
    Voice,
    VoiceStatus,
    WorkerVoice,
    utcnow,
)
from app.errors import NotFound

ERROR_MAX_CHARS = 4000


def _clip(error: str) -> str:
    return error if len(error) <= ERROR_MAX_CHARS else error[: ERROR_MAX_CHARS - 3] + "..."


def _rowcount(result: Any) -> int:
    """Rows an UPDATE matched (a CursorResult's rowcount; typed as plain Result by session.execute)."""
    return int(cast(CursorResult[Any], result).rowcount)


def _insert(session: Session, model: type[Any]) -> Any:
    """A dialect INSERT that supports on_conflict_do_nothing."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(model)
    if name == "sqlite":
        return sqlite.insert(model)
    raise NotImplementedError(f"unsupported database dialect {name!r}")


# Voices -------------------------------------------------------------------


def get_voice(*, session: Session, voice_id: str) -> Voice | None:
    return session.get(Voice, voice_id, populate_existing=True)


def require_voice(*, session: Session, voice_id: str) -> Voice:
    voice = get_voice(session=session, voice_id=voice_id)
    if voice is None:
        raise NotFound(f"no voice {voice_id}")
    return voice


def get_or_create_voice(*, session: Session, voice_id: str, reference_path: str) -> tuple[Voice, bool]:
    """The voice row, created pending if new. Returns (voice, created)."""
    now = utcnow()
    stmt = (
        _insert(session, Voice)
        .values(
            id=voice_id,
            status=VoiceStatus.PENDING,
            reference_path=reference_path,
            prepare_attempts=0,
            uses=0,
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(Voice.id)
    )
    # RETURNING, not rowcount: drivers disagree on rowcount for ON CONFLICT DO NOTHING.
    created = session.execute(stmt).first() is not None
    return require_voice(session=session, voice_id=voice_id), created


def add_voice_use(*, session: Session, voice_id: str, delta: int = 1) -> None:
    session.execute(
        update(Voice).where(Voice.id == voice_id).values(uses=Voice.uses + delta, updated_at=utcnow())
    )


def mark_voice_pending(*, session: Session, voice_id: str) -> None:
    """Back to pending (features evicted, or an earlier preparation failed) before a new prepare."""
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(status=VoiceStatus.PENDING, error=None, prepare_attempts=0, updated_at=utcnow())
    )


def mark_voice_preparing(*, session: Session, voice_id: str) -> int:
    """Start a preparation attempt; returns the attempt number (1 for the first since the last success)."""
    now = utcnow()
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(
            status=VoiceStatus.PREPARING,
            prepare_started_at=now,
            prepare_attempts=Voice.prepare_attempts + 1,
            error=None,
            updated_at=now,
        )
    )
    return require_voice(session=session, voice_id=voice_id).prepare_attempts


def mark_voice_ready(*, session: Session, voice_id: str, prepare_ms: float, feature_nbytes: int) -> None:
    now = utcnow()
    result = session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(
            status=VoiceStatus.READY,
            prepared_at=now,
            prepare_ms=prepare_ms,
            feature_nbytes=feature_nbytes,
            prepare_attempts=0,
            error=None,
            updated_at=now,
        )
    )
    if _rowcount(result) != 1:
        raise NotFound(f"no voice {voice_id}")


def mark_voice_failed(*, session: Session, voice_id: str, error: str) -> None:
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(status=VoiceStatus.FAILED, error=_clip(error), updated_at=utcnow())
    )


def count_live_jobs(*, session: Session, voice_id: str, exclude_job_id: str | None = None) -> int:
    """Jobs of this voice that are not finished (a cancelled job's voice is reclaimed only at zero)."""
    stmt = (
        select(func.count())
        .select_from(Job)
        .where(Job.voice_id == voice_id, Job.status.in_(LIVE_JOB_STATUSES))
    )
    if exclude_job_id is not None:
        stmt = stmt.where(Job.id != exclude_job_id)
    return int(session.execute(stmt).scalar_one())


def is_voice_abandoned(*, session: Session, voice_id: str) -> bool:
    """The voice was wanted only by jobs that have all been cancelled (so its preparation leaked).

    A voice uploaded on its own (no jobs) or used by any job that was not cancelled is not abandoned."""
    total, cancelled = session.execute(
        select(func.count(), func.count().filter(Job.status == JobStatus.CANCELLED)).where(
            Job.voice_id == voice_id
        )
    ).one()
    return total > 0 and total == cancelled


def referenced_paths(*, session: Session) -> set[str]:
    """Every artifact path the database points at (references, token files, outputs)."""
    paths: set[str] = set(
        session.scalars(select(Voice.reference_path).where(Voice.reference_path.is_not(None)))
    )
    for column in (Job.tokens_path, Job.output_path):
        paths.update(session.scalars(select(column).where(column.is_not(None))))
    return paths


# Jobs ---------------------------------------------------------------------


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
) -> tuple[Job, bool]:
    """Insert a queued job. With an idempotency key already used, returns that job instead.

    Returns (job, created)."""
    now = utcnow()
    stmt = _insert(session, Job).values(
        id=job_id,
        voice_id=voice_id,
        status=JobStatus.QUEUED,
        kind=kind,
        tokens=list(tokens) if tokens is not None else None,
        tokens_path=tokens_path,
        n_tokens=n_tokens,
        seed=seed,
        output_format=output_format,
        priority=priority,
        idempotency_key=idempotency_key,
        frames_done=0,
        frames_total=2 * n_tokens,
        submitted_at=now,
        attempts=0,
        updated_at=now,
    )
    if idempotency_key is not None:
        stmt = stmt.on_conflict_do_nothing(index_elements=["idempotency_key"])
    created = session.execute(stmt.returning(Job.id)).first() is not None
    if created:
        return require_job(session=session, job_id=job_id), True
    existing = get_job_by_idempotency_key(session=session, idempotency_key=idempotency_key or "")
    assert existing is not None, "conflicting insert without a row to conflict with"
    return existing, False


def claim_job_attempt(*, session: Session, job_id: str, worker: str, max_attempts: int) -> Job | None:
    """Start the next attempt of a live job on `worker`; None when it must not run.

    None means: finished or cancelled already, another worker claimed this
    attempt first, or out of attempts (the job is then marked failed).
    Progress and timings restart with each attempt."""
    job = require_job(session=session, job_id=job_id)
    if job.status in DONE_JOB_STATUSES:
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


def finish_job(
    *,
    session: Session,
    job_id: str,
    status: JobStatus,
    output_path: str | None = None,
    error: str | None = None,
) -> bool:
    """Move a live job to a final status; False if it was already final (first finisher wins)."""
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


def list_jobs(*, session: Session, status: JobStatus | None = None, limit: int = 100) -> list[Job]:
    stmt = select(Job).order_by(Job.submitted_at.desc()).limit(limit)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    return list(session.scalars(stmt))


# Worker installs ------------------------------------------------------------


def get_worker_voice(*, session: Session, worker_id: str, voice_id: str) -> WorkerVoice | None:
    return session.get(WorkerVoice, (worker_id, voice_id), populate_existing=True)


def record_install(*, session: Session, worker_id: str, voice_id: str, nbytes: int) -> WorkerVoice:
    """Record (or refresh) a voice installed on a worker; unpinned until a job pins it."""
    now = utcnow()
    row = get_worker_voice(session=session, worker_id=worker_id, voice_id=voice_id)
    if row is None:
        row = WorkerVoice(
            worker_id=worker_id, voice_id=voice_id, installed_at=now, last_used=now, pinned=0, nbytes=nbytes
        )
        session.add(row)
    else:
        row.installed_at, row.last_used, row.nbytes = now, now, nbytes
    session.flush()
    return row


def pin_worker_voice(*, session: Session, worker_id: str, voice_id: str, delta: int = 1) -> None:
    """Add `delta` (+1 pin, -1 unpin) live jobs to an install and touch last_used."""
    session.execute(
        update(WorkerVoice)
        .where(WorkerVoice.worker_id == worker_id, WorkerVoice.voice_id == voice_id)
        .values(
            pinned=case((WorkerVoice.pinned + delta < 0, 0), else_=WorkerVoice.pinned + delta),
            last_used=utcnow(),
        )
    )


def remove_worker_voice(*, session: Session, worker_id: str, voice_id: str) -> bool:
    row = get_worker_voice(session=session, worker_id=worker_id, voice_id=voice_id)
    if row is None:
        return False
    session.delete(row)
    session.flush()
    return True


def list_worker_voices(*, session: Session, worker_id: str) -> list[WorkerVoice]:
    """A worker's installs, least recently used first."""
    stmt = select(WorkerVoice).where(WorkerVoice.worker_id == worker_id).order_by(WorkerVoice.last_used)
    return list(session.scalars(stmt))


def clear_worker_voices(*, session: Session, worker_id: str) -> int:
    """Forget every install of a worker (it restarted: its device memory is gone)."""
    rows = list_worker_voices(session=session, worker_id=worker_id)
    for row in rows:
        session.delete(row)
    session.flush()
    return len(rows)


# Maintenance ---------------------------------------------------------------


def list_stale_live_jobs(*, session: Session, updated_before: Any, limit: int = 1000) -> list[Job]:
    """Live jobs (queued, preparing, running) not updated since `updated_before`, oldest first."""
    stmt = (
        select(Job)
        .where(Job.status.in_(LIVE_JOB_STATUSES), Job.updated_at < updated_before)
        .order_by(Job.updated_at)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def touch_job(*, session: Session, job_id: str) -> None:
    """Stamp updated_at (a job sent again is not stale until it has had time to run)."""
    session.execute(update(Job).where(Job.id == job_id).values(updated_at=utcnow()))


def list_abandoned_ready_voices(*, session: Session) -> list[str]:
    """Voices still marked ready although every job that wanted them was cancelled."""
    cancelled = func.count().filter(Job.status == JobStatus.CANCELLED)
    stmt = (
        select(Voice.id)
        .join(Job, Job.voice_id == Voice.id)
        .where(Voice.status == VoiceStatus.READY)
        .group_by(Voice.id)
        .having(func.count() == cancelled)
    )
    return list(session.scalars(stmt))
