"""Books and segments: plans, chapters, statuses, segment jobs (each change of a segment's outcome counted
against its chapters: `chapters`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from app.db.models import (
    LIVE_BOOK_STATUSES,
    LIVE_JOB_STATUSES,
    Book,
    BookChapter,
    BookSegment,
    BookStatus,
    Job,
    JobStatus,
    Segment,
    utcnow,
)
from app.db.queries import paging
from app.errors import NotFound

INSERT_CHUNK = 500  # rows per INSERT: SQLite allows 32,766 bound variables in one statement


@dataclass(frozen=True)
class PlannedChapter:
    title: str
    keys: Sequence[tuple[str, str, str]]  # (segment key, kind, voice id) in reading order, repeats included
    est_seconds: float


@dataclass(frozen=True)
class NewBook:
    """A submitted book's row before it is read: its title until then, and how it renders."""

    id: str
    voice_id: str
    title: str
    author: str
    language: str
    output_format: str
    m4b: bool
    target_lufs: float | None
    seed: int
    priority: int
    mp3: bool = False
    timed: bool = False
    epub3: bool = False
    quality: str = "on"  # the quality gate: on, report or off (app.quality.report.GateMode)
    encoding: dict[str, Any] | None = None  # bitrate_kbps, mp3_bitrate_kbps, sample_rate


def create_book(*, session: Session, new: NewBook) -> Book:
    """Insert a submitted book, `parsing`: its chapters and segments come once it is read
    (`add_book_plan`)."""
    now = utcnow()
    book = Book(id=new.id, voice_id=new.voice_id, status=BookStatus.PARSING, title=new.title,
                author=new.author, language=new.language, plan_key="", output_format=new.output_format,
                m4b=new.m4b, mp3=new.mp3, timed=new.timed, epub3=new.epub3, quality=new.quality,
                **(new.encoding or {}),
                target_lufs=new.target_lufs, seed=new.seed, priority=new.priority, segments_total=0,
                est_seconds=0.0, submitted_at=now, updated_at=now)
    session.add(book)
    session.flush()
    return book


def get_book(*, session: Session, book_id: str) -> Book | None:
    return session.get(Book, book_id, populate_existing=True)


def require_book(*, session: Session, book_id: str) -> Book:
    book = get_book(session=session, book_id=book_id)
    if book is None:
        raise NotFound(f"no book {book_id}")
    return book


def book_ids_with_prefix(*, session: Session, prefix: str, limit: int = 10) -> list[str]:
    """Ids starting with `prefix` (lowercase hex and hyphens, checked by the caller), at most `limit`."""
    stmt = select(Book.id).where(Book.id.startswith(prefix, autoescape=True)).order_by(Book.id).limit(limit)
    return list(session.scalars(stmt))


def list_books(*, session: Session, limit: int = 100) -> list[Book]:
    """Newest first."""
    return page_books(session=session, limit=limit)[0]


def page_books(*, session: Session, after: str | None = None,
               limit: int = 100) -> tuple[list[Book], str | None]:
    """A page of books newest first after the cursor `after`, and the next page's cursor (None: last)."""
    return paging.split(list(session.scalars(paging.page(select(Book), Book, after, limit))), limit)


def list_chapters(*, session: Session, book_id: str) -> list[BookChapter]:
    stmt = select(BookChapter).where(BookChapter.book_id == book_id).order_by(BookChapter.index)
    return list(session.scalars(stmt))


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


def list_unsent_chapters(*, session: Session, scheduled_before: Any) -> list[tuple[str, int]]:
    """(book id, index) of the chapters of rendering books scheduled before `scheduled_before`, not
    assembled, with a segment that has neither a job nor an error: the `book.plan` or `book.chapter`
    that was sending them died part-way (a CPU worker killed between marking the chapter scheduled and
    sending its last segment), so nothing will ever render that segment."""
    unsent = (
        select(BookSegment.key)
        .join(Segment, Segment.key == BookSegment.key)
        .where(BookSegment.book_id == BookChapter.book_id, BookSegment.chapter == BookChapter.index,
               Segment.job_id.is_(None), Segment.error.is_(None))
    )
    stmt = (
        select(BookChapter.book_id, BookChapter.index)
        .join(Book, Book.id == BookChapter.book_id)
        .where(Book.status == BookStatus.RENDERING, BookChapter.scheduled_at < scheduled_before,
               BookChapter.assembled_at.is_(None), unsent.exists())
        .order_by(BookChapter.book_id, BookChapter.index)
    )
    return [(str(book_id), int(index)) for book_id, index in session.execute(stmt)]


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


