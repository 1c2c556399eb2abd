"""Crashes through real worker processes: GPU and CPU Celery workers (tiny preset, dummy weights) on a
SQLite file, on both brokers (Redis and RabbitMQ), killed with SIGKILL mid-work and started again under
the same node name, as a supervisor does; a poison job that kills its worker every time; a hung engine
step (watchdog); Redis and PostgreSQL going away.

The workers keep the default visibility timeout (6 h): a killed worker's jobs must come back through
what a deployment has (RabbitMQ's requeue of a dead consumer's messages, the restarted GPU worker
putting back what its previous process held), never through a short timeout that a user does not run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import soundfile as sf
from sqlalchemy import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.broker.celery_config import make_celery
from app.broker.queues import is_amqp
from app.db import queries
from app.db.models import DONE_JOB_STATUSES, JobStatus, VoiceStatus
from app.db.session import make_engine, make_sessionmaker
from app.reconcile.sweep import run_sweep
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.storage.keys import feature_key
from tests.conftest import make_test_settings
from tests.integration.conftest import send_job, sessions_of, start_gpu_worker, start_worker, store_of
from tests.support.net import free_port
from tests.support.runtime import VOICE_A, VOICE_B, job_row, prepare_ahead

pytestmark = pytest.mark.timeout(240)

# Runs the GPU worker; with WF_TEST_POISON=<job id> the process SIGKILLs itself when that job starts
# streaming (a job that crashes its worker every time), with WF_TEST_HANG=1 every decode step hangs;
# with WF_TEST_SLOW_PREP=1 a CPU worker's host half sleeps (so it can be killed mid-preparation).
GPU_MAIN = """
import os, signal, sys
poison = os.environ.get("WF_TEST_POISON")
if poison:
    import gpu_worker.worker.job as w
    real = w.JobRun._stream
    def _stream(self, *a, **k):
        if self.job_id == poison:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **k)
    w.JobRun._stream = _stream
if os.environ.get("WF_TEST_HANG"):  # every decode step hangs
    import time
    import gpu_worker.engine.decoder as d
    d.StreamingDecoder.step = lambda self, rows: time.sleep(3600)
from celery.__main__ import main
sys.argv = ["celery"] + sys.argv[1:]
main()
"""
CPU_MAIN = """
import os, sys, time
if os.environ.get("WF_TEST_SLOW_PREP"):
    import app.voices.features as f
    f.host_half = lambda *a, **k: time.sleep(600)
