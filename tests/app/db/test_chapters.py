"""Chapter counters kept as segments settle, and the ready record (the outbox of book.chapter), on both
databases: every figure is checked against a count over the segments themselves."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from app import lifecycle
from app.db import queries as q
from app.db.models import Book, BookChapter, BookStatus, JobStatus, utcnow
from tests.app.db.helpers import new_job


def key(name: str) -> str:
    return (name * 64)[:64]


A, B, C, D = key("a"), key("b"), key("c"), key("d")


def plan_book(session: Session, voice: str, *chapters: list[str]) -> str:
    book_id = str(uuid.uuid4())
    q.create_book(session=session, new=q.NewBook(
        id=book_id, voice_id=voice, title="t", author="", language="en", output_format="wav", m4b=False,
        target_lufs=None, seed=0, priority=0))
    planned = [q.PlannedChapter(f"c{i}", [(k, "tokens", voice) for k in keys], 1.0)
               for i, keys in enumerate(chapters)]
    assert lifecycle.add_book_plan(session=session, book_id=book_id, title="t", author="", language="en",
                           plan_key="p", chapters=planned)
    session.commit()
    return book_id


def render(session: Session, voice: str, segment: str, replacing: str | None = None,
           n_tokens: int = 3) -> str:
    job = new_job(session, voice, tokens=[5] * n_tokens)[0]
    assert lifecycle.link_segment_job(session=session, key=segment, job_id=job.id, replacing=replacing,
                              n_tokens=n_tokens)
    session.commit()
    return job.id


def counters(session: Session, book_id: str) -> list[tuple[int, int, int, int]]:
    """(total, done, failed, tokens done) per chapter, as the rows keep them."""
    session.expire_all()
    return [(c.keys_total, c.keys_done, c.keys_failed, c.tokens_done)
            for c in q.list_chapters(session=session, book_id=book_id)]


def counted_now(session: Session, book_id: str) -> list[tuple[int, int, int, int]]:
    """The same figures counted over the chapters' segments as they stand (distinct keys per chapter)."""
    out = []
    for chapter in q.list_chapters(session=session, book_id=book_id):
        states = q.book_segment_states(session=session, book_id=book_id, chapter=chapter.index)
        done = [s for s in states if s.job_status == JobStatus.SUCCEEDED]
        failed = [s for s in states if not s.live and s.job_status != JobStatus.SUCCEEDED
                  and (s.job_id or s.error)]
        out.append((len(states), len(done), len(failed), sum(s.n_tokens or 0 for s in done)))
    return out


def ready(session: Session, book_id: str) -> list[bool]:
    session.expire_all()
    return [c.ready_at is not None for c in q.list_chapters(session=session, book_id=book_id)]


def schedule_all(session: Session, book_id: str) -> None:
    while lifecycle.claim_next_chapter(session=session, book_id=book_id) is not None:
        pass
    session.commit()


def test_settling_counts_every_chapter_holding_the_segment_once_and_records_each_chapter_ready_once(
        session: Session, voice: str) -> None:
    one = plan_book(session, voice, [A, B, A], [C, A])  # A twice in chapter 0, and in chapter 1
    two = plan_book(session, voice, [A, D])  # A shared with another book
    assert counters(session, one) == [(2, 0, 0, 0), (2, 0, 0, 0)]
    jobs = {k: render(session, voice, k, n_tokens=n) for k, n in ((A, 4), (B, 3), (C, 2), (D, 1))}
    schedule_all(session, one)
    schedule_all(session, two)

    settled = lifecycle.settle(session=session, job_id=jobs[A], status=JobStatus.SUCCEEDED,
                               output_path="a.wav")
    session.commit()
    assert settled.finished and settled.chapters_ready == []
    assert counters(session, one) == [(2, 1, 0, 4), (2, 1, 0, 4)] and counters(session, two) == [(2, 1, 0, 4)]

    settled = lifecycle.settle(session=session, job_id=jobs[B], status=JobStatus.FAILED, error="boom")
    session.commit()
    assert settled.chapters_ready == [(one, 0)] and ready(session, one) == [True, False]
    again = lifecycle.settle(session=session, job_id=jobs[B], status=JobStatus.FAILED, error="twice")
    assert again == lifecycle.Settled(False, [])  # already final: counted once, recorded once

    assert lifecycle.cancel(session=session, job_id=jobs[D])  # a cancel counts as a failure
    session.commit()
    assert counters(session, two) == [(2, 1, 1, 4)] and ready(session, two) == [True]
    settled = lifecycle.settle(session=session, job_id=jobs[C], status=JobStatus.SUCCEEDED,
                               output_path="c.wav")
    session.commit()
    assert settled.chapters_ready == [(one, 1)]
    assert counters(session, one) == counted_now(session, one) == [(2, 1, 1, 4), (2, 2, 0, 6)]
    assert counters(session, two) == counted_now(session, two)


