"""Settling a job with its follow-up (`app.lifecycle.outbox.settle_and_send`): the chapter its settling
made ready is committed before its `book.chapter` rings, and a ring the broker loses leaves the ready
record for the reconciler. Both databases."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.db import queries as q
from app.db.models import JobStatus
from app.settings import Settings
from tests.app.db.helpers import vid
from tests.app.db.test_chapters import A, B, plan_book, ready, render, schedule_all


@pytest.fixture
def voice(session: Session) -> str:
    q.get_or_create_voice(session=session, voice_id=vid(), reference_path=f"references/{vid(99)}.wav")
    session.commit()
    return vid()


class CommittedView:
    """A sender that records, with each message, whether the chapters read ready from another session."""

    def __init__(self, sessions: sessionmaker[Session], book_id: str) -> None:
        self.sessions, self.book_id = sessions, book_id
        self.sent: list[tuple[str, Any, list[bool]]] = []

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        with self.sessions() as other:
            self.sent.append((name, args, ready(other, self.book_id)))


class AwayBroker:
    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        raise ConnectionError("the broker is away")


def test_the_last_segment_of_a_chapter_rings_its_book_chapter_once_its_ready_record_is_committed(
        session: Session, sessions: sessionmaker[Session], settings: Settings, voice: str) -> None:
    book = plan_book(session, voice, [A, B])
    jobs = {k: render(session, voice, k) for k in (A, B)}
    schedule_all(session, book)
    sender = CommittedView(sessions, book)

    def settle(job_id: str) -> bool:
        return lifecycle.settle_and_send(session=session, sender=sender, settings=settings, job_id=job_id,
                                         status=JobStatus.SUCCEEDED, output_path="x.wav")

    assert settle(jobs[A]) and sender.sent == []  # the chapter still waits for B
    assert settle(jobs[B])
    assert sender.sent == [("book.chapter", [book, 0], [True])]
    assert not settle(jobs[B]) and len(sender.sent) == 1  # final already: nothing settled, nothing sent


def test_a_ring_the_broker_loses_is_logged_and_leaves_the_chapter_ready_for_the_reconciler(
        session: Session, settings: Settings, voice: str, caplog: pytest.LogCaptureFixture) -> None:
    book = plan_book(session, voice, [A])
    job = render(session, voice, A)
    schedule_all(session, book)
    with caplog.at_level(logging.WARNING, logger="app.lifecycle.outbox"):
        assert lifecycle.settle_and_send(session=session, sender=AwayBroker(), settings=settings, job_id=job,
                                         status=JobStatus.FAILED, error="boom")
    assert "book.chapter not sent" in caplog.text
    assert ready(session, book) == [True]
    chapter = q.list_chapters(session=session, book_id=book)[0]
    assert chapter.rung_at is None  # the reconciler's `resume_chapters` finds it unchecked
