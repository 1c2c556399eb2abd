"""A book's progress, from the database (the only record of it): segments done and in total, audio
seconds rendered, an ETA from the rate so far, per book and per chapter, and its finished files. The
figures are the chapters' counters, kept as segments settle (`app.db.queries.chapters`): reading them
costs O(chapters), however many segments the book has.

    book_status(session=, artifacts=, book_id=) -> BookStatusView     (NotFound for an unknown id)
    book_statuses(session=, artifacts=, books=) -> [BookStatusView]   a page of the list, in one query
    output_file(session=, artifacts=, book_id=, name=) -> Path         a finished output, by name
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.books.files import chapter_file_name, is_output, list_outputs, load_meta, output_dir
from app.books.reading.publication import Publication, publication_from_dict
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES, Book, BookStatus, utcnow
from app.errors import NotFound
from app.speech import TOKEN_RATE
from app.storage.artifacts import ArtifactStore
from app.storage.keys import ID_PREFIX, check_job_id, known_id, one_by_prefix


@dataclass(frozen=True)
class ChapterStatus:
    index: int
    title: str
    segments_total: int
    segments_done: int
    audio_seconds: float
    est_seconds: float
    eta_s: float | None
    seconds: float | None  # length of the assembled chapter file
    loudness_lufs: float | None  # the assembled file's integrated loudness and true peak, as written
    true_peak_dbtp: float | None
    file: str | None  # its name in the output folder, once assembled


@dataclass(frozen=True)
class BookStatusView:
    book: Book
    chapters: list[ChapterStatus]
    segments_total: int
    segments_done: int
    audio_seconds: float  # speech rendered: the segments' own audio, without the pauses between them
    eta_s: float | None
    files: list[str]
    seconds: float | None = None  # the book's length with its pauses (the M4B's), once every chapter is
    notes: list[str] = field(default_factory=list)  # how its audio was made: dummy weights, stand-in ...
    narrator: str = ""  # from the plan: the players' tags
    series: str = ""
    series_part: str = ""
    publication: Publication = Publication()  # from the plan: publisher, year, ISBN, genres
    description: str = ""
    cast: dict[str, str] = field(default_factory=dict)  # from the plan: folded voice name -> voice id
    parse_wait_s: float = 0.0  # how long it waited for its reading to begin (so far, while it waits)


def require_book(*, session: Session, book_id: str) -> Book:
    """The book with this id, or with this unique id prefix (at least 4 characters), as jobs; NotFound
    for an unknown or malformed one (book ids are job-shaped UUIDs), BadInput for an ambiguous prefix."""
    if isinstance(book_id, str) and ID_PREFIX.fullmatch(book_id) and len(book_id) < 36:
        found = queries.book_ids_with_prefix(session=session, prefix=book_id, limit=6)
        book_id = one_by_prefix(found, book_id, "book") or book_id
    return queries.require_book(session=session, book_id=known_id(book_id, check_job_id, "book"))


def _rate(book: Book, audio_seconds: float, now: datetime) -> float | None:
    """Audio seconds rendered per wall second since the book started."""
    if book.started_at is None or audio_seconds <= 0:
        return None
    elapsed = (now - book.started_at).total_seconds()
    return audio_seconds / elapsed if elapsed > 0 else None


def book_status(*, session: Session, artifacts: ArtifactStore, book_id: str) -> BookStatusView:
    book = require_book(session=session, book_id=book_id)
    return _view(book, queries.list_chapters_of(session=session, book_ids=[book.id])[book.id], artifacts)


def book_statuses(*, session: Session, artifacts: ArtifactStore,
                  books: Sequence[Book]) -> list[BookStatusView]:
    """The status of each of these books (a page of the list), their chapters read in one query."""
    chapters = queries.list_chapters_of(session=session, book_ids=[b.id for b in books])
    return [_view(book, chapters[book.id], artifacts) for book in books]


def _view(book: Book, rows: Sequence[queries.ChapterRow], artifacts: ArtifactStore) -> BookStatusView:
    """From the chapters' counters (`app.db.queries.chapters`): O(chapters), whatever the segments."""
    done_s = sum(row.tokens_done for row in rows) / TOKEN_RATE
    rate = _rate(book, done_s, utcnow())
    live = book.status in LIVE_BOOK_STATUSES
    out = output_dir(artifacts, book.id)
    chapters = []
    for row in rows:
        total, done = row.keys_total, row.keys_done
        audio_s = row.tokens_done / TOKEN_RATE
        left = max(row.est_seconds - audio_s, 0.0) if done < total else 0.0
        file = chapter_file_name(row.index, book.output_format)
        chapters.append(ChapterStatus(
            index=row.index, title=row.title, segments_total=total, segments_done=done, audio_seconds=audio_s,
            est_seconds=row.est_seconds, eta_s=round(left / rate, 1) if live and rate else None,
            seconds=row.seconds, loudness_lufs=row.loudness_lufs, true_peak_dbtp=row.true_peak_dbtp,
            file=file if row.assembled_at and (out / file).is_file() else None))
    left = sum(max(c.est_seconds - c.audio_seconds, 0.0) for c in chapters
               if c.segments_done < c.segments_total)
    return BookStatusView(book=book, chapters=chapters,
                          segments_total=sum(c.segments_total for c in chapters),
                          segments_done=sum(c.segments_done for c in chapters), audio_seconds=done_s,
                          eta_s=round(left / rate, 1) if live and rate else (0.0 if not live else None),
                          files=list_outputs(artifacts, book.id), notes=list(book.notes or []),
                          seconds=_length(chapters), parse_wait_s=parse_wait_s(book, utcnow()),
                          **_tags(artifacts, book.id))


def parse_wait_s(book: Book, now: datetime) -> float:
    """Seconds from its submission to the start of its latest reading (`app.books.lanes`); while it
    still waits for one, to `now`."""
    if book.parse_started_at is not None:
        end = book.parse_started_at
    elif book.status == BookStatus.PARSING:
        end = now
    else:
        return 0.0  # read before readings were recorded
    return round(max((end - book.submitted_at).total_seconds(), 0.0), 1)


def _length(chapters: list[ChapterStatus]) -> float | None:
    """The assembled chapter files' total (pauses and, for timed books, the gaps before cues included)."""
    lengths = [c.seconds for c in chapters]
    return round(sum(s for s in lengths if s is not None), 3) if lengths and None not in lengths else None


def _tags(artifacts: ArtifactStore, book_id: str) -> dict[str, Any]:
    """From the book's small meta.json, not its plan (which a long book makes megabytes long)."""
    try:
        meta = load_meta(artifacts, book_id)
    except (OSError, ValueError):  # a book whose files were removed still has a status
        return {}
    return {"narrator": str(meta.get("narrator") or ""), "description": str(meta.get("description") or ""),
            "series": str(meta.get("series") or ""), "series_part": str(meta.get("series_part") or ""),
            "cast": dict(meta.get("cast") or {}),
            "publication": publication_from_dict(dict(meta.get("publication") or {}))}


def output_file(*, session: Session, artifacts: ArtifactStore, book_id: str, name: str) -> Path:
    """A finished output file of a book by its name in the output folder; NotFound otherwise."""
    book_id = require_book(session=session, book_id=book_id).id
    path = output_dir(artifacts, book_id) / name
    if not is_output(name) or not path.is_file():
        raise NotFound(f"book {book_id} has no file {name!r} (yet)")
    return path
