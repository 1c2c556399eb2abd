"""The periodic maintenance sweep the CPU workers send themselves: once per period for the cluster, and a
real worker that sends a stranded job again. Real Redis; the worker test on both databases."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import update

from app.broker.queues import open_broker
from app.db import queries
from app.db.models import Job, utcnow
from app.settings import Settings
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from tasks.celery_app import make_celery
from tasks.schedule import SWEEP_TASK, PeriodicSweep, tick
from tests.integration.conftest import start_worker
from tests.support.audio import wav_bytes
from tests.support.context import context_for


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, **options: Any) -> None:
        self.sent.append((name, options))


def test_one_tick_per_period_sends_the_sweep_however_many_workers_tick(store: FeatureStore) -> None:
    settings = Settings(queue_cpu="cpu-sched", maintenance_interval_s=0.3)
    workers = [Sender(), Sender(), Sender()]
    assert [tick(w, store, settings) for w in workers] == [True, False, False]
    assert workers[0].sent == [(SWEEP_TASK, {"queue": "cpu-sched"})]
    time.sleep(0.3)  # the claim lasts 0.9 of the period
    assert [tick(w, store, settings) for w in reversed(workers)] == [True, False, False]
    assert len(workers[2].sent) == 1 and len(workers[0].sent) == 1


def test_a_claim_covers_only_its_own_queue(store: FeatureStore) -> None:
    a, b = Sender(), Sender()
    assert tick(a, store, Settings(queue_cpu="cpu-a", maintenance_interval_s=60))
    assert tick(b, store, Settings(queue_cpu="cpu-b", maintenance_interval_s=60))


def test_a_tick_without_redis_logs_and_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    unreachable = FeatureStore(redis.Redis(port=1, socket_connect_timeout=0.2), ttl_s=60)
    sender = Sender()
    assert tick(sender, unreachable, Settings(maintenance_interval_s=60)) is False
    assert sender.sent == [] and "not sent" in caplog.text


def test_the_cpu_app_carries_the_periodic_sweep_step() -> None:
    assert PeriodicSweep in make_celery(Settings(), include=()).steps["worker"]


@pytest.mark.timeout(180)
def test_a_cpu_worker_sends_a_job_whose_message_was_lost_again_on_its_own(
        settings: Settings, sessions, artifacts, tmp_path: Path) -> None:
    """A queued job whose `synth` message vanished (a broker that lost it, a worker SIGKILLed between the
    broker's pop and its unacknowledged record) is rung again by the sweep a CPU worker schedules itself."""
    settings = settings.model_copy(update={"maintenance_interval_s": 1.0, "stuck_job_after_s": 1.0})
    producer = make_celery(settings, include=())
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    broker = open_broker(settings.broker_url)
    worker = None
    try:
        with sessions() as session:
            job_id = submit_job(ctx=context_for(settings, producer, sessions=sessions, store=store),
                                session=session, request=JobRequest(
                                    tokens=[1] * 30, reference_bytes=wav_bytes()))
        assert broker.purge(settings.queue_gpu) == 1  # the message is gone, the job is still queued
        with sessions() as session:
            quiet = utcnow() - timedelta(hours=1)
            session.execute(update(Job).where(Job.id == job_id).values(updated_at=quiet))
            session.commit()
        worker = start_worker(settings, f"cpu-sched-{job_id[:8]}", tmp_path,
                              ["-A", "tasks.celery_app", "worker", "-Q", settings.queue_cpu, "-P", "solo"])
        deadline = time.monotonic() + 60
        while broker.queue_depth(settings.queue_gpu) == 0:
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.2)
        time.sleep(2.5)  # more periods pass: rung again only as its waits double (1 s, 1 s, 2 s ...)
        worker.stop()  # a sweep under way ends first (a warm shutdown): rings and messages are settled
        with sessions() as session:
            job = queries.require_job(session=session, job_id=job_id)
        assert job.status == "queued"
        assert broker.queue_depth(settings.queue_gpu) == job.rings <= 3, worker.tail()  # a message a ring
    finally:
        if worker is not None:
            worker.stop()
        broker.purge(settings.queue_gpu)
        store.close()
        producer.close()
