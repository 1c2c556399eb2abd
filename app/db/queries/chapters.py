"""Reads and locks of chapter progress and of the outbox of `book.chapter`; the writes are the
lifecycle's (`app.lifecycle.books`: `count_outcome`, `record_ready`, `mark_chapter_rung`, ...).

A segment's outcome is `open` (no job yet, or a live one), `done` (its job succeeded) or `failed` (its job
failed or was cancelled, or it could not be tokenized: no job and an error). Every change of a segment's
outcome - a job settling, a segment linked to a new job or unlinked from a failed one, a tokenize error -
counts it in its own transaction, with the segment's row locked (`lock_outcome`, here): the counters of
every chapter of a live book that holds the key move with it, so a book's progress is read from its
chapters' rows (O(chapters)), never counted over its segments.

Counters are in distinct keys per chapter (a sentence repeated in a chapter counts once there, and once
in each other chapter it appears in), as the API has always reported them. A book that is no longer
live keeps the figures it ended with. `recount_chapters` sets them from the segments as they stand (a
book planned now; the migration's backfill).

The outbox: the transaction that settles a scheduled chapter's last open segment records `ready_at`; the
settling code sends `book.chapter` after its commit (a doorbell: losing or doubling it is harmless), the
sweep sends it again (`rung_at`) while `checked_at` is unset, and `book.chapter` sets `checked_at` once it
has acted on that readiness. A segment that becomes open again (a failed one sent to render anew)
withdraws the record. Nothing here sends anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from app.db.models import (
    Book,
    BookChapter,
    BookSegment,
    BookStatus,
    Job,
    JobStatus,
    Segment,
    utcnow,
)

OPEN, DONE, FAILED = "open", "done", "failed"


@dataclass(frozen=True)
class Outcome:
    state: str  # OPEN, DONE or FAILED
    tokens: int = 0  # speech tokens of its audio, when done


def _outcome(job_id: str | None, error: str | None, status: str | None, n_tokens: int | None) -> Outcome:
    if job_id is None or status is None:
        return Outcome(FAILED if error else OPEN)
    if status == JobStatus.SUCCEEDED:
        return Outcome(DONE, int(n_tokens or 0))
    if status in (JobStatus.FAILED, JobStatus.CANCELLED):
        return Outcome(FAILED)
    return Outcome(OPEN)


def read_outcome(*, session: Session, key: str) -> Outcome:
    row = session.execute(
        select(Segment.job_id, Segment.error, Job.status, Job.n_tokens)
        .outerjoin(Job, Job.id == Segment.job_id).where(Segment.key == key)).first()
    return Outcome(OPEN) if row is None else _outcome(*row)


def lock_outcome(*, session: Session, key: str) -> Outcome:
    """Lock the segment's row until the commit (PostgreSQL: FOR UPDATE; SQLite has one writer), then read
    its outcome in a second statement, which sees what committed before the lock was granted."""
    session.execute(select(Segment.key).where(Segment.key == key).with_for_update())
    return read_outcome(session=session, key=key)


def lock_job_segments(*, session: Session, job_id: str) -> list[str]:
    """The keys of the segments whose job this is (one, or none for a job not made for a book), locked."""
    return list(session.scalars(select(Segment.key).where(Segment.job_id == job_id).with_for_update()))


def chapter_ready_at(*, session: Session, book_id: str, index: int) -> datetime | None:
    return session.scalar(select(BookChapter.ready_at)
                          .where(BookChapter.book_id == book_id, BookChapter.index == index))


def list_unchecked_chapters(*, session: Session, rung_before: datetime,
                            now: datetime | None = None) -> list[tuple[str, int]]:
    """(book id, index) of the chapters of rendering books recorded ready, not checked by book.chapter,
    neither recorded nor sent again since `rung_before`, and not being rendered (no render lease that
    has not passed at `now`): their doorbell was lost."""
    now = now or utcnow()
    stmt = (select(BookChapter.book_id, BookChapter.index).join(Book, Book.id == BookChapter.book_id)
            .where(Book.status == BookStatus.RENDERING, BookChapter.ready_at.is_not(None),
                   BookChapter.checked_at.is_(None),
                   func.coalesce(BookChapter.rung_at, BookChapter.ready_at) < rung_before,
                   or_(BookChapter.render_until.is_(None), BookChapter.render_until < now))
            .order_by(BookChapter.book_id, BookChapter.index))
    return [(str(book_id), int(index)) for book_id, index in session.execute(stmt)]


@dataclass(frozen=True)
class ChapterRow:
    """What a book's status reads of a chapter: plain values, no ORM object (a page of 200 books reads
    a thousand of them)."""

    index: int
    title: str
    keys_total: int
    keys_done: int
    tokens_done: int
    est_seconds: float
    seconds: float | None
    loudness_lufs: float | None
    true_peak_dbtp: float | None
    assembled_at: datetime | None


_ROW_COLUMNS = (BookChapter.index, BookChapter.title, BookChapter.keys_total, BookChapter.keys_done,
                BookChapter.tokens_done, BookChapter.est_seconds, BookChapter.seconds,
                BookChapter.loudness_lufs, BookChapter.true_peak_dbtp, BookChapter.assembled_at)


def list_chapters_of(*, session: Session, book_ids: Sequence[str]) -> dict[str, list[ChapterRow]]:
    """The chapters of these books, in order, by book id (one query for a page of books)."""
    found: dict[str, list[ChapterRow]] = {book_id: [] for book_id in book_ids}
    stmt = (select(BookChapter.book_id, *_ROW_COLUMNS).where(BookChapter.book_id.in_(list(book_ids)))
            .order_by(BookChapter.book_id, BookChapter.index))
    for book_id, *values in session.execute(stmt):
        found[book_id].append(ChapterRow(*values))
    return found


# Counting from the segments themselves (a just-planned book; tests) ---------------------------------------

def _of_chapter(column: Any) -> Any:
    """`column` over the distinct segments of the chapter row being updated (IN removes repeats)."""
    keys = select(BookSegment.key).where(BookSegment.book_id == BookChapter.book_id,
                                         BookSegment.chapter == BookChapter.index).correlate(BookChapter)
    return (select(column).select_from(Segment).outerjoin(Job, Job.id == Segment.job_id)
            .where(Segment.key.in_(keys)))


def recount_chapters(*, session: Session, book_id: str) -> None:
    """Set a book's chapter counters from its segments' outcomes as they stand: a book planned now
    starts with the segments other renders finished (or failed). The caller locks those segments first
    (`lock_segments`), so that a job settling meanwhile is counted by exactly one of the two."""
    done = Job.status == JobStatus.SUCCEEDED
    tokens = func.coalesce(func.sum(Job.n_tokens), 0)
    failed = or_(and_(Segment.job_id.is_not(None), Job.status.in_([JobStatus.FAILED, JobStatus.CANCELLED])),
                 and_(Segment.job_id.is_(None), Segment.error.is_not(None)))
    session.execute(
        update(BookChapter).where(BookChapter.book_id == book_id)
        .values(keys_total=_of_chapter(func.count()).scalar_subquery(),
                keys_done=_of_chapter(func.count()).where(done).scalar_subquery(),
                keys_failed=_of_chapter(func.count()).where(failed).scalar_subquery(),
                tokens_done=_of_chapter(tokens).where(done).scalar_subquery())
        .execution_options(synchronize_session=False))


def lock_segments(*, session: Session, keys: Sequence[str], chunk: int = 500) -> None:
    """Share-lock these segments' rows (PostgreSQL: FOR SHARE, in key order) until the commit: no job of
    theirs settles until then, and one that settled before is seen by the next statement."""
    ordered = sorted(set(keys))
    for start in range(0, len(ordered), chunk):
        part = ordered[start:start + chunk]
        session.execute(select(Segment.key).where(Segment.key.in_(part)).order_by(Segment.key)
                        .with_for_update(read=True))
