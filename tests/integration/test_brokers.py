"""The two brokers as wavefarm uses them, on the real Redis and the real RabbitMQ: the same job priority
is served first on both, queue depths are read on both, the reconciler rings again on both the jobs
whose lease passed (and leaves leased ones alone), and the jobs rung on a gone worker's own queue are rung
again on the shared queue with their priorities on both.

Nothing consumes the queues here: messages are published by a wavefarm Celery app (`make_celery`, as
the API and the CPU workers publish) and taken off with kombu, the way a worker's consumer takes them.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import timedelta

import pytest
from kombu import Connection, Queue
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.broker.celery_config import make_celery, redis_options
from app.broker.publisher import Publisher
from app.broker.queues import is_amqp, open_broker
from app.broker.wire import send_synth
from app.db import queries
from app.db.models import Job, JobStatus, Worker, utcnow
from app.reconcile.dead_workers import WORKER_GONE_S, expire_leases, reroute_gone
from app.reconcile.report import SweepReport
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.routing import worker_queue
from tests.conftest import make_test_settings
from tests.integration.conftest import send_job, sessions_of, start_worker, store_of
from tests.support.context import context_for
from tests.support.runtime import VOICE_A


@pytest.fixture
def broker_settings(sqlite_url: str, artifacts: ArtifactStore, broker_url: str,
                    redis_session_lock: None) -> Settings:
    tag = f"t{os.getpid()}-{uuid.uuid4().hex[:6]}"  # queues of this test alone
    settings = make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root, tag=tag)
    return settings.model_copy(update={"broker_url": broker_url})


@pytest.fixture
def db(broker_settings: Settings) -> Iterator[sessionmaker[Session]]:
    yield from sessions_of(broker_settings)


@pytest.fixture
def store(broker_settings: Settings, feature_redis) -> Iterator[FeatureStore]:
    yield from store_of(broker_settings)


def take_all(settings: Settings, queue: str) -> list[str]:
    """Task ids in the order the broker hands the queue's messages to a consumer (each acknowledged)."""
    options = {} if is_amqp(settings.broker_url) else redis_options(settings)
    ids = []
    with Connection(settings.broker_url, transport_options=options) as conn:
        bound = Queue(queue)(conn.channel())
        while (message := bound.get()) is not None:
            ids.append(message.headers["id"])
            message.ack()
    return ids


@pytest.mark.parametrize("how", ["celery", "publisher", "round"])
def test_a_higher_job_priority_is_served_first_on_both_brokers(broker_settings: Settings, how: str) -> None:
    """Sent by Celery (a worker's sends), the API's Publisher, or a Publisher's round (a batch)."""
    settings = broker_settings
    app = make_celery(settings)
    sent = {f"job-{p}-{uuid.uuid4().hex[:6]}": p for p in (0, 9, 5, 0, 3)}
    try:
        publisher = Publisher(app)
        with (nullcontext(app) if how == "celery" else nullcontext(publisher) if how == "publisher"
              else publisher.round()) as sender:
            for job_id, priority in sent.items():
                send_synth(sender, settings, job_id, priority)
        broker = open_broker(settings.broker_url)
        try:
            assert broker.queue_depth(settings.queue_gpu) == len(sent)
            order = take_all(settings, settings.queue_gpu)
            assert broker.queue_depth(settings.queue_gpu) == 0
            assert broker.queue_depth(f"never-declared-{uuid.uuid4().hex[:6]}") == 0
        finally:
            broker.close()
    finally:
        app.close()
    assert [sent[j] for j in order] == [9, 5, 3, 0, 0]
    assert order[3:] == [j for j, p in sent.items() if p == 0]  # equal priorities: first in, first out


def claimed_job(settings: Settings, db: sessionmaker[Session], store: FeatureStore, worker: str,
                seed: int, lease_s: float) -> str:
    """A job sent and then claimed by `worker` (registered now) under a lease of `lease_s`, its message
    already taken off the queue and acknowledged: what the broker holds once a worker that streamed it
    is gone for good."""
    job_id = send_job(settings, db, store, VOICE_A, 30, seed=seed)
    assert take_all(settings, settings.queue_gpu) == [job_id]
    with db.begin() as session:
        queries.register_worker(session=session, name=worker)
    with db.begin() as session:
        job = lifecycle.claim(session=session, job_id=job_id, worker=worker, max_attempts=3, lease_s=lease_s)
        assert job is not None and job.status == JobStatus.PREPARING
    return job_id


def test_the_reconciler_rings_again_the_jobs_whose_lease_passed_and_not_those_still_leased(
        broker_settings: Settings, db, store: FeatureStore) -> None:
    settings = broker_settings
    gone = claimed_job(settings, db, store, "gpu-gone@test", seed=1, lease_s=0)  # never renewed: passed
    live = claimed_job(settings, db, store, "gpu-live@test", seed=2, lease_s=600)
    with db.begin() as session:  # gpu-gone stopped beating long ago
        session.execute(update(Worker).where(Worker.name == "gpu-gone@test").values(
            heartbeat_at=utcnow() - timedelta(seconds=WORKER_GONE_S + 60)))
    app = make_celery(settings)
    report = SweepReport()
    try:
        expire_leases(ctx=context_for(settings, app, sessions=db, store=store), report=report)
        assert report.jobs_resumed == [gone]
        assert take_all(settings, settings.queue_gpu) == [gone]  # its doorbell rang, once
        expire_leases(ctx=context_for(settings, app, sessions=db, store=store), report=report)
        assert report.jobs_resumed == [gone]  # a second pass finds nothing more to do
    finally:
        app.close()
    with db() as session:
        resumed, held = (queries.require_job(session=session, job_id=j) for j in (gone, live))
    assert resumed.status == JobStatus.QUEUED and resumed.attempts == 1  # the lost attempt stays counted
    assert held.status == JobStatus.PREPARING and held.worker == "gpu-live@test"


