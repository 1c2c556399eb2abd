"""Keyword-only data access over `app.db.models`.

Every function takes `session=` and flushes its work; the caller owns the
transaction (`app.db.session.session_scope`). State changes that may race
(claims, progress, finishing) are single conditional UPDATEs, so two
processes never both win. Inserts that may race use INSERT .. ON CONFLICT
DO NOTHING (SQLite and PostgreSQL both have it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.models import (
    DONE_JOB_STATUSES,
    LIVE_BOOK_STATUSES,
    LIVE_JOB_STATUSES,
    Book,
    BookChapter,
    BookSegment,
    BookStatus,
    Job,
    JobKind,
    JobStatus,
    PrepPath,
    Segment,
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


# Books and segments ---------------------------------------------------------------


@dataclass(frozen=True)
class PlannedChapter:
    title: str
    keys: Sequence[tuple[str, str]]  # (segment key, kind) in reading order, repeats included
    est_seconds: float


def create_book(*, session: Session, book_id: str, voice_id: str, title: str, author: str, language: str,
                plan_key: str, output_format: str, m4b: bool, target_lufs: float | None, seed: int,
                priority: int, chapters: Sequence[PlannedChapter]) -> Book:
    """Insert a queued book, its chapters, where each segment sits, and every segment not known yet."""
    now = utcnow()
    total = sum(len(c.keys) for c in chapters)
    book = Book(id=book_id, voice_id=voice_id, status=BookStatus.QUEUED, title=title, author=author,
                language=language, plan_key=plan_key, output_format=output_format, m4b=m4b,
                target_lufs=target_lufs, seed=seed, priority=priority, segments_total=total,
                est_seconds=sum(c.est_seconds for c in chapters), submitted_at=now, updated_at=now)
    session.add(book)
    session.flush()
    kinds = {key: kind for c in chapters for key, kind in c.keys}
    if kinds:
        session.execute(
            _insert(session, Segment)
            .values([{"key": k, "voice_id": voice_id, "kind": kind, "jobs_created": 0, "created_at": now,
                      "updated_at": now} for k, kind in kinds.items()])
            .on_conflict_do_nothing(index_elements=["key"]))
    for index, chapter in enumerate(chapters):
        session.add(BookChapter(book_id=book_id, index=index, title=chapter.title,
                                segments_total=len(chapter.keys), est_seconds=chapter.est_seconds))
        session.add_all(BookSegment(book_id=book_id, chapter=index, position=pos, key=key)
                        for pos, (key, _) in enumerate(chapter.keys))
    session.flush()
    return book


def get_book(*, session: Session, book_id: str) -> Book | None:
    return session.get(Book, book_id, populate_existing=True)


def require_book(*, session: Session, book_id: str) -> Book:
    book = get_book(session=session, book_id=book_id)
    if book is None:
        raise NotFound(f"no book {book_id}")
    return book


def list_books(*, session: Session, limit: int = 100) -> list[Book]:
    """Newest first."""
    return list(session.scalars(select(Book).order_by(Book.submitted_at.desc(), Book.id).limit(limit)))


def list_chapters(*, session: Session, book_id: str) -> list[BookChapter]:
    stmt = select(BookChapter).where(BookChapter.book_id == book_id).order_by(BookChapter.index)
    return list(session.scalars(stmt))


def set_book_status(*, session: Session, book_id: str, status: BookStatus,
                    only_from: Sequence[BookStatus] = LIVE_BOOK_STATUSES, error: str | None = None) -> bool:
    """Move a book to `status` if it is in one of `only_from` (first mover wins); stamps the times."""
    now = utcnow()
    values: dict[str, Any] = {"status": status, "updated_at": now}
    if status == BookStatus.RENDERING:
        values["started_at"] = func.coalesce(Book.started_at, now)
        values["finished_at"] = None
        values["error"] = None
    if status in (BookStatus.SUCCEEDED, BookStatus.FAILED, BookStatus.CANCELLED):
        values["finished_at"] = now
    if error is not None:
        values["error"] = _clip(error)
    result = session.execute(
        update(Book).where(Book.id == book_id, Book.status.in_(list(only_from))).values(**values))
    return _rowcount(result) == 1


def claim_next_chapter(*, session: Session, book_id: str) -> int | None:
    """The first chapter of a book not yet scheduled, now marked scheduled; None when none is left.
    A conditional UPDATE: two schedulers never claim the same chapter."""
    while True:
        index = session.scalar(
            select(func.min(BookChapter.index))
            .where(BookChapter.book_id == book_id, BookChapter.scheduled_at.is_(None)))
        if index is None:
            return None
        result = session.execute(
            update(BookChapter)
            .where(BookChapter.book_id == book_id, BookChapter.index == index,
                   BookChapter.scheduled_at.is_(None))
            .values(scheduled_at=utcnow()))
        if _rowcount(result) == 1:
            return int(index)


def count_rendering_segments(*, session: Session, book_id: str) -> int:
    """Distinct segments of the book's scheduled, unassembled chapters that have no finished audio yet."""
    stmt = (
        select(func.count(func.distinct(BookSegment.key)))
        .join(BookChapter, (BookChapter.book_id == BookSegment.book_id)
              & (BookChapter.index == BookSegment.chapter))
        .join(Segment, Segment.key == BookSegment.key)
        .outerjoin(Job, Job.id == Segment.job_id)
        .where(BookSegment.book_id == book_id, BookChapter.scheduled_at.is_not(None),
               BookChapter.assembled_at.is_(None),
               (Job.status.is_(None)) | (Job.status != JobStatus.SUCCEEDED))
    )
    return int(session.execute(stmt).scalar_one())


