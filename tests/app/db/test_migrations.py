"""The Alembic migrations on SQLite and PostgreSQL: up, down and up again; the schema equals the models';
concurrent starts upgrade once; rows survive rebuilt tables; the CHECK constraints follow the enums."""

import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app import lifecycle
from app.db import downgrade, upgrade
from app.db import queries as q
from app.db.models import Base, Job, JobStatus, PrepPath, Voice, VoiceStatus, utcnow
from app.db.session import make_engine
from tests.app.db.helpers import new_job, vid
from tests.conftest import REPO


def _schema(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


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
        assert lifecycle.mark_running(session=session, job_id=job_id, prep_path=path)
        session.flush()
    for status in VoiceStatus:
        session.execute(update(Voice).where(Voice.id == voice).values(status=status))
        session.flush()
    for status in JobStatus:
        session.execute(update(Job).where(Job.id == job_id).values(status=status))
        session.flush()
    session.commit()


def _raw_voice_and_jobs(conn: Any, jobs: dict[str, str], now: Any, worker: str | None = None) -> None:
    """The voice `vid()` and a job of it per {status: id}, as rows of an older schema (plain SQL)."""
    conn.execute(text("INSERT INTO voices (id, status, prepare_attempts, uses, created_at, updated_at) "
                      "VALUES (:v, 'ready', 0, 1, :t, :t)"), {"v": vid(), "t": now})
    for status, job_id in jobs.items():
        conn.execute(text(
            "INSERT INTO jobs (id, voice_id, status, kind, n_tokens, seed, output_format, priority, "
            "frames_done, frames_total, submitted_at, attempts, updated_at, worker) VALUES "
            "(:j, :v, :s, 'tokens', 4, 0, 'wav', 0, 0, 8, :t, :a, :t, :w)"),
            {"j": job_id, "v": vid(), "s": status, "t": now, "a": 0 if worker is None else 1, "w": worker})


def test_0018_fills_the_chapter_counters_and_records_a_settled_chapter_in_flight_ready(empty_db: str):
    upgrade(empty_db, "0015_worker_weights")
    engine = make_engine(empty_db)
    now, book = utcnow(), str(uuid.uuid4())
    jobs = {status: str(uuid.uuid4()) for status in ("succeeded", "failed", "queued")}
    keys = {name: (name * 64)[:64] for name in "abcd"}
    with engine.begin() as conn:
        _raw_voice_and_jobs(conn, jobs, now)
        for name, job_id, error in (("a", jobs["succeeded"], None), ("b", jobs["failed"], None),
                                    ("c", jobs["queued"], None), ("d", None, "tokenize: no file")):
            conn.execute(text("INSERT INTO segments (key, voice_id, kind, job_id, jobs_created, error, "
                              "created_at, updated_at) VALUES (:k, :v, 'tokens', :j, 1, :e, :t, :t)"),
                         {"k": keys[name], "v": vid(), "j": job_id, "e": error, "t": now})
        conn.execute(text(
            "INSERT INTO books (id, voice_id, status, title, author, language, plan_key, output_format, m4b, "
            "seed, priority, segments_total, est_seconds, submitted_at, updated_at) VALUES "
            "(:b, :v, 'rendering', 't', '', 'en', 'p', 'wav', false, 0, 0, 6, 6.0, :t, :t)"),
            {"b": book, "v": vid(), "t": now})
        layout = {0: ("aba", now), 1: ("cd", now), 2: ("a", None)}  # chapter 2 is not scheduled yet
        for index, (names, scheduled) in layout.items():
            conn.execute(text('INSERT INTO book_chapters (book_id, "index", title, segments_total, '
                              "est_seconds, scheduled_at) VALUES (:b, :i, 't', :n, 1.0, :s)"),
                         {"b": book, "i": index, "n": len(names), "s": scheduled})
            for position, name in enumerate(names):
                conn.execute(text("INSERT INTO book_segments (book_id, chapter, position, key) "
                                  "VALUES (:b, :i, :p, :k)"), {"b": book, "i": index, "p": position,
                                                                "k": keys[name]})
    def unchecked(session: Session) -> list[tuple[str, int]]:
        return q.list_unchecked_chapters(session=session, rung_before=utcnow() + timedelta(seconds=1))

    for _ in range(2):  # and again after a downgrade
        upgrade(empty_db)
        with Session(engine) as session:
            rows = q.list_chapters(session=session, book_id=book)
            assert [(c.keys_total, c.keys_done, c.keys_failed, c.tokens_done) for c in rows] == [
                (2, 1, 1, 4), (2, 0, 1, 0), (1, 1, 0, 4)]
            assert [c.ready_at is not None for c in rows] == [True, False, False]
            # the sweep sends its book.chapter; the time it was recorded reads back as it is compared
            assert unchecked(session) == [(book, 0)]
            lifecycle.mark_chapter_checked(session=session, book_id=book, index=0, ready_at=rows[0].ready_at)
            session.commit()
            assert unchecked(session) == []
        downgrade(empty_db, "0015_worker_weights")
    engine.dispose()


def test_0017_leases_the_jobs_claimed_when_it_runs_and_leaves_queued_ones_to_the_reconciler(empty_db: str):
    """A database upgraded with jobs in flight: a claimed job gets a lease from the upgrade (its worker of
    this version renews it; one of the previous version lets it pass), a queued one none."""
    upgrade(empty_db, "0016_routing_index")
    engine = make_engine(empty_db)
    now, jobs = utcnow(), {status: str(uuid.uuid4()) for status in ("queued", "running", "succeeded")}
    with engine.begin() as conn:
        _raw_voice_and_jobs(conn, jobs, now, worker="gpu@old")
    upgrade(empty_db)
    with Session(engine) as session:
        rows = {status: session.get_one(Job, job_id) for status, job_id in jobs.items()}
        assert rows["running"].lease_until is not None and rows["running"].lease_until > utcnow()
        assert rows["queued"].lease_until is None and rows["succeeded"].lease_until is None
        assert {r.rings for r in rows.values()} == {0}
    downgrade(empty_db, "0016_routing_index")
    engine.dispose()
