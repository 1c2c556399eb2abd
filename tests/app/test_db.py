"""Models, queries and migrations on SQLite and PostgreSQL (every test runs on both)."""

import hashlib
import os
import subprocess
import sys
import uuid
from datetime import UTC

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.db import downgrade, upgrade
from app.db import queries as q
from app.db.models import Base, Job, JobStatus, PrepPath, Voice, VoiceStatus, utcnow
from app.db.session import make_engine, session_scope
from app.errors import NotFound
from tests.conftest import REPO, pg_database


def vid(n: int = 0) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def new_job(session: Session, voice_id: str, key: str | None = None, tokens=(1, 2, 3)):
    return q.create_job(
        session=session,
        job_id=str(uuid.uuid4()),
        voice_id=voice_id,
        tokens=list(tokens),
        n_tokens=len(tokens),
        seed=7,
        output_format="wav",
        idempotency_key=key,
    )


@pytest.fixture
def voice(session: Session) -> str:
    q.get_or_create_voice(session=session, voice_id=vid(), reference_path=f"references/{vid(99)}.wav")
    session.commit()
    return vid()


# Migrations --------------------------------------------------------------------------------


def _schema(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mig.sqlite'}"
        return
    with pg_database(f"wavefarm_test_{os.getpid()}_mig") as url:
        yield url


def test_migrations_upgrade_downgrade_and_upgrade_again(empty_db: str):
    upgrade(empty_db)
    assert {"voices", "jobs", "worker_voices"} <= _schema(empty_db)
    upgrade(empty_db)  # idempotent on every service start
    downgrade(empty_db, "base")
    assert _schema(empty_db) <= {"alembic_version"}
    upgrade(empty_db)
    assert {"voices", "jobs", "worker_voices"} <= _schema(empty_db)


def test_migrated_schema_matches_the_models(db_url: str):
    engine = make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


# Voices ----------------------------------------------------------------------------------


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


# Jobs --------------------------------------------------------------------------------------


def test_job_round_trips_tokens_and_defaults(session: Session, voice: str):
    job, created = new_job(session, voice, tokens=[0, 4218, 6560])
    session.commit()
    got = q.require_job(session=session, job_id=job.id)
    assert created and got.tokens == [0, 4218, 6560] and got.n_tokens == 3 and got.frames_total == 6
    assert (got.status, got.attempts, got.priority, got.kind) == (JobStatus.QUEUED, 0, 0, "tokens")
    assert got.submitted_at.tzinfo is UTC
    with pytest.raises(NotFound):
        q.require_job(session=session, job_id=str(uuid.uuid4()))


def test_same_idempotency_key_gives_the_same_job(session: Session, voice: str):
    first, created = new_job(session, voice, key="k-1")
    second, created_again = new_job(session, voice, key="k-1")
    other, _ = new_job(session, voice, key="k-2")
    session.commit()
    assert created and not created_again and second.id == first.id and other.id != first.id


def test_claims_are_exclusive_and_bounded_by_max_attempts(sessions: sessionmaker[Session], voice: str):
    with session_scope(sessions) as s:
        job_id = new_job(s, voice)[0].id
    with session_scope(sessions) as s:
        claimed = q.claim_job_attempt(session=s, job_id=job_id, worker="w1", max_attempts=2)
        assert claimed is not None and claimed.attempts == 1 and claimed.status == JobStatus.PREPARING
    with session_scope(sessions) as s:  # redelivered after w1 died
        again = q.claim_job_attempt(session=s, job_id=job_id, worker="w2", max_attempts=2)
        assert again is not None and (again.attempts, again.worker) == (2, "w2")
    with session_scope(sessions) as s:
        assert q.claim_job_attempt(session=s, job_id=job_id, worker="w3", max_attempts=2) is None
    with session_scope(sessions) as s:
        job = q.require_job(session=s, job_id=job_id)
        assert job.status == JobStatus.FAILED and "gave up after 2 attempts" in (job.error or "")


def test_progress_stamps_first_audio_once_and_stops_after_cancel(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    q.claim_job_attempt(session=session, job_id=job_id, worker="w", max_attempts=3)
    assert q.mark_job_running(session=session, job_id=job_id, prep_path=PrepPath.PREPARED_AHEAD)
    assert q.update_progress(session=session, job_id=job_id, frames_done=0)
    assert q.require_job(session=session, job_id=job_id).first_audio_at is None
    assert q.update_progress(session=session, job_id=job_id, frames_done=2)
    first = q.require_job(session=session, job_id=job_id).first_audio_at
    assert q.update_progress(session=session, job_id=job_id, frames_done=4, frames_total=6)
    job = q.require_job(session=session, job_id=job_id)
    assert first is not None and job.first_audio_at == first and (job.frames_done, job.frames_total) == (4, 6)
    assert job.prep_path == "prepared_ahead" and job.status == JobStatus.RUNNING
    assert q.cancel_job(session=session, job_id=job_id)
    assert not q.update_progress(session=session, job_id=job_id, frames_done=6)
    assert not q.cancel_job(session=session, job_id=job_id)
    assert q.require_job(session=session, job_id=job_id).status == JobStatus.CANCELLED


def test_first_finisher_wins(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    done = q.finish_job(
        session=session, job_id=job_id, status=JobStatus.SUCCEEDED, output_path="outputs/a.wav"
    )
    late = q.finish_job(session=session, job_id=job_id, status=JobStatus.FAILED, error="late")
    session.commit()
    job = q.require_job(session=session, job_id=job_id)
    assert done and not late and job.status == JobStatus.SUCCEEDED and job.error is None
    assert job.finished_at is not None and job.frames_done == job.frames_total
    assert q.claim_job_attempt(session=session, job_id=job_id, worker="w", max_attempts=3) is None


def test_live_jobs_of_a_voice_are_counted(session: Session, voice: str):
    a = new_job(session, voice)[0].id
    b = new_job(session, voice)[0].id
    q.cancel_job(session=session, job_id=b)
    assert q.count_live_jobs(session=session, voice_id=voice) == 1
    assert q.count_live_jobs(session=session, voice_id=voice, exclude_job_id=a) == 0


# Worker installs ----------------------------------------------------------------------------


def test_worker_installs_pin_unpin_and_order_by_last_use(session: Session, voice: str):
    q.get_or_create_voice(session=session, voice_id=vid(1), reference_path="references/z.wav")
    q.record_install(session=session, worker_id="gpu0", voice_id=voice, nbytes=100)
    q.record_install(session=session, worker_id="gpu0", voice_id=vid(1), nbytes=200)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1), delta=-1)  # never below 0
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice, delta=-1)
    session.commit()
    rows = q.list_worker_voices(session=session, worker_id="gpu0")
    assert [r.voice_id for r in rows] == [vid(1), voice]  # least recently used first
    assert {r.voice_id: r.pinned for r in rows} == {voice: 1, vid(1): 0}
    assert q.remove_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1))
    assert not q.remove_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1))
    assert q.clear_worker_voices(session=session, worker_id="gpu0") == 1
    session.commit()
    assert q.list_worker_voices(session=session, worker_id="gpu0") == []


