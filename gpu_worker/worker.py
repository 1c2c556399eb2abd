"""The GPU worker process: a Celery worker on the `gpu` queue whose `synth` tasks feed one engine.

    celery -A gpu_worker.worker worker -Q gpu -P threads -c <slots> -E

Each `synth` task (JSON args `[job_id]`) is a thin adapter: it claims the job's next attempt in the
database, registers an `EngineJob` with the in-process engine and waits on its own event queue, writing
audio to a temp file under the artifact root as it arrives, reporting progress (database, throttled;
Celery `task-progress` events and task state for Flower) and renaming the file into place at the end.
The N threads of the pool are the N slots of continuous batching.

One engine thread owns the model and the device (`EngineLoop`): it steps the engine and routes each event
to its job's queue. Voice installs and evictions are recorded per worker in the database by a small
bookkeeping thread, so no database write sits inside the decode loop. Heavy resources (model, engine,
connections) are built once per process (`runtime()`, `build_engine`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis
import torch
from celery import Celery, Task, signals
from celery.exceptions import Reject
from kombu import Queue
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from app.api.metrics import (
    WORKER_FIRST_AUDIO_SECONDS,
    WORKER_FRAMES,
    WORKER_INSTALLS,
    WORKER_ROWS_PER_STEP,
    WORKER_STEPS,
)
from app.artifacts import ArtifactStore
from app.audio import commit_output, load_reference, open_output
from app.db import queries
from app.db.models import JobStatus, VoiceStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.errors import EngineFailure, FeaturesMissing
from app.features import PromptHostFeatures, host_half
from app.keys import COUNTER_PREP_PATH
from app.settings import Settings, get_settings
from app.store import FeatureStore
from app.submit import job_tokens, reclaim_abandoned_voice, reference_limits
from gpu_worker.decoder import StreamingDecoder
from gpu_worker.engine import Engine, FeatureSource, InlinePreparer
from gpu_worker.loading import load_dummy, load_model_folder
from gpu_worker.model.config import ModelArgs
from gpu_worker.prompt import Speaker, StandInSpeaker, install_voice
from gpu_worker.speaker import SpeakerFrontend
from gpu_worker.streams import (
    Aborted,
    Audio,
    EngineEvent,
    EngineJob,
    Failed,
    Finished,
    VoiceEvicted,
    VoiceInstalled,
    VoiceReady,
    plan_chunks,
)
from gpu_worker.voices import VoiceCache

log = logging.getLogger(__name__)

TERMINAL = (Finished, Failed, Aborted)
_runtime: Runtime | None = None  # the process's runtime (see `runtime()`)
_runtime_lock = threading.Lock()
STATS_LOG_S = 60.0  # how often the engine thread logs its counters


# -- adapters at the engine boundary ---------------------------------------------------------------
class StoreFeatures:
    """FeatureSource over the Redis feature store; store errors surface as ConnectionError."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        try:
            data = self.store.get(voice_id)
        except redis.RedisError as exc:
            raise ConnectionError(f"feature store: {exc}") from exc
        return None if data is None else PromptHostFeatures.from_bytes(data)


