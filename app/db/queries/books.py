"""Books and segments: plans, chapters, statuses, segment jobs (each change of a segment's outcome counted
against its chapters: `chapters`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
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
from app.db.queries import chapters as chapter_counts
from app.db.queries import paging
from app.db.queries._common import _clip, _insert, _rowcount
from app.db.queries.chapters import OPEN
from app.errors import NotFound


@dataclass(frozen=True)
class PlannedChapter:
    title: str
    keys: Sequence[tuple[str, str, str]]  # (segment key, kind, voice id) in reading order, repeats included
    est_seconds: float


INSERT_CHUNK = 500  # rows per INSERT: SQLite allows 32,766 bound variables in one statement


def create_book(*, session: Session, book_id: str, voice_id: str, title: str, author: str, language: str,
                output_format: str, m4b: bool, target_lufs: float | None, seed: int, priority: int,
                mp3: bool = False, timed: bool = False, epub3: bool = False,
                encoding: dict[str, Any] | None = None) -> Book:
    """Insert a submitted book, `parsing`: its chapters and segments come once it is read
    (`add_book_plan`)."""
    now = utcnow()
    book = Book(id=book_id, voice_id=voice_id, status=BookStatus.PARSING, title=title, author=author,
                language=language, plan_key="", output_format=output_format, m4b=m4b, mp3=mp3, timed=timed,
                epub3=epub3, **(encoding or {}),
                target_lufs=target_lufs, seed=seed, priority=priority, segments_total=0, est_seconds=0.0,
                submitted_at=now, updated_at=now)
    session.add(book)
    session.flush()
    return book


def start_book_parse(*, session: Session, book_id: str) -> int | None:
    """Count one more reading of a `parsing` book; its attempts so far, or None if it is not parsing."""
    result = session.execute(
        update(Book).where(Book.id == book_id, Book.status == BookStatus.PARSING)
        .values(parse_attempts=Book.parse_attempts + 1, updated_at=utcnow()))
    if _rowcount(result) != 1:
        return None
    return int(session.scalar(select(Book.parse_attempts).where(Book.id == book_id)) or 0)


def add_book_plan(*, session: Session, book_id: str, title: str, author: str, language: str, plan_key: str,
                  chapters: Sequence[PlannedChapter], chapters_selected: str | None = None) -> bool:
    """Record a read book's chapters, where each segment sits and every segment not known yet, and move
    it from `parsing` to `queued`; False (nothing written) if it is no longer parsing (cancelled).
    Rows go in chunks of INSERT_CHUNK, so a book of 200,000 segments stays under SQLite's limits."""
    now = utcnow()
    result = session.execute(
        update(Book).where(Book.id == book_id, Book.status == BookStatus.PARSING)
        .values(status=BookStatus.QUEUED, title=title, author=author, language=language, plan_key=plan_key,
                segments_total=sum(len(c.keys) for c in chapters),
                est_seconds=sum(c.est_seconds for c in chapters), chapters_selected=chapters_selected,
                updated_at=now))
    if _rowcount(result) != 1:
        return False
    kinds = {key: (kind, voice) for c in chapters for key, kind, voice in c.keys}
    rows = [{"key": k, "voice_id": voice, "kind": kind, "jobs_created": 0, "created_at": now,
             "updated_at": now} for k, (kind, voice) in kinds.items()]
    for chunk in _chunks(rows):
        session.execute(_insert(session, Segment).values(chunk)
                        .on_conflict_do_nothing(index_elements=["key"]))
    session.execute(insert(BookChapter), [
        {"book_id": book_id, "index": index, "title": c.title, "segments_total": len(c.keys),
         "est_seconds": c.est_seconds} for index, c in enumerate(chapters)])
    placed = [{"book_id": book_id, "chapter": index, "position": pos, "key": key}
              for index, c in enumerate(chapters) for pos, (key, _, _) in enumerate(c.keys)]
    for chunk in _chunks(placed):
        session.execute(insert(BookSegment), chunk)
    chapter_counts.lock_segments(session=session, keys=list(kinds))
    chapter_counts.recount_chapters(session=session, book_id=book_id)  # segments other renders settled
    session.flush()
    return True


def _chunks(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(rows), INSERT_CHUNK):
        yield rows[start:start + INSERT_CHUNK]


def get_book(*, session: Session, book_id: str) -> Book | None:
    return session.get(Book, book_id, populate_existing=True)


def require_book(*, session: Session, book_id: str) -> Book:
    book = get_book(session=session, book_id=book_id)
    if book is None:
        raise NotFound(f"no book {book_id}")
    return book


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


