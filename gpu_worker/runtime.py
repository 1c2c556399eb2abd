"""The GPU worker's long-lived runtime: model, engine thread, bookkeeping thread, metrics.

Built once per process (`gpu_worker.worker.runtime()`); the `synth` tasks in `gpu_worker.worker` are
thin adapters over it. One engine thread owns the model and the device (`EngineLoop`): it steps the
engine and routes each event to its job's queue. Voice installs and evictions are recorded per worker
in the database by a small bookkeeping thread (`Bookkeeper`), so no database write sits inside the
decode loop. Not in here: Celery, job claiming, output files.
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
from typing import Any

import redis
import torch
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
from app.audio import load_reference
from app.db import queries
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.errors import EngineFailure, FeaturesMissing
from app.features import PromptHostFeatures, host_half
from app.settings import Settings, get_settings
from app.store import FeatureStore
from app.submit import reclaim_abandoned_voice, reference_limits
from gpu_worker.decoder import StreamingDecoder
from gpu_worker.engine import Engine, FeatureSource, InlinePreparer
from gpu_worker.loading import load_dummy, load_model_folder, prepare_hift
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.linear import set_cpu_linear
from gpu_worker.prompt import Speaker, StandInSpeaker, install_voice, install_voices
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
)
from gpu_worker.voices import VoiceCache

log = logging.getLogger(__name__)

TERMINAL = (Finished, Failed, Aborted)
STATS_LOG_S = 60.0  # how often the engine thread logs its counters
_runtime: Runtime | None = None  # the process's runtime (see `runtime()`)
_runtime_lock = threading.Lock()


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
    set_cpu_linear(settings.cpu_linear)
    if settings.torch_threads:
        # Small models on a busy CPU lose more to thread hand-offs than they gain (docs/PERFORMANCE.md).
        torch.set_num_threads(settings.torch_threads)
    args = ModelArgs.preset(settings.model_preset)
    speaker: Speaker
    if settings.model_dir is None:
        model = load_dummy(args, DUMMY_SEED, device=device, dtype=dtype)
        speaker = StandInSpeaker(device)
    else:
        model = load_model_folder(settings.model_dir, device=device, dtype=dtype, args=args)
        speaker = SpeakerFrontend.from_folder(settings.model_dir, device=device)
    prepare_hift(model.hift, DTYPES[settings.hift_dtype])  # g v / |v| folded once; the body's dtype
    decoder = StreamingDecoder(model, device=device, dtype=dtype, micro_batch_size=settings.micro_batch_size)
    voices = VoiceCache(partial(install_voice, speaker=speaker, decoder=decoder), device=device,
                        max_voices=settings.voice_cache_capacity,
                        batch_installer=partial(install_voices, speaker=speaker, decoder=decoder))
    # Inline host halves run beside the decode loop (CPU work; torch releases the GIL in it).
    pool = ThreadPoolExecutor(max_workers=INLINE_PREP_THREADS, thread_name_prefix="wavefarm-inline-prep")
    lane = None
    if settings.install_lane and device.type == "cpu":  # on CUDA installs already overlap (side stream)
        lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wavefarm-install-lane")
    return Engine(decoder, voices, features=features, preparer=preparer,
                  micro_batch_size=settings.micro_batch_size, prep_wait_ms=settings.prep_wait_ms,
                  prep_pool=pool, install_lane=lane, admission_window_ms=settings.admission_window_ms,
                  install_batch=settings.install_batch)


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


def current_runtime() -> Runtime | None:
    """The runtime if this process built one (metrics and shutdown must not build it)."""
    return _runtime