def test_services_starting_together_upgrade_the_schema_once(empty_db: str):
    # Separate processes, as services are (Alembic's context is process-global: not for threads).
    code = "import sys; from app.db import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, empty_db], cwd=REPO, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert {"voices", "jobs", "worker_voices"} <= _schema(empty_db)


def test_migrations_keep_the_rows_they_rebuild_tables_around(empty_db: str):
    upgrade(empty_db, "0001")
    engine = make_engine(empty_db)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO voices (id, status, prepare_attempts, uses, created_at, updated_at) "
                "VALUES (:v, 'ready', 0, 1, :t, :t)"
            ),
            {"v": vid(), "t": utcnow()},
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, voice_id, status, kind, n_tokens, seed, output_format, priority, "
                "frames_done, frames_total, submitted_at, attempts, updated_at) VALUES "
                "(:j, :v, 'queued', 'tokens', 1, 0, 'wav', 0, 0, 2, :t, 0, :t)"
            ),
            {"j": str(uuid.uuid4()), "v": vid(), "t": utcnow()},
        )
    upgrade(empty_db)
    downgrade(empty_db, "0001")
    upgrade(empty_db)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM voices")).scalar_one() == 1
    engine.dispose()


def test_the_database_refuses_values_outside_the_enums(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    session.commit()
    with pytest.raises(IntegrityError):
        session.execute(update(Job).where(Job.id == job_id).values(status="exploded"))
        session.flush()
    session.rollback()
    with pytest.raises(IntegrityError):
        session.execute(update(Job).where(Job.id == job_id).values(priority=10))
        session.flush()


def test_every_enum_value_the_code_knows_is_allowed_by_the_migrated_schema(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    for path in PrepPath:
        assert q.mark_job_running(session=session, job_id=job_id, prep_path=path)
        session.flush()
    for status in VoiceStatus:
        session.execute(update(Voice).where(Voice.id == voice).values(status=status))
        session.flush()
    for status in JobStatus:
        session.execute(update(Job).where(Job.id == job_id).values(status=status))
        session.flush()
    session.commit()


def test_referenced_paths_lists_every_artifact_the_rows_point_at(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    q.finish_job(
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
    q.cancel_job(session=session, job_id=a)
    assert not q.is_voice_abandoned(session=session, voice_id=voice)
    q.cancel_job(session=session, job_id=b)
    assert q.is_voice_abandoned(session=session, voice_id=voice)


def test_two_workers_claiming_the_same_attempt_never_both_win(sessions: sessionmaker[Session], voice: str):
    import threading
    import time

    with session_scope(sessions) as s:
        job_id = new_job(s, voice)[0].id
    first = sessions()
    assert q.claim_job_attempt(session=first, job_id=job_id, worker="w1", max_attempts=3) is not None
    second: list[object] = []

    def claim() -> None:  # reads attempts=0, then its UPDATE waits for the first claim's lock
        with session_scope(sessions) as s:
            second.append(q.claim_job_attempt(session=s, job_id=job_id, worker="w2", max_attempts=3))

    thread = threading.Thread(target=claim)
    thread.start()
    time.sleep(0.5)
    first.commit()
    first.close()
    thread.join(timeout=60)
    assert second == [None]
    with session_scope(sessions) as s:
        job = q.require_job(session=s, job_id=job_id)
        assert (job.attempts, job.worker) == (1, "w1")
