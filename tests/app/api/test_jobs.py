"""/v1/jobs against real Redis and both databases: tasks are really sent, on per-test queues nobody
consumes; jobs are finished through `app.db.queries` where a test needs a done job."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from app.db.models import JobStatus
from app.dev import SAMPLES
from app.settings import Settings
from app.storage.keys import cancel_key
from tests.app.api.helpers import TOKENS, finish, mark_prepared, queued, submit, upload_voice
from tests.support.audio import wav_bytes


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


def test_a_text_job_as_json_or_as_a_form_is_queued_for_tokenizing(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    as_json = client.post("/v1/jobs", json={"voice_id": voice_id, "text": "Hello there.",
                                            "language": "en-GB"})
    assert as_json.status_code == 202, as_json.text
    job = as_json.json()
    assert (job["kind"], job["text"], job["language"], job["n_tokens"], job["notes"]) == (
        "text", "Hello there.", "en-GB", 0, [])
    as_form = client.post("/v1/jobs", data={"text": "And again.", "seed": "2"},
                          files={"reference": ("ref.wav", reference, "audio/wav")})
    assert as_form.status_code == 202, as_form.text
    assert (as_form.json()["kind"], as_form.json()["language"], as_form.json()["seed"]) == ("text", "en", 2)
    tokenize = [t for t in queued(broker, settings.queue_cpu) if t["headers"]["task"] == "job.tokenize"]
    assert {t["headers"]["id"] for t in tokenize} == {f"tokenize-{job['id']}",
                                                       f"tokenize-{as_form.json()['id']}"}
    assert queued(broker, settings.queue_gpu) == []


def test_bad_text_jobs_are_refused_with_the_reason(client: TestClient, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    for body, says in (({"tokens": [1], "text": "Hi."}, "exactly one of tokens or text"),
                       ({"text": "Hi.", "language": "../x"}, "language must be a tag"),
                       ({"text": "Hi.", "language": "xx-yy"}, "no guide voice speaks language 'xx-yy'"),
                       ({"text": "   "}, "text is empty"),
                       ({"tokens": [1], "language": "de"}, "language goes with text"),
                       ({}, "tokens are missing (send tokens, or text)")):
        refused = client.post("/v1/jobs", json={"voice_id": voice_id, **body})
        assert refused.status_code == 422 and says in refused.json()["reason"], (body, refused.text)
    neither = client.post("/v1/jobs", data={"voice_id": voice_id})
    assert neither.status_code == 422 and "send tokens, or text" in neither.json()["reason"]


def test_idempotency_key_returns_the_same_job(client: TestClient, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    first = submit(client, voice_id, idempotency_key="k-1").json()
    assert submit(client, voice_id, idempotency_key="k-1").json()["id"] == first["id"]
    by_header = client.post("/v1/jobs", json={"voice_id": voice_id, "tokens": TOKENS},
                            headers={"Idempotency-Key": "k-1"})
    assert by_header.json()["id"] == first["id"]
    assert submit(client, voice_id, idempotency_key="k-2").json()["id"] != first["id"]


@pytest.mark.parametrize("change, differs", [
    ({"priority": 7}, "priority"),
    ({"output_format": "flac"}, "output format"),
    ({"seed": 99}, "seed"),
    ({"tokens": [9, 8, 7]}, "tokens"),
])
def test_an_idempotency_key_reused_with_another_request_is_409_naming_what_differs(
        client: TestClient, reference: bytes, change: dict[str, Any], differs: str) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    body = {"voice_id": voice_id, "tokens": TOKENS, "seed": 1, "idempotency_key": "k-409"}
    first = client.post("/v1/jobs", json=body)
    assert first.status_code == 202, first.text
    again = client.post("/v1/jobs", json={**body, **change})
    assert again.status_code == 409, again.text
    assert again.json()["error"] == "Conflict" and differs in again.json()["reason"]
    assert client.post("/v1/jobs", json=body).json()["id"] == first.json()["id"]  # the same request: 202


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


def test_list_jobs_and_books_page_with_a_cursor(client: TestClient, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    submitted = [submit(client, voice_id).json()["id"] for _ in range(5)]
    pages, after = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"after": after} if after else {})})
        assert page.status_code == 200 and len(page.json()) <= 2
        pages.append([j["id"] for j in page.json()])
        after = page.headers.get("x-next-cursor")
        if after is None:
            break
        submitted.append(submit(client, voice_id).json()["id"])  # inserted between pages: not in this walk
    seen = [i for p in pages for i in p]
    assert sorted(seen) == sorted(submitted[:5]) and len(pages) == 3
    assert seen == [j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()][-5:]
    for path in ("/v1/jobs", "/v1/books"):
        bad = client.get(path, params={"after": "bm90IGEgY3Vyc29y"})
        assert bad.status_code == 422 and "after: not a cursor" in bad.json()["reason"], bad.text
    assert "x-next-cursor" not in client.get("/v1/books").headers


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


def test_a_text_jobs_status_shows_where_it_is_before_its_tokens_and_how_long_each_half_took(
        client: TestClient, reference: bytes) -> None:
    import tasks.text as text_task
    from app.s3 import StandInTokenizer
    from gpu_worker.worker.guide import TokenizeLane, tokenize_text_job

    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    voice_id = upload_voice(client, reference).json()["id"]
    job_id = client.post("/v1/jobs", json={"voice_id": voice_id, "text": "Hello there."}).json()["id"]
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert (view["phase"], view["timings"]["speak_ms"], view["timings"]["tokenize_ms"]) == (
        "speaking", None, None)
    assert text_task.tokenize_job(job_id, ctx) == "sent"  # the CPU worker's half
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["phase"] == "tokenizing" and view["timings"]["speak_ms"] > 0 and view["n_tokens"] == 0
    lane = TokenizeLane(StandInTokenizer())
    try:
        assert tokenize_text_job(ctx, lane, job_id) == "ready"  # the GPU worker's half
    finally:
        lane.close()
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["phase"] is None and view["n_tokens"] > 0 and view["timings"]["tokenize_ms"] > 0
    assert client.get("/v1/jobs").json()[0]["phase"] is None  # lists read no phase
