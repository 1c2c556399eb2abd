"""The HTTP API against the real Redis (broker + feature store) and a real database (SQLite, PostgreSQL).

Tasks are really sent to the broker, on per-test queues nobody consumes, so the tests see what a
worker would receive; jobs are finished through `app.db.queries` where a test needs a done job.
"""

from __future__ import annotations

import io
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import soundfile as sf
import torch
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.api.client import ApiError, HttpClient, follow
from app.api.main import create_app
from app.api.metrics import broker_queue_depth
from app.artifacts import ArtifactStore
from app.db import queries
from app.db.models import JobStatus, PrepPath
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.dev import SAMPLES, services
from app.keys import COUNTER_PREP_PATH, cancel_key
from app.settings import Settings
from app.store import FeatureStore
from tests.conftest import SESSION_TAG, settings_env
from tests.conftest import _wait_ready as wait_ready

TOKENS = [1, 2, 3, 4, 5, 6560, 0, 42]


def wav_bytes(seconds: float = 2.0, freq: float = 220.0, sr: int = 16000, amp: float = 0.3) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


@pytest.fixture
def reference() -> bytes:
    return (SAMPLES / "voice_a.wav").read_bytes()


def make_client(settings: Settings, **kwargs: Any) -> Iterator[TestClient]:
    with TestClient(create_app(settings), **kwargs) as client:
        yield client


@pytest.fixture
def client(settings: Settings, feature_redis: redis.Redis) -> Iterator[TestClient]:
    """An app on this test's database and queues; the feature store is flushed around the test."""
    yield from make_client(settings)


@pytest.fixture
def broker(settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.broker_url)
    yield client
    for queue in (settings.queue_cpu, settings.queue_gpu):
        client.delete(queue, *[f"{queue}\x06\x16{n}" for n in range(1, 10)])
    client.close()


def queued(broker: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The task messages waiting on a queue (every priority list), as kombu wrote them."""
    keys = [queue] + [f"{queue}\x06\x16{n}" for n in range(1, 10)]
    return [json.loads(raw) for key in keys for raw in broker.lrange(key, 0, -1)]


def upload_voice(client: TestClient, data: bytes) -> Any:
    return client.post("/v1/voices", files={"file": ("ref.wav", data, "audio/wav")})


def submit(client: TestClient, voice_id: str, tokens: list[Any] = TOKENS, **extra: Any) -> Any:
    return client.post("/v1/jobs", json={"voice_id": voice_id, "tokens": tokens, **extra})


def finish(settings: Settings, job_id: str, status: JobStatus, output: bytes | None = None) -> None:
    """Play the GPU worker's part: finish a job (writing its output file when given)."""
    artifacts = ArtifactStore(settings.artifact_root)
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        relpath = None
        if output is not None:
            relpath = artifacts.output_relpath(job_id, "wav")
            artifacts.write_bytes(relpath, output)
        assert queries.finish_job(session=s, job_id=job_id, status=status, output_path=relpath)
    engine.dispose()


# Schema --------------------------------------------------------------------------------------------


def test_openapi_schema_parses_and_publishes_every_route(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    assert set(spec["paths"]) >= {
        "/v1/voices", "/v1/voices/{voice_id}", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/audio",
        "/v1/jobs/{job_id}/cancel", "/healthz", "/metrics"}
    body = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "multipart/form-data"}
    assert "tokens" in body["application/json"]["schema"]["properties"]
    assert spec["components"]["schemas"]["JobOut"]["properties"]["progress"]
    for ref in _refs(spec):  # no openapi-spec-validator here: at least every reference resolves
        node: Any = spec
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            assert op.get("responses"), f"{method} {path} documents no response"


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


# Voices --------------------------------------------------------------------------------------------


def test_upload_voice_creates_it_once_and_queues_one_preparation(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    first = upload_voice(client, reference)
    assert first.status_code == 201, first.text
    voice = first.json()
    assert len(voice["id"]) == 64 and voice["status"] == "pending"
    assert first.headers["location"] == f"/v1/voices/{voice['id']}"
    again = upload_voice(client, reference)
    assert again.status_code == 200 and again.json()["id"] == voice["id"]
    tasks = queued(broker, settings.queue_cpu)
    assert [t["headers"]["task"] for t in tasks] == ["voice.prepare"]
    assert tasks[0]["headers"]["argsrepr"] == repr([voice["id"]])
    got = client.get(f"/v1/voices/{voice['id']}")
    assert got.status_code == 200 and got.json()["id"] == voice["id"]
    assert [v["id"] for v in client.get("/v1/voices").json()] == [voice["id"]]


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"RIFF not really a wav file at all", "not a readable audio file"),
    (wav_bytes(0.1), "at least"),
    (wav_bytes(amp=0.0), "silent"),
])
def test_bad_reference_audio_is_refused_with_its_reason(client: TestClient, data: bytes, reason: str) -> None:
    response = upload_voice(client, data)
    assert response.status_code == 422
    assert response.json()["error"] == "BadAudio"
    assert reason in response.json()["reason"]