from celery.__main__ import main
sys.argv = ["celery"] + sys.argv[1:]
main()
"""


class Workers:
    """Worker subprocesses of one test, each stopped (SIGKILL if need be) at the end."""

    def __init__(self, settings: Settings, logs: Path) -> None:
        self.settings, self.logs = settings, logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names = {kind: f"{kind}-{uuid.uuid4().hex[:6]}" for kind in ("gpu", "cpu")}

    def start(self, kind: str, *, env: dict[str, str] | None = None,
              wait: bool = True) -> subprocess.Popen[bytes]:
        """A GPU or CPU worker run through GPU_MAIN / CPU_MAIN, under the one node name of its kind in
        this test (a restart is the same worker started again); with `wait`, returns once it answers a
        ping or has died already (a poison job may have been waiting for it)."""
        name = self.names[kind]
        if kind == "gpu":
            worker = start_gpu_worker(self.settings, name, self.logs, extra_env=env, events=False, wait=wait,
                                      launcher=(sys.executable, "-c", GPU_MAIN), exited_ok=True)
        else:
            args = ["-A", "tasks.celery_app", "worker", "-Q", self.settings.queue_cpu, "-P", "solo"]
            worker = start_worker(self.settings, name, self.logs, args, extra_env=env, wait=wait,
                                  launcher=(sys.executable, "-c", CPU_MAIN), exited_ok=True)
        self.procs.append(worker.proc)
        return worker.proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def tail(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def crash_settings(sqlite_url: str, artifacts: ArtifactStore, broker_url: str,
                   redis_session_lock: None) -> Settings:
    """Small workers on each broker, with the default visibility timeout (module docstring)."""
    settings = make_test_settings(
        database_url=sqlite_url, artifact_root=artifacts.root, tag=f"t{os.getpid()}-{uuid.uuid4().hex[:6]}",
        model_preset="tiny", prep_wait_ms=200, progress_interval_s=0.1, micro_batch_size=4, worker_slots=2,
        voice_cache_capacity=4, job_max_attempts=2)
    assert settings.visibility_timeout_s == Settings().visibility_timeout_s == 6 * 3600
    return settings.model_copy(update={"broker_url": broker_url})


@pytest.fixture
def workers(crash_settings: Settings, tmp_path: Path) -> Iterator[Workers]:
    logs = tmp_path / "logs"
    logs.mkdir()
    w = Workers(crash_settings, logs)
    yield w
    w.stop_all()
    print(w.tail())


@pytest.fixture
def db(crash_settings: Settings) -> Iterator[sessionmaker[Session]]:
    yield from sessions_of(crash_settings)


@pytest.fixture
def store(crash_settings: Settings, feature_redis) -> Iterator[FeatureStore]:
    yield from store_of(crash_settings)


def assert_whole_outputs(db, artifacts: ArtifactStore, jobs: dict[str, int]) -> None:
    """Every job succeeded and its file on disk holds all 960 samples of each of its n tokens."""
    for job_id, n in jobs.items():
        job = job_row(db, job_id)
        assert job.status == JobStatus.SUCCEEDED, job.error
        audio, _ = sf.read(artifacts.path(job.output_path), dtype="float32")
        assert audio.shape == (n * 960,)  # whole, not a half-written file


def wait_for(check: Callable[[], bool], timeout: float, what: str, workers: Workers) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{workers.tail()}"
        time.sleep(0.1)


def outputs(settings: Settings) -> list[str]:
    return sorted(p.name for p in (Path(settings.artifact_root) / "outputs").iterdir())


def orphans(settings: Settings, db) -> list[Path]:
    with db() as session:
        referenced = queries.referenced_paths(session=session)
    return ArtifactStore(settings.artifact_root).list_orphans(referenced=referenced, older_than_s=0)


# -- the GPU worker killed mid-decode -----------------------------------------------------------------
RESUME_WITHIN_S = 60.0


def test_a_gpu_worker_killed_mid_decode_and_restarted_resumes_its_jobs_within_60_s_and_completes_them_once(
        crash_settings: Settings, workers: Workers, db, store: FeatureStore) -> None:
    """On Redis the killed worker's messages sit in kombu's `unacked` hash for the visibility timeout; on
    RabbitMQ they are requeued when its connection drops. Either way no job may wait in `running` for
    hours (issue 18, defect 4)."""
    settings = crash_settings
    prepare_ahead(SimpleRuntime(store), VOICE_A)
    jobs = {send_job(settings, db, store, VOICE_A, n, seed=n): n for n in (500, 450)}
    first = workers.start("gpu")
    wait_for(lambda: all(job_row(db, j).frames_done > 0 for j in jobs), 120, "audio of both jobs", workers)
    workers.kill(first)  # SIGKILL: no shutdown, no requeue by the worker itself
    assert all(job_row(db, j).status == JobStatus.RUNNING and job_row(db, j).attempts == 1 for j in jobs)
    workers.start("gpu")  # its supervisor restarts it
    started = time.monotonic()
    wait_for(lambda: all(job_row(db, j).attempts == 2 for j in jobs), RESUME_WITHIN_S,
             "every job of the killed worker to start again", workers)
    print(f"resumed {time.monotonic() - started:.1f} s after the restarted worker answered")
    wait_for(lambda: all(job_row(db, j).status in DONE_JOB_STATUSES for j in jobs), 150,
             "the jobs to finish", workers)
    assert_whole_outputs(db, ArtifactStore(settings.artifact_root), jobs)
    assert all(job_row(db, j).attempts == 2 for j in jobs)  # the killed attempt is counted, once
    assert outputs(settings) == sorted(f"{j}.wav" for j in jobs)  # one whole output per job, no partials
    assert orphans(settings, db) == []


class SimpleRuntime:
    """`prepare_ahead` needs only `.store`."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store


