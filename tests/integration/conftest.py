"""The integration tests' fixtures and process helpers: real Celery workers as subprocesses.

- `cpu_worker`: the session's CPU worker (`celery -A tasks.celery_app worker`, solo pool) on
  `worker_settings` (the session's PostgreSQL database and an artifact root of its own);
- `start_worker` / `start_gpu_worker` / `running_gpu_worker`: a worker a test starts on its own settings,
  with its output in the test's folder (`WorkerProcess.tail()` shows it when something fails);
- the modules that test in-process runtimes (`make_runtime`) override `sessions` with the SQLite file
  those runtimes use;
- `send_job`: a job of random tokens submitted through the broker, as the API sends it;
- `amqp_url`: a RabbitMQ virtual host of this session (127.0.0.1:5672, guest), deleted at the end, and
  `broker_url`, which runs a test once on the Redis broker and once on RabbitMQ.
Every test in this folder is marked `integration`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from app.broker.celery_config import make_celery
from app.db.session import make_engine, make_sessionmaker
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from tests.conftest import (
    BROKER_DB,
    REPO,
    SESSION_TAG,
    _sessions,
    empty_tables,
    make_test_settings,
    redis_url,
    service_missing,
    settings_env,
)
from tests.support.context import context_for

RABBITMQ = ("127.0.0.1", 5672)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def worker_settings(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, redis_session_lock: None
) -> Settings:
    """Settings shared by the session's CPU worker and the tests that talk to it (PostgreSQL)."""
    root = tmp_path_factory.mktemp("worker") / "artifacts"
    ArtifactStore(root).ensure_layout()
    return make_test_settings(database_url=pg_url, artifact_root=root)


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()[-500:]}")


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """A virtual host of this session on the local RabbitMQ: no other test run sees its queues or
    messages, and it is deleted (queues, messages and all) at the end. Nothing on 5672: as the Redis and
    PostgreSQL fixtures (`service_missing`; `./run test` starts a RabbitMQ server)."""
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError:
        service_missing(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}")
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("RabbitMQ listens on 5672 but rabbitmqctl is missing: cannot make the session's vhost")
    vhost = f"wavefarm-test-{SESSION_TAG}"
    subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True, timeout=60)  # a leftover
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    try:
        yield f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(params=["redis", "amqp"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The test runs once on the Redis broker (the session's database) and once on RabbitMQ."""
    if request.param == "redis":
        request.getfixturevalue("redis_session_lock")
        return redis_url(BROKER_DB)
    return str(request.getfixturevalue("amqp_url"))


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


def sessions_of(settings: Settings) -> Iterator[sessionmaker[Session]]:
    """For a fixture: sessions on `settings`' database, the engine disposed after the test."""
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def store_of(settings: Settings) -> Iterator[FeatureStore]:
    """For a fixture: `settings`' feature store, closed after the test."""
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    yield store
    store.close()


def send_job(settings: Settings, sessions: sessionmaker[Session], store: FeatureStore, reference: bytes,
             n_tokens: int, seed: int = 1) -> str:
    """Submit a job of `n_tokens` random tokens (drawn from `seed`) with `reference`, sent through the
    broker of `settings` as the API sends it; -> its id."""
    tokens = torch.randint(0, VOCAB_SIZE, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    app = make_celery(settings)
    try:
        with sessions() as session:
            return submit_job(ctx=context_for(settings, app, sessions=sessions, store=store), session=session,
                              request=JobRequest(tokens=tokens, reference_bytes=reference, seed=seed))
    finally:
        app.close()


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
    args = ["-A", "gpu_worker.worker.process", "worker", "-Q", settings.queue_gpu, "-P", "threads",
            "-c", str(concurrency or settings.worker_slots)]
    return args + (["-E"] if events else [])


def start_gpu_worker(settings: Settings, name: str, log_dir: Path, *, concurrency: int | None = None,
                     extra_env: Mapping[str, str] | None = None, launcher: Sequence[str] = CELERY_MAIN,
                     events: bool = True, wait: bool = True, exited_ok: bool = False) -> WorkerProcess:
    """A GPU worker subprocess (`celery -A gpu_worker.worker.process worker -Q <gpu queue> -P threads`) on
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
