"""The engine thread: one thread owns the engine, and so the model and the device.

`EngineLoop` steps the engine while there is work, routes each event to the queue of the job it belongs
to (the `synth` task waiting on it, `gpu_worker.worker.job`) and hands voice events (installs, evictions) to a
callback, the install records. A step that raises is an engine bug: its live jobs fail, the loop goes on.
Not in here: Celery, the database, the engine's policy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from gpu_worker.engine.core import Engine
from gpu_worker.engine.streams import Aborted, Audio, EngineEvent, EngineJob, Failed, Finished
from gpu_worker.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

TERMINAL = (Finished, Failed, Aborted)
STATS_LOG_S = 60.0  # how often the engine thread logs its counters


class EngineLoop:
    """Owns the engine: steps it on one thread and routes events to per-job queues."""

    def __init__(self, engine: Engine, on_voice_event: Callable[[EngineEvent], None],
                 metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        self._on_voice_event = on_voice_event
        self.metrics = metrics
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
                self.engine.fetch_features()  # the input side's reads, before the step
                events = self.engine.step()
            except Exception as exc:  # an engine bug: fail the live jobs, keep serving
                log.exception("engine step failed; failing its live jobs")
                events = self._fail_live(exc)
            self._observe(self.engine.stats["rows"] - rows, events)
            for event in events:
                self._route(event)
            if not any(isinstance(e, Audio) for e in events):
                time.sleep(self.engine.idle_hint_s())  # every live job is waiting for its voice

    def _observe(self, rows: int, events: list[EngineEvent]) -> None:
        if self.metrics is None:
            return
        if rows > 0:
            self.metrics.rows_per_step.observe(rows)
        for event in events:
            if isinstance(event, Finished) and "first_audio_s" in event.timings:
                self.metrics.first_audio.observe(event.timings["first_audio_s"])

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