def touch_chapter(*, session: Session, book_id: str, index: int) -> None:
    """Stamp a chapter's scheduled_at again: its `book.plan` was just sent anew, so it is not listed
    unsent again until it has had time to run (`list_unsent_chapters`)."""
    session.execute(update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
                    .values(scheduled_at=utcnow()))


def mark_chapter_assembled(*, session: Session, book_id: str, index: int, seconds: float,
                           loudness_lufs: float | None = None, true_peak_dbtp: float | None = None) -> None:
    session.execute(
        update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
        .values(seconds=seconds, loudness_lufs=loudness_lufs, true_peak_dbtp=true_peak_dbtp,
                assembled_at=utcnow()))


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
               func.coalesce(Job.n_tokens, Segment.n_tokens), func.coalesce(Job.error, Segment.error))
        .outerjoin(Job, Job.id == Segment.job_id).where(Segment.key == key)).first()
    return None if row is None else SegmentState(*row)


def unlink_segment_job(*, session: Session, key: str, job_id: str) -> bool:
    """Forget a segment's failed or cancelled job (and its error) before rendering it again (counted:
    its chapters no longer count it settled)."""
    before = chapter_counts.lock_outcome(session=session, key=key)
    result = session.execute(
        update(Segment).where(Segment.key == key, Segment.job_id == job_id)
        .values(job_id=None, error=None, updated_at=utcnow()))
    if _rowcount(result) != 1:
        return False
    chapter_counts.count_outcome(session=session, key=key, before=before, after=chapter_counts.Outcome(OPEN))
    return True


def get_segment(*, session: Session, key: str) -> Segment | None:
    return session.get(Segment, key, populate_existing=True)


def link_segment_job(*, session: Session, key: str, job_id: str, replacing: str | None,
                     n_tokens: int) -> bool:
    """Point a segment at a new job, if it still points at `replacing` (None: no job yet).

    False when another render linked its own job first: use that one instead. The new job is live:
    the segment's chapters count it open again (a failed or vanished render replaced)."""
    before = chapter_counts.lock_outcome(session=session, key=key)
    cond = Segment.job_id.is_(None) if replacing is None else Segment.job_id == replacing
    result = session.execute(
        update(Segment).where(Segment.key == key, cond)
        .values(job_id=job_id, n_tokens=n_tokens, error=None, jobs_created=Segment.jobs_created + 1,
                updated_at=utcnow()))
    if _rowcount(result) != 1:
        return False
    chapter_counts.count_outcome(session=session, key=key, before=before, after=chapter_counts.Outcome(OPEN))
    return True


def fail_segment(*, session: Session, key: str, error: str | None) -> None:
    """A segment that could not even become a job (its text or audio could not be tokenized); None
    clears the error. Counted: a segment without a job and with an error has failed."""
    before = chapter_counts.lock_outcome(session=session, key=key)
    session.execute(update(Segment).where(Segment.key == key)
                    .values(error=None if error is None else _clip(error), updated_at=utcnow()))
    chapter_counts.count_outcome(session=session, key=key, before=before,
                                 after=chapter_counts.read_outcome(session=session, key=key))


def reopen_failed_segments(*, session: Session, book_id: str, index: int) -> int:
    """Forget the failed or cancelled jobs (and tokenize errors) of a chapter's segments, so that its
    members render them again and its counters do not count them settled meanwhile: called in the
    transaction that schedules the chapter, before any of its segments is sent. Returns how many."""
    failed_job = Job.status.in_([JobStatus.FAILED, JobStatus.CANCELLED])
    stmt = (select(Segment.key).distinct().join(BookSegment, BookSegment.key == Segment.key)
            .outerjoin(Job, Job.id == Segment.job_id)
            .where(BookSegment.book_id == book_id, BookSegment.chapter == index,
                   (Segment.job_id.is_not(None) & failed_job)
                   | (Segment.job_id.is_(None) & Segment.error.is_not(None))))
    # every segment locked before any chapter is counted, in key order: a render of another book
    # holding one of them never waits on a chapter this holds
    locked = {key: chapter_counts.lock_outcome(session=session, key=key)
              for key in sorted(session.scalars(stmt))}
    reopened = 0
    for key, before in locked.items():
        if before.state != chapter_counts.FAILED:
            continue  # replaced meanwhile
        session.execute(update(Segment).where(Segment.key == key)
                        .values(job_id=None, error=None, updated_at=utcnow()))
        chapter_counts.count_outcome(session=session, key=key, before=before,
                                     after=chapter_counts.Outcome(OPEN))
        reopened += 1
    return reopened


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
