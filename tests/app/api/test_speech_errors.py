"""POST /v1/audio/speech when its job gives no audio, on a real uvicorn server (tasks to a recording
sender, no workers): the job's state is set the way a worker would leave it, and the request joins that
job through its Idempotency-Key. Before any audio the answer is an error with the reason (never a 500);
after audio has started a failure cuts the transfer; no audio within the bound: 503 or 504, the job
cancelled when it was the speech request's own.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import Job, JobStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.dev import SAMPLES
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.submission import jobs
from app.submission.request import JobRequest
from tests.conftest import make_test_settings
from tests.support.net import serving
from tests.support.runtime import RecordingSender

TEXT = "The boats came home at half past three."


@pytest.fixture
def speech_settings(sqlite_url: str, artifacts: ArtifactStore, redis_session_lock: None) -> Settings:
    return make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root,
                              speech_first_audio_timeout_s=1.0)


@pytest.fixture
def api(speech_settings: Settings) -> Iterator[httpx.Client]:
    with serving(speech_settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture
def voice(api: httpx.Client) -> str:
    added = api.post("/v1/voices", files={"reference": ("ref.wav", (SAMPLES / "voice_a.wav").read_bytes())})
    assert added.status_code in (200, 201, 202), added.text
    return str(added.json()["id"])


def _speech(api: httpx.Client, voice: str, key: str | None = None) -> httpx.Response:
    return api.post("/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": voice,
                                              "response_format": "wav"},
                    headers={"Idempotency-Key": key} if key else {})


def _job_in_state(settings: Settings, voice: str, status: JobStatus,
                  error: str | None = None) -> tuple[str, str]:
    """A text job the speech request `_speech(api, voice, key)` joins, left in `status`; (key, job id)."""
    key = f"speech-{uuid.uuid4().hex}"
    ctx = Context.build(settings, sender=RecordingSender())
    try:
        with ctx.session() as s:
            job_id = jobs.submit_job(ctx=ctx, session=s, request=JobRequest(
                text=TEXT, voice_id=voice, output_format="wav", idempotency_key=key))
            if status in (JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.SUCCEEDED):
                assert lifecycle.finish(session=s, job_id=job_id, status=status, error=error)
            elif status != JobStatus.QUEUED:
                s.get_one(Job, job_id).status = status
    finally:
        ctx.close()
    return key, job_id


def _status(settings: Settings, job_id: str) -> Any:
    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as s:
            return queries.require_job(session=s, job_id=job_id).status
    finally:
        engine.dispose()


def _partial_wav(settings: Settings, job_id: str, seconds: float = 0.5) -> None:
    """What a GPU worker leaves while it renders: a PCM WAV under the output's hidden part name."""
    final = ArtifactStore(settings.artifact_root).output_path(job_id, "wav")
    out = io.BytesIO()
    sf.write(out, np.zeros(int(24000 * seconds), dtype=np.int16), 24000, format="WAV", subtype="PCM_16")
    (final.parent / f".{final.name}.x1.part").write_bytes(out.getvalue())


def test_a_job_that_failed_before_any_audio_is_a_502_with_its_error(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:
    key, job_id = _job_in_state(speech_settings, voice, JobStatus.FAILED,
                                error="the engine ran out of memory")
    answer = _speech(api, voice, key)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"] == "JobFailed" and "the engine ran out of memory" in answer.json()["reason"]
    assert answer.headers["X-Wavefarm-Job-Id"] == job_id


def test_a_job_cancelled_before_any_audio_is_a_409(api: httpx.Client, speech_settings: Settings,
                                                    voice: str) -> None:
    key, job_id = _job_in_state(speech_settings, voice, JobStatus.CANCELLED)
    answer = _speech(api, voice, key)
    assert answer.status_code == 409 and answer.json()["error"] == "JobCancelled", answer.text
    assert job_id in answer.json()["reason"]


def test_a_failure_after_the_audio_started_cuts_the_transfer_and_is_no_bug(
        api: httpx.Client, speech_settings: Settings, voice: str, caplog: pytest.LogCaptureFixture) -> None:
    """The status line went out with the first audio: the failure shows as a body that never completes,
    logged as the job's failure, not as an unhandled error of the API."""
    key, job_id = _job_in_state(speech_settings, voice, JobStatus.FAILED, error="the GPU went away")
    _partial_wav(speech_settings, job_id)
    received = bytearray()
    body = {"model": "tts-1", "input": TEXT, "voice": voice, "response_format": "pcm"}
    with api.stream("POST", "/v1/audio/speech", headers={"Idempotency-Key": key}, json=body) as response:
        assert response.status_code == 200 and response.headers["X-Wavefarm-Job-Id"] == job_id
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in response.iter_raw():
                received += chunk
    assert len(received) == 24000  # the half second of 16-bit samples that had been written, then the cut
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("app.")]
    assert ("WARNING", f"job {job_id} failed after its audio had started streaming (the GPU went away): "
                       "the response is cut") in logged, logged
    assert not [m for level, m in logged if level == "ERROR"], logged


def test_no_gpu_worker_within_the_bound_is_a_503_and_the_job_is_cancelled(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:
    answer = _speech(api, voice)  # nothing consumes the queues: the job stays queued
    assert answer.status_code == 503 and answer.json()["error"] == "NoGpuWorker", answer.text
    job_id = answer.headers["X-Wavefarm-Job-Id"]
    assert f"no GPU worker took job {job_id} within 1 s" in answer.json()["reason"]
    assert _status(speech_settings, job_id) == JobStatus.CANCELLED


def test_a_claimed_job_without_audio_within_the_bound_is_a_504_and_goes_on_for_its_submitter(
        api: httpx.Client, speech_settings: Settings, voice: str) -> None:
    """The job was submitted before (as through /v1/jobs), so the speech request that joined it by its key
    gives up alone: the job is not its to cancel (`app.api.speech_listeners`)."""
    key, job_id = _job_in_state(speech_settings, voice, JobStatus.RUNNING)
    answer = _speech(api, voice, key)
    assert answer.status_code == 504 and answer.json()["error"] == "NoAudioInTime", answer.text
    assert "wrote no audio within 1 s" in answer.json()["reason"]
    assert "goes on for its other clients" in answer.json()["reason"]
    assert _status(speech_settings, job_id) == JobStatus.RUNNING
