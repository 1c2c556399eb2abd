"""Cancellation at every stage of a job, through the real pieces in process: `submit_job`, `voice.prepare`
(`prepare_voice`), the GPU worker's `JobRun` on the real engine (tiny preset, dummy weights), real Redis
and SQLite. Slow stages are held open with events so the cancel lands exactly where the test says.

After each: the job is `cancelled`, the engine has no live job, no pins are left (engine and database),
no file under the artifact root is unreferenced, and a preparation that was running when the job went
away is reclaimed once it settles (features, install) unless another live job shares the voice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import app.voices.features
import gpu_worker.worker.output
from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import JobStatus, VoiceStatus
from app.storage.keys import COUNTER_PREP_PATH
from app.voices.service import reclaim_abandoned_voice
from gpu_worker.worker.job import JobRun
from gpu_worker.worker.runtime import Runtime
from tasks.voice import prepare_voice
from tests.support.context import context_for
from tests.support.runtime import (
    VOICE_A,
    VOICE_B,
    RecordingSender,
    RecordingTask,
    job_row,
    prepare_ahead,
    submit,
)

pytestmark = pytest.mark.timeout(120)


# -- helpers ------------------------------------------------------------------------------------------
def cancel(rt: Runtime, sqlite_sessions, job_id: str) -> None:
    """What POST /v1/jobs/{id}/cancel does."""
    with sqlite_sessions() as session:
        assert lifecycle.cancel(session=session, job_id=job_id)
        voice_id = job_row(sqlite_sessions, job_id).voice_id
        reclaim_abandoned_voice(session=session, store=rt.store, voice_id=voice_id)
        session.commit()
    rt.store.request_cancel(job_id, ttl_s=600)


def run_in_thread(rt: Runtime, job_id: str) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            result.update(JobRun(rt, RecordingTask(), job_id).run())
        except Exception as exc:  # the test inspects it
            result["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    return thread, result


def wait_for(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Gate:
    """Wraps a function so that calls block until released; `entered` is set once a call is inside."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.entered, self.release = fn, threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.release.wait(60)
        return self.fn(*args, **kwargs)


def resources(rt: Runtime, sqlite_sessions) -> Context:
    """A CPU worker's clients on the runtime's database, store and files."""
    return context_for(rt.settings, RecordingSender(), sessions=sqlite_sessions, store=rt.store,
                       artifacts=rt.artifacts)


def assert_nothing_leaked(rt: Runtime, sqlite_sessions, *, keep_voice: str | None = None) -> None:
    wait_for(lambda: not rt.loop.engine.live_jobs())
    time.sleep(0.3)  # two more engine steps: reclaimed installs are collected in the finish phase
    engine = rt.loop.engine
    assert all((engine.voices.get(v).pins == 0) for v in engine.voices)
    installed = set(engine.voices)
    assert installed == ({keep_voice} & installed if keep_voice else set()), installed
    rt.book.drain()
    with sqlite_sessions() as session:
        rows = queries.list_worker_voices(session=session, worker_id=rt.worker_id)
        assert [w.pinned for w in rows] == [0] * len(rows)
        referenced = queries.referenced_paths(session=session)
    assert rt.artifacts.list_orphans(referenced=referenced, older_than_s=0) == []


def features_kept(rt: Runtime, sqlite_sessions, job_id: str) -> bool:
    return rt.store.exists(job_row(sqlite_sessions, job_id).voice_id)


# -- the stages ---------------------------------------------------------------------------------------
def test_cancelled_while_queued_the_delivery_is_skipped(make_runtime, sqlite_sessions) -> None:
    rt = make_runtime()
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    cancel(rt, sqlite_sessions, job_id)
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "skipped"
    assert job_row(sqlite_sessions, job_id).status == JobStatus.CANCELLED
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_while_voice_prepare_runs_its_features_are_reclaimed_when_it_settles(
        make_runtime, sqlite_sessions, monkeypatch) -> None:
    rt = make_runtime(prep_wait_ms=60_000)  # the GPU side waits for the CPU preparation
    gate = Gate(app.voices.features.host_half)
    monkeypatch.setattr(app.voices.features, "host_half", gate)
    job_id = submit(rt, sqlite_sessions, VOICE_B, n_tokens=30)
    voice_id = job_row(sqlite_sessions, job_id).voice_id
    outcome: dict[str, str] = {}
    res = resources(rt, sqlite_sessions)
    cpu = threading.Thread(target=lambda: outcome.update(o=prepare_voice(voice_id, res)))
    cpu.start()
    assert gate.entered.wait(30)
    gpu, result = run_in_thread(rt, job_id)
    wait_for(lambda: bool(rt.loop.engine.live_jobs()))
    cancel(rt, sqlite_sessions, job_id)
    gpu.join(30)
    assert result["status"] == "cancelled" and result["prep_path"] == "abandoned"
    gate.release.set()  # the preparation settles after its only job went away
    cpu.join(30)
    assert outcome["o"] == "reclaimed" and not rt.store.exists(voice_id)
    with sqlite_sessions() as session:
        assert queries.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING
    assert rt.store.count(COUNTER_PREP_PATH, "abandoned") == 1
    assert_nothing_leaked(rt, sqlite_sessions)


