"""Counts for the API's metrics: books by status and the chapters of the books still being made.

Read-only; the jobs' counts (by status, by route) live beside the jobs and the workers.
"""

from __future__ import annotations

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from app.db.models import Book, BookChapter, BookStatus

_ENDED_BOOKS = (BookStatus.SUCCEEDED, BookStatus.FAILED, BookStatus.CANCELLED)


def count_books_by_status(*, session: Session) -> dict[str, int]:
    """Every book status, 0 for those no book has (a dashboard's series never vanish)."""
    counts = {status.value: 0 for status in BookStatus}
    for status, count in session.execute(select(Book.status, func.count()).group_by(Book.status)):
        counts[str(status)] = int(count)
    return counts


def count_live_book_chapters(*, session: Session) -> dict[str, int]:
    """The chapters of books not ended yet: {"assembled": n, "pending": m} (a book's progress, summed)."""
    assembled = func.sum(case((BookChapter.assembled_at.is_not(None), 1), else_=0))
    stmt = (select(func.count(), assembled).select_from(BookChapter)
            .join(Book, Book.id == BookChapter.book_id).where(Book.status.not_in(_ENDED_BOOKS)))
    total, done = session.execute(stmt).one()
    return {"assembled": int(done or 0), "pending": int(total or 0) - int(done or 0)}