def _n_tokens() -> Any:
    """The job's token count, or the segment's while its text job waits for the GPU worker's tokens."""
    return func.coalesce(func.nullif(Job.n_tokens, 0), Segment.n_tokens)


def book_segment_states(*, session: Session, book_id: str, chapter: int | None = None) -> list[SegmentState]:
    """Each distinct segment of a book (or one chapter) with its job's state, in reading order."""
    stmt = (
        select(Segment.key, Segment.kind, Segment.job_id, Job.status, Job.output_path,
               _n_tokens(), func.coalesce(Job.error, Segment.error))
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


def gather_book_notes(*, session: Session, book_id: str, job_ids: Sequence[str]) -> list[str]:
    """Add the notes of these jobs (a chapter's segment jobs) to the book's, each sentence once; returns
    the book's notes. A book's notes say how its audio was made (dummy weights, the stand-in tokenizer)."""
    book = require_book(session=session, book_id=book_id)
    notes = list(book.notes or [])
    for chunk in (list(job_ids)[i:i + INSERT_CHUNK] for i in range(0, len(job_ids), INSERT_CHUNK)):
        for (found,) in session.execute(select(Job.notes).where(Job.id.in_(chunk), Job.notes.is_not(None))):
            notes += [n for n in found or [] if n not in notes]
    if notes != list(book.notes or []):
        book.notes = notes
    return notes


def segment_state(*, session: Session, key: str) -> SegmentState | None:
    row = session.execute(
        select(Segment.key, Segment.kind, Segment.job_id, Job.status, Job.output_path,
               _n_tokens(), func.coalesce(Job.error, Segment.error))
        .outerjoin(Job, Job.id == Segment.job_id).where(Segment.key == key)).first()
    return None if row is None else SegmentState(*row)


def renders_segment(*, session: Session, job_id: str) -> bool:
    """Whether the job is (or was) a book segment's render."""
    return session.execute(select(Segment.key).where(Segment.job_id == job_id).limit(1)).first() is not None


def get_segment(*, session: Session, key: str) -> Segment | None:
    return session.get(Segment, key, populate_existing=True)


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


def reading_candidates(*, session: Session, prefer: str | None, stale_before: datetime,
                       long_slots: int, limit: int = 5) -> list[str]:
    """The `parsing` books a `book.parse` doorbell may read now, fairest first (`app.lifecycle.readings`):
    `prefer` (the doorbell's own book) if it is in the quick lane and nobody reads it, then the quick
    lane's books oldest first, then, while fewer than `long_slots` long readings run, the long lane's
    oldest first. A book being read (started after `stale_before`) is nobody's to take."""
    free = or_(Book.parse_started_at.is_(None), Book.parse_started_at < stale_before)
    waiting = select(Book.id).where(Book.status == BookStatus.PARSING, free)
    quick = list(session.scalars(waiting.where(Book.parse_lane == "quick")
                                 .order_by(Book.submitted_at, Book.id).limit(limit)))
    if prefer in quick:
        quick = [prefer, *[b for b in quick if b != prefer]]
    elif prefer is not None and session.scalar(waiting.where(Book.id == prefer, Book.parse_lane == "quick")):
        quick = [prefer, *quick]
    if quick:
        return quick
    running = session.scalar(select(func.count()).select_from(Book).where(
        Book.status == BookStatus.PARSING, Book.parse_lane == "long", Book.parse_started_at >= stale_before))
    if int(running or 0) >= long_slots:
        return []
    return list(session.scalars(waiting.where(Book.parse_lane == "long")
                                .order_by(Book.submitted_at, Book.id).limit(limit)))
