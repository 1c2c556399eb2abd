"""The whole pipeline on real services: PostgreSQL, Redis, a real CPU worker and a real GPU worker, once
with the Redis broker and once with RabbitMQ.

8 jobs with 3 voices submitted at once: every job succeeds, each voice is prepared exactly once (the
database and the counters agree), every output is a 24 kHz file of 960 samples per token, and each
job's audio equals the same job decoded alone with the same seed.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from app.audio import load_reference
from app.db import queries
from app.db.models import JobStatus, VoiceStatus
from app.dev import SAMPLES
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.storage.keys import COUNTER_PREP_PATH, COUNTER_PREPARE
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.features import PromptHostFeatures
from gpu_worker.checkpoint.load import load_dummy
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.model.config import ModelArgs
from gpu_worker.voices.prompt import StandInSpeaker, install_voice
from gpu_worker.worker.process import make_gpu_celery
from gpu_worker.worker.runtime import DUMMY_SEED
from tests.conftest import SESSION_TAG
from tests.integration.conftest import running_gpu_worker, start_worker
from tests.support.context import context_for

# 8 jobs over 3 voices: (voice index, tokens, seed)
JOBS = [(0, 60, 1), (1, 45, 2), (2, 30, 3), (0, 25, 4), (1, 80, 5), (2, 51, 6), (0, 38, 7), (1, 27, 8)]


def third_voice() -> bytes:
    """A harmonic, voice-like reference unlike the two bundled samples (22.05 kHz stereo)."""
    sr = 22050
    t = np.arange(int(4.0 * sr)) / sr
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wave = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    wave = 0.2 * wave / np.abs(wave).max() + 0.003 * np.random.default_rng(3).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, np.stack([wave, 0.8 * wave], axis=1).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


REFERENCES = [(SAMPLES / "voice_a.wav").read_bytes(), (SAMPLES / "voice_b.wav").read_bytes(), third_voice()]


@pytest.fixture(scope="module", params=["redis", "amqp"])
def gpu_worker(request: pytest.FixtureRequest, worker_settings: Settings,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A GPU worker and a CPU worker on one broker: the session's CPU worker on Redis, one of this
    module's own on RabbitMQ."""
    # Long prep wait: jobs wait for the CPU worker instead of preparing inline.
    settings = worker_settings.model_copy(update={
        "model_preset": "tiny", "prep_wait_ms": 120_000, "micro_batch_size": 8, "worker_slots": 8,
        "voice_cache_capacity": 3, "progress_interval_s": 0.2})
    logs = tmp_path_factory.mktemp("pipeline-log")
    cpu = None
    if request.param == "redis":
        request.getfixturevalue("cpu_worker")
    else:
        settings = settings.model_copy(update={"broker_url": request.getfixturevalue("amqp_url")})
        cpu = start_worker(settings, f"cpu-pipeline-{SESSION_TAG}", logs,
                           ["-A", "tasks.celery_app", "worker", "-Q", settings.queue_cpu, "-P", "solo"])
    try:
        with running_gpu_worker(settings, f"gpu-pipeline-{request.param}-{SESSION_TAG}", logs):
            yield settings
    finally:
        if cpu is not None:
            cpu.stop()


def job_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(1000 + seed)).tolist()


def decode_alone(features: PromptHostFeatures, tokens: list[int], seed: int) -> np.ndarray:
    """The GPU worker's model and voice install, one job on its own."""
    torch.set_num_threads(1)
    model = load_dummy(ModelArgs.tiny(), DUMMY_SEED)
    decoder = StreamingDecoder(model, device="cpu", dtype=torch.float32, micro_batch_size=1)
    with torch.inference_mode():
        voice = install_voice(features, speaker=StandInSpeaker("cpu"), decoder=decoder)
        return decoder.decode_offline(voice, tokens, seed).numpy()


@pytest.mark.timeout(600)
def test_eight_jobs_three_voices_prepared_once_each_equal_to_decoding_alone(
    gpu_worker: Settings, worker_sessions
) -> None:
    settings = gpu_worker
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    artifacts = ArtifactStore(settings.artifact_root)
    app = make_gpu_celery(settings)
    prepared_before = store.counters(COUNTER_PREPARE).get("prepared", 0)
    paths_before = store.counters(COUNTER_PREP_PATH)
    voice_ids = [load_reference(ref)[1] for ref in REFERENCES]
    for voice_id in voice_ids:  # nothing left over from an earlier run (features, or a claim an earlier
        store.delete(voice_id)  # test took for a preparation it sent to queues nobody consumes)
        store.release_prepare(voice_id)
    submitted = []
    try:
        for voice, n, seed in JOBS:
            with worker_sessions() as session:
                job_id = submit_job(ctx=context_for(settings, app, sessions=worker_sessions, store=store,
                                                    artifacts=artifacts),
                                    session=session, request=JobRequest(
                                        tokens=job_tokens(n, seed), reference_bytes=REFERENCES[voice],
                                        seed=seed, output_format="wav"))
            submitted.append((job_id, voice, n, seed))
        results = {job_id: app.AsyncResult(job_id).get(timeout=480) for job_id, *_ in submitted}
    finally:
        app.close()

    with worker_sessions() as session:
        jobs = {job_id: queries.require_job(session=session, job_id=job_id) for job_id, *_ in submitted}
        voices = {v: queries.get_voice(session=session, voice_id=v) for v in voice_ids}
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs.values()), {
        j: (job.status, job.error) for j, job in jobs.items()}
    # Each voice prepared exactly once, by the CPU worker: counters and database agree.
    assert store.counters(COUNTER_PREPARE).get("prepared", 0) - prepared_before == 3
    assert all(v is not None and v.status == VoiceStatus.READY for v in voices.values())
    paths = {job.prep_path for job in jobs.values()}
    assert paths <= {"prepared_ahead", "late", "already_installed"}, paths
    paths_after = store.counters(COUNTER_PREP_PATH)
    counted = sum(paths_after.get(p, 0) - paths_before.get(p, 0) for p in paths_after)
    assert counted == len(JOBS)

    features = {v: PromptHostFeatures.from_bytes(store.get(v)) for v in voice_ids}
    store.close()
    for job_id, voice, n, seed in submitted:
        audio, rate = sf.read(artifacts.path(results[job_id]["output_path"]), dtype="float32")
        assert rate == 24000 and audio.shape == (n * 960,)
        alone = decode_alone(features[voice_ids[voice]], job_tokens(n, seed), seed)
        # 16-bit WAV: one quantisation step is 3.1e-5; batching changes a row by under 1e-5.
        assert np.abs(audio - np.clip(alone, -1, 1)).max() < 1e-4, job_id
    assert len({Path(r["output_path"]).name for r in results.values()}) == len(JOBS)
