"""The books' part of the maintenance sweep (`app.reconcile.sweep`, part 7):

- a book folder (books/<id>/) with no row, older than `orphan_grace_s`, is removed: the API stored an
  upload and died before its row was committed (a refused submission removes its own folder);
- a book still `parsing` and not updated for `book_parse_timeout_s + stuck_job_after_s` gets its
  `book.parse` again: the CPU worker reading it died (a reading child is killed at its own limits and
  never lasts longer), and on Redis its message would wait for the visibility timeout. Each reading
  counts an attempt; after `job_max_attempts` the book fails (`app.books.intake.read_book`).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.books.files import BOOKS_DIR
from app.broker import wire
from app.db.models import Book, BookStatus, utcnow
from app.db.session import session_scope
from app.storage.artifacts import ArtifactStore

if TYPE_CHECKING:
    from app.context import Context

log = logging.getLogger(__name__)


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