# -- a poison job -------------------------------------------------------------------------------------
def test_a_job_that_kills_its_worker_every_time_fails_after_its_attempts(
        crash_settings: Settings, workers: Workers, db, store: FeatureStore) -> None:
    settings = crash_settings
    prepare_ahead(SimpleRuntime(store), VOICE_B)
    poison = send_job(settings, db, store, VOICE_B, 30, seed=3)
    env = {"WF_TEST_POISON": poison}
    restarts = 0
    while job_row(db, poison).status not in (JobStatus.FAILED, JobStatus.SUCCEEDED):
        assert restarts < 6, f"still looping after {restarts} restarts\n{workers.tail()}"
        proc = workers.start("gpu", env=env, wait=False)
        deadline = time.monotonic() + 90
        while proc.poll() is None and job_row(db, poison).status != JobStatus.FAILED:
            assert time.monotonic() < deadline, workers.tail()
            time.sleep(0.2)
        if proc.poll() is None:
            workers.kill(proc)
        restarts += 1
    job = job_row(db, poison)
    assert job.status == JobStatus.FAILED and "gave up after 2 attempts" in (job.error or "")
    assert job.attempts == settings.job_max_attempts
    healthy = send_job(settings, db, store, VOICE_B, 30, seed=4)  # the worker serves other jobs again
    workers.start("gpu", env=env)
    wait_for(lambda: job_row(db, healthy).status == JobStatus.SUCCEEDED, 90, "a healthy job", workers)


# -- a CPU worker killed mid-preparation ---------------------------------------------------------------
def test_a_cpu_worker_killed_mid_preparation_its_voice_is_prepared_again_and_the_job_completes(
        crash_settings: Settings, workers: Workers, db, store: FeatureStore) -> None:
    """RabbitMQ hands the killed worker's `voice.prepare` to the restarted one at once. kombu's Redis
    transport keeps it unacknowledged for the visibility timeout (6 h); there the GPU worker, which waits
    only `prep_wait_ms` for a preparation, prepares the voice inline: the job never waits for it."""
    settings = crash_settings
    job_id = send_job(settings, db, store, VOICE_A, 30, seed=5)
    voice_id = job_row(db, job_id).voice_id

    def voice_status() -> str:
        with db() as session:
            return queries.require_voice(session=session, voice_id=voice_id).status

    slow = workers.start("cpu", env={"WF_TEST_SLOW_PREP": "1"}, wait=False)  # busy: cannot answer pings
    wait_for(lambda: voice_status() == VoiceStatus.PREPARING, 60, "the preparation to start", workers)
    workers.kill(slow)
    workers.start("cpu")
    if is_amqp(settings.broker_url):
        wait_for(lambda: voice_status() == VoiceStatus.READY, 60, "the voice to be prepared again", workers)
        assert store.exists(voice_id)
    workers.start("gpu")
    wait_for(lambda: job_row(db, job_id).status in DONE_JOB_STATUSES, 90, "the job", workers)
    job = job_row(db, job_id)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert voice_status() == VoiceStatus.READY and store.exists(voice_id)
    if not is_amqp(settings.broker_url):
        assert job.prep_path == "inline"  # the killed preparation's message is still unacknowledged


