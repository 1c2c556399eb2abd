"""Submission: validation, rows, the reference on disk, and the tasks it puts on the real broker."""

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
import soundfile as sf
from celery import Celery
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.artifacts import ArtifactStore
from app.db import queries as q
from app.db.models import Job, Voice, VoiceStatus
from app.errors import BadAudio, BadInput, BadTokens, NotFound
from app.jobs import INLINE_TOKENS_MAX, job_tokens, submit_job
from app.settings import Settings
from app.store import FeatureStore
from app.voices import reclaim_abandoned_voice, register_voice
from tasks.celery_app import make_celery


def wav_bytes(seconds: float = 2.0, sr: int = 16000, freq: float = 220.0) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def queued(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """Messages waiting in a queue (any priority level), oldest first, as {task, id, args, priority}."""
    out = []
    for key in sorted(client.keys(f"{queue}*")):
        if key.decode() != queue and not key.decode().startswith(f"{queue}\x06\x16"):
            continue
        for raw in reversed(client.lrange(key, 0, -1)):  # kombu LPUSHes, consumers BRPOP
            msg = json.loads(raw)
            args = json.loads(base64.b64decode(msg["body"]))[0]
            out.append(
                {
                    "task": msg["headers"]["task"],
                    "id": msg["headers"]["id"],
                    "args": args,
                    "priority": msg["properties"].get("priority"),
                }
            )
    return out


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, include=())
    yield app
    app.close()


@pytest.fixture
def submit(
    settings: Settings, session: Session, celery: Celery, store: FeatureStore, artifacts: ArtifactStore
):
    def _submit(**kwargs: Any) -> str:
        kwargs.setdefault("tokens", [1, 2, 3])
        if "voice_id" not in kwargs:
            kwargs.setdefault("reference_bytes", wav_bytes())
        return submit_job(
            settings=settings, session=session, sender=celery, store=store, artifacts=artifacts, **kwargs
        )

    return _submit


def count(session: Session, model: type) -> int:
    return session.scalar(select(func.count()).select_from(model)) or 0


def test_submission_creates_rows_stores_the_reference_and_enqueues_both_tasks(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis, artifacts: ArtifactStore
):
    job_id = submit(tokens=[0, 4218, 6560], seed=5, output_format="flac", priority=7)
    job = q.require_job(session=session, job_id=job_id)
    voice = q.require_voice(session=session, voice_id=job.voice_id)
    assert (job.status, job.tokens, job.seed, job.output_format, job.priority) == (
        "queued",
        [0, 4218, 6560],
        5,
        "flac",
        7,
    )
    assert voice.status == VoiceStatus.PENDING and voice.uses == 1
    assert voice.reference_path and artifacts.read_bytes(voice.reference_path) == wav_bytes()
    prepare, synth = queued(broker_redis, settings.queue_cpu), queued(broker_redis, settings.queue_gpu)
    assert [(m["task"], m["args"]) for m in prepare] == [("voice.prepare", [voice.id])]
    assert [(m["task"], m["args"], m["id"]) for m in synth] == [("synth", [job_id], job_id)]
    assert synth[0]["priority"] == 2  # job priority 7 of 9 -> broker priority 2 (0 is served first)


def test_the_same_idempotency_key_returns_the_same_job_and_enqueues_once(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis
):
    first = submit(idempotency_key="client-42")
    second = submit(idempotency_key="client-42", tokens=[9, 9])
    assert first == second and count(session, Job) == 1
    assert len(queued(broker_redis, settings.queue_gpu)) == 1


def test_jobs_sharing_a_voice_prepare_it_once(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis
):
    a = submit()
    b = submit()
    voice_id = q.require_job(session=session, job_id=a).voice_id
    assert q.require_job(session=session, job_id=b).voice_id == voice_id
    c = submit(voice_id=voice_id)
    assert count(session, Voice) == 1 and q.require_voice(session=session, voice_id=voice_id).uses == 3
    assert [m["task"] for m in queued(broker_redis, settings.queue_cpu)] == ["voice.prepare"]
    assert [m["args"] for m in queued(broker_redis, settings.queue_gpu)] == [[a], [b], [c]]


def test_a_ready_voice_with_stored_features_skips_preparation_and_an_evicted_one_does_not(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis, store: FeatureStore
):
    from tests.app.test_store import blob

    voice_id = q.require_job(session=session, job_id=submit()).voice_id
    store.release_prepare(voice_id)
    broker_redis.delete(*broker_redis.keys(f"{settings.queue_cpu}*"))
    q.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=10)
    session.commit()
    store.put(voice_id, blob())
    submit(voice_id=voice_id)
    assert queued(broker_redis, settings.queue_cpu) == []
    store.delete(voice_id)  # evicted
    submit(voice_id=voice_id)
    assert [m["args"] for m in queued(broker_redis, settings.queue_cpu)] == [[voice_id]]
    assert q.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING


@pytest.mark.parametrize(
    "tokens",
    [[], [-1], [6561], [1, 2, 99999], ["1"], [1.0], [True], [None], "123", b"\x01", 5, None],
)
def test_bad_tokens_are_refused_before_anything_is_stored(
    submit, session: Session, tokens, artifacts: ArtifactStore
):
    with pytest.raises(BadTokens):
        submit(tokens=tokens)
    assert count(session, Job) == 0 and count(session, Voice) == 0
    assert list((artifacts.root / "references").iterdir()) == []


def test_more_tokens_than_the_limit_are_refused(submit, settings: Settings):
    with pytest.raises(BadTokens, match="at most"):
        submit(tokens=[1] * (settings.max_tokens + 1))


def test_long_token_lists_live_in_the_artifact_store(submit, session: Session, artifacts: ArtifactStore):
    tokens = list(range(INLINE_TOKENS_MAX + 1))
    job = q.require_job(session=session, job_id=submit(tokens=tokens))
    assert job.tokens is None and job.tokens_path == f"tokens/{job.id}.json" and job.n_tokens == len(tokens)
    assert job_tokens(job=job, artifacts=artifacts) == tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"output_format": "mp3"},
        {"priority": 10},
        {"priority": -1},
        {"seed": -1},
        {"idempotency_key": ""},
        {"idempotency_key": "k" * 129},
        {"voice_id": "0" * 64, "reference_bytes": b"x"},
        {"voice_id": "../x"},
    ],
)
def test_bad_options_are_refused(submit, kwargs):
    with pytest.raises(BadInput):
        submit(**kwargs)


def test_an_unknown_voice_id_is_not_found(submit):
    with pytest.raises(NotFound):
        submit(voice_id="0" * 64)


def test_unusable_audio_is_refused_and_nothing_is_stored(
    submit, session: Session, artifacts: ArtifactStore, settings: Settings
):
    for data in (b"not audio", wav_bytes(seconds=0.1), b"\0" * (settings.max_reference_bytes + 1)):
        with pytest.raises(BadAudio):
            submit(reference_bytes=data)
    assert count(session, Voice) == 0 and list((artifacts.root / "references").iterdir()) == []


class BrokenBroker:
    def send_task(self, name: str, args: Any = None, **options: Any) -> Any:
        raise ConnectionError("broker down")


def test_a_job_the_broker_refused_is_withdrawn(
    settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore
):
    with pytest.raises(ConnectionError):
        submit_job(
            settings=settings,
            session=session,
            sender=BrokenBroker(),
            store=store,
            artifacts=artifacts,
            tokens=[1],
            reference_bytes=wav_bytes(),
            idempotency_key="retry-me",
        )
    assert count(session, Job) == 0
    voice = session.scalars(select(Voice)).one()
    assert voice.uses == 0 and store.claim_prepare(voice.id, 10)  # the claim was released


def test_a_voice_registered_alone_is_stored_once_and_prepared_once(
    settings: Settings,
    session: Session,
    celery: Celery,
    store: FeatureStore,
    artifacts: ArtifactStore,
    broker_redis: redis.Redis,
):
    def register() -> tuple[str, bool]:
        return register_voice(
            settings=settings,
            session=session,
            sender=celery,
            store=store,
            artifacts=artifacts,
            reference_bytes=wav_bytes(),
        )

    voice_id, created = register()
    again, created_again = register()
    assert (voice_id, created, created_again) == (again, True, False)
    assert [m["args"] for m in queued(broker_redis, settings.queue_cpu)] == [[voice_id]]
    assert not q.is_voice_abandoned(session=session, voice_id=voice_id)  # no jobs: kept


def test_cancelling_the_last_job_of_a_prepared_voice_reclaims_its_features(
    submit, session: Session, store: FeatureStore
):
    from tests.app.test_store import blob

    a, b = submit(), submit()
    voice_id = q.require_job(session=session, job_id=a).voice_id
    q.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=10)
    store.put(voice_id, blob())
    q.cancel_job(session=session, job_id=a)
    assert not reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id)  # b still wants it
    q.cancel_job(session=session, job_id=b)
    assert reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id)
    session.commit()
    assert not store.exists(voice_id)
    assert q.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING
