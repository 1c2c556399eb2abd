"""OpenAI's speech API, called by OpenAI's own Python SDK against the real stack (API, CPU worker, GPU
worker with the tiny dummy model, bearer token set): the audio in every format decodes with PyAV, it
streams while the job renders, a client that goes away mid-stream cancels its job, and refusals are 4xx."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

import av
import httpx
import openai
import pytest

from app.api.client import HttpClient
from app.dev import SAMPLES, services
from app.settings import Settings
from tests.conftest import SESSION_TAG, settings_env
from tests.integration.conftest import _wait_ready as wait_ready
from tests.support.net import answers_healthz, free_port

TOKEN = "speech-test-token"
TEXT = "The wind blew from the north. It was half past three, and the boats came home."
LONG_TEXT = " ".join(["The lighthouse keeper walked along the cliff and counted the boats below."] * 40)


@pytest.fixture(scope="module")
def api(cpu_worker: str, worker_settings: Settings,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("openai")
    env = {**os.environ, **settings_env(worker_settings), "WAVEFARM_MODEL_PRESET": "tiny",
           "WAVEFARM_WORKER_SLOTS": "4", "WAVEFARM_PROGRESS_INTERVAL_S": "0.3", "OMP_NUM_THREADS": "1",
           "WAVEFARM_API_TOKEN": TOKEN, "WAVEFARM_OPENAI_VOICES": "alloy=Ada"}
    node = f"gpu-oai-{SESSION_TAG}@{os.uname().nodename}"
    port = free_port()
    procs = [services.start_cli(["gpu-worker", "--hostname", node], env=env, log_path=logs / "gpu.log"),
             services.start_cli(["serve", "--port", str(port)], env=env, log_path=logs / "api.log")]
    try:
        wait_ready(worker_settings, node, procs[0], logs / "gpu.log")
        url = f"http://127.0.0.1:{port}"
        assert services.wait_until(lambda: answers_healthz(url), timeout=90), \
            services.log_tail(logs / "api.log")
        yield url
    finally:
        for proc in procs:
            services.stop_process(proc)
        print(services.log_tail(logs / "api.log", 40))


@pytest.fixture
def voice(api: str, worker_sessions: Any) -> str:
    """A stored voice named Ada (the name is what the SDK sends); the tables are emptied after the test."""
    client = HttpClient(api, token=TOKEN)
    voice_id = client.add_voice((SAMPLES / "voice_a.wav").read_bytes())["id"]
    named = httpx.patch(f"{api}/v1/voices/{voice_id}", json={"name": "Ada"},
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert named.status_code == 200 and named.json()["name"] == "Ada", named.text
    return voice_id


def sdk(api: str, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=token, max_retries=0, timeout=300)


def decode(data: bytes, fmt: str) -> tuple[int, int]:
    """(samples per channel, sample rate) PyAV decodes from `data`."""
    if fmt == "pcm":  # headerless: 24 kHz, 16-bit little-endian mono, as OpenAI defines it
        assert len(data) % 2 == 0
        return len(data) // 2, 24000
    container = av.open(io.BytesIO(data), format={"aac": "aac", "opus": "ogg"}.get(fmt))
    frames = list(container.decode(audio=0))
    assert frames, f"{fmt}: no audio decoded"
    return sum(f.samples for f in frames), frames[0].sample_rate


def job(api: str, job_id: str) -> dict[str, Any]:
    return HttpClient(api, token=TOKEN).job(job_id)


@pytest.mark.timeout(600)
def test_speech_create_in_every_format_decodes_to_the_jobs_audio(api: str, voice: str) -> None:
    client = sdk(api)
    assert {"wavefarm-code2wav", "tts-1"} <= {m.id for m in client.models.list().data}
    first = client.audio.speech.create(model="tts-1", voice="Ada", input=TEXT, response_format="wav",
                                       extra_headers={"Idempotency-Key": f"oai-{SESSION_TAG}"})
    job_id = first.response.headers["X-Wavefarm-Job-Id"]
    done = job(api, job_id)
    assert done["status"] == "succeeded" and done["kind"] == "text" and done["voice_id"] == voice
    expected = done["n_tokens"] * 960  # 24 kHz samples of the job's tokens
    assert decode(first.content, "wav") == (expected, 24000)
    for fmt in ("pcm", "flac", "mp3", "opus", "aac"):
        # The same key and request: the same job, its audio sent again in another format.
        with client.audio.speech.with_streaming_response.create(
                model="wavefarm-code2wav", voice=voice[:10], input=TEXT, response_format=fmt,
                extra_headers={"Idempotency-Key": f"oai-{SESSION_TAG}"}) as response:
            assert response.headers["X-Wavefarm-Job-Id"] == job_id
            data = b"".join(response.iter_bytes())
        samples, rate = decode(data, fmt)
        if fmt in ("pcm", "flac"):  # lossless: every sample
            assert (samples, rate) == (expected, 24000), fmt
        else:  # a lossy codec adds priming and padding (and Opus decodes at 48 kHz)
            seconds = samples / rate
            assert abs(seconds - expected / 24000) < 0.2, (fmt, seconds, expected / 24000)


@pytest.mark.timeout(600)
def test_the_sdks_default_voice_mapped_by_the_operator_speaks_at_the_speed_asked(
        api: str, voice: str) -> None:
    """WAVEFARM_OPENAI_VOICES=alloy=Ada: the SDK's `alloy` is Ada; speed 2.0 halves the audio's length."""
    client = sdk(api)
    fast = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                      speed=2.0)
    done = job(api, fast.response.headers["X-Wavefarm-Job-Id"])
    assert done["status"] == "succeeded" and done["voice_id"] == voice
    samples, _ = decode(fast.content, "wav")
    own = done["n_tokens"] * 960
    assert abs(samples - own / 2) < 0.05 * own, (samples, own)


@pytest.mark.timeout(600)
def test_audio_streams_while_the_job_renders_and_a_client_that_leaves_cancels_it(
        api: str, voice: str) -> None:
    client = sdk(api)
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="Ada", input=LONG_TEXT, response_format="pcm") as response:
        job_id = response.headers["X-Wavefarm-Job-Id"]
        chunks = response.iter_bytes()
        assert next(chunks)
        running = job(api, job_id)
        assert running["status"] == "running", running  # the first bytes came before the end
        assert running["progress"]["frames_done"] < running["progress"]["frames_total"]
    # Leaving the block closes the connection mid-stream: the job is cancelled.
    cancelled = services.wait_until(lambda: job(api, job_id)["status"] == "cancelled", timeout=60)
    assert cancelled, job(api, job_id)
    final = job(api, job_id)
    assert final["progress"]["frames_done"] < final["progress"]["frames_total"]


def test_refusals_are_4xx_with_a_reason(api: str, voice: str) -> None:
    client = sdk(api)
    with pytest.raises(openai.AuthenticationError):
        sdk(api, token="wrong").audio.speech.create(model="tts-1", voice="Ada", input=TEXT)
    with pytest.raises(openai.NotFoundError, match="no voice"):
        client.audio.speech.create(model="tts-1", voice="shimmer", input=TEXT)
    with pytest.raises(openai.UnprocessableEntityError, match="response_format"):
        client.audio.speech.create(model="tts-1", voice="Ada", input=TEXT,
                                   response_format="ogg")  # type: ignore[arg-type]
    with pytest.raises(openai.UnprocessableEntityError, match="speed"):
        client.audio.speech.create(model="tts-1", voice="Ada", input=TEXT, speed=5.0)
    with pytest.raises(openai.NotFoundError, match="no model"):
        client.audio.speech.create(model="whisper-1", voice="Ada", input=TEXT)
    listed = httpx.get(f"{api}/v1/audio/voices", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert {"id": voice, "name": "Ada"}.items() <= next(v for v in listed["data"] if v["id"] == voice).items()
