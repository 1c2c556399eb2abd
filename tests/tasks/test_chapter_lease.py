"""A chapter's render is a lease (issue 42): a `book.chapter` sent again while the chapter renders (the
sweep sends one a minute after the chapter was recorded ready, and a long chapter takes longer) leaves
it to the render that holds it, and the sweep does not send one while the lease is renewed; a render
whose holder died is sent again once its lease has passed."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import update

import app.books.render as render
import tasks.books as books
from app import lifecycle
from app.db.models import BookChapter, utcnow
from app.reconcile.books import UNCHECKED_CHAPTER_AFTER_S, resume_chapters
from app.reconcile.report import SweepReport
from tests.support.books import RecordingSender
from tests.tasks.test_books import manifest_book, render_live_jobs, submit


def _age_ready(ctx, book_id: str) -> None:
    """As if the chapter had been recorded ready longer ago than the sweep waits for its book.chapter."""
    with ctx.sessions() as session:
        session.execute(update(BookChapter).where(BookChapter.book_id == book_id).values(
            ready_at=utcnow() - timedelta(seconds=UNCHECKED_CHAPTER_AFTER_S + 5), rung_at=None))
        session.commit()


def _sweep_sends(ctx) -> list:
    sender = RecordingSender()
    resume_chapters(ctx=replace(ctx, sender=sender), report=SweepReport())
    return [(name, args) for name, args, _ in sender.sent]


def test_a_chapter_sent_again_while_it_renders_is_rendered_once(ctx, celery: Celery,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    book_id = submit(ctx, celery, manifest_book([[30, 40]]))
    books.plan(book_id, ctx)
    assert render_live_jobs(ctx, book_id) == 2  # the chapter is recorded ready
    rendering, release, renders = threading.Event(), threading.Event(), []
    real = render.render_chapter

    def slow_render(*args, **kwargs):
        renders.append(threading.current_thread().name)
        rendering.set()
        assert release.wait(60)  # a chapter that takes long to render
        return real(*args, **kwargs)

    monkeypatch.setattr(render, "render_chapter", slow_render)
    first: list[str] = []
    worker = threading.Thread(target=lambda: first.append(books.check_chapter(book_id, 0, ctx)), name="first")
    worker.start()
    try:
        assert rendering.wait(60)
        _age_ready(ctx, book_id)
        assert _sweep_sends(ctx) == []  # the lease is held: no second book.chapter
        assert books.check_chapter(book_id, 0, ctx) == "busy"  # one sent anyway leaves it to the holder
        assert renders == ["first"]
    finally:
        release.set()
        worker.join(60)
    assert first == ["assembled"] and renders == ["first"]
    with ctx.sessions() as session:
        row = session.get(BookChapter, (book_id, 0))
        assert row is not None and row.render_owner is None and row.assembled_at is not None  # given back


def test_a_render_whose_holder_died_is_sent_again_once_its_lease_passed(ctx, celery: Celery) -> None:
    book_id = submit(ctx, celery, manifest_book([[30, 40]]))
    books.plan(book_id, ctx)
    render_live_jobs(ctx, book_id)
    with ctx.sessions() as session:  # a worker took the lease and died before it rendered anything
        assert lifecycle.claim_render(session=session, book_id=book_id, index=0, owner="gone:1:x")
        session.commit()
    assert books.check_chapter(book_id, 0, ctx) == "busy"
    assert _sweep_sends(ctx) == []  # recorded ready just now, and leased
    with ctx.sessions() as session:
        session.execute(update(BookChapter).where(BookChapter.book_id == book_id)
                        .values(render_until=utcnow() - timedelta(seconds=1)))
        session.commit()
    assert _sweep_sends(ctx) == [("book.chapter", [book_id, 0])]  # at once, not a minute after ready
    assert books.check_chapter(book_id, 0, ctx) == "assembled"
