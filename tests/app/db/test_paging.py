"""Keyset pages of jobs and books on SQLite and PostgreSQL: every row exactly once, newest first, with rows
inserted between pages and rows sharing a submission time; a malformed cursor refused with a reason."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from app.db import queries as q
from app.db.models import Book, Job
from app.db.queries.paging import decode_cursor, encode_cursor
from app.errors import BadInput
from tests.app.db.helpers import new_job, vid

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _stamp(session: Session, table: Any, row_id: str, when: datetime) -> None:
    session.execute(update(table).where(table.id == row_id).values(submitted_at=when))
    session.commit()


def _job_at(session: Session, voice: str, when: datetime) -> str:
    job_id = new_job(session, voice)[0].id
    _stamp(session, Job, job_id, when)
    return job_id


def _book_at(session: Session, voice: str, when: datetime) -> str:
    book = q.create_book(session=session, new=q.NewBook(
        id=str(uuid.uuid4()), voice_id=voice, title="t", author="", language="en", output_format="flac",
        m4b=True, target_lufs=None, seed=1, priority=0))
    _stamp(session, Book, book.id, when)
    return book.id


def _walk(page, limit: int, between=lambda: None) -> list[str]:
    seen: list[str] = []
    rows, cursor = page(after=None, limit=limit)
    seen += [r.id for r in rows]
    while cursor is not None:
        between()
        rows, cursor = page(after=cursor, limit=limit)
        assert len(rows) <= limit
        seen += [r.id for r in rows]
    return seen


def _newest_first(session: Session, table: Any, ids: list[str]) -> list[str]:
    rows = {r.id: r.submitted_at for r in session.query(table).filter(table.id.in_(ids))}
    return sorted(ids, key=lambda i: (rows[i], i), reverse=True)


@pytest.mark.parametrize("limit", [1, 3, 7, 50])
def test_job_pages_cover_every_row_once_newest_first_under_inserts(session: Session, voice: str,
                                                                   limit: int) -> None:
    # Ties: three jobs share each submission time, so the id must break them.
    old = [_job_at(session, voice, T0 + timedelta(seconds=i // 3)) for i in range(14)]
    newer: list[str] = []

    def insert_newer() -> None:  # a client submits while another pages
        newer.append(_job_at(session, voice, T0 + timedelta(days=1, seconds=len(newer))))

    seen = _walk(lambda **kw: q.page_jobs(session=session, **kw), limit, insert_newer)
    assert seen == _newest_first(session, Job, old)  # each once, in order; newer ones not mixed in
    assert newer or limit >= len(old)
    assert _walk(lambda **kw: q.page_jobs(session=session, **kw), limit) == _newest_first(session, Job,
                                                                                            old + newer)


def test_job_pages_keep_their_filters(session: Session, voice: str) -> None:
    q.get_or_create_voice(session=session, voice_id=vid(5), reference_path=f"references/{vid(98)}.wav")
    session.commit()
    mine = [_job_at(session, voice, T0 + timedelta(seconds=i)) for i in range(5)]
    [_job_at(session, vid(5), T0 + timedelta(seconds=i, milliseconds=500)) for i in range(5)]
    seen = _walk(lambda **kw: q.page_jobs(session=session, voice_id=voice, **kw), 2)
    assert seen == list(reversed(mine))
    assert _walk(lambda **kw: q.page_jobs(session=session, status="failed", **kw), 2) == []


def test_book_pages_cover_every_row_once_newest_first(session: Session, voice: str) -> None:
    books = [_book_at(session, voice, T0 + timedelta(microseconds=i // 2)) for i in range(9)]
    for limit in (1, 2, 4, 9, 10):
        assert _walk(lambda **kw: q.page_books(session=session, **kw), limit) == _newest_first(
            session, Book, books)


def test_the_last_full_page_says_there_is_no_next(session: Session, voice: str) -> None:
    [_job_at(session, voice, T0 + timedelta(seconds=i)) for i in range(4)]
    rows, cursor = q.page_jobs(session=session, limit=4)
    assert len(rows) == 4 and cursor is None
    rows, cursor = q.page_jobs(session=session, limit=3)
    assert len(rows) == 3 and cursor is not None


def test_cursor_round_trips_and_malformed_ones_are_refused() -> None:
    when = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)
    assert decode_cursor(encode_cursor(when, "abc")) == (when, "abc")
    naive = base64.urlsafe_b64encode(b"2026-03-04T05:06:07|abc").decode()
    for bad in ["", "!!!", "bm90IGEgY3Vyc29y", naive, "x" * 300,
                base64.urlsafe_b64encode(b"\xff\xfe|x").decode(),
                base64.urlsafe_b64encode(b"2026-03-04T05:06:07+00:00|a\x00b").decode(),  # NUL: PostgreSQL
                base64.urlsafe_b64encode(b"0001-01-01T00:00:00+05:00|abc").decode()]:  # before year 1 in UTC
        with pytest.raises(BadInput, match="after: not a cursor"):
            decode_cursor(bad)