def test_an_idle_worker_on_rabbitmq_stops_about_as_soon_as_one_on_redis(
        sqlite_url: str, artifacts: ArtifactStore, amqp_url: str, tmp_path) -> None:
    """Its event loop would otherwise sleep up to 10 s before it reads the SIGTERM (every stop took 10.9 s
    before `app.broker.celery_config.PromptShutdown`); kombu's Redis transport wakes its loop every second by
    itself. A ratio, measured in one run with both workers stopped at the same moment, so that a loaded
    machine slows both: a fixed bound failed on a loaded CI machine (5.9 s against 5 s)."""
    tag = f"t{os.getpid()}-{uuid.uuid4().hex[:6]}"
    settings = make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root, tag=tag)
    workers = {}
    for broker, url in (("redis", settings.broker_url), ("amqp", amqp_url)):
        on = settings.model_copy(update={"broker_url": url})
        workers[broker] = start_worker(on, f"cpu-stop-{broker}-{uuid.uuid4().hex[:6]}", tmp_path,
                                       ["-A", "tasks.celery_app", "worker", "-Q", on.queue_cpu, "-P", "solo"])
    took: dict[str, float] = {}

    def stop(broker: str) -> None:
        started = time.monotonic()
        assert workers[broker].stop(timeout=60) == 0, workers[broker].tail()
        took[broker] = time.monotonic() - started

    stoppers = [threading.Thread(target=stop, args=(b,)) for b in workers]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join()
    print(f"warm shutdown: RabbitMQ {took['amqp']:.2f} s, Redis {took['redis']:.2f} s")
    assert took["amqp"] < 3 * took["redis"] + 1.0, (took, workers["amqp"].tail())


def test_jobs_rung_on_a_gone_workers_own_queue_are_rung_again_on_the_shared_queue_in_priority_order(
        broker_settings: Settings, db, store: FeatureStore) -> None:
    """Voice affinity sent jobs to two workers' own queues; one of them stopped beating. The reconciler
    rings those jobs again on the shared queue, at their priorities, where they are served by priority with
    the ones already there; the live worker's jobs are left alone. (The doorbells left in the gone worker's
    queue are duplicates: if that worker comes back, each finds its job claimed or ended.)"""
    settings = broker_settings
    gone, live = "gpu-gone@test", "gpu-live@test"
    jobs = [send_job(settings, db, store, VOICE_A, 30, seed=n) for n in range(5)]
    take_all(settings, settings.queue_gpu)  # submitted to the shared queue; sent again below by hand
    with db.begin() as session:
        for name in (gone, live):
            queries.register_worker(session=session, name=name)
    priorities = dict(zip(jobs, (2, 9, 5, 0, 7), strict=True))
    app = make_celery(settings)
    report = SweepReport()
    try:
        with db.begin() as session:
            for job_id, priority in priorities.items():
                session.execute(update(Job).where(Job.id == job_id).values(priority=priority))
            queries.set_job_route(session=session, job_ids=jobs[:3], routed_to=gone, route="holder")
            queries.set_job_route(session=session, job_ids=[jobs[4]], routed_to=live, route="holder")
        for job_id in jobs[:3]:
            send_synth(app, settings, job_id, priorities[job_id], queue=worker_queue(settings, gone))
        send_synth(app, settings, jobs[3], priorities[jobs[3]])  # already on the shared queue
        send_synth(app, settings, jobs[4], priorities[jobs[4]], queue=worker_queue(settings, live))
        reroute_gone(ctx=context_for(settings, app, sessions=db, store=store), report=report)
        assert report.jobs_rerouted == []  # both beat just now: nobody is gone
        long_ago = utcnow() - timedelta(seconds=WORKER_GONE_S + 5)
        with db.begin() as session:
            session.execute(update(Worker).where(Worker.name == gone).values(heartbeat_at=long_ago))
        reroute_gone(ctx=context_for(settings, app, sessions=db, store=store), report=report)
        assert sorted(report.jobs_rerouted) == sorted(jobs[:3])
        order = take_all(settings, settings.queue_gpu)
        assert [priorities[j] for j in order] == [9, 5, 2, 0]
        assert take_all(settings, worker_queue(settings, live)) == [jobs[4]]
        reroute_gone(ctx=context_for(settings, app, sessions=db, store=store), report=report)
        assert len(report.jobs_rerouted) == 3  # rung on the shared queue now: nothing more to do
    finally:
        app.close()
    with db() as session:
        routes = {j: queries.require_job(session=session, job_id=j).route for j in jobs}
    assert {routes[j] for j in jobs[:3]} == {"shared_worker_gone"}
