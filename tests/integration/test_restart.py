"""A GPU worker SIGKILLed mid-decode and restarted under its node name, on both brokers and with the
default visibility timeout (6 h, what a deployment runs): every job it held resumes within 60 s of the
restart and completes once, whole on disk.

On kombu's Redis transport the killed worker's messages sit in the `unacked` hash until the visibility
timeout; on RabbitMQ they are requeued when its connection drops. Either way the restarted worker must
not leave a job in `running` for hours (issue 18, defect 4).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import soundfile as sf
import torch
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.celery_config import make_celery
from app.db import queries
from app.db.models import DONE_JOB_STATUSES, JobStatus
from app.db.session import make_engine, make_sessionmaker
from app.jobs import submit_job
from app.settings import Settings
from app.store import FeatureStore
from tests.conftest import make_test_settings
from tests.integration.conftest import WorkerProcess, start_gpu_worker
from tests.support.runtime import VOICE_A, prepare_ahead

pytestmark = pytest.mark.timeout(300)

RESUME_WITHIN_S = 60.0


@pytest.fixture
def restart_settings(sqlite_url: str, artifacts: ArtifactStore, broker_url: str,
                     redis_session_lock: None) -> Settings:
    """The crash tests' small worker, but the visibility timeout and the attempts are the defaults."""
    settings = make_test_settings(
        database_url=sqlite_url, artifact_root=artifacts.root, tag=f"t{os.getpid()}-{uuid.uuid4().hex[:6]}",
        model_preset="tiny", prep_wait_ms=200, progress_interval_s=0.1, micro_batch_size=4, worker_slots=2,
        voice_cache_capacity=4)
    assert settings.visibility_timeout_s == Settings().visibility_timeout_s == 6 * 3600
    return settings.model_copy(update={"broker_url": broker_url})


@pytest.fixture
def db(restart_settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(restart_settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def store(restart_settings: Settings, feature_redis) -> Iterator[FeatureStore]:
    s = FeatureStore.from_url(restart_settings.feature_store_url, ttl_s=600)
    yield s
    s.close()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    workers: list[WorkerProcess] = []
    yield workers
    for worker in workers:
        worker.stop()
    for worker in workers[-1:]:
        print(worker.tail(6000))


def submit(settings: Settings, db, store: FeatureStore, n_tokens: int, seed: int) -> str:
    tokens = torch.randint(0, 6561, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    app = make_celery(settings)
    try:
        with db() as session:
            return submit_job(settings=settings, session=session, sender=app, store=store,
                              artifacts=ArtifactStore(settings.artifact_root), tokens=tokens,
                              reference_bytes=VOICE_A, seed=seed)
    finally:
        app.close()


def row(db, job_id: str):
    with db() as session:
        return queries.require_job(session=session, job_id=job_id)


def wait_for(check, timeout: float, what: str, worker: WorkerProcess) -> float:
    """Poll `check` until true; returns the seconds it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}\n{worker.tail()}"
        time.sleep(0.1)
    return time.monotonic() - start


class Store:
    """`prepare_ahead` needs only `.store`."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store


def test_a_gpu_worker_killed_mid_decode_and_restarted_resumes_its_jobs_within_60_s(
        restart_settings: Settings, db, store: FeatureStore, started: list[WorkerProcess],
        tmp_path: Path) -> None:
    settings = restart_settings
    prepare_ahead(Store(store), VOICE_A)
    jobs = {submit(settings, db, store, n, seed=n): n for n in (500, 450)}
    name = f"gpu-restart-{uuid.uuid4().hex[:6]}"
    started.append(start_gpu_worker(settings, name, tmp_path, events=False))
    wait_for(lambda: all(row(db, j).frames_done > 0 for j in jobs), 120, "audio of both jobs", started[0])
    started[0].stop(9)  # SIGKILL mid-decode: no shutdown, no requeue by the worker itself
    assert all(row(db, j).status == JobStatus.RUNNING and row(db, j).attempts == 1 for j in jobs)
    started.append(start_gpu_worker(settings, name, tmp_path, events=False))  # the supervisor restarts it

    def resumed() -> bool:
        return all(row(db, j).attempts == 2 for j in jobs)

    took = wait_for(resumed, RESUME_WITHIN_S, "every job of the killed worker to start again", started[1])
    print(f"resumed {took:.1f} s after the restarted worker answered")
    wait_for(lambda: all(row(db, j).status in DONE_JOB_STATUSES for j in jobs), 150, "the jobs", started[1])
    for job_id, n in jobs.items():
        job = row(db, job_id)
        assert job.status == JobStatus.SUCCEEDED and job.attempts == 2, (job.status, job.attempts, job.error)
        audio, _ = sf.read(ArtifactStore(settings.artifact_root).path(job.output_path), dtype="float32")
        assert audio.shape == (n * 960,)  # whole, not a half-written file
    outputs = sorted(p.name for p in (Path(settings.artifact_root) / "outputs").iterdir())
    assert outputs == sorted(f"{j}.wav" for j in jobs)  # one output per job, no partial left
