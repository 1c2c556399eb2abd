"""The GPU worker as a real Celery worker process (`celery -A gpu_worker.worker.process`, thread pool) on real
Redis and SQLite: several `synth` tasks through it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import soundfile as sf
import torch

from app.db import queries
from app.db.models import JobStatus
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from gpu_worker.worker.process import make_gpu_celery
from tests.integration.conftest import running_gpu_worker
from tests.support.context import context_for
from tests.support.runtime import (
    VOICE_A,
    VOICE_B,
    job_row,
    settings_for,
)


@pytest.fixture
def gpu_worker(sqlite_url, artifacts, feature_redis, tmp_path) -> Iterator[Settings]:
    """A GPU worker on queues of its own, with an empty feature store: an earlier test's prepared voice
    would otherwise be found there ("prepared_ahead") although no CPU worker runs for this one."""
    settings = settings_for(sqlite_url, artifacts, prep_wait_ms=200)
    with running_gpu_worker(settings, f"gpu-{settings.queue_gpu}", tmp_path) as worker:
        try:
            yield settings
        finally:
            worker.stop()
            print(worker.tail(2000))


@pytest.mark.timeout(300)
def test_synth_tasks_through_a_real_celery_worker(gpu_worker: Settings, sqlite_sessions) -> None:
    settings = gpu_worker
    app = make_gpu_celery(settings)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    artifacts = ArtifactStore(settings.artifact_root)
    jobs = []
    for reference, n in ((VOICE_A, 40), (VOICE_B, 30), (VOICE_A, 55), (VOICE_B, 20)):
        tokens = torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with sqlite_sessions() as session:
            job_id = submit_job(ctx=context_for(settings, app, sessions=sqlite_sessions, store=store,
                                                artifacts=artifacts),
                                session=session, request=JobRequest(
                                    tokens=tokens, reference_bytes=reference, seed=n))
        jobs.append((job_id, n))
    try:
        results = {job_id: app.AsyncResult(job_id).get(timeout=240) for job_id, _ in jobs}
    finally:
        app.close()
        store.close()
    for job_id, n in jobs:
        assert results[job_id]["status"] == "succeeded"
        audio, rate = sf.read(artifacts.path(results[job_id]["output_path"]), dtype="float32")
        assert rate == 24000 and audio.shape == (n * 960,)
        assert job_row(sqlite_sessions, job_id).status == JobStatus.SUCCEEDED
    paths = sorted(r["prep_path"] for r in results.values())
    assert "inline" in paths or "late" in paths  # no CPU worker prepared ahead in this test
    with sqlite_sessions() as session:
        rows = queries.list_worker_voices(session=session, worker_id=_node(results))
    installed = {w.voice_id for w in rows}
    assert installed == {job_row(sqlite_sessions, j).voice_id for j, _ in jobs}


def _node(results: dict[str, dict]) -> str:
    return next(iter(results.values()))["worker"]
