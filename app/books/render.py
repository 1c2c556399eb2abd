"""The work of a book's last two steps, from the database and the book's files; the `book.chapter` and
`book.assemble` tasks (`tasks.books`) adapt it.

    settle_chapter(...) -> (outcome, last)  'waiting' while segments render, 'failed' (the book fails with
                                            the segment's reason), 'stopped' (the book is no longer live),
                                            'busy' (another book.chapter holds the chapter's render lease,
                                            `app.lifecycle.chapters`: it renders, this one leaves it)
                                            or 'assembled' (the chapter file is written); `last`: it was
                                            the book's last chapter and the book is now assembling.
                                            'failed' and 'assembled' mark the chapter's ready record
                                            checked (`app.lifecycle.books`): the sweep stops
                                            sending book.chapter for it
    assemble(...)       -> the book's status: every chapter file (reused), the M4B, the index and, for an
                           epub3 book, the read-along EPUB, then succeeded

Both look at the database, not at what triggered them, so an early, late or repeated call is harmless.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.books import files
from app.books.writing.assemble import ChapterAudio
from app.books.writing.encoding import Encoding
from app.books.writing.output import BookOutput, assemble_book, render_chapter
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES, BookStatus
from app.db.session import session_scope
from app.storage.artifacts import ArtifactStore

log = logging.getLogger(__name__)


def settle_chapter(*, sessions: sessionmaker[Session], artifacts: ArtifactStore, book_id: str,
                   index: int) -> tuple[str, bool]:
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    with session_scope(sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        if book.status not in LIVE_BOOK_STATUSES:
            return "stopped", False
        if not lifecycle.claim_render(session=session, book_id=book_id, index=index, owner=owner):
            return "busy", False  # its holder renders it, and records it checked
        ready_at = queries.chapter_ready_at(session=session, book_id=book_id, index=index)
        states = queries.book_segment_states(session=session, book_id=book_id, chapter=index)
        failed = [s for s in states if not s.done and not s.live and (s.job_id or s.error)]
        if failed or not all(s.done for s in states):
            lifecycle.release_render(session=session, book_id=book_id, index=index, owner=owner)
        if failed:
            bad = failed[0]
            reason = f"chapter {index + 1}: segment {bad.key[:12]} failed: {bad.error or bad.job_status}"
            lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED,
                                      error=reason)
            lifecycle.mark_chapter_checked(session=session, book_id=book_id, index=index, ready_at=ready_at)
            log.error("book %s: %s", book_id, reason)
            return "failed", False
        if not all(s.done for s in states):
            return "waiting", False
        audio = {s.key: artifacts.path(s.output_path or "") for s in states}
        fmt, lufs, timed = book.output_format, book.target_lufs, book.timed
        queries.gather_book_notes(session=session, book_id=book_id,
                                  job_ids=[s.job_id for s in states if s.job_id])
    chapter = files.load_plan(artifacts, book_id).chapters[index]
    with _leased(sessions, book_id, index, owner):
        done = render_chapter(chapter, audio, files.output_dir(artifacts, book_id), fmt=fmt,
                              target_lufs=lufs, timed=timed)  # assemble() reuses the file
    with session_scope(sessions) as session:
        lifecycle.mark_chapter_assembled(session=session, book_id=book_id, index=index, seconds=done.duration,
                                         **_loudness_columns(done))
        lifecycle.mark_chapter_checked(session=session, book_id=book_id, index=index, ready_at=ready_at)
        lifecycle.release_render(session=session, book_id=book_id, index=index, owner=owner)
        chapters = queries.list_chapters(session=session, book_id=book_id)
        last = all(c.assembled_at is not None for c in chapters) and lifecycle.set_book_status(
            session=session, book_id=book_id, status=BookStatus.ASSEMBLING, only_from=(BookStatus.RENDERING,))
    return "assembled", last


@contextmanager
def _leased(sessions: sessionmaker[Session], book_id: str, index: int, owner: str) -> Iterator[None]:
    """Renew the chapter's render lease every third of it while the body runs (a thread: the render is
    one long call); give it back if the body fails."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lifecycle.RENDER_LEASE_S / 3):
            try:
                with session_scope(sessions) as session:
                    if not lifecycle.renew_render(session=session, book_id=book_id, index=index, owner=owner):
                        log.warning("book %s chapter %d: its render lease was lost", book_id, index + 1)
                        return
            except Exception:  # a database away for a moment: the next renewal tries again
                log.warning("book %s chapter %d: could not renew its render lease", book_id, index + 1,
                            exc_info=True)

    renewer = threading.Thread(target=renew, name=f"chapter-lease-{index}", daemon=True)
    renewer.start()
    try:
        yield
    except BaseException:
        stop.set()
        renewer.join()
        with session_scope(sessions) as session:
            lifecycle.release_render(session=session, book_id=book_id, index=index, owner=owner)
        raise
    finally:
        stop.set()
        renewer.join()


def assemble(*, sessions: sessionmaker[Session], artifacts: ArtifactStore, book_id: str) -> str:
    with session_scope(sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        if book.status != BookStatus.ASSEMBLING:
            return str(book.status)
        audio = {s.key: artifacts.path(s.output_path or "")
                 for s in queries.book_segment_states(session=session, book_id=book_id) if s.done}
        fmt, lufs, m4b, mp3, timed = book.output_format, book.target_lufs, book.m4b, book.mp3, book.timed
        epub3, notes = book.epub3, tuple(book.notes or ())
        encoding = Encoding(book.bitrate_kbps, book.mp3_bitrate_kbps, book.sample_rate)
    cover, cover_type = files.load_cover(artifacts, book_id)
    readalong = files.load_readalong(artifacts, book_id) if epub3 else None
    output = BookOutput(fmt=fmt, target_lufs=lufs, m4b=m4b, mp3=mp3, timed=timed, cover=cover,
                        cover_type=cover_type, readalong=readalong, notes=notes, encoding=encoding)
    result = assemble_book(files.load_plan(artifacts, book_id), audio, files.output_dir(artifacts, book_id),
                           output=output)
    with session_scope(sessions) as session:
        for chapter in result.chapters:  # a chapter re-assembled here (its file was gone) is measured anew
            lifecycle.mark_chapter_assembled(session=session, book_id=book_id, index=chapter.index,
                                             seconds=chapter.duration, **_loudness_columns(chapter))
        lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.SUCCEEDED,
                                  only_from=(BookStatus.ASSEMBLING,))
    log.info("book %s assembled: %d chapters, %.1f s", book_id, len(result.chapters),
             sum(c.duration for c in result.chapters))
    return "succeeded"


def _loudness_columns(chapter: ChapterAudio) -> dict[str, float | None]:
    figures = chapter.loudness.as_dict() if chapter.loudness else {}
    return {"loudness_lufs": figures.get("integrated_lufs"), "true_peak_dbtp": figures.get("true_peak_dbtp")}
