"""Shared fixtures: real Redis, real PostgreSQL, a SQLite file, a real Celery CPU worker.

Isolation from other test runs on the same machine:
- Redis databases 10-13 only: 10 broker, 11 results, 12 feature store, 13 the
  session lock. A session holds the lock (`wf:test:session` in db 13) while it
  uses them, so two concurrent runs never flush each other's data.
- PostgreSQL: a database `wavefarm_test_<pid>` created on the `test` database at
  session start (migrated to head) and dropped at the end; tables are emptied
  after each test that used it. Tests skip when PostgreSQL is not reachable.
- Queues are named per session (`cpu-t<pid>`, `gpu-t<pid>`), so a worker only
  sees this session's tasks.

Worker subprocesses: `cpu_worker` is the session's CPU worker; `start_gpu_worker` /
`running_gpu_worker` start a GPU worker on a test's settings (`start_worker` any Celery worker).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.db import upgrade
from app.db.session import make_engine, make_sessionmaker
from app.settings import Settings
from app.store import FeatureStore

REPO = Path(__file__).resolve().parents[1]
REDIS = os.environ.get("WAVEFARM_TEST_REDIS", "redis://127.0.0.1:6379")
BROKER_DB, RESULT_DB, FEATURE_DB, LOCK_DB = 10, 11, 12, 13
PG_ADMIN_URL = os.environ.get("WAVEFARM_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
TABLES = ("worker_voices", "jobs", "voices")  # children first
SESSION_TAG = f"t{os.getpid()}"


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
        pytest.skip(f"no Redis at {REDIS}")
    lock = client.lock("wf:test:session", timeout=120, blocking_timeout=900, thread_local=False)
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
        pytest.skip(f"no PostgreSQL at {PG_ADMIN_URL}: {exc}")
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


# A real Celery CPU worker -----------------------------------------------------------------


@pytest.fixture(scope="session")
def worker_settings(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, redis_session_lock: None
) -> Settings:
    """Settings shared by the session's CPU worker and the tests that talk to it (PostgreSQL)."""
    root = tmp_path_factory.mktemp("worker") / "artifacts"
    ArtifactStore(root).ensure_layout()
    return make_test_settings(database_url=pg_url, artifact_root=root)


def _wait_ready(settings: Settings, nodename: str, proc: subprocess.Popen[bytes], log: Path, *,
                exited_ok: bool = False) -> None:
    """Ping `nodename` until it answers (120 s). A process that exits first is an error, unless
    `exited_ok` (a worker a test expects to die early, e.g. on a poison job waiting in its queue)."""
    from tasks.celery_app import make_celery

    app = make_celery(settings, include=())
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if exited_ok:
                    return
                raise RuntimeError(f"celery worker exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if app.control.ping(destination=[nodename], timeout=1.0):
                return
        raise RuntimeError(f"celery worker not ready in 120 s:\n{log.read_text()[-4000:]}")
    finally:
        app.close()


@pytest.fixture(scope="session")
def cpu_worker(worker_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`celery -A tasks.celery_app worker` on this session's cpu queue; yields its node name."""
    nodename = f"cpu-{SESSION_TAG}@{os.uname().nodename}"
    log = tmp_path_factory.mktemp("worker-log") / "worker.log"
    env = {**os.environ, **settings_env(worker_settings), "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks.celery_app",
        "worker",
        "-Q",
        worker_settings.queue_cpu,
        "-n",
        nodename,
        "-P",
        "solo",
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(worker_settings, nodename, proc, log)
        yield nodename
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def worker_sessions(worker_settings: Settings) -> Iterator[sessionmaker[Session]]:
    """Sessions on the worker's database, emptied after the test."""
    yield from _sessions(worker_settings.database_url)
    empty_tables(worker_settings.database_url)


# Worker subprocesses (the GPU worker above all) ---------------------------------------------------

CELERY_MAIN = (sys.executable, "-m", "celery")


@dataclass
class WorkerProcess:
    """A Celery worker subprocess: its Popen, its node name and the file its output goes to."""

    proc: subprocess.Popen[bytes]
    nodename: str
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` (SIGTERM: Celery's warm shutdown) unless it has exited, SIGKILL it if it is still
        running after `timeout`; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_worker(settings: Settings, name: str, log_dir: Path, celery_args: Sequence[str], *,
                 launcher: Sequence[str] = CELERY_MAIN, extra_env: Mapping[str, str] | None = None,
                 wait: bool = True, exited_ok: bool = False) -> WorkerProcess:
    """`<launcher> <celery_args> -n <name>@<host>` with `settings` in its environment (one torch thread),
    output appended to `<log_dir>/<name>.log`; with `wait`, returns once the node answers a ping.
    `launcher` is `python -m celery` unless a test runs Celery from a script of its own (`python -c`)."""
    nodename = f"{name}@{os.uname().nodename}"
    log = log_dir / f"{name}.log"
    env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           **(extra_env or {})}
    cmd = [*launcher, *celery_args, "-n", nodename, "-l", "INFO", "--without-gossip", "--without-mingle",
           "--without-heartbeat"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    worker = WorkerProcess(proc, nodename, log)
    if wait:
        try:
            _wait_ready(settings, nodename, proc, log, exited_ok=exited_ok)
        except BaseException:
            worker.stop()
            raise
    return worker


def gpu_worker_args(settings: Settings, *, concurrency: int | None = None, events: bool = True) -> list[str]:
    """The GPU worker's celery arguments: the synth queue, a thread pool of `worker_slots` (or
    `concurrency`) slots, task events on (`-E`) unless `events` is false."""
    args = ["-A", "gpu_worker.worker", "worker", "-Q", settings.queue_gpu, "-P", "threads",
            "-c", str(concurrency or settings.worker_slots)]
    return args + (["-E"] if events else [])


def start_gpu_worker(settings: Settings, name: str, log_dir: Path, *, concurrency: int | None = None,
                     extra_env: Mapping[str, str] | None = None, launcher: Sequence[str] = CELERY_MAIN,
                     events: bool = True, wait: bool = True, exited_ok: bool = False) -> WorkerProcess:
    """A GPU worker subprocess (`celery -A gpu_worker.worker worker -Q <gpu queue> -P threads`) on
    `settings`; the caller stops it (`WorkerProcess.stop`). See `start_worker` for the rest."""
    args = gpu_worker_args(settings, concurrency=concurrency, events=events)
    return start_worker(settings, name, log_dir, args, launcher=launcher, extra_env=extra_env, wait=wait,
                        exited_ok=exited_ok)


@contextlib.contextmanager
def running_gpu_worker(settings: Settings, name: str, log_dir: Path, *, concurrency: int | None = None,
                       extra_env: Mapping[str, str] | None = None,
                       launcher: Sequence[str] = CELERY_MAIN) -> Iterator[WorkerProcess]:
    """A GPU worker that answers pings for the duration of the block, stopped (SIGTERM, then SIGKILL
    after 30 s) when it ends."""
    worker = start_gpu_worker(settings, name, log_dir, concurrency=concurrency, extra_env=extra_env,
                              launcher=launcher)
    try:
        yield worker
    finally:
        worker.stop()
