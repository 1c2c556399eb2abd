"""`app.voices.service`: a voice is stored once and prepared once (with jobs or alone), re-armed when its
features
are gone, and reclaimed when every job that wanted it was cancelled."""

import dataclasses

import pytest
import redis
from celery import Celery
from sqlalchemy.orm import Session

from app import lifecycle
from app.db import queries as q
from app.db.models import Voice, VoiceStatus
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.service import StoredFeatures, reclaim_abandoned_voice, register_voice
from tests.app.helpers import count, queued
from tests.support.audio import wav_bytes
from tests.support.store import blob


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


def test_a_ready_voice_found_stored_is_trusted_for_a_second_and_checked_again_after_it(
    ctx, submit, session: Session, settings: Settings, broker_redis: redis.Redis, store: FeatureStore,
    monkeypatch: pytest.MonkeyPatch
):
    """With the API's `StoredFeatures`, a ready voice whose features were found less than `TRUST_S` ago
    skips the store's EXISTS; one evicted in that second is not re-armed until the find runs out (its jobs
    are prepared inline on the GPU worker meanwhile), then is. A voice reclaimed meanwhile is pending, so
    its next job queues its preparation at once."""
    now = [100.0]
    api = dataclasses.replace(ctx, stored_features=StoredFeatures(clock=lambda: now[0]))
    voice_id = q.require_job(session=session, job_id=submit()).voice_id
    store.release_prepare(voice_id)
    broker_redis.delete(*broker_redis.keys(f"{settings.queue_cpu}*"))
    q.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=10)
    session.commit()
    store.put(voice_id, blob())
    asked: list[str] = []
    exists = store.exists
    monkeypatch.setattr(store, "exists", lambda v: asked.append(v) or exists(v))

    def submit_via_api() -> str:
        return submit_job(ctx=api, session=session, request=JobRequest(voice_id=voice_id, tokens=[1, 2]))

    submit_via_api()
    submit_via_api()
    assert asked == [voice_id] and queued(broker_redis, settings.queue_cpu) == []
    store.delete(voice_id)  # evicted within the second
    now[0] += 0.5
    submit_via_api()
    assert asked == [voice_id] and queued(broker_redis, settings.queue_cpu) == []
    now[0] += StoredFeatures.TRUST_S
    submit_via_api()
    assert asked == [voice_id, voice_id]
    assert [m["args"] for m in queued(broker_redis, settings.queue_cpu)] == [[voice_id]]
    assert q.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING

    broker_redis.delete(*broker_redis.keys(f"{settings.queue_cpu}*"))  # ready again, found, then reclaimed
    q.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=10)
    session.commit()
    store.put(voice_id, blob())
    store.release_prepare(voice_id)
    job_id = submit_via_api()
    for job in q.list_jobs(session=session, voice_id=voice_id):
        lifecycle.cancel(session=session, job_id=job.id)
    assert reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id)
    session.commit()
    assert q.require_job(session=session, job_id=job_id).status == "cancelled"
    submit_via_api()
    assert [m["args"] for m in queued(broker_redis, settings.queue_cpu)] == [[voice_id]]


def test_a_voice_registered_alone_is_stored_once_and_prepared_once(
    ctx, settings: Settings,
    session: Session,
    celery: Celery,
    store: FeatureStore,
    artifacts: ArtifactStore,
    broker_redis: redis.Redis,
):
    def register() -> tuple[str, bool]:
        return register_voice(
            ctx=ctx, session=session,
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

    a, b = submit(), submit()
    voice_id = q.require_job(session=session, job_id=a).voice_id
    q.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=10)
    store.put(voice_id, blob())
    lifecycle.cancel(session=session, job_id=a)
    assert not reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id)  # b still wants it
    lifecycle.cancel(session=session, job_id=b)
    assert reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id)
    session.commit()
    assert not store.exists(voice_id)
    assert q.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING
