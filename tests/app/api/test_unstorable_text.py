"""Text no database can store (a NUL character, which PostgreSQL's text refuses, or a lone surrogate,
which has no UTF-8 form) is refused where it comes in, with a 422 naming the field, on SQLite and on
PostgreSQL alike (the `client` fixture runs each test on both); never a 500."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.app.api.helpers import upload_voice

BAD = {"NUL": "a\x00b", "surrogate": "a\ud800b"}


def _json(body: object) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \\ud800, as a client's would


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("field", ["text", "idempotency_key", "language", "voice_id"])
def test_a_job_field_that_cannot_be_stored_is_a_422_naming_it(client: TestClient, reference: bytes,
                                                              field: str, bad: str) -> None:
    voice = upload_voice(client, reference).json()["id"]
    body = {"voice_id": voice, "text": "Good morning.", field: BAD[bad]}
    answer = client.post("/v1/jobs", content=_json(body), headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    # pydantic's JSON parser refuses a lone surrogate as invalid JSON, before any field (still a 422)
    assert field in answer.json()["reason"] or (bad == "surrogate" and "JSON" in answer.json()["reason"])
    if bad == "NUL":  # a form is UTF-8 bytes: no client can send a lone surrogate in one
        form = client.post("/v1/jobs", data=body)
        assert form.status_code == 422 and field in form.json()["reason"], form.text


@pytest.mark.parametrize("bad", sorted(BAD))
def test_one_unstorable_batch_item_is_refused_alone(client: TestClient, reference: bytes, bad: str) -> None:
    voice = upload_voice(client, reference).json()["id"]
    items = [{"voice_id": voice, "text": "One."}, {"voice_id": voice, "text": BAD[bad]},
             {"voice_id": voice, "text": "Three.", "idempotency_key": BAD[bad]},
             {"voice_id": voice, "text": "Four."}]
    answer = client.post("/v1/jobs/batch", content=_json(items), headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["accepted"] for r in results] == [True, False, False, True]
    assert results[1]["code"] == 422 and "text" in results[1]["reason"]
    assert results[2]["code"] == 422 and "idempotency_key" in results[2]["reason"]


@pytest.mark.parametrize("bad", sorted(BAD))
def test_unstorable_speech_input_and_voice_are_a_422(client: TestClient, reference: bytes, bad: str) -> None:
    voice = upload_voice(client, reference).json()["id"]
    for field, body in (("input", {"input": BAD[bad], "voice": voice}),
                        ("voice", {"input": "Hello.", "voice": BAD[bad]}),
                        ("voice", {"input": "Hello.", "voice": {"id": BAD[bad]}})):
        answer = client.post("/v1/audio/speech", content=_json({"model": "tts-1", **body}),
                             headers={"content-type": "application/json"})
        assert answer.status_code == 422 and field in answer.json()["reason"], answer.text


def test_unstorable_book_title_and_author_are_a_422(client: TestClient, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    for field in ("title", "author"):
        answer = client.post("/v1/books", data={"voice_id": voice, field: "A\x00Title"},
                             files={"book": ("b.md", b"# One\n\nIt was a night.\n")})
        assert answer.status_code == 422 and field in answer.json()["reason"], answer.text


def test_a_voice_filter_with_a_nul_is_a_422_and_a_voice_path_a_404(client: TestClient) -> None:
    listed = client.get("/v1/jobs", params={"voice_id": "a\x00b"})
    assert listed.status_code == 422 and "voice_id" in listed.json()["reason"], listed.text
    assert client.get("/v1/voices/a%00b").status_code == 404  # names no voice: never a 500
    assert client.patch("/v1/voices/a%00b", json={"name": "Ada"}).status_code == 404


def test_the_jobs_voice_filter_takes_a_name_and_a_prefix(client: TestClient, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    assert client.patch(f"/v1/voices/{voice}", json={"name": "Ada"}).status_code == 200
    job = client.post("/v1/jobs", json={"voice_id": voice, "text": "Hello."}).json()["id"]
    for ref in (voice, "Ada", voice[:8]):
        assert [j["id"] for j in client.get("/v1/jobs", params={"voice_id": ref}).json()] == [job], ref
    assert client.get("/v1/jobs", params={"voice_id": "Nobody"}).status_code == 404
