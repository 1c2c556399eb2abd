"""End to end over HTTP: the API, a CPU worker and a GPU worker as real processes; a client submits, follows
progress, downloads the audio, and cancels a job while it runs."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from app.api.client import ApiError, HttpClient, follow
from app.db.models import PrepPath
from app.dev import SAMPLES, services
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from tests.conftest import SESSION_TAG, settings_env
from tests.integration.conftest import _wait_ready as wait_ready
from tests.support.net import answers_healthz, free_port


@pytest.fixture(scope="module")
def live_api(cpu_worker: str, worker_settings: Settings,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`wavefarm gpu-worker` (tiny dummy model) and `wavefarm serve` beside the session's CPU worker."""
    logs = tmp_path_factory.mktemp("e2e")
    env = {**os.environ, **settings_env(worker_settings), "WAVEFARM_MODEL_PRESET": "tiny",
           "WAVEFARM_WORKER_SLOTS": "4", "WAVEFARM_PROGRESS_INTERVAL_S": "0.3", "OMP_NUM_THREADS": "1"}
    node = f"gpu-{SESSION_TAG}@{os.uname().nodename}"
    port = free_port()
    procs = {
        "gpu": services.start_cli(["gpu-worker", "--hostname", node], env=env, log_path=logs / "gpu.log"),
        "api": services.start_cli(["serve", "--port", str(port)], env=env, log_path=logs / "api.log"),
    }
    try:
        wait_ready(worker_settings, node, procs["gpu"], logs / "gpu.log")
        url = f"http://127.0.0.1:{port}"
        assert services.wait_until(lambda: answers_healthz(url), timeout=90), \
            services.log_tail(logs / "api.log")
        yield url
    finally:
        for proc in procs.values():
            services.stop_process(proc)
        print(services.log_tail(logs / "gpu.log", 40))


class Recorder:
    """A client whose job reads are remembered, to check what a follower saw."""

    def __init__(self, client: HttpClient) -> None:
        self.client, self.seen = client, []

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.client.job(job_id)
        self.seen.append(job)
        return job


@pytest.mark.timeout(400)
def test_end_to_end_submit_over_http_follow_progress_download_audio(
        live_api: str, worker_settings: Settings, worker_sessions: Any) -> None:
    client = HttpClient(live_api)
    voice = client.add_voice((SAMPLES / "voice_a.wav").read_bytes())
    tokens = json.loads((SAMPLES / "tokens_a.json").read_text())
    job = client.submit(voice=voice["id"], tokens=tokens, seed=1, output_format="wav", priority=0,
                        idempotency_key=None)
    # A second job uploads its reference with the tokens as files, and asks for FLAC.
    flac = client.submit(voice=(SAMPLES / "voice_b.wav").read_bytes(),
                         tokens=json.loads((SAMPLES / "tokens_b.json").read_text()), seed=2,
                         output_format="flac", priority=5, idempotency_key="e2e-flac")
    recorder = Recorder(client)
    final = follow(recorder, job["id"], timeout_s=300, poll_s=0.2)
    assert final["status"] == "succeeded", final
    assert final["attempts"] == 1 and final["prep_path"] in {p.value for p in PrepPath}
    assert final["progress"]["frames_done"] == final["progress"]["frames_total"] == 2 * len(tokens)
    assert final["timings"]["first_audio_ms"] is not None and final["timings"]["run_ms"] > 0
    done = [j["progress"]["frames_done"] for j in recorder.seen]
    assert done == sorted(done), "progress never goes backwards"
    assert {j["status"] for j in recorder.seen} <= {"queued", "preparing", "running", "succeeded"}
    wave, rate = sf.read(io.BytesIO(client.audio(job["id"])), dtype="float32")
    assert rate == 24000 and wave.shape == (len(tokens) * 960,) and np.isfinite(wave).all()

    flac_final = follow(client, flac["id"], timeout_s=300, poll_s=0.2)
    assert flac_final["status"] == "succeeded", flac_final
    info = sf.info(io.BytesIO(client.audio(flac["id"])))
    assert info.format == "FLAC" and info.frames == flac_final["n_tokens"] * 960
    assert client.voices()[0]["status"] in ("ready", "preparing", "pending")
    metrics = httpx.get(f"{live_api}/metrics").text
    assert f'wavefarm_prep_path_total{{path="{final["prep_path"]}"}}' in metrics
    assert 'wavefarm_jobs{status="succeeded"}' in metrics


