"""Job queries on both databases: idempotent creation, exclusive claims, progress, the first finisher wins."""

import logging
import uuid
from dataclasses import replace
from datetime import UTC

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.db import queries as q
from app.db.models import Job, JobKind, JobStatus, PrepPath
from app.db.session import session_scope
from app.errors import NotFound
from tests.app.db.helpers import new_job, vid


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


def test_a_job_insert_is_compiled_once_and_answers_as_written(session: Session, voice: str,
                                                               caplog: pytest.LogCaptureFixture):
    """The INSERT is a statement SQLAlchemy caches (its log says "cached since", never "no key": an
    uncacheable one was compiled again for every submission), and the job it returns is the row as read
    back."""
    new_job(session, voice)  # compiled here, if no earlier test of this process did it
    session.commit()  # a connection reads the log level as it is taken: take the next one in at_level
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine.Engine"):
        job, created = new_job(session, voice, tokens=[5, 6], key="cached-1")
    logged = [r.getMessage().lstrip() for r in caplog.records]
    inserts = [i for i, line in enumerate(logged) if line.startswith("INSERT INTO jobs")]
    stats = [logged[i + 1] for i in inserts]
    assert created and len(inserts) == 1 and "cached since" in stats[0] and "no key" not in stats[0], stats
    session.commit()
    got = q.require_job(session=session, job_id=job.id)
    for column in Job.__table__.columns:
        assert getattr(job, column.key) == getattr(got, column.key), column.key


def test_a_job_written_with_its_voices_use_is_the_row_create_job_writes_and_counts_one_use(
        session: Session, voice: str, caplog: pytest.LogCaptureFixture):
    """`create_job_using_voice` (one statement on PostgreSQL) writes every column as `create_job` does,
    counts one use of the voice, returns the voice's status, and is a statement SQLAlchemy caches."""
    def fields(key: str) -> q.NewJob:
        return q.NewJob(id=str(uuid.uuid4()), voice_id=voice, tokens=[7, 8, 9], n_tokens=3, seed=2**40,
                        output_format="flac", priority=4, idempotency_key=key, routed_to="gpu-1",
                        route="affinity")

    q.create_job_using_voice(session=session, new=fields("warm-up"))  # compiled here, if not before
    before = q.require_voice(session=session, voice_id=voice).uses
    session.commit()  # a connection reads the log level as it is taken: take the next one in at_level
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine.Engine"):
        used, job, created = q.create_job_using_voice(session=session, new=fields("used-1"))
    logged = [r.getMessage().lstrip() for r in caplog.records]
    writes = [i for i, line in enumerate(logged) if line.startswith(("WITH used", "INSERT", "UPDATE"))]
    assert [logged[i].split(" ")[0] for i in writes] == (
        ["WITH"] if session.get_bind().dialect.name == "postgresql" else ["UPDATE", "INSERT"])
    assert all("cached since" in logged[i + 1] for i in writes), [logged[i + 1] for i in writes]
    single, _ = q.create_job(session=session, new=replace(fields("single-1")))
    session.commit()
    session.expire_all()
    assert created and used == (voice, "pending")
    assert q.require_voice(session=session, voice_id=voice).uses == before + 1
    got, twin = (q.require_job(session=session, job_id=j.id) for j in (job, single))
    for column in Job.__table__.columns:
        assert getattr(job, column.key) == getattr(got, column.key), column.key
        if column.key not in ("id", "idempotency_key", "submitted_at", "updated_at"):
            assert getattr(got, column.key) == getattr(twin, column.key), column.key


def test_a_job_written_with_its_voices_use_finds_a_taken_key_and_writes_nothing_for_no_voice(
        session: Session, voice: str):
    """A taken idempotency key: that job, created False, and the use counted all the same (the caller gives
    it back). No such voice: NotFound, and no job and no use written."""
    first, _ = new_job(session, voice, key="taken-2")
    session.commit()
    before = q.require_voice(session=session, voice_id=voice).uses
    again = q.NewJob(id=str(uuid.uuid4()), voice_id=voice, tokens=[1], n_tokens=1, seed=1,
                     output_format="wav", idempotency_key="taken-2")
    used, job, created = q.create_job_using_voice(session=session, new=again)
    assert (used.id, job.id, created) == (voice, first.id, False)
    session.commit()
    assert q.require_voice(session=session, voice_id=voice).uses == before + 1
    nobody = replace(again, id=str(uuid.uuid4()), voice_id=vid(99), idempotency_key="nobody's")
    with pytest.raises(NotFound, match="no voice"):
        q.create_job_using_voice(session=session, new=nobody)
    session.rollback()
    assert q.get_job(session=session, job_id=nobody.id) is None
    assert q.get_job_by_idempotency_key(session=session, idempotency_key="nobody's") is None