# -- a hung engine step -------------------------------------------------------------------------------
def test_a_hung_engine_step_makes_the_watchdog_exit_the_worker(make_runtime, sqlite_sessions) -> None:
    from gpu_worker.worker.job import JobRun
    from gpu_worker.worker.watchdog import Watchdog
    from tests.support.runtime import RecordingTask
    from tests.support.runtime import submit as submit_in_process

    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    release = threading.Event()
    real_step = rt.loop.engine.decoder.step

    def hung_step(rows: Any) -> Any:
        release.wait(30)
        return real_step(rows)

    rt.loop.engine.decoder.step = hung_step
    exits: list[int] = []
    dog = Watchdog(rt.loop, deadline_s=0.5, on_hang=exits.append, interval_s=0.05)
    dog.start()
    job_id = submit_in_process(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    runner = threading.Thread(target=lambda: JobRun(rt, RecordingTask(), job_id).run(), daemon=True)
    runner.start()
    deadline = time.monotonic() + 20
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits and exits[0] != 0  # the process would exit non-zero: its supervisor restarts it
    release.set()
    runner.join(30)
    dog.stop()
    assert not Watchdog(rt.loop, deadline_s=0.5, on_hang=exits.append).hung()  # idle is not hung



def test_a_worker_whose_step_hangs_exits_non_zero_and_its_job_is_redelivered(
        crash_settings: Settings, workers: Workers, db, store: FeatureStore) -> None:
    settings = crash_settings.model_copy(update={"step_deadline_s": 2.0})
    workers.settings = settings
    prepare_ahead(SimpleRuntime(store), VOICE_A)
    job_id = send_job(settings, db, store, VOICE_A, 60, seed=9)
    hung = workers.start("gpu", env={"WF_TEST_HANG": "1"})
    assert hung.wait(90) == 70, workers.tail()  # the watchdog's exit status: the supervisor restarts it
    assert job_row(db, job_id).status != JobStatus.SUCCEEDED
    workers.start("gpu")
    wait_for(lambda: job_row(db, job_id).status == JobStatus.SUCCEEDED, 90, "the redelivered job", workers)
    assert job_row(db, job_id).attempts == 2


# -- Redis restarted mid-run, PostgreSQL briefly unavailable ------------------------------------------
class OwnRedis:
    """A redis-server of this test alone (temp folder, own port, no persistence): restartable."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "own redis-server did not start"
                time.sleep(0.05)
        client.close()

    def crash(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)




def sweep_until_done(settings: Settings, db, jobs: list[str], workers: Workers, timeout: float) -> None:
    """What a periodic `maintenance.sweep` does for jobs whose broker messages were lost."""
    deadline = time.monotonic() + timeout
    while not all(job_row(db, j).status in (JobStatus.SUCCEEDED, JobStatus.FAILED) for j in jobs):
        assert time.monotonic() < deadline, f"jobs not done: {[job_row(db, j).status for j in jobs]}\n" \
                                            f"{workers.tail()}"
        sender = make_celery(settings)
        try:
            run_sweep(settings, sender)
        finally:
            sender.close()
        time.sleep(2)


def test_redis_restarted_mid_run_workers_reconnect_and_every_job_finishes_on_disk(
        sqlite_url: str, artifacts: ArtifactStore, tmp_path: Path) -> None:
    own = OwnRedis(tmp_path, free_port())
    own.start()
    url = f"redis://127.0.0.1:{own.port}"
    settings = make_test_settings(
        database_url=sqlite_url, artifact_root=artifacts.root, tag="r", model_preset="tiny",
        prep_wait_ms=300, progress_interval_s=0.1, micro_batch_size=4, worker_slots=4,
        stuck_job_after_s=2,
    ).model_copy(update={"broker_url": f"{url}/0", "result_backend": f"{url}/1",
                         "feature_store_url": f"{url}/2"})
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = Workers(settings, logs)
    engine = make_engine(settings.database_url)
    db = make_sessionmaker(engine)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    try:
        workers.start("cpu")
        workers.start("gpu")
        jobs = {send_job(settings, db, store, ref, n, seed=n): n
                for ref, n in ((VOICE_A, 400), (VOICE_B, 350), (VOICE_A, 60), (VOICE_B, 80))}
        wait_for(lambda: any(job_row(db, j).frames_done > 0 for j in jobs), 120, "audio", workers)
        own.crash()  # queues, unacked messages, results and features: all gone
        time.sleep(1.0)
        own.start()
        sweep_until_done(settings, db, list(jobs), workers, timeout=150)
        assert_whole_outputs(db, artifacts, jobs)  # nothing reported done that is not (whole) on disk
        assert all(p.poll() is None for p in workers.procs)  # reconnected, not dead
    finally:
        store.close()
        workers.stop_all()
        print(workers.tail())
        own.stop()
        engine.dispose()


class PausableProxy:
    """A TCP forwarder to PostgreSQL that this test can take down (connections cut, new ones refused)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.down = threading.Event()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.down.set()
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for a, b in pairs:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def restore(self) -> None:
        self.down.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_postgresql_briefly_unavailable_the_gpu_worker_finishes_its_jobs(
        pg_test_url: str, artifacts: ArtifactStore, redis_session_lock: None, feature_redis,
        tmp_path: Path) -> None:
    parsed = make_url(pg_test_url)
    proxy = PausableProxy((parsed.host or "127.0.0.1", parsed.port or 5432))
    via_proxy = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    settings = make_test_settings(
        database_url=via_proxy, artifact_root=artifacts.root, tag=f"pg{uuid.uuid4().hex[:6]}",
        model_preset="tiny", prep_wait_ms=200, progress_interval_s=0.1, micro_batch_size=4,
        worker_slots=2, stuck_job_after_s=5)
    direct = settings.model_copy(update={"database_url": pg_test_url})
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = Workers(settings, logs)
    engine = make_engine(pg_test_url)
    db = make_sessionmaker(engine)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    try:
        prepare_ahead(SimpleRuntime(store), VOICE_A)
        jobs = {send_job(direct, db, store, VOICE_A, n, seed=n): n for n in (400, 300)}
        workers.start("gpu")
        wait_for(lambda: any(job_row(db, j).frames_done > 0 for j in jobs), 120, "audio", workers)
        proxy.cut()  # every connection of the worker dies; new ones are refused
        time.sleep(3.0)
        proxy.restore()
        sweep_until_done(direct, db, list(jobs), workers, timeout=120)
        assert_whole_outputs(db, artifacts, jobs)
        assert all(p.poll() is None for p in workers.procs)
    finally:
        store.close()
        workers.stop_all()
        print(workers.tail())
        proxy.close()
        engine.dispose()


# -- features that expire or are evicted ----------------------------------------------------------------
def test_feature_ttl_is_refreshed_on_use_and_evicted_features_are_prepared_again(make_runtime,
                                                                                  sqlite_sessions) -> None:
    from gpu_worker.worker.job import JobRun
    from tests.support.runtime import RecordingTask
    from tests.support.runtime import submit as submit_in_process

    rt = make_runtime(prep_wait_ms=100)
    voice_id = prepare_ahead(rt, VOICE_B)
    assert 0 < (rt.store.ttl(voice_id) or 0) <= rt.store.ttl_s  # every feature key expires
    rt.store.client.expire(feature_key(voice_id), 5)
    assert rt.store.get(voice_id) is not None and (rt.store.ttl(voice_id) or 0) > 5  # a read refreshes it
    rt.store.delete(voice_id)  # evicted (LRU) or lost with a Redis restart
    job_id = submit_in_process(rt, sqlite_sessions, VOICE_B, n_tokens=30)
    result = JobRun(rt, RecordingTask(), job_id).run()
    assert result["status"] == "succeeded" and result["prep_path"] == "inline"  # prepared again
    assert rt.store.exists(voice_id) and 0 < (rt.store.ttl(voice_id) or 0) <= rt.store.ttl_s