def mark_chapter_assembled(*, session: Session, book_id: str, index: int, seconds: float) -> None:
    session.execute(
        update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
        .values(seconds=seconds, assembled_at=utcnow()))


@dataclass(frozen=True)
class SegmentState:
    key: str
    kind: str
    job_id: str | None
    job_status: str | None
    output_path: str | None
    n_tokens: int | None
    error: str | None

    @property
    def done(self) -> bool:
        return self.job_status == JobStatus.SUCCEEDED and self.output_path is not None

    @property
    def live(self) -> bool:
        return self.job_status in LIVE_JOB_STATUSES


def book_segment_states(*, session: Session, book_id: str, chapter: int | None = None) -> list[SegmentState]:
    """Each distinct segment of a book (or one chapter) with its job's state, in reading order."""
    stmt = (
        select(Segment.key, Segment.kind, Segment.job_id, Job.status, Job.output_path,
               func.coalesce(Job.n_tokens, Segment.n_tokens), func.coalesce(Job.error, Segment.error))
        .join(BookSegment, BookSegment.key == Segment.key)
        .outerjoin(Job, Job.id == Segment.job_id)
        .where(BookSegment.book_id == book_id)
        .order_by(BookSegment.chapter, BookSegment.position)
    )
    if chapter is not None:
        stmt = stmt.where(BookSegment.chapter == chapter)
    seen: dict[str, SegmentState] = {}
    for row in session.execute(stmt):
        seen.setdefault(row[0], SegmentState(*row))
    return list(seen.values())


def segment_state(*, session: Session, key: str) -> SegmentState | None:
    row = session.execute(
        select(Segment.key, Segment.kind, Segment.job_id, Job.status, Job.output_path,
               func.coalesce(Job.n_tokens, Segment.n_tokens), func.coalesce(Job.error, Segment.error))
        .outerjoin(Job, Job.id == Segment.job_id).where(Segment.key == key)).first()
    return None if row is None else SegmentState(*row)


def unlink_segment_job(*, session: Session, key: str, job_id: str) -> bool:
    """Forget a segment's failed or cancelled job (and its error) before rendering it again."""
    result = session.execute(
        update(Segment).where(Segment.key == key, Segment.job_id == job_id)
        .values(job_id=None, error=None, updated_at=utcnow()))
    return _rowcount(result) == 1


def get_segment(*, session: Session, key: str) -> Segment | None:
    return session.get(Segment, key, populate_existing=True)


def link_segment_job(*, session: Session, key: str, job_id: str, replacing: str | None,
                     n_tokens: int) -> bool:
    """Point a segment at a new job, if it still points at `replacing` (None: no job yet).

    False when another render linked its own job first: use that one instead."""
    cond = Segment.job_id.is_(None) if replacing is None else Segment.job_id == replacing
    result = session.execute(
        update(Segment).where(Segment.key == key, cond)
        .values(job_id=job_id, n_tokens=n_tokens, error=None, jobs_created=Segment.jobs_created + 1,
                updated_at=utcnow()))
    return _rowcount(result) == 1


def fail_segment(*, session: Session, key: str, error: str | None) -> None:
    """A segment that could not even become a job (its text or audio could not be tokenized); None
    clears the error."""
    session.execute(update(Segment).where(Segment.key == key)
                    .values(error=None if error is None else _clip(error), updated_at=utcnow()))


@dataclass(frozen=True)
class ChapterProgress:
    index: int
    segments_total: int  # distinct segments
    segments_done: int
    tokens_done: int  # speech tokens rendered (25 per second)
    tokens_total: int  # rendered + tokenized-but-not-rendered; untokenized segments are not in it


def book_progress(*, session: Session, book_id: str) -> list[ChapterProgress]:
    """Per chapter, from the segments' jobs: the database is the only record of progress."""
    done = Job.status == JobStatus.SUCCEEDED
    per_key = (
        select(BookSegment.chapter.label("chapter"), Segment.key.label("key"),
               case((done, 1), else_=0).label("done"),
               case((done, Job.n_tokens), else_=0).label("tokens_done"),
               func.coalesce(Job.n_tokens, Segment.n_tokens, 0).label("tokens"))
        .join(Segment, Segment.key == BookSegment.key)
        .outerjoin(Job, Job.id == Segment.job_id)
        .where(BookSegment.book_id == book_id)
        .distinct()
        .subquery()
    )
    rows = session.execute(
        select(per_key.c.chapter, func.count(), func.sum(per_key.c.done), func.sum(per_key.c.tokens_done),
               func.sum(per_key.c.tokens))
        .group_by(per_key.c.chapter).order_by(per_key.c.chapter))
    return [ChapterProgress(int(c), int(n), int(d or 0), int(t or 0), int(tt or 0))
            for c, n, d, t, tt in rows]


def segment_renders(*, session: Session, book_id: str) -> dict[str, tuple[int, int]]:
    """Segment key -> (jobs created for it over all time, synth attempts of its current job)."""
    stmt = (
        select(Segment.key, Segment.jobs_created, func.coalesce(Job.attempts, 0))
        .join(BookSegment, BookSegment.key == Segment.key)
        .outerjoin(Job, Job.id == Segment.job_id)
        .where(BookSegment.book_id == book_id)
        .distinct()
    )
    return {key: (int(created), int(attempts)) for key, created, attempts in session.execute(stmt)}


def count_live_books_with_segment(*, session: Session, key: str, exclude_book_id: str | None = None) -> int:
    stmt = (select(func.count(func.distinct(Book.id))).join(BookSegment, BookSegment.book_id == Book.id)
            .where(BookSegment.key == key, Book.status.in_(list(LIVE_BOOK_STATUSES))))
    if exclude_book_id is not None:
        stmt = stmt.where(Book.id != exclude_book_id)
    return int(session.execute(stmt).scalar_one())
