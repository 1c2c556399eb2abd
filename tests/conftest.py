"""Shared fixtures: real Redis, real PostgreSQL, a SQLite file, a real Celery CPU worker.

Isolation from other test runs on the same machine:
- Redis databases 6-14 only: 10 broker, 11 results, 12 feature store (6, 7, 8 for the second
  pytest-xdist worker), 13 the session locks, 14 the kill-loss probe's record (9 for the second
  worker; tests/integration/test_kill_loss.py). A session holds the lock of its set (`wf:test:session:<broker
  db>` in db 13) while it uses it, so two concurrent runs never flush each other's data.
- PostgreSQL: a database `wavefarm_test_<pid>` created on the `test` database at
  session start (migrated to head) and dropped at the end; tables are emptied
  after each test that used it.
- A service that is not reachable (Redis, PostgreSQL, RabbitMQ) skips the tests that need it, except under
  `./run test` (WAVEFARM_TEST_SERVICES=required, which starts them first), where it fails them.
- Queues are named per session (`cpu-t<pid>`, `gpu-t<pid>`), so a worker only
  sees this session's tasks.

Real worker processes (the session's CPU worker, GPU workers started by a test) are the integration
tests' (tests/integration/conftest.py); GPU worker runtimes in this process come from the plugin
`tests.support.runtime`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from app.broker.queues import open_broker
from app.context import Context
from app.db import upgrade
from app.db.session import make_engine, make_sessionmaker
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore

pytest_plugins = ["tests.support.runtime"]

REPO = Path(__file__).resolve().parents[1]
REDIS = os.environ.get("WAVEFARM_TEST_REDIS", "redis://127.0.0.1:6379")
# `./run test` runs the suite in two pytest-xdist worker processes (gw0, gw1), a file each at a time; each
# worker has its own broker, results and feature-store databases and its own lock on them.
DB_SETS = {"gw0": (10, 11, 12), "gw1": (6, 7, 8)}
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
if XDIST_WORKER not in DB_SETS:
    raise RuntimeError(f"pytest-xdist worker {XDIST_WORKER}: the test Redis has database sets for "
                       f"{len(DB_SETS)} workers only (pytest -n {len(DB_SETS)} at most)")
BROKER_DB, RESULT_DB, FEATURE_DB = DB_SETS[XDIST_WORKER]
LOCK_DB = 13
PG_ADMIN_URL = os.environ.get("WAVEFARM_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
TABLES = ("install_events", "worker_voices", "jobs", "voices", "workers")  # children first
SESSION_TAG = f"t{os.getpid()}"


def service_missing(reason: str) -> None:
    """A service the test needs is not reachable: a failure under `./run test`, which starts every service
    first (so a skip there would hide a broken set-up), a skip in a bare `pytest` run."""
    if os.environ.get("WAVEFARM_TEST_SERVICES") == "required":
        pytest.fail(f"{reason} (./run test starts it; see its output)")
    pytest.skip(reason)


def redis_url(db: int) -> str:
    return f"{REDIS}/{db}"


# Redis ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_session_lock() -> Iterator[None]:
    """Hold the test-Redis lock for the whole session; flush our databases on entry and exit."""
    client = redis.Redis.from_url(redis_url(LOCK_DB))
    try:
        client.ping()
    except redis.ConnectionError:
        service_missing(f"no Redis at {REDIS}")
    lock = client.lock(f"wf:test:session:{BROKER_DB}", timeout=120, blocking_timeout=900,
                       thread_local=False)
    if not lock.acquire():
        pytest.fail("another test session held the test Redis databases for 15 minutes")
    stop = threading.Event()

    def keep_alive() -> None:  # a crashed session lets go within two minutes
        while not stop.wait(30):
            lock.reacquire()

    thread = threading.Thread(target=keep_alive, daemon=True)
    thread.start()
    for db in (BROKER_DB, RESULT_DB, FEATURE_DB):
        redis.Redis.from_url(redis_url(db)).flushdb()
    try:
        yield
    finally:
        for db in (BROKER_DB, RESULT_DB, FEATURE_DB):
            redis.Redis.from_url(redis_url(db)).flushdb()
        stop.set()
        thread.join()
        lock.release()
        client.close()


@pytest.fixture
def feature_redis(redis_session_lock: None) -> Iterator[redis.Redis]:
    """The feature-store database (12), flushed around the test."""
    client = redis.Redis.from_url(redis_url(FEATURE_DB))
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def broker_redis(redis_session_lock: None) -> Iterator[redis.Redis]:
    """The broker database (10). Not flushed per test: a running worker's queue bindings live there."""
    client = redis.Redis.from_url(redis_url(BROKER_DB))
    yield client
    client.close()


