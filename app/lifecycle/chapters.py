"""A chapter's render as a lease, as a job's claim is (`app.lifecycle.jobs`): `book.chapter` writes a
chapter's file only while it holds the chapter's lease (an owner and an expiry in the chapter's row),
renews it while it renders, and gives it back in the transaction that records the file. A `book.chapter`
sent again meanwhile (the sweep's, a minute after the chapter was recorded ready, while a long chapter
still renders) finds the lease held and leaves the chapter to its holder; a holder that died stops
renewing, and once its lease has passed the reconciler clears it and sends `book.chapter` again
(`app.reconcile.books`, rule 6 of the sweep).

    claim_render(session=, book_id=, index=, owner=, now=)    -> True when the lease is now `owner`'s
    renew_render(session=, book_id=, index=, owner=)          -> False when it is no longer `owner`'s
    release_render(session=, book_id=, index=, owner=)
    expire_renders(session=, now=) -> [(book id, index)]      leases that passed, cleared

Every function takes `session=` and flushes; the caller owns the transaction. Each is one conditional
UPDATE: of two claims, one wins.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.db.models import BookChapter, utcnow
from app.db.queries._common import _rowcount

RENDER_LEASE_S = 60.0  # renewed every third of it while the chapter renders


def _held_by(book_id: str, index: int, owner: str) -> tuple:
    return (BookChapter.book_id == book_id, BookChapter.index == index, BookChapter.render_owner == owner)


def claim_render(*, session: Session, book_id: str, index: int, owner: str,
                 now: datetime | None = None) -> bool:
    """Take the chapter's render lease if nobody holds one that has not passed."""
    now = now or utcnow()
    result = session.execute(
        update(BookChapter)
        .where(BookChapter.book_id == book_id, BookChapter.index == index,
               or_(BookChapter.render_until.is_(None), BookChapter.render_until < now))
        .values(render_owner=owner, render_until=now + timedelta(seconds=RENDER_LEASE_S))
        .execution_options(synchronize_session=False))
    return _rowcount(result) == 1


def renew_render(*, session: Session, book_id: str, index: int, owner: str) -> bool:
    result = session.execute(
        update(BookChapter).where(*_held_by(book_id, index, owner))
        .values(render_until=utcnow() + timedelta(seconds=RENDER_LEASE_S))
        .execution_options(synchronize_session=False))
    return _rowcount(result) == 1


def release_render(*, session: Session, book_id: str, index: int, owner: str) -> None:
    session.execute(update(BookChapter).where(*_held_by(book_id, index, owner))
                    .values(render_owner=None, render_until=None)
                    .execution_options(synchronize_session=False))


def expire_renders(*, session: Session, now: datetime) -> list[tuple[str, int]]:
    """(book id, index) of the chapters whose render lease passed (its holder died or hung), each
    cleared; the caller sends their book.chapter again."""
    passed = [(str(b), int(i)) for b, i in session.execute(
        select(BookChapter.book_id, BookChapter.index).where(BookChapter.render_until < now)
        .order_by(BookChapter.book_id, BookChapter.index))]
    for book_id, index in passed:
        session.execute(update(BookChapter)
                        .where(BookChapter.book_id == book_id, BookChapter.index == index,
                               BookChapter.render_until < now)
                        .values(render_owner=None, render_until=None)
                        .execution_options(synchronize_session=False))
    return passed
