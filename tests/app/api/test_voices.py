"""/v1/voices: upload (deduplicated, prepared once), refusals, the size limit at the door."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import soundfile as sf
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


def _encoded(fmt: str, subtype: str) -> bytes:
    t = np.arange(24000 * 3) / 24000
    out = io.BytesIO()
    sf.write(out, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, format=fmt, subtype=subtype)
    return out.getvalue()


@pytest.mark.parametrize(("fmt", "subtype"), [("WAVEX", "PCM_16"), ("WAVEX", "FLOAT"), ("RF64", "PCM_24")])
def test_a_wav_in_an_extensible_or_rf64_wrapper_is_accepted_as_a_wav(client: TestClient, fmt: str,
                                                                    subtype: str) -> None:
    """Editors write WAVE_FORMAT_EXTENSIBLE: PCM or float in a wrapper, not another format."""
    response = upload_voice(client, _encoded(fmt, subtype))
    assert response.status_code == 201, response.text
    assert response.json()["id"] == upload_voice(client, _encoded("WAV", subtype)).json()["id"]


def test_a_readable_format_that_is_not_accepted_is_refused_with_what_is(client: TestClient) -> None:
    response = upload_voice(client, _encoded("AIFF", "PCM_16"))
    assert response.status_code == 422 and response.json()["error"] == "BadAudio"
    assert "AIFF" in response.json()["reason"] and "WAV" in response.json()["reason"]


def test_the_upload_field_is_reference_as_for_jobs_and_file_is_still_read(client: TestClient) -> None:
    reference = wav_bytes(2.0, freq=200.0)
    assert upload_voice(client, reference, field="reference").status_code == 201
    assert upload_voice(client, reference, field="file").status_code == 200  # the same voice
    refused = upload_voice(client, reference, field="audio")
    assert refused.status_code == 422 and "'reference'" in refused.json()["reason"]
    schema = client.get("/openapi.json").json()["paths"]["/v1/voices"]["post"]["requestBody"]
    assert schema["content"]["multipart/form-data"]["schema"]["required"] == ["reference"]


@pytest.mark.parametrize(("seconds", "note"), [(6.78, "6.78 s long; its first 6 s are the voice"),
                                               (2.5, "2.50 s long; it is padded with silence to 6 s"),
                                               (6.0, None)])
def test_the_voice_record_says_what_normalising_its_reference_changed(client: TestClient, seconds: float,
                                                                       note: str | None) -> None:
    voice = upload_voice(client, wav_bytes(seconds, freq=190.0, sr=24000)).json()
    assert voice["notes"] == ([] if note is None else [f"the reference is {note}"])
    assert client.get(f"/v1/voices/{voice['id']}").json()["notes"] == voice["notes"]


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
