"""A speech client's disconnect cancels its job only when nobody else holds it (`app.api.speech_listeners`):
two speech requests with one Idempotency-Key share a job, and the first to leave does not cut the other's
stream; a job first submitted through /v1/jobs is never cancelled by a speech disconnect. On a real uvicorn
server with no workers; the test plays the GPU worker (the job's status, its growing WAV)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from app.db import queries
from app.db.models import Job, JobStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from tests.app.api.test_speech_errors import TEXT, _job_in_state, _partial_wav, _status, voice  # noqa: F401
from tests.conftest import make_test_settings
from tests.support.net import serving

BODY = {"model": "tts-1", "input": TEXT, "response_format": "pcm"}


@pytest.fixture
def speech_settings(sqlite_url: str, artifacts: ArtifactStore, redis_session_lock: None) -> Settings:
    return make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root,
                              speech_first_audio_timeout_s=60.0)


@pytest.fixture
def api(speech_settings: Settings) -> Iterator[httpx.Client]:
    with serving(speech_settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _job_by_key(settings: Settings, key: str, wait_s: float = 30.0) -> str:
    engine = make_engine(settings.database_url)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with session_scope(make_sessionmaker(engine)) as s:
                job = queries.get_job_by_idempotency_key(session=s, idempotency_key=key)
                if job is not None:
                    return job.id
            time.sleep(0.05)
    finally:
        engine.dispose()
    raise AssertionError(f"no job under {key}")


def _running(settings: Settings, job_id: str) -> None:
    """The GPU worker's part: the job runs and has written half a second."""
    _partial_wav(settings, job_id)
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        s.get_one(Job, job_id).status = JobStatus.RUNNING
    engine.dispose()


def _status_after(settings: Settings, job_id: str, want: JobStatus, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while (status := _status(settings, job_id)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return str(status)


def test_one_speech_clients_disconnect_does_not_cut_anothers_stream(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:  # noqa: F811
    key, body = f"shared-{uuid.uuid4().hex}", {**BODY, "voice": voice}
    first_read = threading.Event()
    leave_first = threading.Event()
    got: dict[str, object] = {}

    def first() -> None:  # the client whose request creates the job, then keeps reading
        with httpx.Client(base_url=str(api.base_url), timeout=60) as own, \
                own.stream("POST", "/v1/audio/speech", json=body, headers={"Idempotency-Key": key}) as r:
            got["status"] = r.status_code
            chunks = r.iter_raw()  # held: a dropped iterator closes the connection
            next(chunks)
            first_read.set()
            leave_first.wait(60)

    reader = threading.Thread(target=first)
    reader.start()
    try:
        job_id = _job_by_key(speech_settings, key)
        _running(speech_settings, job_id)
        assert first_read.wait(60) and got["status"] == 200
        with api.stream("POST", "/v1/audio/speech", json=body, headers={"Idempotency-Key": key}) as second:
            assert second.status_code == 200 and second.headers["X-Wavefarm-Job-Id"] == job_id
            next(second.iter_raw())
        # the second client has gone; the first still holds the job
        assert _status_after(speech_settings, job_id, JobStatus.CANCELLED, 3.0) == JobStatus.RUNNING
    finally:
        leave_first.set()
        reader.join(60)
    assert _status_after(speech_settings, job_id, JobStatus.CANCELLED, 30.0) == JobStatus.CANCELLED


def test_a_job_submitted_through_v1_jobs_is_never_cancelled_by_a_speech_disconnect(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:  # noqa: F811
    key, job_id = _job_in_state(speech_settings, voice, JobStatus.RUNNING)
    _partial_wav(speech_settings, job_id)
    with api.stream("POST", "/v1/audio/speech", json={**BODY, "voice": voice},
                    headers={"Idempotency-Key": key}) as response:
        assert response.status_code == 200 and response.headers["X-Wavefarm-Job-Id"] == job_id
        next(response.iter_raw())
    assert _status_after(speech_settings, job_id, JobStatus.CANCELLED, 3.0) == JobStatus.RUNNING


def test_a_lone_speech_clients_disconnect_still_cancels_its_job(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:  # noqa: F811
    key, body = f"alone-{uuid.uuid4().hex}", {**BODY, "voice": voice}
    result: dict[str, int] = {}

    def ask() -> None:
        with httpx.Client(base_url=str(api.base_url), timeout=60) as own, \
                own.stream("POST", "/v1/audio/speech", json=body, headers={"Idempotency-Key": key}) as r:
            result["status"] = r.status_code
            next(r.iter_raw())

    reader = threading.Thread(target=ask)
    reader.start()
    job_id = _job_by_key(speech_settings, key)
    _running(speech_settings, job_id)
    reader.join(60)
    assert result["status"] == 200
    assert _status_after(speech_settings, job_id, JobStatus.CANCELLED, 30.0) == JobStatus.CANCELLED
