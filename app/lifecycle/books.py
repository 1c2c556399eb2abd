"""A book's life, and its chapters' and segments', in one place: every change of their state is made here
(a job's is `app.lifecycle.jobs`'s). docs/RELIABILITY.md has the diagrams.

    book      parsing --claim_reading (each reading: `app.lifecycle.readings`)--> parsing
              --add_book_plan--> queued
              queued --set_book_status(rendering)--> rendering --> assembling --> succeeded
              any live status --set_book_status--> failed | cancelled
    chapter   claim_next_chapter (scheduled) -> ready (the transaction that settles its last open segment:
              count_outcome, or record_ready for one settled before it was scheduled) -> rung again by the
              reconciler (mark_chapter_rung) -> checked by book.chapter (mark_chapter_checked) ->
              mark_chapter_assembled; touch_chapter when its sending is started again
    segment   open (no job, or a live one: link_segment_job) -> done | failed (its job settled, or
              fail_segment: it could not become a job) -> open again (unlink_segment_job,
              reopen_failed_segments: rendered anew)

Each change of a segment's outcome moves the counters of every chapter of a live book that holds it, in
the same transaction (`count_outcome`, with the segment's row locked: `queries.chapters.lock_outcome`), and
the change that settles a scheduled chapter's last open segment records the chapter ready: the outbox
whose `book.chapter` the caller sends after its commit. Every function takes `session=` and flushes; the
caller owns the transaction. Changes that may race are single conditional UPDATEs: of two, one wins.
Reads (progress, listings, the reconciler's questions) stay in `app.db.queries`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from app.db.models import (
    LIVE_BOOK_STATUSES,
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
from app.db.queries._common import _clip, _insert, _rowcount
from app.db.queries.books import INSERT_CHUNK, PlannedChapter
from app.db.queries.chapters import DONE, FAILED, OPEN, Outcome


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
    count_outcome(session=session, key=key, before=before, after=chapter_counts.Outcome(OPEN))
    return True


def unlink_segment_job(*, session: Session, key: str, job_id: str) -> bool:
    """Forget a segment's failed or cancelled job (and its error) before rendering it again (counted:
    its chapters no longer count it settled)."""
    before = chapter_counts.lock_outcome(session=session, key=key)
    result = session.execute(
        update(Segment).where(Segment.key == key, Segment.job_id == job_id)
        .values(job_id=None, error=None, updated_at=utcnow()))
    if _rowcount(result) != 1:
        return False
    count_outcome(session=session, key=key, before=before, after=chapter_counts.Outcome(OPEN))
    return True


def fail_segment(*, session: Session, key: str, error: str | None) -> None:
    """A segment that could not even become a job (its text or audio could not be tokenized); None
    clears the error. Counted: a segment without a job and with an error has failed."""
    before = chapter_counts.lock_outcome(session=session, key=key)
    session.execute(update(Segment).where(Segment.key == key)
                    .values(error=None if error is None else _clip(error), updated_at=utcnow()))
    count_outcome(session=session, key=key, before=before,
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
        count_outcome(session=session, key=key, before=before,
                                     after=chapter_counts.Outcome(OPEN))
        reopened += 1
    return reopened


def count_outcome(*, session: Session, key: str, before: Outcome, after: Outcome) -> list[tuple[str, int]]:
    """Move the counters of every chapter of a live book holding `key` from `before` to `after`; returns
    the (book id, index) of the scheduled chapters this made ready (send their book.chapter after the
    commit). Chapters are updated in key order, so two settling transactions never wait on each other
    in a circle."""
    if before == after:
        return []
    d_done = (after.state == DONE) - (before.state == DONE)
    d_failed = (after.state == FAILED) - (before.state == FAILED)
    d_tokens = after.tokens - before.tokens
    stmt = (select(BookSegment.book_id, BookSegment.chapter).distinct()
            .join(Book, Book.id == BookSegment.book_id)
            .where(BookSegment.key == key, Book.status.in_(list(LIVE_BOOK_STATUSES)))
            .order_by(BookSegment.book_id, BookSegment.chapter))
    ready = []
    for book_id, index in session.execute(stmt).all():
        row = session.execute(
            update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
            .values(keys_done=BookChapter.keys_done + d_done, keys_failed=BookChapter.keys_failed + d_failed,
                    tokens_done=BookChapter.tokens_done + d_tokens)
            .returning(BookChapter.keys_done + BookChapter.keys_failed >= BookChapter.keys_total,
                       BookChapter.scheduled_at, BookChapter.ready_at)
            .execution_options(synchronize_session=False)).one()
        settled, scheduled_at, ready_at = row
        if settled and ready_at is None and scheduled_at is not None:
            _set_ready(session, book_id, index, utcnow())
            ready.append((str(book_id), int(index)))
        elif not settled and ready_at is not None:
            _set_ready(session, book_id, index, None)
    return ready


def _set_ready(session: Session, book_id: str, index: int, when: datetime | None) -> None:
    session.execute(update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
                    .values(ready_at=when, rung_at=None, checked_at=None)
                    .execution_options(synchronize_session=False))


def record_ready(*, session: Session, book_id: str, index: int) -> bool:
    """Record a scheduled chapter ready if every segment of it has settled already (one whose segments
    were all rendered or failed before it was scheduled); True if recorded here (send its book.chapter
    after the commit)."""
    result = session.execute(
        update(BookChapter)
        .where(BookChapter.book_id == book_id, BookChapter.index == index, BookChapter.ready_at.is_(None),
               BookChapter.scheduled_at.is_not(None),
               BookChapter.keys_done + BookChapter.keys_failed >= BookChapter.keys_total)
        .values(ready_at=utcnow(), rung_at=None, checked_at=None)
        .execution_options(synchronize_session=False))
    return _rowcount(result) == 1


def mark_chapter_checked(*, session: Session, book_id: str, index: int, ready_at: datetime | None) -> None:
    """book.chapter acted on the readiness recorded at `ready_at` (the value it read as it began: a newer
    record, made while it ran, stays unchecked)."""
    if ready_at is None:
        return
    session.execute(update(BookChapter)
                    .where(BookChapter.book_id == book_id, BookChapter.index == index,
                           BookChapter.ready_at == ready_at)
                    .values(checked_at=utcnow()).execution_options(synchronize_session=False))


def mark_chapter_rung(*, session: Session, book_id: str, index: int) -> None:
    session.execute(update(BookChapter).where(BookChapter.book_id == book_id, BookChapter.index == index)
                    .values(rung_at=utcnow()).execution_options(synchronize_session=False))


