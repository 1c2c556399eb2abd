"""A book's tasks once the book is cancelled (issue 42): a `book.tokenize` still on the queue finds the book
stopped and ends quietly, one INFO line and no ERROR or traceback (8 cancels logged 309 tracebacks)."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

import tasks.books as books
from app.books.service import cancel_book
from app.context import Context
from app.db import queries
from tests.tasks.test_books import submit


def test_a_task_of_a_cancelled_book_logs_one_info_line_and_no_error(
        ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    book_id = submit(ctx, celery, b"Title\n\nOne sentence here. Another one there.", filename="b.txt")
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        keys = [s.key for s in queries.book_segment_states(session=session, book_id=book_id)]
        assert cancel_book(session=session, store=ctx.store, book_id=book_id, cancel_ttl_s=60)
    monkeypatch.setattr(books, "resources", lambda: ctx)  # the test's database, not the environment's
    with caplog.at_level(logging.INFO):
        outcomes = [books.tokenize_task.apply(args=[book_id, key]) for key in keys]
    assert [o.state for o in outcomes] == ["IGNORED"] * len(keys)  # acknowledged; no chained synth runs
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not [r for r in caplog.records if r.exc_info]
    ours = [r for r in caplog.records if book_id in r.getMessage()]
    assert len(ours) == len(keys) and {r.levelno for r in ours} == {logging.INFO}
    assert "cancelled" in ours[0].getMessage()
