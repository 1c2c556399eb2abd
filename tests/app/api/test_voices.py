"""/v1/voices: upload (deduplicated, prepared once), refusals, the size limit at the door."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.app.api.helpers import make_client, queued, upload_voice
from tests.support.audio import wav_bytes


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


def test_a_chunked_upload_over_the_limit_is_413_even_where_fastapi_reads_the_form(settings: Settings) -> None:
    """FastAPI turned the limit's error inside its form parsing into a 400 'error parsing the body'."""
    small = settings.model_copy(update={"max_reference_bytes": 100_000, "max_tokens": 10})
    boundary = "wf-boundary"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is met as the bytes arrive
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
               "Content-Type: audio/wav\r\n\r\n").encode()
        yield from (b"x" * 65536 for _ in range(40))
        yield f"\r\n--{boundary}--\r\n".encode()

    for client in make_client(small):
        for path in ("/v1/voices", "/v1/jobs"):
            response = client.post(path, content=chunked(),
                                   headers={"content-type": f"multipart/form-data; boundary={boundary}"})
            assert response.status_code == 413, (path, response.text)
            assert response.json()["error"] == "TooLarge" and "larger than" in response.json()["reason"]
