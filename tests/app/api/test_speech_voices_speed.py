"""POST /v1/audio/speech with OpenAI's voice names and `speed`, on a real uvicorn server (tasks to a
recording sender, no workers): `alloy` is a 404 that says how to give it a voice, a mapping
(WAVEFARM_OPENAI_VOICES) or a stored voice named `alloy` makes it one, and a speed other than 1.0
stretches the job's audio (pitch kept) as it streams."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import Job, JobStatus
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
                              speech_first_audio_timeout_s=1.0, openai_voices="Echo=Ada, nova=nobody")


@pytest.fixture
def api(speech_settings: Settings) -> Iterator[httpx.Client]:
    with serving(speech_settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _voice(api: httpx.Client, name: str | None = None) -> str:
    added = api.post("/v1/voices", files={"reference": ("ref.wav", (SAMPLES / "voice_a.wav").read_bytes())})
    assert added.status_code in (200, 201, 202), added.text
    voice_id = str(added.json()["id"])
    if name is not None:
        assert api.patch(f"/v1/voices/{voice_id}", json={"name": name}).status_code == 200
    return voice_id


def _speech(api: httpx.Client, voice: str, **extra: object) -> httpx.Response:
    return api.post("/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": voice, **extra})


def _job_voice(settings: Settings, job_id: str) -> str:
    ctx = Context.build(settings, sender=RecordingSender())
    try:
        with ctx.session() as s:
            return queries.require_job(session=s, job_id=job_id).voice_id
    finally:
        ctx.close()


def test_an_openai_voice_name_nobody_gave_a_voice_is_a_404_saying_how(api: httpx.Client) -> None:
    _voice(api, "Ada")
    answer = _speech(api, "alloy")
    assert answer.status_code == 404, answer.text
    reason = answer.json()["reason"]
    assert "PATCH /v1/voices/{id}" in reason and "WAVEFARM_OPENAI_VOICES='alloy=" in reason, reason


def test_a_mapped_openai_voice_speaks_in_the_stored_voice(api: httpx.Client,
                                                           speech_settings: Settings) -> None:
    ada = _voice(api, "Ada")
    answer = _speech(api, "echo")  # mapped as Echo=Ada: names compared case-insensitively
    assert answer.status_code == 503, answer.text  # no GPU worker here: the job was made, then cancelled
    assert _job_voice(speech_settings, answer.headers["X-Wavefarm-Job-Id"]) == ada


def test_a_mapping_to_no_stored_voice_says_so(api: httpx.Client) -> None:
    answer = _speech(api, "nova")
    assert answer.status_code == 404 and "mapped to 'nobody'" in answer.json()["reason"], answer.text


def test_a_stored_voice_named_alloy_needs_no_mapping(api: httpx.Client, speech_settings: Settings) -> None:
    voice = _voice(api, "alloy")
    answer = _speech(api, "alloy")
    assert answer.status_code == 503, answer.text
    assert _job_voice(speech_settings, answer.headers["X-Wavefarm-Job-Id"]) == voice


def _succeeded_job(settings: Settings, voice: str, audio: np.ndarray, n_tokens: int = 0) -> str:
    """A text job that succeeded with `audio` as its WAV output (`n_tokens`: its tokens, 0: not
    tokenized); its idempotency key."""
    key = f"speech-{uuid.uuid4().hex}"
    ctx = Context.build(settings, sender=RecordingSender())
    try:
        with ctx.session() as s:
            job_id = jobs.submit_job(ctx=ctx, session=s, request=JobRequest(
                text=TEXT, voice_id=voice, output_format="wav", idempotency_key=key))
            out = io.BytesIO()
            sf.write(out, audio, 24000, format="WAV", subtype="PCM_16")
            final = ArtifactStore(settings.artifact_root).output_path(job_id, "wav")
            final.parent.mkdir(parents=True, exist_ok=True)
            final.write_bytes(out.getvalue())
            s.get_one(Job, job_id).n_tokens = n_tokens
            assert lifecycle.finish(session=s, job_id=job_id, status=JobStatus.SUCCEEDED)
    finally:
        ctx.close()
    return key


@pytest.mark.parametrize("speed", [0.25, 2.0, 4.0])
def test_speed_stretches_the_streamed_audio_and_keeps_its_pitch(
        api: httpx.Client, speech_settings: Settings, speed: float) -> None:
    t = np.arange(2 * 24000) / 24000
    voice = _voice(api)
    key = _succeeded_job(speech_settings, voice, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))
    answer = api.post("/v1/audio/speech", headers={"Idempotency-Key": key}, json={
        "model": "tts-1", "input": TEXT, "voice": voice, "speed": speed, "response_format": "wav"})
    assert answer.status_code == 200, answer.text
    samples, rate = sf.read(io.BytesIO(answer.content), dtype="float32")
    assert rate == 24000
    assert abs(len(samples) / 24000 - 2 / speed) < 0.05 * 2 / speed, (speed, len(samples))
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    peak_hz = np.argmax(spectrum) * 24000 / len(samples)
    assert abs(peak_hz - 440) < 10, peak_hz  # pitch kept: resampling would have moved it to 440 * speed


def test_speed_outside_openais_range_is_a_422(api: httpx.Client) -> None:
    answer = _speech(api, _voice(api), speed=4.5)
    assert answer.status_code == 422 and "speed" in answer.text


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_a_saved_flac_answer_opens_with_the_jobs_length(api: httpx.Client, speech_settings: Settings,
                                                         speed: float) -> None:
    voice = _voice(api)
    audio = (0.3 * np.sin(2 * np.pi * 440 * np.arange(50 * 960) / 24000)).astype(np.float32)
    key = _succeeded_job(speech_settings, voice, audio, n_tokens=50)
    answer = api.post("/v1/audio/speech", headers={"Idempotency-Key": key}, json={
        "model": "tts-1", "input": TEXT, "voice": voice, "speed": speed, "response_format": "flac"})
    assert answer.status_code == 200, answer.text
    assert sf.info(io.BytesIO(answer.content)).frames == round(50 * 960 / speed)
    assert len(sf.read(io.BytesIO(answer.content))[0]) == round(50 * 960 / speed)