@pytest.fixture
def store(feature_redis: redis.Redis) -> FeatureStore:
    return FeatureStore(feature_redis, ttl_s=3600)


# SQL -----------------------------------------------------------------------------


@contextlib.contextmanager
def pg_database(name: str) -> Iterator[str]:
    """Create database `name` (dropping a leftover), yield its SQLAlchemy URL, drop it."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        service_missing(f"no PostgreSQL at {PG_ADMIN_URL}: {exc}")
    with admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """This session's PostgreSQL database, migrated to head."""
    with pg_database(f"wavefarm_test_{os.getpid()}") as url:
        upgrade(url)
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file, migrated to head."""
    url = f"sqlite:///{tmp_path / 'wavefarm.sqlite'}"
    upgrade(url)
    return url


def empty_tables(url: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test runs once on a fresh SQLite file and once on this session's PostgreSQL database."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    url = request.getfixturevalue("pg_url")
    yield url
    empty_tables(url)


@pytest.fixture
def pg_test_url(pg_url: str) -> Iterator[str]:
    """The session's PostgreSQL database, emptied after the test."""
    yield pg_url
    empty_tables(pg_url)


def _sessions(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    yield from _sessions(db_url)


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as s:
        yield s


# Settings, artifacts ------------------------------------------------------------------


def make_test_settings(
    *, database_url: str, artifact_root: Path, tag: str = SESSION_TAG, **extra: object
) -> Settings:
    return Settings(
        database_url=database_url,
        broker_url=redis_url(BROKER_DB),
        result_backend=redis_url(RESULT_DB),
        feature_store_url=redis_url(FEATURE_DB),
        artifact_root=artifact_root,
        queue_cpu=f"cpu-{tag}",
        queue_gpu=f"gpu-{tag}",
        **{"maintenance_interval_s": 0.0, **extra},  # a test that wants the periodic sweep says so
    )


def settings_env(settings: Settings) -> dict[str, str]:
    """The WAVEFARM_* variables that rebuild `settings` in a child process."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump(exclude_none=True).items():
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"WAVEFARM_{name.upper()}"] = str(value)
    return env


@pytest.fixture
def artifacts(tmp_path: Path) -> ArtifactStore:
    store = ArtifactStore(tmp_path / "artifacts")
    store.ensure_layout()
    return store


@pytest.fixture
def settings(db_url: str, artifacts: ArtifactStore, redis_session_lock: None) -> Settings:
    """Settings for one test: its database, its artifact root, queues nobody consumes."""
    return make_test_settings(
        database_url=db_url, artifact_root=artifacts.root, tag=f"{SESSION_TAG}-{uuid.uuid4().hex[:8]}"
    )


# The broker and a producer on a test's queues ------------------------------------------------------


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    """A Celery producer on the test's broker and queues (nobody consumes them)."""
    from tasks.celery_app import make_celery

    app = make_celery(settings, include=())
    yield app
    app.close()


@pytest.fixture
def ctx(settings: Settings, sessions: sessionmaker[Session], store: FeatureStore, artifacts: ArtifactStore,
        celery: Celery) -> Iterator[Context]:
    """The services' clients (`app.context.Context`) on this test's settings, database, store and artifact
    root; tasks go through the test's `celery` producer."""
    broker = open_broker(settings.broker_url)
    yield Context(settings=settings, engine=sessions.kw["bind"], sessions=sessions, store=store,
                  artifacts=artifacts, sender=celery, broker=broker)
    broker.close()


@pytest.fixture
def broker(settings: Settings) -> Iterator[redis.Redis]:
    """The test's broker database; the test's queues (every priority list) are emptied afterwards."""
    client = redis.Redis.from_url(settings.broker_url)
    yield client
    for queue in (settings.queue_cpu, settings.queue_gpu):
        open_broker(settings.broker_url).purge(queue)
    client.close()