def test_a_shared_voice_is_kept_for_the_job_that_was_not_cancelled(make_runtime, sqlite_sessions,
                                                                   monkeypatch) -> None:
    rt = make_runtime(prep_wait_ms=60_000)
    gate = Gate(app.voices.features.host_half)
    monkeypatch.setattr(app.voices.features, "host_half", gate)
    gone = submit(rt, sqlite_sessions, VOICE_B, n_tokens=30)
    kept = submit(rt, sqlite_sessions, VOICE_B, n_tokens=40)
    voice_id = job_row(sqlite_sessions, gone).voice_id
    cpu = threading.Thread(target=lambda: prepare_voice(voice_id, resources(rt, sqlite_sessions)))
    cpu.start()
    assert gate.entered.wait(30)
    gpu_gone, gone_result = run_in_thread(rt, gone)
    gpu_kept, kept_result = run_in_thread(rt, kept)
    wait_for(lambda: len(rt.loop.engine.live_jobs()) == 2)
    cancel(rt, sqlite_sessions, gone)
    gpu_gone.join(30)
    gate.release.set()
    cpu.join(30)
    gpu_kept.join(60)
    assert gone_result["status"] == "cancelled" and kept_result["status"] == "succeeded"
    assert kept_result["prep_path"] == "late" and rt.store.exists(voice_id)
    assert_nothing_leaked(rt, sqlite_sessions, keep_voice=voice_id)
    assert voice_id in rt.loop.engine.voices  # a job finished with it: a normal LRU entry


def test_cancelled_after_preparation_finished_but_before_install(make_runtime, sqlite_sessions) -> None:
    rt = make_runtime()
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    voice_id = job_row(sqlite_sessions, job_id).voice_id
    assert prepare_voice(voice_id, resources(rt, sqlite_sessions)) == "prepared"
    cancel(rt, sqlite_sessions, job_id)  # the synth message has not reached the GPU worker yet
    assert not rt.store.exists(voice_id)
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "skipped"
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_after_a_failed_preparation_nothing_is_left(make_runtime, sqlite_sessions) -> None:
    rt = make_runtime(prep_wait_ms=60_000)
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    voice_id = job_row(sqlite_sessions, job_id).voice_id
    with sqlite_sessions() as session:
        reference = queries.require_voice(session=session, voice_id=voice_id).reference_path
    rt.artifacts.path(reference).write_bytes(b"RIFF garbage")  # the stored reference went bad
    assert prepare_voice(voice_id, resources(rt, sqlite_sessions)) == "failed"
    gpu, result = run_in_thread(rt, job_id)  # prep hint "failed": the worker prepares inline (and fails)
    gpu.join(60)
    cancel_after = job_row(sqlite_sessions, job_id).status
    if cancel_after in (JobStatus.QUEUED, JobStatus.PREPARING):
        cancel(rt, sqlite_sessions, job_id)
    assert job_row(sqlite_sessions, job_id).status in (JobStatus.FAILED, JobStatus.CANCELLED)
    assert not rt.store.exists(voice_id)
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_while_the_worker_prepares_inline_nothing_is_installed_or_kept(
        make_runtime, sqlite_sessions, monkeypatch) -> None:
    rt = make_runtime(prep_wait_ms=0)  # straight to inline preparation, in the engine's pool
    gate = Gate(app.voices.features.host_half)
    monkeypatch.setattr(app.voices.features, "host_half", gate)
    job_id = submit(rt, sqlite_sessions, VOICE_B, n_tokens=30)
    gpu, result = run_in_thread(rt, job_id)
    assert gate.entered.wait(30)
    cancel(rt, sqlite_sessions, job_id)
    gpu.join(30)
    assert result["status"] == "cancelled" and result["prep_path"] == "abandoned"
    gate.release.set()  # the inline preparation settles after the job went away
    wait_for(lambda: not rt.loop.engine.resolver.preparing)
    time.sleep(0.3)
    assert not features_kept(rt, sqlite_sessions, job_id)
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_while_installing_the_install_is_reclaimed_once_it_settles(make_runtime,
                                                                           sqlite_sessions) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    voices = rt.loop.engine.voices
    gate = Gate(voices._installer)
    voices._installer = gate
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    gpu, result = run_in_thread(rt, job_id)
    assert gate.entered.wait(30)
    cancel(rt, sqlite_sessions, job_id)
    time.sleep(0.2)  # the worker sees the flag while the engine thread is still inside the install
    gate.release.set()
    gpu.join(30)
    assert result["status"] == "cancelled"
    assert not features_kept(rt, sqlite_sessions, job_id)
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_mid_decode_the_partial_output_is_removed(make_runtime, sqlite_sessions) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=600)
    gpu, result = run_in_thread(rt, job_id)
    wait_for(lambda: job_row(sqlite_sessions, job_id).frames_done > 0)
    cancel(rt, sqlite_sessions, job_id)
    gpu.join(60)
    assert result["status"] == "cancelled" and job_row(sqlite_sessions, job_id).status == JobStatus.CANCELLED
    assert not list((rt.artifacts.root / "outputs").iterdir())
    assert_nothing_leaked(rt, sqlite_sessions)


def test_cancelled_while_finishing_the_job_stays_cancelled_and_leaves_no_file(
        make_runtime, sqlite_sessions, monkeypatch) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sqlite_sessions, VOICE_A, n_tokens=30)
    real_commit = gpu_worker.worker.output.commit_output

    def cancel_then_commit(*args: Any) -> None:  # the cancel lands between the last audio and the commit
        cancel(rt, sqlite_sessions, job_id)
        real_commit(*args)

    monkeypatch.setattr(gpu_worker.worker.output, "commit_output", cancel_then_commit)
    result = JobRun(rt, RecordingTask(), job_id).run()
    row = job_row(sqlite_sessions, job_id)
    assert row.status == JobStatus.CANCELLED and row.output_path is None
    assert result["status"] == "cancelled"
    assert not list((rt.artifacts.root / "outputs").iterdir())
    assert_nothing_leaked(rt, sqlite_sessions, keep_voice=row.voice_id)
