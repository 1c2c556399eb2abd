"""The reconciler's book rules (rules 6 and 7 of `app.reconcile.sweep`): the only part of the
reconciler that knows books, so the job rules load without them (a GPU worker runs those).

- ready chapters (`resume_chapters`): the transaction that settles a chapter's last segment records it
  ready (`app.lifecycle.books`, an outbox) and the settling code sends its `book.chapter` after the
  commit (`app.lifecycle.outbox`); a ready chapter of a rendering book that `book.chapter` has not
  checked `UNCHECKED_CHAPTER_AFTER_S` after it was recorded (or last sent again) gets it sent again: the
  send was lost (a broker away, a process killed between commit and send, a job settled by a path that
  does not send: a cancel through the API, a job out of attempts). `book.chapter` is idempotent, so
  sending it again is always safe; a chapter whose file is being rendered holds a render lease
  (`app.lifecycle.chapters`, renewed while it renders) and is not sent again while the lease lasts, so no
  chapter renders twice at once; a lease that passed (its renderer died) is cleared and the chapter's
  `book.chapter` sent again at once. A scheduled chapter with a segment that has no job (and no error)
  for `stuck_job_after_s` was being sent when its CPU worker died: no SQL row would ever make that
  segment render (a text segment has no job until `book.tokenize` made one), so its book gets its
  `book.plan` again, which sends every scheduled, unassembled chapter's segments that are neither done
  nor rendering (idempotent too: a text segment's tokenize finds a job made meanwhile);
- book folders (`remove_orphan_books`): a folder books/<id>/ with no row, older than `orphan_grace_s`,
  is removed: the API stored an upload and died before its row was committed (a refused submission
  removes its own folder);
- books parsing (`resume_parsing`): a book still `parsing` and not updated for
  `book_parse_timeout_s + stuck_job_after_s` gets its `book.parse` again: the CPU worker reading it died
  (a reading child is killed at its own limits and never lasts longer), and on Redis its message would
  wait for the visibility timeout. Each reading counts an attempt; after `job_max_attempts` the book
  fails (`app.books.intake.read_book`).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.books.files import BOOKS_DIR
from app.broker import wire
from app.context import Context
from app.db import queries
from app.db.models import Book, BookStatus, utcnow
from app.db.session import session_scope
from app.reconcile.report import SweepReport
from app.storage.artifacts import ArtifactStore

log = logging.getLogger(__name__)

# A ready chapter's book.chapter is sent as its last segment's job commits and runs within seconds (it
# goes ahead of every job's work on the cpu queue); unchecked after this, it is sent again.
UNCHECKED_CHAPTER_AFTER_S = 60.0


def resume_chapters(*, ctx: Context, report: SweepReport) -> None:
    """Ready chapters' lost doorbells, and chapters whose sending died (module docstring)."""
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        lapsed = lifecycle.expire_renders(session=session, now=now)  # their renderer died or hung
        unchecked = queries.list_unchecked_chapters(
            session=session, rung_before=now - timedelta(seconds=UNCHECKED_CHAPTER_AFTER_S), now=now)
        unchecked = sorted({*unchecked, *lapsed})
        for book_id, index in unchecked:  # stamped before sending: a send that fails waits a period
            lifecycle.mark_chapter_rung(session=session, book_id=book_id, index=index)
        unsent = queries.list_unsent_chapters(
            session=session, scheduled_before=now - timedelta(seconds=ctx.settings.stuck_job_after_s))
        for book_id, index in unsent:
            lifecycle.touch_chapter(session=session, book_id=book_id, index=index)
    for book_id, index in unchecked:
        wire.send_chapter(ctx.sender, ctx.settings, book_id, index)
        why = "its render lease passed" if (book_id, index) in lapsed else "it was ready and not checked"
        log.warning("maintenance: book %s chapter %d: %s; book.chapter sent again", book_id, index, why)
        report.chapters_resumed.append(f"{book_id}/{index}")
    for book_id in dict.fromkeys(book for book, _ in unsent):
        ctx.sender.send_task(wire.BOOK_PLAN_TASK, args=[book_id], queue=ctx.settings.queue_cpu)
        chapters = [index for book, index in unsent if book == book_id]
        log.warning("maintenance: book %s chapters %s were scheduled but some segments never sent; "
                    "book.plan sent again", book_id, [i + 1 for i in chapters])
        report.chapters_resumed += [f"{book_id}/{i}" for i in chapters]


def remove_orphan_books(*, sessions: sessionmaker[Session], artifacts: ArtifactStore,
                        grace_s: float) -> list[str]:
    """Book folders without a row, last changed more than `grace_s` ago; -> the ids removed."""
    root = artifacts.root / BOOKS_DIR
    if not root.is_dir():
        return []
    cutoff = time.time() - grace_s
    folders = {}
    for entry in root.iterdir():
        try:
            book_id = str(uuid.UUID(entry.name))
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                folders[book_id] = entry
        except (ValueError, FileNotFoundError):
            continue  # not a book's folder, or removed while we looked
    if not folders:
        return []
    with session_scope(sessions) as session:
        known = set(session.scalars(select(Book.id).where(Book.id.in_(list(folders)))))
    removed = []
    for book_id, folder in folders.items():
        if book_id not in known:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(book_id)
    if removed:
        log.warning("maintenance: %d book folders without a book removed", len(removed))
    return removed


def resume_parsing(*, ctx: Context) -> list[str]:
    """`parsing` books whose reader died; -> their ids, `book.parse` sent again."""
    settings = ctx.settings
    quiet = utcnow() - timedelta(seconds=settings.book_parse_timeout_s + settings.stuck_job_after_s)
    with session_scope(ctx.sessions) as session:
        stale = list(session.execute(select(Book.id, Book.priority).where(
            Book.status == BookStatus.PARSING, Book.updated_at < quiet)))
        for book_id, _ in stale:  # touched, so the next sweep waits a whole period again
            session.get(Book, book_id).updated_at = utcnow()  # type: ignore[union-attr]
    for book_id, priority in stale:
        ctx.sender.send_task(wire.BOOK_PARSE_TASK, args=[book_id], queue=settings.queue_cpu,
                             priority=wire.broker_priority(priority))
        log.warning("maintenance: book %s has been parsing without a reader; book.parse sent again", book_id)
    return [book_id for book_id, _ in stale]