class ReferencePreparer:
    """InlinePreparer: read the voice's stored reference and run the host half in this process."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], artifacts: ArtifactStore,
                 store: FeatureStore) -> None:
        self.settings, self.sessions, self.artifacts, self.store = settings, sessions, artifacts, store

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        with session_scope(self.sessions) as session:
            voice = queries.require_voice(session=session, voice_id=job.voice_id)
            reference = voice.reference_path
        if reference is None:
            raise FeaturesMissing(f"voice {job.voice_id} has no stored reference audio")
        pcm, voice_id = load_reference(self.artifacts.read_bytes(reference), reference_limits(self.settings))
        if voice_id != job.voice_id:
            raise EngineFailure(f"reference {reference} normalises to voice {voice_id}, not {job.voice_id}")
        start = time.perf_counter()
        host = host_half(pcm, voice_id)
        self._publish(host, time.perf_counter() - start)
        return host

    def _publish(self, host: PromptHostFeatures, seconds: float) -> None:
        """Store the features for later jobs and other workers, as `voice.prepare` would, and reclaim
        them at once if every job that wanted the voice was cancelled meanwhile."""
        data = host.to_bytes()
        try:
            self.store.put(host.voice_id, data)
            with session_scope(self.sessions) as session:
                queries.mark_voice_ready(session=session, voice_id=host.voice_id, prepare_ms=1000 * seconds,
                                         feature_nbytes=len(data))
                reclaim_abandoned_voice(session=session, store=self.store, voice_id=host.voice_id)
        except redis.RedisError as exc:
            log.warning("voice %s: could not store inline-prepared features: %s", host.voice_id, exc)


# -- the engine thread -----------------------------------------------------------------------------
class EngineLoop:
    """Owns the engine: steps it on one thread and routes events to per-job queues."""

    def __init__(self, engine: Engine, on_voice_event: Callable[[EngineEvent], None]) -> None:
        self.engine = engine
        self._on_voice_event = on_voice_event
        self._queues: dict[str, queue.Queue[EngineEvent]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wavefarm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, job: EngineJob) -> queue.Queue[EngineEvent]:
        events: queue.Queue[EngineEvent] = queue.Queue()
        with self._lock:
            self._queues[job.job_id] = events
        try:
            self.engine.add(job)
        except BaseException:
            with self._lock:
                self._queues.pop(job.job_id, None)
            raise
        return events

    def abort(self, job_id: str) -> None:
        self.engine.abort(job_id)

    def running(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._queues

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        next_log = time.monotonic() + STATS_LOG_S
        while not self._stop.is_set():
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + STATS_LOG_S
                log.info("engine: %s", self.engine.snapshot())
            if not self.engine.wait_for_work(timeout=0.2):
                continue
            rows = self.engine.stats["rows"]
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - an engine bug: fail the live jobs, keep serving
                log.exception("engine step failed; failing its live jobs")
                events = self._fail_live(exc)
            if self.engine.stats["rows"] > rows:
                ROWS_PER_STEP.observe(self.engine.stats["rows"] - rows)
            for event in events:
                if isinstance(event, Finished) and "first_audio_s" in event.timings:
                    FIRST_AUDIO.observe(event.timings["first_audio_s"])
                self._route(event)
            if not any(isinstance(e, Audio) for e in events):
                time.sleep(self.engine.idle_hint_s())  # every live job is waiting for its voice

    def _fail_live(self, exc: Exception) -> list[EngineEvent]:
        failed: list[EngineEvent] = []
        for job_id in self.engine.live_jobs():
            self.engine.abort(job_id)
            failed.append(Failed(job_id=job_id, error=f"engine step failed: {exc!r}", prep_path=None))
        return failed

    def _route(self, event: EngineEvent) -> None:
        job_id = getattr(event, "job_id", None)
        if job_id is None:
            self._on_voice_event(event)
            return
        with self._lock:
            events = self._queues.pop(job_id) if isinstance(event, TERMINAL) else self._queues.get(job_id)
        if events is not None:
            events.put(event)


class Bookkeeper:
    """Runs small database writes on its own thread, in order, so the engine thread never waits on them."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._run, name="wavefarm-bookkeeper", daemon=True).start()

    def put(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def drain(self, timeout: float = 5.0) -> None:
        done = threading.Event()
        self.put(done.set)
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            try:
                work()
            except Exception:  # noqa: BLE001 - bookkeeping must not stop; the next write may succeed
                log.exception("worker bookkeeping write failed")


# -- metrics (served by `wavefarm gpu-worker --metrics-port`, from the process-global registry) -------
ROWS_PER_STEP = Histogram(WORKER_ROWS_PER_STEP, "rows decoded together in one engine step",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
FIRST_AUDIO = Histogram(WORKER_FIRST_AUDIO_SECONDS, "from a job's admission to its first audio",
                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))


class EngineCollector(Collector):
    """The process's engine counters, read at scrape time."""

    def collect(self) -> Iterator[Metric]:
        rt = _runtime
        if rt is None:
            return
        snap = rt.loop.engine.snapshot()
        yield CounterMetricFamily(WORKER_STEPS, "batched decode steps", value=snap.get("batches", 0))
        yield CounterMetricFamily(WORKER_FRAMES, "mel frames decoded (50 per second of audio)",
                                  value=snap.get("mel_frames", 0))
        installs = CounterMetricFamily(WORKER_INSTALLS, "voices installed and evicted", labels=["event"])
        installs.add_metric(["installed"], snap.get("installs", 0))
        installs.add_metric(["evicted"], snap.get("evictions", 0))
        yield installs
        yield GaugeMetricFamily("wavefarm_worker_live_jobs", "jobs in the engine", value=snap["live_jobs"])
        yield GaugeMetricFamily("wavefarm_worker_voice_bytes", "device bytes of installed voices",
                                value=snap["voice_bytes"])


REGISTRY.register(EngineCollector())


class InstallRecords:
    """This worker's installed voices in the database (`worker_voices`), written by the bookkeeper."""

    def __init__(self, book: Bookkeeper, sessions: sessionmaker[Session], worker_id: str) -> None:
        self.book, self.sessions, self.worker_id = book, sessions, worker_id

    def on_voice_event(self, event: EngineEvent) -> None:
        """Engine thread: installs and evictions become rows (queued, in order)."""
        if isinstance(event, VoiceInstalled):
            voice_id, nbytes = event.voice_id, event.nbytes
            self.book.put(lambda: self._db(queries.record_install, voice_id=voice_id, nbytes=nbytes))
        elif isinstance(event, VoiceEvicted):
            evicted = event.voice_id
            self.book.put(lambda: self._db(queries.remove_worker_voice, voice_id=evicted))

    def pin(self, voice_id: str, delta: int) -> None:
        self.book.put(lambda: self._db(queries.pin_worker_voice, voice_id=voice_id, delta=delta))

    def _db(self, query: Callable[..., Any], **kwargs: Any) -> None:
        with session_scope(self.sessions) as session:
            query(session=session, worker_id=self.worker_id, **kwargs)


# -- one process's resources -----------------------------------------------------------------------
@dataclass
class Runtime:
    settings: Settings
    worker_id: str
    sessions: sessionmaker[Session]
    store: FeatureStore
    artifacts: ArtifactStore
    loop: EngineLoop
    book: Bookkeeper
    installs: InstallRecords

    def close(self) -> None:
        self.loop.stop()
        self.book.drain()
        self.store.close()


EngineFactory = Callable[[Settings, FeatureSource, InlinePreparer], Engine]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DUMMY_SEED = 0
INLINE_PREP_THREADS = 1


def build_engine(settings: Settings, features: FeatureSource, preparer: InlinePreparer) -> Engine:
    """Model, speaker models, decoder and voice cache on the configured device -> the engine."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    args = ModelArgs.preset(settings.model_preset)
    speaker: Speaker
    if settings.model_dir is None:
        model = load_dummy(args, DUMMY_SEED, device=device, dtype=dtype)
        speaker = StandInSpeaker(device)
    else:
        model = load_model_folder(settings.model_dir, device=device, dtype=dtype, args=args)
        speaker = SpeakerFrontend.from_folder(settings.model_dir, device=device)
    decoder = StreamingDecoder(model, device=device, dtype=dtype, micro_batch_size=settings.micro_batch_size)
    voices = VoiceCache(partial(install_voice, speaker=speaker, decoder=decoder), device=device,
                        max_voices=settings.voice_cache_capacity)
    # Inline host halves run beside the decode loop (CPU work; torch releases the GIL in it).
    pool = ThreadPoolExecutor(max_workers=INLINE_PREP_THREADS, thread_name_prefix="wavefarm-inline-prep")
    return Engine(decoder, voices, features=features, preparer=preparer,
                  micro_batch_size=settings.micro_batch_size, prep_wait_ms=settings.prep_wait_ms,
                  prep_pool=pool)


def build_runtime(settings: Settings, worker_id: str,
                  engine_factory: EngineFactory = build_engine) -> Runtime:
    sessions = make_sessionmaker(make_engine(settings.database_url))
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    artifacts = ArtifactStore(settings.artifact_root)
    artifacts.ensure_layout()
    preparer = ReferencePreparer(settings, sessions, artifacts, store)
    engine = engine_factory(settings, StoreFeatures(store), preparer)
    with session_scope(sessions) as session:  # a restarted worker's device memory is empty
        queries.clear_worker_voices(session=session, worker_id=worker_id)
    book = Bookkeeper()
    installs = InstallRecords(book, sessions, worker_id)
    loop = EngineLoop(engine, installs.on_voice_event)
    loop.start()
    log.info("GPU worker %s ready: device %s, preset %s, %d slots, micro-batch %d", worker_id,
             settings.device, settings.model_preset, settings.worker_slots, settings.micro_batch_size)
    return Runtime(settings=settings, worker_id=worker_id, sessions=sessions, store=store,
                   artifacts=artifacts, loop=loop, book=book, installs=installs)


def runtime(worker_id: str) -> Runtime:
    """The process's runtime, built on first use (the `worker_ready` signal builds it eagerly)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = build_runtime(get_settings(), worker_id)
        return _runtime


# -- one job ---------------------------------------------------------------------------------------
class _Output:
    """The job's audio file, written incrementally beside its final name and renamed into place."""

    def __init__(self, artifacts: ArtifactStore, job_id: str, fmt: str) -> None:
        self.relpath = artifacts.output_relpath(job_id, fmt)
        self.path: Path = artifacts.path(self.relpath)
        self.handle, self.tmp = open_output(self.path, fmt)

    def write(self, samples: Any) -> None:
        self.handle.write(samples.numpy())

    def commit(self) -> None:
        commit_output(self.handle, self.tmp, self.path)

    def discard(self) -> None:
        if not self.handle.closed:
            self.handle.close()
        self.tmp.unlink(missing_ok=True)


@dataclass
class _Progress:
    voice_id: str
    frames_per_chunk: list[int]
    frames_done: int = 0
    next_report: float = 0.0
    pinned: bool = False


class JobRun:
    """The body of one `synth` task, in numbered steps."""

    def __init__(self, rt: Runtime, task: Task, job_id: str) -> None:
        self.rt, self.task, self.job_id = rt, task, job_id

    def run(self) -> dict[str, Any]:
        if self.rt.loop.running(self.job_id):  # a duplicate delivery while the job streams here
            return {"job_id": self.job_id, "status": "skipped", "worker": self.rt.worker_id}
        job = self._claim()  # 1. claim the attempt (None: finished, cancelled or taken)
        if job is None:
            return {"job_id": self.job_id, "status": "skipped", "worker": self.rt.worker_id}
        engine_job, fmt = job
        output: _Output | None = None
        submitted = False
        try:
            output = _Output(self.rt.artifacts, self.job_id, fmt)  # 2. open the output's temp file
            events = self.rt.loop.submit(engine_job)  # 3. hand the job to the engine
            submitted = True
            return self._stream(events, output, engine_job)  # 4. write audio until the end
        except BaseException as exc:
            if output is not None:
                output.discard()
            if submitted:  # e.g. the database went away mid-job: free the engine slot and the pin
                self.rt.loop.abort(self.job_id)
            if not isinstance(exc, EngineFailure | Reject):
                self._finish(JobStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
            raise

    def _claim(self) -> tuple[EngineJob, str] | None:
        settings = self.rt.settings
        with session_scope(self.rt.sessions) as session:
            if queries.get_job(session=session, job_id=self.job_id) is None:
                log.warning("synth %s: no such job (withdrawn, or a worker on another database)", self.job_id)
                return None
            row = queries.claim_job_attempt(session=session, job_id=self.job_id, worker=self.rt.worker_id,
                                            max_attempts=settings.job_max_attempts)
            if row is None:
                return None
            voice = queries.require_voice(session=session, voice_id=row.voice_id)
            hint = "failed" if voice.status == VoiceStatus.FAILED else None
            tokens = job_tokens(job=row, artifacts=self.rt.artifacts)
            job = EngineJob(job_id=row.id, voice_id=row.voice_id, tokens=tokens, seed=row.seed,
                            priority=row.priority, prep_hint=hint)
            return job, row.output_format

    def _stream(self, events: queue.Queue[EngineEvent], output: _Output, job: EngineJob) -> dict[str, Any]:
        progress = _Progress(job.voice_id, [c.mel_frames for c in plan_chunks(len(job.tokens))])
        try:
            while True:
                try:
                    event = events.get(timeout=self.rt.settings.progress_interval_s)
                except queue.Empty:
                    if not self.rt.loop.alive():  # the worker is shutting down under this job
                        raise Reject("engine stopped; the job goes back to the queue", requeue=True) from None
                    event = None
                result = self._handle(event, output, progress)
                if result is not None:
                    return result
                self._report(progress)
        finally:
            if progress.pinned:
                self.rt.installs.pin(job.voice_id, -1)

    def _handle(self, event: EngineEvent | None, output: _Output,
                progress: _Progress) -> dict[str, Any] | None:
        if isinstance(event, VoiceReady):
            self._running(event, progress)
        elif isinstance(event, Audio):
            output.write(event.samples)
            progress.frames_done += progress.frames_per_chunk[event.chunk_index]
        elif isinstance(event, Finished):
            output.commit()
            self._finish(JobStatus.SUCCEEDED, output_path=output.relpath)
            return {"job_id": self.job_id, "status": "succeeded", "output_path": output.relpath,
                    "prep_path": event.prep_path, "audio_s": event.audio_s, "timings": event.timings,
                    "worker": self.rt.worker_id}
        elif isinstance(event, Failed):
            self._finish(JobStatus.FAILED, error=event.error)
            raise EngineFailure(event.error)
        elif isinstance(event, Aborted):
            output.discard()
            if event.prep_path == "abandoned":
                self._count("abandoned")
            self._reclaim_features(progress.voice_id)
            return {"job_id": self.job_id, "status": "cancelled", "prep_path": event.prep_path,
                    "worker": self.rt.worker_id}
        return None

    def _running(self, event: VoiceReady, progress: _Progress) -> None:
        with session_scope(self.rt.sessions) as session:
            queries.mark_job_running(session=session, job_id=self.job_id, prep_path=event.prep_path)
        self.rt.installs.pin(event.voice_id, +1)
        progress.pinned = True
        self._count(event.prep_path)

    def _report(self, progress: _Progress) -> None:
        """Throttled: progress to the database and to Celery; a job no longer live is aborted."""
        now = time.monotonic()
        if now < progress.next_report:
            return
        progress.next_report = now + self.rt.settings.progress_interval_s
        total = sum(progress.frames_per_chunk)
        with session_scope(self.rt.sessions) as session:
            live = queries.update_progress(session=session, job_id=self.job_id,
                                           frames_done=progress.frames_done)
        meta = {"job_id": self.job_id, "frames_done": progress.frames_done, "frames_total": total}
        self.task.send_event("task-progress", **meta)
        if self.task.request.id is not None:
            self.task.update_state(state="PROGRESS", meta=meta)
        if not live or self._cancel_requested():
            self.rt.loop.abort(self.job_id)

    def _reclaim_features(self, voice_id: str) -> None:
        """Features prepared for jobs that were all cancelled (inline ones too) must not linger."""
        with session_scope(self.rt.sessions) as session:
            if reclaim_abandoned_voice(session=session, store=self.rt.store, voice_id=voice_id):
                log.info("voice %s: every job that wanted it was cancelled; features reclaimed", voice_id)

    def _cancel_requested(self) -> bool:
        try:
            return self.rt.store.is_cancelled(self.job_id)
        except redis.RedisError:
            return False  # the database status is checked too (update_progress)

    def _count(self, prep_path: str | None) -> None:
        try:
            self.rt.store.incr(COUNTER_PREP_PATH, prep_path or "unknown")
        except redis.RedisError as exc:
            log.warning("could not count prep path %s: %s", prep_path, exc)

    def _finish(self, status: JobStatus, *, output_path: str | None = None, error: str | None = None) -> None:
        with session_scope(self.rt.sessions) as session:
            queries.finish_job(session=session, job_id=self.job_id, status=status, output_path=output_path,
                               error=error)


# -- Celery ----------------------------------------------------------------------------------------
def make_gpu_celery(settings: Settings) -> Celery:
    """The GPU worker's Celery app: same wire contract as the CPU app (JSON, acks late), own tasks."""
    app = Celery("wavefarm-gpu", broker=settings.broker_url, backend=settings.result_backend)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        worker_send_task_events=True, task_send_sent_event=True, task_track_started=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s,
                                  "queue_order_strategy": "priority", "priority_steps": list(range(10))},
        broker_connection_retry_on_startup=True,
        task_queues=(Queue(settings.queue_gpu),), task_default_queue=settings.queue_gpu,
        worker_concurrency=settings.worker_slots, worker_pool="threads",
        worker_hijack_root_logger=False,
    )
    return app


celery = make_gpu_celery(get_settings())


@celery.task(name="synth", bind=True)
def synth(self: Task, job_id: str) -> dict[str, Any]:
    return JobRun(runtime(self.request.hostname or "gpu-worker"), self, job_id).run()


@signals.worker_ready.connect
def _build_on_start(sender: Any = None, **_: Any) -> None:
    runtime(getattr(sender, "hostname", None) or "gpu-worker")


@signals.worker_shutdown.connect
def _close_on_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.close()