def test_reference_over_the_size_limit_is_refused(settings: Settings) -> None:
    small = settings.model_copy(update={"max_reference_bytes": 100_000, "max_tokens": 10})
    for client in make_client(small):
        response = upload_voice(client, wav_bytes(4.0))  # 128 kB: passes the door, not the check
        assert response.status_code == 422 and "limit" in response.json()["reason"]
        huge = upload_voice(client, wav_bytes(60.0))  # never read: refused by its Content-Length
        assert huge.status_code == 413 and huge.json()["error"] == "TooLarge"

        def chunked() -> Iterator[bytes]:
            yield from (b"x" * 65536 for _ in range(40))

        streamed = client.post("/v1/jobs", content=chunked(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        # A book upload may be far larger than a job request: it is not refused at the door.
        book = client.post("/v1/books", content=b"x" * 3_000_000, headers={"content-type": "text/plain"})
        assert book.status_code != 413, book.text


# Jobs ----------------------------------------------------------------------------------------------


def test_submit_json_job_queues_synth_and_reports_status(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    response = submit(client, voice_id, seed=7, output_format="flac", priority=5)
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["voice_id"] == voice_id and job["seed"] == 7
    assert job["progress"] == {"frames_done": 0, "frames_total": 2 * len(TOKENS), "fraction": 0.0}
    assert job["output_format"] == "flac" and job["priority"] == 5 and job["attempts"] == 0
    assert job["audio_url"] is None and job["prep_path"] is None
    synth = queued(broker, settings.queue_gpu)
    assert [(t["headers"]["task"], t["headers"]["id"]) for t in synth] == [("synth", job["id"])]
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["id"] == job["id"] and got["timings"]["submitted_at"]


def test_submit_multipart_with_reference_and_token_file(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    response = client.post("/v1/jobs", data={"seed": "3", "output_format": "wav"}, files={
        "reference": ("ref.wav", reference, "audio/wav"),
        "tokens": ("tokens.json", (SAMPLES / "tokens_a.json").read_bytes(), "application/json")})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["n_tokens"] == len(json.loads((SAMPLES / "tokens_a.json").read_text())) and job["seed"] == 3
    voice = client.get(f"/v1/voices/{job['voice_id']}").json()
    assert voice["uses"] == 1
    assert [t["headers"]["task"] for t in queued(broker, settings.queue_cpu)] == ["voice.prepare"]


def test_idempotency_key_returns_the_same_job(client: TestClient, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    first = submit(client, voice_id, idempotency_key="k-1").json()
    assert submit(client, voice_id, idempotency_key="k-1").json()["id"] == first["id"]
    by_header = client.post("/v1/jobs", json={"voice_id": voice_id, "tokens": TOKENS},
                            headers={"Idempotency-Key": "k-1"})
    assert by_header.json()["id"] == first["id"]
    assert submit(client, voice_id, idempotency_key="k-2").json()["id"] != first["id"]


@pytest.mark.parametrize("tokens, status, reason", [
    ([], 422, "tokens"),
    ([1, 6561], 422, "0..6560"),
    ([-1], 422, "0..6560"),
    (["a", 2], 422, "tokens"),
    ([1.5], 422, "tokens"),
    (["5"], 422, "tokens"),
    ([True], 422, "tokens"),
])
def test_bad_tokens_are_refused(client: TestClient, reference: bytes, tokens: list[Any], status: int,
                                reason: str) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    response = submit(client, voice_id, tokens)
    assert response.status_code == status, response.text
    assert reason in response.json()["reason"]


def test_bad_token_files_and_options_are_refused(client: TestClient, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]

    def post(tokens: bytes, **form: str) -> Any:
        return client.post("/v1/jobs", data={"voice_id": voice_id, **form},
                           files={"tokens": ("t.json", tokens, "application/json")})

    assert post(b"not json").json()["error"] == "BadTokens"
    assert post(b'{"nope": 1}').json()["error"] == "BadTokens"
    assert post(b"[7000]").status_code == 422
    for hostile in (b"[" * 100_000 + b"]" * 100_000, b"[NaN]", b"[1e400]", b"[10000000000000000000000]",
                    b"[[1]]", b'{"tokens": "123"}', b"\xff\xfe", b"[1, 2]" * 1000):
        refused = post(hostile)
        assert refused.status_code == 422 and refused.json()["error"] == "BadTokens", hostile[:20]
    assert post(b"[1, 2]", seed="99999999999999999999999").status_code == 422
    assert post(b"[1, 2]", priority="-1").status_code == 422
    assert post(b"[1, 2]", seed="x").json()["reason"] == "seed must be an integer, not 'x'"
    assert post(b"[1, 2]", output_format="mp3").status_code == 422
    assert post(b"[1, 2]", priority="99").status_code == 422
    assert client.post("/v1/jobs", data={"voice_id": "../../etc", "tokens": "[1]"}).status_code == 422
    assert client.post("/v1/jobs", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
    broken_json = client.post("/v1/jobs", content=b"{", headers={"content-type": "application/json"})
    assert broken_json.status_code == 422 and broken_json.json()["error"] == "ValidationError"
    both = client.post("/v1/jobs", data={"voice_id": voice_id}, files={
        "reference": ("r.wav", reference, "audio/wav"), "tokens": ("t.json", b"[1]", "application/json")})
    assert both.status_code == 422 and "exactly one" in both.json()["reason"]


def test_list_jobs_filters_by_status_and_voice(client: TestClient, settings: Settings,
                                               reference: bytes) -> None:
    voice_a = upload_voice(client, reference).json()["id"]
    voice_b = upload_voice(client, wav_bytes(freq=330.0)).json()["id"]
    a1, a2 = (submit(client, voice_a).json()["id"] for _ in range(2))
    b1 = submit(client, voice_b).json()["id"]
    finish(settings, a1, JobStatus.FAILED)
    assert {j["id"] for j in client.get("/v1/jobs").json()} == {a1, a2, b1}
    assert [j["id"] for j in client.get("/v1/jobs", params={"voice_id": voice_b}).json()] == [b1]
    assert [j["id"] for j in client.get("/v1/jobs", params={"status": "failed"}).json()] == [a1]
    assert len(client.get("/v1/jobs", params={"limit": 2}).json()) == 2
    assert client.get("/v1/jobs", params={"status": "bogus"}).status_code == 422
    assert client.get("/v1/jobs", params={"limit": 0}).status_code == 422


def test_cancel_a_queued_job_flags_it_for_the_worker(client: TestClient, settings: Settings,
                                                    reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    job_id = submit(client, voice_id).json()["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    store = redis.Redis.from_url(settings.feature_store_url)
    assert store.exists(cancel_key(job_id)) and store.ttl(cancel_key(job_id)) > 0
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200  # idempotent
    assert client.get(f"/v1/jobs/{job_id}/audio").status_code == 409


def mark_prepared(settings: Settings, voice_id: str) -> FeatureStore:
    """Play the CPU worker: features in the store, voice ready."""
    from safetensors.torch import save

    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    store.put(voice_id, save({"x": torch.zeros(1)}))
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        queries.mark_voice_ready(session=s, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=8)
    engine.dispose()
    return store


def test_cancelling_the_last_job_of_a_voice_reclaims_its_features(client: TestClient, settings: Settings,
                                                                  reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    first, second = (submit(client, voice_id).json()["id"] for _ in range(2))
    store = mark_prepared(settings, voice_id)
    assert client.post(f"/v1/jobs/{first}/cancel").status_code == 200
    assert store.exists(voice_id), "another live job still wants the voice"
    assert client.post(f"/v1/jobs/{second}/cancel").status_code == 200
    assert not store.exists(voice_id)
    assert client.get(f"/v1/voices/{voice_id}").json()["status"] == "pending"
    store.close()


def test_cancel_after_the_job_finished_is_a_conflict(client: TestClient, settings: Settings,
                                                    reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    job_id = submit(client, voice_id).json()["id"]
    finish(settings, job_id, JobStatus.SUCCEEDED, output=wav_bytes())
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 409 and "succeeded" in response.json()["reason"]


def test_audio_is_a_conflict_until_the_job_succeeded(client: TestClient, settings: Settings,
                                                    reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    job_id = submit(client, voice_id).json()["id"]
    pending = client.get(f"/v1/jobs/{job_id}/audio")
    assert pending.status_code == 409 and pending.json()["error"] == "Conflict"
    output = wav_bytes(1.0)
    finish(settings, job_id, JobStatus.SUCCEEDED, output=output)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["audio_url"] == f"/v1/jobs/{job_id}/audio"
    assert job["progress"]["frames_done"] == job["progress"]["frames_total"]
    audio = client.get(job["audio_url"])
    assert audio.status_code == 200 and audio.headers["content-type"] == "audio/wav"
    assert audio.content == output


@pytest.mark.parametrize("method, path", [
    ("get", "/v1/voices/" + "0" * 64),
    ("get", "/v1/voices/not-a-sha"),
    ("get", "/v1/jobs/00000000-0000-4000-8000-000000000000"),
    ("get", "/v1/jobs/not-a-uuid"),
    ("get", "/v1/jobs/00000000-0000-4000-8000-000000000000/audio"),
    ("post", "/v1/jobs/00000000-0000-4000-8000-000000000000/cancel"),
    ("get", "/v1/nothing-here"),
])
def test_unknown_ids_are_404(client: TestClient, method: str, path: str) -> None:
    response = client.request(method.upper(), path)
    assert response.status_code == 404
    assert response.json()["error"] == "NotFound"


def test_submit_with_an_unknown_voice_is_404(client: TestClient) -> None:
    response = submit(client, "f" * 64)
    assert response.status_code == 404 and response.json()["error"] == "NotFound"


# Auth, health, metrics, errors -------------------------------------------------------------------


def test_bearer_token_is_required_when_configured(settings: Settings) -> None:
    for client in make_client(settings.model_copy(update={"api_token": SecretStr("s3cret")})):
        assert client.get("/v1/jobs").status_code == 401
        wrong = client.get("/v1/jobs", headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/jobs", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/healthz").status_code == 200  # probes stay open
        assert client.get("/openapi.json").status_code == 200


def test_no_token_configured_means_an_open_api(client: TestClient) -> None:
    assert client.get("/v1/jobs").status_code == 200
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_healthz_checks_database_and_both_redis(client: TestClient, settings: Settings) -> None:
    ok = client.get("/healthz")
    assert ok.status_code == 200
    assert ok.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok", "feature_store": "ok"}}
    down = settings.model_copy(update={"feature_store_url": "redis://127.0.0.1:1/0"})
    for other in make_client(down):
        response = other.get("/healthz")
        assert response.status_code == 503
        checks = response.json()["checks"]
        assert checks["database"] == "ok" and checks["feature_store"].startswith("ConnectionError")


def test_metrics_report_queues_prep_paths_and_job_counts(client: TestClient, settings: Settings,
                                                         reference: bytes, broker: redis.Redis) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    job_ids = [submit(client, voice_id).json()["id"] for _ in range(3)]
    finish(settings, job_ids[0], JobStatus.CANCELLED)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=60)
    store.incr(COUNTER_PREP_PATH, PrepPath.PREPARED_AHEAD, 5)
    store.incr(COUNTER_PREP_PATH, PrepPath.INLINE)
    store.close()
    assert broker_queue_depth(broker, settings.queue_gpu) == 3
    text = client.get("/metrics").text
    assert f'wavefarm_queue_depth{{queue="{settings.queue_gpu}"}} 3.0' in text
    assert f'wavefarm_queue_depth{{queue="{settings.queue_cpu}"}} 1.0' in text
    assert 'wavefarm_prep_path_total{path="prepared_ahead"} 5.0' in text
    assert 'wavefarm_prep_path_total{path="inline"} 1.0' in text
    assert 'wavefarm_jobs{status="queued"} 2.0' in text and 'wavefarm_jobs{status="cancelled"} 1.0' in text
    assert 'wavefarm_source_up{source="broker"} 1.0' in text
    assert 'wavefarm_http_requests_total{method="POST",route="/v1/jobs",status="202"} 3.0' in text


class BrokenSender:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def send_task(self, name: str, args: Any = None, **options: Any) -> Any:
        raise self.exc


@pytest.mark.parametrize("exc, status", [(redis.ConnectionError("broker gone"), 503),
                                         (RuntimeError("a bug"), 500)])
def test_server_side_failures_are_5xx_without_details(settings: Settings, reference: bytes,
                                                      exc: Exception, status: int) -> None:
    app = create_app(settings, sender=BrokenSender(exc))
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/jobs", files={"reference": ("r.wav", reference, "audio/wav"),
                                                  "tokens": ("t.json", b"[1, 2, 3]", "application/json")})
        assert response.status_code == status
        assert str(exc) not in response.text
        assert client.get("/v1/jobs").json() == []  # the job was withdrawn: the client may retry


# End to end: the API, a CPU worker and a GPU worker as real processes ------------------------------


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
        assert services.wait_until(lambda: _healthy(url), timeout=90), services.log_tail(logs / "api.log")
        yield url
    finally:
        for proc in procs.values():
            services.stop_process(proc)
        print(services.log_tail(logs / "gpu.log", 40))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class Recorder:
    """A client whose job reads are remembered, to check what a follower saw."""

    def __init__(self, client: HttpClient) -> None:
        self.client, self.seen = client, []

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.client.job(job_id)
        self.seen.append(job)
        return job


@pytest.mark.integration
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


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_end_to_end_cancel_while_running_stops_the_worker_and_leaves_no_file(
        live_api: str, worker_settings: Settings, worker_sessions: Any) -> None:
    from tasks.celery_app import make_celery

    client = HttpClient(live_api)
    tokens = np.random.default_rng(0).integers(0, 6561, size=4000).tolist()
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
