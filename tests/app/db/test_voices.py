"""Voice queries: creation, the preparation lifecycle, abandoned voices, the artifact paths rows point at."""

import logging
from datetime import UTC

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from app import lifecycle
from app.db import queries as q
from app.db.models import Job, JobStatus, VoiceStatus
from app.errors import NotFound
from tests.app.db.helpers import new_job, vid


def test_voice_is_created_once_and_starts_pending(session: Session):
    a, created_a = q.get_or_create_voice(session=session, voice_id=vid(), reference_path="references/x.wav")
    b, created_b = q.get_or_create_voice(session=session, voice_id=vid(), reference_path="references/y.wav")
    session.commit()
    assert (created_a, created_b) == (True, False)
    assert b.reference_path == "references/x.wav" and b.status == VoiceStatus.PENDING
    assert b.created_at.tzinfo is UTC


def test_voice_lifecycle_records_timings_size_and_errors(session: Session, voice: str):
    assert q.mark_voice_preparing(session=session, voice_id=voice) == 1
    q.mark_voice_failed(session=session, voice_id=voice, error="x" * 10_000)
    v = q.require_voice(session=session, voice_id=voice)
    assert v.status == VoiceStatus.FAILED and len(v.error or "") == q.ERROR_MAX_CHARS
    assert q.mark_voice_preparing(session=session, voice_id=voice) == 2
    q.mark_voice_ready(session=session, voice_id=voice, prepare_ms=12.5, feature_nbytes=4096)
    session.commit()
    v = q.require_voice(session=session, voice_id=voice)
    assert (v.status, v.prepare_ms, v.feature_nbytes, v.error, v.prepare_attempts) == (
        "ready",
        12.5,
        4096,
        None,
        0,
    )
    assert v.prepared_at is not None and v.prepare_started_at is not None
    assert v.prepared_at >= v.prepare_started_at
    with pytest.raises(NotFound):
        q.mark_voice_ready(session=session, voice_id=vid(5), prepare_ms=1, feature_nbytes=1)


def test_referenced_paths_lists_every_artifact_the_rows_point_at(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    lifecycle.finish(
        session=session, job_id=job_id, status=JobStatus.SUCCEEDED, output_path=f"outputs/{job_id}.wav"
    )
    session.execute(update(Job).where(Job.id == job_id).values(tokens_path=f"tokens/{job_id}.json"))
    assert q.referenced_paths(session=session) == {
        f"references/{vid(99)}.wav",
        f"outputs/{job_id}.wav",
        f"tokens/{job_id}.json",
    }


def test_a_voice_is_abandoned_only_when_all_its_jobs_were_cancelled(session: Session, voice: str):
    assert not q.is_voice_abandoned(session=session, voice_id=voice)  # no jobs: uploaded on its own
    a, b = new_job(session, voice)[0].id, new_job(session, voice)[0].id
    lifecycle.cancel(session=session, job_id=a)
    assert not q.is_voice_abandoned(session=session, voice_id=voice)
    lifecycle.cancel(session=session, job_id=b)
    assert q.is_voice_abandoned(session=session, voice_id=voice)


def test_using_a_voice_counts_it_and_answers_its_id_and_status_from_one_cached_statement(
        session: Session, voice: str, caplog: pytest.LogCaptureFixture):
    """One UPDATE both counts the use and reads what a submission needs (no Voice entity), compiled once
    (SQLAlchemy's log: "cached since", never "no key"); an unknown voice is NotFound and changes nothing."""
    before = q.require_voice(session=session, voice_id=voice).updated_at
    assert q.use_voice(session=session, voice_id=voice) == (voice, VoiceStatus.PENDING)  # compiled here
    q.mark_voice_ready(session=session, voice_id=voice, prepare_ms=1.0, feature_nbytes=1)
    session.commit()  # a connection reads the log level as it is taken: take the next one in at_level
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine.Engine"):
        used = q.use_voice(session=session, voice_id=voice)
    logged = [r.getMessage().lstrip() for r in caplog.records]
    stats = [logged[i + 1] for i, line in enumerate(logged) if line.startswith("UPDATE voices SET uses")]
    assert len(stats) == 1 and "cached since" in stats[0] and "no key" not in stats[0], stats
    assert used == (voice, VoiceStatus.READY) and used.id == voice and used.status == "ready"
    with pytest.raises(NotFound):
        q.use_voice(session=session, voice_id=vid(7))
    session.commit()
    session.expire_all()
    got = q.require_voice(session=session, voice_id=voice)
    assert got.uses == 2 and got.updated_at >= before and got.updated_at.tzinfo is UTC
