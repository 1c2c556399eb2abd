"""A book's segment jobs are rung by the lifecycle (`lifecycle.ring`), in process, on both databases: a
segment planned with its tokens and one made by `book.tokenize` are routed job by job, their route and
ring recorded, their `synth` sent where routing chose; a redelivered `book.tokenize` makes no second job
and rings only a queued one; a `book.tokenize` message of the old format (with the route chosen at
planning) still runs. Messages go to the test's Redis broker; nobody consumes them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from celery import Celery

import tasks.books as books
from app import lifecycle
from app.books import segment_jobs, service
from app.books.segment_jobs import GROUP
from app.broker.queues import open_broker
from app.context import Context
from app.db import queries
from app.db.models import Job, JobStatus, utcnow
from app.submission import routing
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.app.helpers import queued
from tests.tasks.test_books import manifest_book, render_live_jobs, submit, tokenize_live_jobs

A, B = "gpu-a@host", "gpu-b@host"
BOOK_PRIORITY = 9  # a book at the default priority 0: served last (`wire.broker_priority`)


@pytest.fixture
def workers(ctx: Context, broker: redis.Redis) -> Iterator[list[str]]:
    """Two live GPU workers with two slots each (routing chooses between their own queues), whose
    queues are emptied afterwards."""
    with ctx.sessions() as session:
        for name in (A, B):
            queries.register_worker(session=session, name=name, slots=2)
        session.commit()
    yield [A, B]
    for name in (A, B):
        open_broker(ctx.settings.broker_url).purge(routing.worker_queue(ctx.settings, name))


def jobs_of(ctx: Context, book_id: str) -> list[Job]:
    """The book's segment jobs, in reading order."""
    with ctx.sessions() as session:
        states = queries.book_segment_states(session=session, book_id=book_id)
        rows = [queries.require_job(session=session, job_id=s.job_id) for s in states if s.job_id]
        session.expunge_all()
    return rows


def synths(broker: redis.Redis, queue: str) -> list[tuple[str, str, int]]:
    """(task id, job id, broker priority) of each `synth` waiting in `queue`."""
    return [(m["id"], m["args"][0], m["priority"]) for m in queued(broker, queue) if m["task"] == "synth"]


def test_a_planned_segments_synth_goes_where_routing_chose_with_its_route_and_ring_recorded(
        ctx: Context, celery: Celery, broker: redis.Redis, workers: list[str]) -> None:
    """Routed job by job: the chapter's next lines find the first queued on its worker (affinity) until
    that worker's two slots are full; then one spills to the free worker, which holds the voice too."""
    book_id = submit(ctx, celery, manifest_book([[30, 40, 41, 42]]))
    before = utcnow()
    assert books.plan(book_id, ctx) == 4
    after = utcnow()
    jobs = jobs_of(ctx, book_id)
    assert [(j.routed_to, j.route) for j in jobs] == [(A, "placed"), (A, "affinity"), (B, "spilled"),
                                                      (B, "affinity")]
    grace = timedelta(seconds=ctx.settings.stuck_job_after_s)
    for job in jobs:  # rung once, due again one grace after the ring
        assert job.status == JobStatus.QUEUED and job.rings == 1
        assert before + grace <= job.ring_due_at <= after + grace
    for worker in (A, B):
        assert synths(broker, routing.worker_queue(ctx.settings, worker)) == [
            (j.id, j.id, BOOK_PRIORITY) for j in jobs if j.routed_to == worker]
    assert synths(broker, ctx.settings.queue_gpu) == []


LONG_CHAPTER = "# Long\n\n## One\n\n" + "\n\n".join(f"Line number {n} of the chapter." for n in range(11))


def test_book_tokenize_goes_in_groups_of_a_chapters_segments_in_reading_order(
        ctx: Context, celery: Celery, broker: redis.Redis) -> None:
    book_id = submit(ctx, celery, LONG_CHAPTER.encode(), filename="book.md")
    open_broker(ctx.settings.broker_url).purge(ctx.settings.queue_cpu)
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        keys = [s.key for s in queries.book_segment_states(session=session, book_id=book_id)]
    messages = [m for m in queued(broker, ctx.settings.queue_cpu) if m["task"] == "book.tokenize"]
    assert len(keys) > GROUP  # more than one group
    assert [m["args"] for m in messages] == [[book_id, keys[start:start + GROUP]]
                                             for start in range(0, len(keys), GROUP)]
    assert {m["priority"] for m in messages} == {BOOK_PRIORITY}


def test_book_tokenize_makes_a_groups_jobs_at_once_and_a_redelivery_makes_no_second_job(
        ctx: Context, celery: Celery, broker: redis.Redis, workers: list[str]) -> None:
    """A group's jobs are made together and routed as a batch is, once per voice: all to the worker
    placed for it (not job by job, as planned segments are); each rung once, its `synth` sent."""
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    open_broker(ctx.settings.broker_url).purge(ctx.settings.queue_cpu)
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        keys = [s.key for s in queries.book_segment_states(session=session, book_id=book_id)]
    group = [m["args"] for m in queued(broker, ctx.settings.queue_cpu) if m["task"] == "book.tokenize"][0][1]
    assert group == keys[:len(group)] and len(group) >= 2
    assert synths(broker, routing.worker_queue(ctx.settings, A)) == []  # no job yet: nothing to render

    made = books.tokenize(book_id, group, ctx)
    jobs = jobs_of(ctx, book_id)
    assert [j.id for j in jobs] == made and len(set(made)) == len(group)
    assert [(j.status, j.rings, j.routed_to, j.route) for j in jobs] == [
        (JobStatus.QUEUED, 1, A, "placed")] * len(group)
    assert synths(broker, routing.worker_queue(ctx.settings, A)) == [(j, j, BOOK_PRIORITY) for j in made]

    assert books.tokenize(book_id, group, ctx) == made  # redelivered, queued: rung again, nothing made
    with ctx.sessions() as session:
        assert [queries.get_segment(session=session, key=k).jobs_created for k in group] == [1] * len(group)
        assert [queries.require_job(session=session, job_id=j).rings for j in made] == [2] * len(group)
    again = [m for w in (A, B) for m in synths(broker, routing.worker_queue(ctx.settings, w))]
    assert len(again) == 2 * len(group)  # each rung again where routing says now, job by job


def test_a_redelivered_book_tokenize_leaves_a_claimed_or_finished_job_alone(
        ctx: Context, celery: Celery, broker: redis.Redis) -> None:
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        key = queries.book_segment_states(session=session, book_id=book_id)[0].key
    job_id = books.tokenize(book_id, [key], ctx)[0]
    (job,) = jobs_of(ctx, book_id)
    assert (job.id, job.status, job.rings, job.routed_to, job.route) == (
        job_id, JobStatus.QUEUED, 1, None, "shared_single")  # no live GPU worker: nothing to choose
    assert synths(broker, ctx.settings.queue_gpu) == [(job_id, job_id, BOOK_PRIORITY)]

    tokenize_live_jobs(ctx, book_id)  # the GPU worker tokenizes the job's speech before its claim
    with ctx.sessions() as session:
        assert lifecycle.claim(session=session, job_id=job_id, worker=A, max_attempts=3, lease_s=30)
        session.commit()
    assert books.tokenize(book_id, [key], ctx)[0] == job_id  # redelivered, claimed: nothing sent
    assert render_live_jobs(ctx, book_id) == 1
    assert books.tokenize(book_id, [key], ctx)[0] == job_id  # redelivered, done: nothing sent
    assert len(synths(broker, ctx.settings.queue_gpu)) == 1
    with ctx.sessions() as session:
        assert queries.get_segment(session=session, key=key).jobs_created == 1


def test_an_old_format_book_tokenize_with_the_planned_route_still_renders_its_segment(
        ctx: Context, celery: Celery, broker: redis.Redis, workers: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent before an upgrade as `book.tokenize(book_id, key, routed_to, route) | synth`: the two extra
    arguments are ignored, the job is routed now, and the id returned is what the chained `synth` of
    such a message gets (a duplicate doorbell)."""
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        key = queries.book_segment_states(session=session, book_id=book_id)[0].key
    monkeypatch.setattr(books, "resources", lambda: ctx)  # the test's database, not the environment's
    outcome = books.tokenize_task.apply(args=[book_id, key, B, "affinity"])
    assert outcome.successful()
    (job,) = jobs_of(ctx, book_id)
    assert outcome.result == job.id
    assert (job.status, job.rings, job.routed_to, job.route) == (JobStatus.QUEUED, 1, A, "placed")
    assert synths(broker, routing.worker_queue(ctx.settings, A)) == [(job.id, job.id, BOOK_PRIORITY)]


def test_a_segment_another_render_linked_meanwhile_keeps_its_job_and_the_groups_others_keep_theirs(
        ctx: Context, celery: Celery, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a group is spoken, another render links its own job to the group's last segment: that
    segment keeps the other job (nothing made for it here), and the group's other segments keep the
    jobs made for them, queued and rung (the lost link undoes only its own segment's job)."""
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        group = [s.key for s in queries.book_segment_states(session=session, book_id=book_id)][:3]
    real = segment_jobs.source_for
    other: list[str] = []

    def racing(segment):  # the other render links the last segment's job as this group speaks it
        if segment.key == group[-1] and not other:
            with ctx.sessions() as session:
                book = queries.require_book(session=session, book_id=book_id)
                job_id, created = service.make_segment_job(
                    session=session, artifacts=ctx.artifacts, book=book, key=segment.key, content=[5, 6, 7],
                    replacing=None)
                session.commit()
                assert created
                other.append(job_id)
        return real(segment)

    monkeypatch.setattr(segment_jobs, "source_for", racing)
    made = books.tokenize(book_id, group, ctx)
    assert made[-1] == other[0] and len(set(made)) == 3
    with ctx.sessions() as session:
        for key, job_id in zip(group, made, strict=True):
            assert queries.get_segment(session=session, key=key).job_id == job_id
            assert queries.require_job(session=session, job_id=job_id).status == JobStatus.QUEUED
        rings = [queries.require_job(session=session, job_id=job_id).rings for job_id in made]
    assert rings == [1, 1, 1]  # the other render's job rung too (as a redelivery rings a queued job)
    assert [s[1] for s in synths(broker, ctx.settings.queue_gpu)] == made
