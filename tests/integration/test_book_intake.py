"""Hostile books through the session's real CPU worker (`book.parse` on PostgreSQL and Redis): each is
refused with its reason by the bounded child that reads it, and the worker process goes on serving.
Before issue 28 a subtitle cue at 99,999 h asked `book.chapter` for 31 TiB and the worker exited."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from app.books.files import book_dir
from app.books.service import BookOptions, cancel, submit_book
from app.broker.celery_config import make_celery
from app.db import queries
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.support.audio import wav_bytes
from tests.support.books import book_request
from tests.support.context import context_for
from tests.support.hostile import timed_subtitles


@pytest.fixture
def producer(worker_settings: Settings) -> Iterator[tuple[Celery, FeatureStore]]:
    app = make_celery(worker_settings)
    store = FeatureStore.from_url(worker_settings.feature_store_url, ttl_s=600)
    yield app, store
    app.close()
    store.close()


def _worker_pid(app: Celery, nodename: str) -> int:
    stats = app.control.inspect(destination=[nodename], timeout=10).stats() or {}
    return int(stats[nodename]["pid"])


def _submit(settings: Settings, sessions: sessionmaker[Session], producer: Any, data: bytes,
            **kw: Any) -> str:
    app, store = producer
    with sessions() as session:
        return submit_book(ctx=context_for(settings, app, sessions=sessions, store=store), session=session,
                           data=data,
                           request=book_request(reference_bytes=wav_bytes(), **kw))


def _cancel_and_settle(settings: Settings, sessions: sessionmaker[Session], producer: Any, book_id: str,
                       nodename: str, timeout: float = 120) -> None:
    """Cancel a book the test no longer needs and wait until the worker runs nothing for it, so that no
    task of it writes rows while the tables are emptied after the test."""
    app, store = producer
    with sessions() as session:
        cancel(ctx=context_for(settings, app, sessions=sessions, store=store), session=session,
               book_id=book_id)
    deadline, idle = time.monotonic() + timeout, 0
    while idle < 2:  # twice in a row: a task may start between two looks
        active = app.control.inspect(destination=[nodename], timeout=10).active() or {}
        idle = idle + 1 if not active.get(nodename) else 0
        assert time.monotonic() < deadline, f"the worker is still busy: {active}"
        time.sleep(0.5)


def _read(settings: Settings, sessions: sessionmaker[Session], book_id: str, timeout: float = 300) -> Any:
    """The book once it is no longer `parsing`."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as session:
            book = queries.require_book(session=session, book_id=book_id)
        if book.status != "parsing":
            return book
        assert time.monotonic() < deadline, "book still parsing"
        time.sleep(0.25)


def test_a_cue_at_99999_hours_is_refused_by_the_worker_which_then_reads_a_good_book(
        worker_settings: Settings, cpu_worker: str, worker_sessions: sessionmaker[Session], producer) -> None:
    settings = worker_settings
    pid = _worker_pid(producer[0], cpu_worker)
    timed = _submit(settings, worker_sessions, producer, timed_subtitles("vtt", 99_999), filename="s.vtt",
                    options=BookOptions(timed=True))
    good = _submit(settings, worker_sessions, producer, MARKDOWN_BOOK.encode(), filename="b.md")
    refused = _read(settings, worker_sessions, timed)
    assert refused.status == "failed" and "past the timed span limit of 48:00:00" in refused.error
    planned = _read(settings, worker_sessions, good)
    assert planned.status in ("queued", "rendering") and planned.title == "The Lighthouse Keeper"
    assert _worker_pid(producer[0], cpu_worker) == pid  # the same process served both
    artifacts = ArtifactStore(settings.artifact_root)
    assert not book_dir(artifacts, timed).exists()
    _cancel_and_settle(settings, worker_sessions, producer, good, cpu_worker)
