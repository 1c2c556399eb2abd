"""`voice.prepare` through the session's real CPU worker: a submitted voice is prepared, and a pickled
message is refused."""

import time

from sqlalchemy.orm import Session, sessionmaker

from app.db import queries as q
from app.db.models import VoiceStatus
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.storage.keys import COUNTER_PREPARE
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.features import PromptHostFeatures
from tasks.celery_app import make_celery
from tests.support.audio import wav_bytes
from tests.support.context import context_for


def wait_for(predicate, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not true within {timeout} s")


def test_a_real_cpu_worker_prepares_a_submitted_voice(
    cpu_worker: str, worker_settings: Settings, worker_sessions: sessionmaker[Session], feature_redis
):
    store = FeatureStore(feature_redis, ttl_s=worker_settings.feature_ttl_s)
    artifacts = ArtifactStore(worker_settings.artifact_root)
    celery = make_celery(worker_settings, include=())
    try:
        with worker_sessions() as session:
            job_id = submit_job(
                ctx=context_for(worker_settings, celery, sessions=worker_sessions, store=store,
                                artifacts=artifacts),
                session=session,
                request=JobRequest(tokens=[1, 2, 3], reference_bytes=wav_bytes(freq=440.0)),
            )
            voice_id = q.require_job(session=session, job_id=job_id).voice_id

        def ready() -> bool:
            with worker_sessions() as session:
                return q.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.READY

        wait_for(ready)
        blob = store.get(voice_id)
        assert blob is not None and PromptHostFeatures.from_bytes(blob).voice_id == voice_id
        # Sent again by name (as a redelivery would be): a counted no-op, same id back.
        result = celery.send_task("voice.prepare", args=[voice_id], queue=worker_settings.queue_cpu)
        assert result.get(timeout=60) == voice_id
        assert store.counters(COUNTER_PREPARE) == {"prepared": 1, "noop": 1}
    finally:
        celery.close()


def test_the_real_worker_refuses_pickled_messages(
    cpu_worker: str, worker_settings: Settings, worker_sessions: sessionmaker[Session], feature_redis
):
    store = FeatureStore(feature_redis, ttl_s=worker_settings.feature_ttl_s)
    celery = make_celery(worker_settings, include=())
    try:
        with worker_sessions() as session:
            q.get_or_create_voice(session=session, voice_id="ab" * 32, reference_path="references/none.wav")
            session.commit()
        celery.send_task(
            "voice.prepare", args=["ab" * 32], queue=worker_settings.queue_cpu, serializer="pickle"
        )
        # A JSON message sent after it is handled, so the pickled one has been seen (and refused) by then.
        ok = celery.send_task("voice.prepare", args=["cd" * 32], queue=worker_settings.queue_cpu)
        assert ok.get(timeout=60) == "cd" * 32
        with worker_sessions() as session:
            assert q.require_voice(session=session, voice_id="ab" * 32).status == VoiceStatus.PENDING
        assert store.counters(COUNTER_PREPARE) == {"failed": 1}  # only the JSON one ran (no such voice)
        assert celery.control.ping(destination=[cpu_worker], timeout=5)
    finally:
        celery.close()