@pytest.mark.timeout(400)
def test_end_to_end_cancel_while_running_stops_the_worker_and_leaves_no_file(
        live_api: str, worker_settings: Settings, worker_sessions: Any) -> None:
    from tasks.celery_app import make_celery

    client = HttpClient(live_api)
    tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, size=4000).tolist()
    job = client.submit(voice=(SAMPLES / "voice_a.wav").read_bytes(), tokens=tokens, seed=3,
                        output_format="wav", priority=0, idempotency_key=None)
    assert services.wait_until(lambda: client.job(job["id"])["progress"]["frames_done"] > 0, timeout=240)
    assert client.cancel(job["id"])["status"] == "cancelled"
    app = make_celery(worker_settings, include=())
    try:
        result = app.AsyncResult(job["id"]).get(timeout=60)
    finally:
        app.close()
    assert result["status"] == "cancelled"
    final = client.job(job["id"])
    assert final["status"] == "cancelled"
    assert final["progress"]["frames_done"] < final["progress"]["frames_total"]
    with pytest.raises(ApiError, match="HTTP 409"):
        client.audio(job["id"])
    outputs = ArtifactStore(worker_settings.artifact_root).root / "outputs"
    assert not [p for p in outputs.glob("*") if job["id"] in p.name], "no output and no temp file"


@pytest.mark.timeout(400)
def test_a_text_job_is_spoken_on_the_cpu_worker_tokenized_on_the_gpu_worker_and_says_how(
        live_api: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Text in, speech out: the guide voice on the CPU worker, the S3 tokenizer and the decoder on the GPU
    worker.
    Both run without a model folder here, and the job's record and the CLI's follower say so."""
    client = HttpClient(live_api)
    job = client.submit(voice=(SAMPLES / "voice_a.wav").read_bytes(), tokens=None,
                        text="The wind blew N.N.E., force 7.\n\nIt was 3:30 pm.", language="en",
                        seed=4, output_format="wav", priority=0, idempotency_key=None)
    assert job["kind"] == "text" and job["n_tokens"] == 0
    final = follow(client, job["id"], timeout_s=300, poll_s=0.2)
    assert final["status"] == "succeeded", final
    assert 50 < final["n_tokens"] < 400  # about 4 s of guide speech and its pauses, 25 tokens a second
    wave, rate = sf.read(io.BytesIO(client.audio(job["id"])), dtype="float32")
    assert rate == 24000 and wave.shape == (final["n_tokens"] * 960,)
    assert len(final["notes"]) == 2
    assert final["notes"][0].startswith("tokens from the stand-in tokenizer")
    assert final["notes"][1].startswith("rendered with dummy weights") and "noise" in final["notes"][1]
    told = capsys.readouterr().err
    assert all(f"note: job {job['id'][:8]}: {note}" in told for note in final["notes"])


@pytest.mark.timeout(400)
def test_a_batchs_jobs_render_through_the_workers(live_api: str) -> None:
    client = HttpClient(live_api)
    voice = client.add_voice((SAMPLES / "voice_a.wav").read_bytes())["id"]
    tokens = json.loads((SAMPLES / "tokens_a.json").read_text())[:40]
    answer = client.submit_batch([{"voice_id": voice, "tokens": tokens[: 20 + 10 * i], "seed": i}
                                  for i in range(3)] + [{"voice_id": voice, "tokens": [VOCAB_SIZE]}])
    assert (answer["accepted"], answer["refused"]) == (3, 1)
    for i, result in enumerate(answer["results"][:3]):
        final = follow(client, result["job_id"], timeout_s=300, poll_s=0.2)
        assert final["status"] == "succeeded", final
        audio, sr = sf.read(io.BytesIO(client.audio(result["job_id"])))
        assert len(audio) == (20 + 10 * i) * 960 and sr == 24000
