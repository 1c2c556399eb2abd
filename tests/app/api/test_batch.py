"""POST /v1/jobs/batch against real Redis and both databases: each item's own answer, in order; the rows
and the messages of the accepted jobs; idempotency within and across batches; the bounds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.settings import Settings
from app.submission import routing
from tests.app.api.helpers import TOKENS, make_client, queued, submit, upload_voice
from tests.support.audio import wav_bytes

UNKNOWN_VOICE = "f" * 64


def post_batch(client: TestClient, items: list[Any]) -> Any:
    return client.post("/v1/jobs/batch", json=items)


def post_lines(client: TestClient, lines: list[bytes]) -> Any:
    return client.post("/v1/jobs/batch", content=b"\n".join(lines),
                       headers={"content-type": "application/x-ndjson"})


def test_a_mixed_batch_accepts_the_good_items_and_refuses_each_bad_one_with_its_reason(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    items = [{"voice_id": voice, "tokens": TOKENS, "seed": 1, "priority": 7, "output_format": "flac"},
             {"voice_id": voice, "tokens": [1, 99999]},
             {"voice_id": UNKNOWN_VOICE, "tokens": TOKENS},
             {"voice_id": voice, "text": "Hello there.", "language": "en-GB"},
             {"voice_id": voice, "tokens": TOKENS, "colour": "red"},
             "not an object",
             {"voice_id": voice, "tokens": TOKENS, "seed": 2}]
    response = post_batch(client, items)
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert [r["index"] for r in results] == list(range(len(items)))
    assert [(r["accepted"], r["code"], r["error"]) for r in results] == [
        (True, 202, None), (False, 422, "BadTokens"), (False, 404, "NotFound"), (True, 202, None),
        (False, 422, "BadInput"), (False, 422, "BadInput"), (True, 202, None)]
    assert "token 1 is 99999" in results[1]["reason"] and "colour" in results[4]["reason"]
    assert (body["accepted"], body["refused"]) == (3, 4)
    first = client.get(f"/v1/jobs/{results[0]['job_id']}").json()
    assert (first["status"], first["seed"], first["priority"], first["output_format"], first["n_tokens"]) == (
        "queued", 1, 7, "flac", len(TOKENS))
    text_job = client.get(f"/v1/jobs/{results[3]['job_id']}").json()
    assert (text_job["kind"], text_job["text"], text_job["language"]) == ("text", "Hello there.", "en-GB")
    assert all(r["status"] == "queued" and not r["existed"] for r in results if r["accepted"])
    synth = queued(broker, settings.queue_gpu)
    assert sorted(t["headers"]["id"] for t in synth) == sorted([results[0]["job_id"], results[6]["job_id"]])
    cpu = [(t["headers"]["task"], t["headers"]["id"]) for t in queued(broker, settings.queue_cpu)]
    assert ("job.tokenize", f"tokenize-{results[3]['job_id']}") in cpu
    assert [task for task, _ in cpu].count("voice.prepare") == 1  # the upload queued it; the batch did not
    assert client.get(f"/v1/voices/{voice}").json()["uses"] == 3


def test_idempotency_keys_name_one_job_within_a_batch_and_across_batches(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    single = submit(client, voice, idempotency_key="one-by-one").json()
    items = [{"voice_id": voice, "tokens": TOKENS, "idempotency_key": "k1"},
             {"voice_id": voice, "tokens": TOKENS, "idempotency_key": "k1"},
             {"voice_id": voice, "tokens": [7, 7], "idempotency_key": "k1"},
             {"voice_id": voice, "tokens": TOKENS, "idempotency_key": "one-by-one"},
             {"voice_id": voice, "tokens": TOKENS, "idempotency_key": "one-by-one", "priority": 3}]
    results = post_batch(client, items).json()["results"]
    assert [(r["code"], r["existed"]) for r in results] == [
        (202, False), (202, True), (409, False), (202, True), (409, False)]
    assert results[1]["job_id"] == results[0]["job_id"] and results[3]["job_id"] == single["id"]
    assert "item 0 of this batch" in results[2]["reason"] and "tokens" in results[2]["reason"]
    assert "priority" in results[4]["reason"]
    again = post_batch(client, items[:2]).json()["results"]
    assert [(r["job_id"], r["existed"]) for r in again] == [(results[0]["job_id"], True)] * 2
    synth = [t["headers"]["id"] for t in queued(broker, settings.queue_gpu)]
    assert sorted(synth) == sorted([single["id"], results[0]["job_id"]])  # one message per job


def test_json_lines_with_a_malformed_line_refuse_that_line_only(
        client: TestClient, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    good = json.dumps({"voice_id": voice, "tokens": TOKENS}).encode()
    response = post_lines(client, [good, b"{not json", b"", b"[" * 100_000, good, b"\xff\xfe"])
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [(r["index"], r["code"]) for r in results] == [(0, 202), (1, 422), (2, 422), (3, 202), (4, 422)]
    assert "item 1 is not a JSON line" in results[1]["reason"]


@pytest.mark.parametrize("body, ctype, status, says", [
    (b"{not json", "application/json", 422, "not JSON"),
    (b'{"voice_id": "x"}', "application/json", 422, "JSON array"),
    (b"[]", "application/json", 422, "empty"),
    (b"\n\n", "application/x-ndjson", 422, "empty"),
    (b"[1]", "text/plain", 415, "application/x-ndjson"),
    (json.dumps([{}] * 1001).encode(), "application/json", 413, "at most 1000 jobs"),
    (b"{}\n" * 1001, "application/x-ndjson", 413, "at most 1000 jobs"),
])
def test_bodies_refused_whole_say_why(client: TestClient, body: bytes, ctype: str, status: int,
                                      says: str) -> None:
    response = client.post("/v1/jobs/batch", content=body, headers={"content-type": ctype})
    assert response.status_code == status and says in response.json()["reason"], response.text


def test_a_batch_body_over_its_limit_is_413(settings: Settings, feature_redis: redis.Redis) -> None:
    for client in make_client(settings.model_copy(update={"max_batch_bytes": 2000})):
        body = [{"voice_id": UNKNOWN_VOICE, "tokens": TOKENS}] * 40
        response = post_batch(client, body)
        assert response.status_code == 413 and "2000 bytes" in response.json()["reason"]
        assert post_batch(client, body[:3]).status_code == 200  # under it: answered item by item


def test_a_full_batch_routes_each_voice_once_and_writes_every_job(
        client: TestClient, broker: redis.Redis, settings: Settings, reference: bytes,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a = upload_voice(client, reference).json()["id"]
    b = upload_voice(client, wav_bytes(seconds=2.0, freq=330.0)).json()["id"]
    decided: list[str] = []
    real = routing.route_voice

    def counted(**kwargs: Any) -> routing.Route:
        decided.append(kwargs["voice_id"])
        return real(**kwargs)

    monkeypatch.setattr(routing, "route_voice", counted)
    items = [{"voice_id": a if i % 2 else b, "tokens": TOKENS, "seed": i} for i in range(1000)]
    results = post_batch(client, items).json()["results"]
    assert all(r["code"] == 202 for r in results)
    assert sorted(decided) == sorted([a, b])
    assert len(queued(broker, settings.queue_gpu)) == 1000
    assert client.get(f"/v1/voices/{a}").json()["uses"] == 500
    listed = client.get("/v1/jobs", params={"limit": 1000}).json()
    assert {j["id"] for j in listed} == {r["job_id"] for r in results}
    assert {j["seed"] for j in listed} == set(range(1000))


class FailingAfter:
    """A broker that takes `n` messages, then refuses every one."""

    def __init__(self, n: int) -> None:
        self.n, self.sent = n, []  # type: ignore[var-annotated]

    def send_task(self, name: str, args: Any = None, **options: Any) -> Any:
        if len(self.sent) >= self.n:
            raise redis.ConnectionError("broker gone")
        self.sent.append((name, args))


def test_jobs_whose_messages_the_broker_refused_are_taken_back_and_answered_503(
        settings: Settings, feature_redis: redis.Redis, reference: bytes) -> None:
    sender = FailingAfter(3)
    with TestClient(create_app(settings, sender=sender)) as client:
        voice = upload_voice(client, reference).json()["id"]  # its voice.prepare is message 1
        results = post_batch(client, [{"voice_id": voice, "tokens": TOKENS}] * 4).json()["results"]
        assert [r["code"] for r in results] == [202, 202, 503, 503]
        assert results[2]["error"] == "Unavailable" and "retry" in results[2]["reason"]
        kept = {j["id"] for j in client.get("/v1/jobs").json()}
        assert kept == {results[0]["job_id"], results[1]["job_id"]}
        synth = [args[0] for name, args in sender.sent if name == "synth"]
        assert synth == [r["job_id"] for r in results[:2]]
        assert client.get(f"/v1/voices/{voice}").json()["uses"] == 2


class UnconfirmedRound(FailingAfter):
    """A broker whose round takes every message and then misses a confirm (RabbitMQ's pipelined round:
    `app.broker.publisher.Publisher.round`)."""

    deferred = True

    @contextmanager
    def round(self) -> Iterator[UnconfirmedRound]:
        yield self
        raise TimeoutError("1 of 5 messages not confirmed by the broker")


def test_a_round_whose_confirms_are_missing_takes_every_job_of_the_batch_back(
        settings: Settings, feature_redis: redis.Redis, reference: bytes) -> None:
    sender = UnconfirmedRound(10**6)
    with TestClient(create_app(settings, sender=sender)) as client:
        voice = upload_voice(client, reference).json()["id"]
        results = post_batch(client, [{"voice_id": voice, "tokens": TOKENS}] * 4).json()["results"]
        assert [r["code"] for r in results] == [503] * 4 and len(sender.sent) == 5  # all published
        assert client.get("/v1/jobs").json() == [] and client.get(f"/v1/voices/{voice}").json()["uses"] == 0
