"""Which book a `book.parse` reads: every `book.parse` is a doorbell, and the book it reads is chosen from
SQL so that no one's book waits behind someone else's worst-case uploads (issue 42, item 7).

    claim_next(ctx, prefer) -> (book id, attempts, lane) | None
        the fairest `parsing` book nobody reads (`queries.reading_candidates`: the doorbell's own book if
        it is in the quick lane, then the quick lane oldest first, then the long lane while fewer than
        `book_parse_long_slots` long readings run), claimed (`lifecycle.claim_reading`)
    ring_waiting(ctx)
        after a reading: one `book.parse` for a book that could be read now, if any (a doorbell used
        for another book, or skipped while the long lane was full, is not lost)

Two lanes: a book is first read in the quick lane, with `book_parse_quick_cpu_s` of CPU (and four times
that of wall time); most books take a second or two. One that needs more (a 1,000-page PDF, or a file
made to be costly) is moved to the long lane and read again there with the full limits
(`book_parse_cpu_s`, `book_parse_timeout_s`). Long readings are bounded in number, so the other CPU
worker processes keep serving quick books: a book submitted after a batch of hostile uploads waits for
at most one quick reading of each of them, not for their full limits one after another.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from app import lifecycle
from app.broker import wire
from app.db import queries
from app.db.models import utcnow
from app.db.session import session_scope
from app.settings import Settings

if TYPE_CHECKING:
    from app.context import Context

log = logging.getLogger(__name__)


def stale_before(settings: Settings) -> datetime:
    """A reading started before this has ended, whatever became of its worker (a child is killed at its
    wall-clock limit)."""
    return utcnow() - timedelta(seconds=settings.book_parse_timeout_s + settings.stuck_job_after_s)


def claim_next(ctx: Context, prefer: str) -> tuple[str, int, str] | None:
    settings = ctx.settings
    with session_scope(ctx.sessions) as session:
        stale = stale_before(settings)
        for candidate in queries.reading_candidates(session=session, prefer=prefer, stale_before=stale,
                                                    long_slots=settings.book_parse_long_slots):
            attempts = lifecycle.claim_reading(session=session, book_id=candidate, now=utcnow(),
                                               stale_before=stale)
            if attempts is None:
                continue  # another reader took it since it was listed
            book = queries.require_book(session=session, book_id=candidate)
            log.info("book %s: read in the %s lane after %.1f s of waiting", candidate, book.parse_lane,
                     (utcnow() - book.submitted_at).total_seconds())
            return candidate, attempts, book.parse_lane
    return None


def ring_waiting(ctx: Context) -> None:
    """Best effort: a send that fails here leaves the book to the sweep (`app.reconcile.books`)."""
    try:
        with session_scope(ctx.sessions) as session:
            waiting = queries.reading_candidates(session=session, prefer=None,
                                                 stale_before=stale_before(ctx.settings),
                                                 long_slots=ctx.settings.book_parse_long_slots, limit=1)
            priority = queries.require_book(session=session, book_id=waiting[0]).priority if waiting else 0
        if waiting:
            ctx.sender.send_task(wire.BOOK_PARSE_TASK, args=[waiting[0]], queue=ctx.settings.queue_cpu,
                                 priority=wire.broker_priority(priority))
    except Exception:  # a broker or database away for a moment
        log.warning("could not ring the next book's reading; the sweep will", exc_info=True)
