"""Hostile books do not hold up everyone's (issue 42, item 7): a small book submitted after several
worst-case uploads is read before any of them has run to its limits, by two CPU worker processes played
by two threads here, each taking the broker's doorbells in order. Before, each `book.parse` read its own
book with the full limits, so the small book waited for all of them, two at a time.

The budgets are scaled down so the test takes seconds (a quick lane of 2 CPU s instead of 15, a long
limit of 4 instead of 120); the lanes behave the same at any scale. On both databases, the reading
child real."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from app.books import intake
from app.books.service import submit_book
from app.books.status import book_status
from app.context import Context
from app.db import queries
from app.db.models import BookStatus
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.support.audio import wav_bytes
from tests.support.books import book_request
from tests.support.hostile import inflating_pdf


class QueueSender:
    """The cpu queue as the doorbells' order: what a book sends is appended, the workers take from the
    front."""

    def __init__(self) -> None:
        self.queue: deque[str] = deque()
        self.lock = threading.Lock()

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        if name == "book.parse":
            with self.lock:
                self.queue.append(args[0])


def _workers(ctx: Context, sender: QueueSender, n: int) -> list[tuple[str, str]]:
    """Run `n` workers until no doorbell is left and none is reading; -> (doorbell, outcome) in order."""
    busy, done = [0], []

    def work() -> None:
        while True:
            with sender.lock:
                if not sender.queue and not busy[0]:
                    return
                book_id = sender.queue.popleft() if sender.queue else None
                busy[0] += book_id is not None
            if book_id is None:
                time.sleep(0.05)
                continue
            try:
                done.append((book_id, intake.read_book(book_id, ctx)))
            finally:
                with sender.lock:
                    busy[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return done


def test_a_small_book_after_worst_case_uploads_is_read_before_any_of_them_runs_to_its_limits(
        ctx: Context, session: Session) -> None:
    settings = ctx.settings.model_copy(update={"book_parse_quick_cpu_s": 2, "book_parse_cpu_s": 4,
                                               "book_parse_timeout_s": 120.0, "book_parse_long_slots": 1})
    sender = QueueSender()
    ctx = replace(ctx, settings=settings, sender=sender)
    hostile = [submit_book(ctx=ctx, session=session, data=inflating_pdf(2), request=book_request(
        filename=f"h{i}.pdf", reference_bytes=wav_bytes())) for i in range(3)]
    small = submit_book(ctx=ctx, session=session, data=MARKDOWN_BOOK.encode(), request=book_request(
        filename="small.md", reference_bytes=wav_bytes()))
    session.commit()
    assert list(sender.queue) == [*hostile, small]  # the broker's order: the small book's doorbell last
    outcomes = _workers(ctx, sender, 2)
    session.expire_all()
    books = {b: queries.require_book(session=session, book_id=b) for b in [*hostile, small]}
    assert books[small].status == BookStatus.QUEUED  # read and planned
    for b in hostile:  # each read twice: out of the quick lane's time, then stopped at the full limit
        assert books[b].finished_at > books[small].updated_at  # none ran to its limits before it was read
        assert (books[b].status, books[b].parse_lane) == (BookStatus.FAILED, "long")
        assert "more than 4 s of CPU" in (books[b].error or "")
    assert books[small].parse_lane == "quick" and books[small].parse_attempts == 1
    assert [o for _, o in outcomes].count("long") == 3 and "planned" in [o for _, o in outcomes]
    waited = book_status(session=session, artifacts=ctx.artifacts, book_id=small).parse_wait_s
    assert waited == round((books[small].parse_started_at - books[small].submitted_at).total_seconds(), 1)
    assert waited > 0  # it did wait: for two quick readings, not for six
