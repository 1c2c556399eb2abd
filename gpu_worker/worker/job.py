"""One `synth` task's body: a job from its claim to its file, in numbered steps (`JobRun.run`).

0. a text job's tokens, from the guide speech a CPU worker stored, tokenized on this worker's lane with
other jobs' segments and stored before any claim (`gpu_worker.worker.guide`);
1. claim the job's next attempt in the database, leased (`app.lifecycle`: nothing to do when it finished,
was cancelled or an attempt holds its lease); 2. open its output's temp file; 3. hand it to the engine
(`EngineLoop.submit`); 4. write its audio as it arrives, report progress (database, throttled, which
renews the lease; Celery `task-progress` events and task state for Flower), and rename the file into
place at the end. Audio with a NaN or infinite sample, or one value throughout (a broken voice or model:
a constant -1.0 is what NaN features decode to), is never recorded as a success: the job fails with the
reason and its file is discarded. A job no longer live (cancelled, or finished elsewhere) or no longer
this attempt's (its lease passed and another worker claimed it) is aborted at the next report. The
database, the broker or Redis being away, or the engine stopping under the job (the worker shutting
down), sends it back to the queue with `Reject` (a new, counted attempt), not to failure; the task
releases it first (`gpu_worker.worker.recovery`). Settling a job is the lifecycle's, follow-up included
(`lifecycle.settle_and_send`: a book chapter it made ready is rung there).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

import kombu.exceptions
import redis
from celery import Task
from celery.exceptions import Reject
from sqlalchemy.exc import OperationalError

from app import lifecycle
from app.db import queries
from app.db.models import DONE_JOB_STATUSES, JobStatus, VoiceStatus
from app.db.session import session_scope
from app.errors import EngineFailure
from app.storage.keys import COUNTER_PREP_PATH
from app.submission.jobs import job_tokens
from app.voices.service import reclaim_abandoned_voice
from gpu_worker.engine.streams import (
    Aborted,
    Audio,
    EngineEvent,
    EngineJob,
    Failed,
    Finished,
    VoiceReady,
    plan_chunks,
)
from gpu_worker.worker.guide import tokenize_text_job
from gpu_worker.worker.output import Output, drop_partials, quiet_gain
from gpu_worker.worker.runtime import Runtime, dummy_weights_note

log = logging.getLogger(__name__)

# The database, the broker or Redis not answering for a while: the job goes back to the queue (its
# next delivery is a new, counted attempt), it is not failed.
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError)
FINISH_RETRY_S = 30.0  # how long a decoded job waits for the database to record it


@dataclass
class _Progress:
    voice_id: str
    frames_per_chunk: list[int]
    frames_done: int = 0
    next_report: float = 0.0
    pinned: bool = False
    audio_reported: bool = False  # the first audio is reported at once, whatever the throttle


class JobRun:
    """The body of one `synth` task, in numbered steps."""

    def __init__(self, rt: Runtime, task: Task, job_id: str) -> None:
        self.rt, self.task, self.job_id = rt, task, job_id
        self.attempt: int | None = None  # the job's `attempts` once this run claimed it: its lease's name

    def run(self) -> dict[str, Any]:
        if self.rt.loop.running(self.job_id):  # a duplicate delivery while the job streams here
            return {"job_id": self.job_id, "status": "skipped", "worker": self.rt.worker_id}
        if self._tokenize() == "failed":  # 0. a text job's tokens (its row says why not)
            return {"job_id": self.job_id, "status": "failed", "worker": self.rt.worker_id}
        job = self._claim()  # 1. claim the attempt (None: finished, cancelled or taken)
        if job is None:
            return {"job_id": self.job_id, "status": "skipped", "worker": self.rt.worker_id}
        engine_job, fmt = job
        output: Output | None = None
        submitted = False
        try:
            output = Output(self.rt.artifacts, self.job_id, fmt, gain=quiet_gain(  # 2. open its temp file
                self.rt.settings.test_quiet_renders, len(engine_job.tokens), engine_job.seed))
            events = self.rt.loop.submit(engine_job)  # 3. hand the job to the engine
            submitted = True
            return self._stream(events, output, engine_job)  # 4. write audio until the end
        except BaseException as exc:
            if output is not None:
                output.discard()
            if submitted:  # e.g. the database went away mid-job: free the engine slot and the pin
                self.rt.loop.abort(self.job_id)
            if isinstance(exc, TRANSIENT):
                log.warning("synth %s: %s; back to the queue", self.job_id, exc)
                raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from exc
            if not isinstance(exc, EngineFailure | Reject):
                self._finish(JobStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
            raise

    def _tokenize(self) -> str:
        try:
            return tokenize_text_job(self.rt, self.rt.guide, self.job_id)
        except TRANSIENT as exc:
            log.warning("synth %s: %s while tokenizing; back to the queue", self.job_id, exc)
            raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from exc

    def _claim(self) -> tuple[EngineJob, str] | None:
        settings = self.rt.settings
        with session_scope(self.rt.sessions) as session:
            found = queries.get_job(session=session, job_id=self.job_id)
            if found is None:
                log.warning("synth %s: no such job (withdrawn, or a worker on another database)", self.job_id)
                return None
            if not queries.is_tokenized(found):  # no speech stored: job.tokenize stores it, sends synth again
                log.warning("synth %s: a text job without its guide speech (job.tokenize stores it)",
                            self.job_id)
                return None
            row = lifecycle.claim(session=session, job_id=self.job_id, worker=self.rt.worker_id,
                                  max_attempts=settings.job_max_attempts, lease_s=settings.job_lease_s)
            if row is None:
                if queries.require_job(session=session, job_id=self.job_id).status in DONE_JOB_STATUSES:
                    drop_partials(self.rt.artifacts, self.job_id)  # left by a worker killed mid-job
                return None
            self.attempt = row.attempts
            if settings.model_dir is None:
                queries.add_job_note(session=session, job_id=row.id, note=dummy_weights_note(settings))
            voice = queries.require_voice(session=session, voice_id=row.voice_id)
            hint = "failed" if voice.status == VoiceStatus.FAILED else None
            if voice.status == VoiceStatus.PENDING and self.rt.cpu_backlog.full():
                hint = "queue_full"  # its preparation waits behind a deep cpu queue: do not wait for it
            tokens = job_tokens(job=row, artifacts=self.rt.artifacts)
            job = EngineJob(job_id=row.id, voice_id=row.voice_id, tokens=tokens, seed=row.seed,
                            priority=row.priority, prep_hint=hint)
            return job, row.output_format

    def _stream(self, events: queue.Queue[EngineEvent], output: Output, job: EngineJob) -> dict[str, Any]:
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

    def _handle(self, event: EngineEvent | None, output: Output,
                progress: _Progress) -> dict[str, Any] | None:
        if isinstance(event, VoiceReady):
            self._running(event, progress)
        elif isinstance(event, Audio):
            output.write(event.samples)
            progress.frames_done += progress.frames_per_chunk[event.chunk_index]
        elif isinstance(event, Finished):
            self._refuse_garbage(output)
            output.commit()  # on disk first: nothing is reported done that is not there
            if not self._finish_decoded(output.relpath):
                return self._not_recorded(output, progress.voice_id, event.prep_path)
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

    def _refuse_garbage(self, output: Output) -> None:
        """Audio that is not audio is never a success: the job fails with the reason, its file goes."""
        defect = output.defect()
        if defect is not None:
            output.discard()
            self._finish(JobStatus.FAILED, error=defect)
            log.error("synth %s: %s", self.job_id, defect)
            raise EngineFailure(defect)

    def _not_recorded(self, output: Output, voice_id: str, prep_path: str) -> dict[str, Any]:
        """The job stopped being live while it finished: cancelled (its file goes), or recorded by
        another attempt (same file name: kept)."""
        with session_scope(self.rt.sessions) as session:
            status = queries.require_job(session=session, job_id=self.job_id).status
        if status == JobStatus.SUCCEEDED:
            return {"job_id": self.job_id, "status": "skipped", "worker": self.rt.worker_id}
        output.withdraw()
        self._reclaim_features(voice_id)
        return {"job_id": self.job_id, "status": str(status), "prep_path": prep_path,
                "worker": self.rt.worker_id}

    def _running(self, event: VoiceReady, progress: _Progress) -> None:
        with session_scope(self.rt.sessions) as session:
            lifecycle.mark_running(session=session, job_id=self.job_id, prep_path=event.prep_path,
                                   attempt=self.attempt)
        self.rt.installs.pin(event.voice_id, +1)
        progress.pinned = True
        self._count(event.prep_path)

    def _report(self, progress: _Progress) -> None:
        """Throttled: progress to the database and to Celery; a job no longer live is aborted."""
        now = time.monotonic()
        first_audio = progress.frames_done > 0 and not progress.audio_reported
        if now < progress.next_report and not first_audio:
            return
        progress.next_report = now + self.rt.settings.progress_interval_s
        progress.audio_reported = progress.frames_done > 0
        total = sum(progress.frames_per_chunk)
        try:
            with session_scope(self.rt.sessions) as session:
                live = lifecycle.renew(session=session, job_id=self.job_id, frames_done=progress.frames_done,
                                       attempt=self.attempt, lease_s=self.rt.settings.job_lease_s)
        except OperationalError as exc:  # the database is away for a moment: keep decoding
            log.warning("synth %s: progress not recorded: %s", self.job_id, exc)
            live = True
        meta = {"job_id": self.job_id, "frames_done": progress.frames_done, "frames_total": total}
        try:  # a view for Flower: the broker or result store being away must not cost the job
            self.task.send_event("task-progress", **meta)
            if self.task.request.id is not None:
                self.task.update_state(state="PROGRESS", meta=meta)
        except (*TRANSIENT, ConnectionError, OSError) as exc:
            log.warning("synth %s: progress event not sent: %s", self.job_id, exc)
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

    def _finish(self, status: JobStatus, *, output_path: str | None = None, error: str | None = None) -> bool:
        with session_scope(self.rt.sessions) as session:  # commits, then sends the follow-up it recorded
            return lifecycle.settle_and_send(session=session, sender=self.rt.sender,
                                             settings=self.rt.settings, job_id=self.job_id, status=status,
                                             output_path=output_path, error=error)

    def _finish_decoded(self, relpath: str) -> bool:
        """Record success, waiting out a short database outage; False if the job was no longer live."""
        deadline = time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                return self._finish(JobStatus.SUCCEEDED, output_path=relpath)
            except OperationalError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("synth %s: could not record success yet: %s", self.job_id, exc)
                time.sleep(1.0)