def test_a_batch_insert_writes_each_row_as_a_single_insert_does_and_skips_taken_keys(session: Session,
                                                                                     voice: str):
    """`insert_jobs` (one statement for a batch: an unnest of arrays on PostgreSQL) writes every column as
    `create_job` writes the same job, and leaves out a job whose idempotency key is taken."""
    taken, _ = new_job(session, voice, key="taken")

    def job(**fields) -> q.NewJob:
        fields.setdefault("output_format", "wav")
        return q.NewJob(id=str(uuid.uuid4()), voice_id=voice, **fields)

    batch = [job(tokens=[1, 2, 3], n_tokens=3, seed=2**40, priority=9, idempotency_key="b-1",
                 routed_to="gpu-1", route="warm"),
             job(tokens=None, n_tokens=0, seed=8, output_format="flac", kind=JobKind.TEXT,
                 text="Hello 'quoted'", language="en"),
             job(tokens=None, n_tokens=5000, seed=9, tokens_path="tokens/long.json"),
             job(tokens=[4], n_tokens=1, seed=10, idempotency_key="taken")]
    created = q.insert_jobs(session=session, jobs=batch)
    singles = [q.create_job(session=session, new=replace(new, id=str(uuid.uuid4()), idempotency_key=(
        new.idempotency_key and new.idempotency_key + "-single")))[0] for new in batch[:3]]
    session.commit()
    assert created == {new.id for new in batch[:3]}
    assert q.require_job(session=session, job_id=taken.id).tokens == [1, 2, 3]
    own = {"id", "idempotency_key", "submitted_at", "updated_at"}
    for new, single in zip(batch[:3], singles, strict=True):
        got = q.require_job(session=session, job_id=new.id)
        assert got.idempotency_key == new.idempotency_key and got.submitted_at.tzinfo is UTC
        for column in Job.__table__.columns:
            if column.key not in own:
                assert getattr(got, column.key) == getattr(single, column.key), column.key


def test_claims_are_exclusive_and_bounded_by_max_attempts(sessions: sessionmaker[Session], voice: str):
    with session_scope(sessions) as s:
        job_id = new_job(s, voice)[0].id
    with session_scope(sessions) as s:
        claimed = lifecycle.claim(session=s, job_id=job_id, worker="w1", max_attempts=2, lease_s=0)
        assert claimed is not None and claimed.attempts == 1 and claimed.status == JobStatus.PREPARING
    with session_scope(sessions) as s:  # redelivered after w1 died (its lease passed at once)
        again = lifecycle.claim(session=s, job_id=job_id, worker="w2", max_attempts=2, lease_s=0)
        assert again is not None and (again.attempts, again.worker) == (2, "w2")  # w2 dies at once too
    with session_scope(sessions) as s:
        assert lifecycle.claim(session=s, job_id=job_id, worker="w3", max_attempts=2, lease_s=30) is None
    with session_scope(sessions) as s:
        job = q.require_job(session=s, job_id=job_id)
        assert job.status == JobStatus.FAILED and "gave up after 2 attempts" in (job.error or "")


def test_progress_stamps_first_audio_once_and_stops_after_cancel(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    lifecycle.claim(session=session, job_id=job_id, worker="w", max_attempts=3, lease_s=30)
    assert lifecycle.mark_running(session=session, job_id=job_id, prep_path=PrepPath.PREPARED_AHEAD)
    assert lifecycle.renew(session=session, job_id=job_id, frames_done=0)
    assert q.require_job(session=session, job_id=job_id).first_audio_at is None
    assert lifecycle.renew(session=session, job_id=job_id, frames_done=2)
    first = q.require_job(session=session, job_id=job_id).first_audio_at
    assert lifecycle.renew(session=session, job_id=job_id, frames_done=4, frames_total=6)
    job = q.require_job(session=session, job_id=job_id)
    assert first is not None and job.first_audio_at == first and (job.frames_done, job.frames_total) == (4, 6)
    assert job.prep_path == "prepared_ahead" and job.status == JobStatus.RUNNING
    assert lifecycle.cancel(session=session, job_id=job_id)
    assert not lifecycle.renew(session=session, job_id=job_id, frames_done=6)
    assert not lifecycle.cancel(session=session, job_id=job_id)
    assert q.require_job(session=session, job_id=job_id).status == JobStatus.CANCELLED


def test_first_finisher_wins(session: Session, voice: str):
    job_id = new_job(session, voice)[0].id
    done = lifecycle.finish(
        session=session, job_id=job_id, status=JobStatus.SUCCEEDED, output_path="outputs/a.wav"
    )
    late = lifecycle.finish(session=session, job_id=job_id, status=JobStatus.FAILED, error="late")
    session.commit()
    job = q.require_job(session=session, job_id=job_id)
    assert done and not late and job.status == JobStatus.SUCCEEDED and job.error is None
    assert job.finished_at is not None and job.frames_done == job.frames_total
    assert lifecycle.claim(session=session, job_id=job_id, worker="w", max_attempts=3, lease_s=30) is None


def test_live_jobs_of_a_voice_are_counted(session: Session, voice: str):
    a = new_job(session, voice)[0].id
    b = new_job(session, voice)[0].id
    lifecycle.cancel(session=session, job_id=b)
    assert q.count_live_jobs(session=session, voice_id=voice) == 1
    assert q.count_live_jobs(session=session, voice_id=voice, exclude_job_id=a) == 0


def test_two_workers_claiming_the_same_attempt_never_both_win(sessions: sessionmaker[Session], voice: str):
    import threading
    import time

    with session_scope(sessions) as s:
        job_id = new_job(s, voice)[0].id
    first = sessions()
    assert lifecycle.claim(session=first, job_id=job_id, worker="w1", max_attempts=3, lease_s=30) is not None
    second: list[object] = []

    def claim() -> None:  # reads attempts=0, then its UPDATE waits for the first claim's lock
        with session_scope(sessions) as s:
            second.append(lifecycle.claim(session=s, job_id=job_id, worker="w2", max_attempts=3, lease_s=30))

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
