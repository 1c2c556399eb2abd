"""A book's reading (`book.parse`), claimed like a job (`app.lifecycle.jobs`) and served in two lanes so
that a hostile upload holds up no one else's book (issue 42).

    claim_reading(session=, book_id=, now=, stale_before=) -> attempts | None
        take a `parsing` book that nobody reads (never started, or started before `stale_before`: that
        reader died, since a reading is killed at its wall-clock limit); counts an attempt, stamps
        parse_started_at (a book's wait for its reading is parse_started_at - submitted_at)
    demote_reading(session=, book_id=)
        a quick reading ran out of the quick lane's budget: the book goes to the long lane, unclaimed,
        and that reading is not counted as an attempt

`app.books.intake` picks which book a doorbell reads (`app.db.queries.books.next_reading`): quick books
first, the long lane's books only while fewer than `book_parse_long_slots` long readings run. Every
function takes `session=` and flushes; the caller owns the transaction; each is one conditional UPDATE.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.db.models import Book, BookStatus, utcnow
from app.db.queries._common import _rowcount

QUICK, LONG = "quick", "long"


def claim_reading(*, session: Session, book_id: str, now: datetime, stale_before: datetime) -> int | None:
    result = session.execute(
        update(Book)
        .where(Book.id == book_id, Book.status == BookStatus.PARSING,
               or_(Book.parse_started_at.is_(None), Book.parse_started_at < stale_before))
        .values(parse_started_at=now, parse_attempts=Book.parse_attempts + 1, updated_at=now)
        .execution_options(synchronize_session=False))
    if _rowcount(result) != 1:
        return None
    return int(session.scalar(select(Book.parse_attempts).where(Book.id == book_id)) or 0)


def demote_reading(*, session: Session, book_id: str) -> bool:
    result = session.execute(
        update(Book).where(Book.id == book_id, Book.status == BookStatus.PARSING)
        .values(parse_lane=LONG, parse_started_at=None, parse_attempts=Book.parse_attempts - 1,
                updated_at=utcnow())
        .execution_options(synchronize_session=False))
    return _rowcount(result) == 1