def test_a_failed_segment_rendered_again_is_open_until_its_new_job_settles(session: Session,
                                                                         voice: str) -> None:
    one = plan_book(session, voice, [A, B])
    two = plan_book(session, voice, [B, C])
    schedule_all(session, one)
    schedule_all(session, two)
    first = {k: render(session, voice, k) for k in (A, B, C)}
    for k, status in ((A, JobStatus.SUCCEEDED), (B, JobStatus.FAILED), (C, JobStatus.SUCCEEDED)):
        lifecycle.settle(session=session, job_id=first[k], status=status, output_path="x.wav")
    session.commit()
    assert ready(session, one) == [True] and counters(session, two) == [(2, 1, 1, 3)]

    assert lifecycle.reopen_failed_segments(session=session, book_id=one,
                                            index=0) == 1  # book.plan schedules again
    session.commit()
    assert counters(session, one) == [(2, 1, 0, 3)] and ready(session, one) == [False]
    assert counters(session, two) == [(2, 1, 0, 3)] and ready(session, two) == [False]  # it shares B
    assert lifecycle.reopen_failed_segments(session=session, book_id=one, index=0) == 0
    replaced = render(session, voice, B)
    assert counters(session, one) == counted_now(session, one) == [(2, 1, 0, 3)]
    settled = lifecycle.settle(session=session, job_id=replaced, status=JobStatus.SUCCEEDED,
                               output_path="b.wav")
    session.commit()
    assert sorted(settled.chapters_ready) == sorted([(one, 0), (two, 0)])
    assert counters(session, one) == counted_now(session, one) == [(2, 2, 0, 6)]
    assert counters(session, two) == counted_now(session, two) == [(2, 2, 0, 6)]


def test_a_tokenize_error_counts_as_a_failure_and_clearing_it_reopens_the_segment(session: Session,
                                                                                voice: str) -> None:
    book = plan_book(session, voice, [A])
    schedule_all(session, book)
    lifecycle.fail_segment(session=session, key=A, error="tokenize: no such file")
    session.commit()
    assert counters(session, book) == counted_now(session, book) == [(1, 0, 1, 0)]
    assert ready(session, book) == [True]
    lifecycle.fail_segment(session=session, key=A, error=None)
    session.commit()
    assert counters(session, book) == [(1, 0, 0, 0)] and ready(session, book) == [False]


def test_a_new_book_starts_from_what_other_renders_settled_and_an_ended_book_keeps_its_figures(
        session: Session, voice: str) -> None:
    first = plan_book(session, voice, [A, B])
    jobs = {k: render(session, voice, k) for k in (A, B)}
    lifecycle.settle(session=session, job_id=jobs[A], status=JobStatus.SUCCEEDED, output_path="a.wav")
    lifecycle.settle(session=session, job_id=jobs[B], status=JobStatus.FAILED, error="x")
    session.commit()
    later = plan_book(session, voice, [B, A, C])
    assert counters(session, later) == counted_now(session, later) == [(3, 1, 1, 3)]
    assert ready(session, later) == [False]  # not scheduled: nothing is recorded ready before that

    session.execute(update(Book).where(Book.id == later).values(status=BookStatus.SUCCEEDED))
    render(session, voice, A, replacing=jobs[A])  # A's audio vanished: another render makes it again
    assert counters(session, later) == [(3, 1, 1, 3)]  # ended: as it ended
    assert counters(session, first) == counted_now(session, first) == [(2, 0, 1, 0)]  # live: A is open


def test_a_chapter_with_nothing_left_to_render_is_recorded_ready_when_scheduled(session: Session,
                                                                              voice: str) -> None:
    plan_book(session, voice, [A])
    job = render(session, voice, A)
    lifecycle.settle(session=session, job_id=job, status=JobStatus.SUCCEEDED, output_path="a.wav")
    session.commit()
    again = plan_book(session, voice, [A])
    assert not lifecycle.record_ready(session=session, book_id=again, index=0)  # not scheduled yet
    schedule_all(session, again)
    assert lifecycle.record_ready(session=session, book_id=again, index=0)
    assert not lifecycle.record_ready(session=session, book_id=again, index=0)  # once


def test_the_sweep_lists_a_ready_chapter_until_book_chapter_has_checked_that_readiness(
        session: Session, voice: str) -> None:
    book = plan_book(session, voice, [A], [B])
    session.execute(update(Book).where(Book.id == book).values(status=BookStatus.RENDERING))
    schedule_all(session, book)
    jobs = {k: render(session, voice, k) for k in (A, B)}
    for k in (A, B):
        lifecycle.settle(session=session, job_id=jobs[k], status=JobStatus.SUCCEEDED, output_path="x.wav")
    session.commit()
    cutoff = utcnow() - timedelta(seconds=60)

    def unchecked() -> list[tuple[str, int]]:
        return q.list_unchecked_chapters(session=session, rung_before=cutoff)

    assert unchecked() == []  # recorded just now: its doorbell is on its way
    session.execute(update(BookChapter).values(ready_at=cutoff - timedelta(seconds=60)))
    session.commit()
    assert unchecked() == [(book, 0), (book, 1)]
    lifecycle.mark_chapter_rung(session=session, book_id=book, index=1)
    session.commit()
    assert unchecked() == [(book, 0)]  # sent again just now
    seen = [q.chapter_ready_at(session=session, book_id=book, index=i) for i in (0, 1)]
    lifecycle.mark_chapter_checked(session=session, book_id=book, index=0, ready_at=seen[0])
    session.commit()
    assert unchecked() == []

    # recorded anew while book.chapter ran (a segment rendered again and settled): not what it checked
    session.execute(update(BookChapter).where(BookChapter.index == 1)
                    .values(ready_at=cutoff - timedelta(seconds=30), rung_at=None))
    lifecycle.mark_chapter_checked(session=session, book_id=book, index=1, ready_at=seen[1])
    session.commit()
    assert unchecked() == [(book, 1)]
    session.execute(update(Book).where(Book.id == book).values(status=BookStatus.FAILED))
    session.commit()
    assert unchecked() == []  # a book that ended needs no chapter
