"""A `synth` job's body (`gpu_worker.worker.job.JobRun`) through the real engine (tiny preset, dummy weights)
on real
Redis and SQLite, in process, with a recording stand-in for the Celery task object."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import soundfile as sf
import torch
from celery.exceptions import Reject

from app import lifecycle
from app.audio import load_reference
from app.broker.celery_config import make_celery
from app.broker.queues import open_broker
from app.broker.wire import send_prepare
from app.db import queries
from app.db.models import JobStatus
from app.errors import EngineFailure
from app.settings import Settings
from app.storage.feature_store import FeatureStore
from app.storage.keys import COUNTER_PREP_PATH, feature_key
from app.voices.features import PromptHostFeatures, host_half
from gpu_worker.checkpoint.write import write_official_layout
from gpu_worker.model.config import ModelArgs
from gpu_worker.worker.adapters import StoreFeatures
from gpu_worker.worker.job import JobRun
from tests.support.runtime import VOICE_A, VOICE_B, RecordingTask, job_row, prepare_ahead, submit


def test_a_prepared_ahead_job_streams_into_its_output_file(make_runtime, sessions) -> None:
    rt = make_runtime()
    voice_id = prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sessions, VOICE_A, n_tokens=60)
    task = RecordingTask()
    result = JobRun(rt, task, job_id).run()
    assert result["status"] == "succeeded" and result["prep_path"] == "prepared_ahead"
    audio, rate = sf.read(rt.artifacts.path(result["output_path"]), dtype="float32")
    assert rate == 24000 and audio.shape == (60 * 960,) and abs(audio).max() > 0
    row = job_row(sessions, job_id)
    assert row.status == JobStatus.SUCCEEDED and row.prep_path == "prepared_ahead"
    assert row.worker == rt.worker_id and row.attempts == 1 and row.first_audio_at is not None
    assert row.frames_done == row.frames_total == 120
    assert [k for k, _ in task.events] and all(k == "task-progress" for k, _ in task.events)
    assert rt.store.count(COUNTER_PREP_PATH, "prepared_ahead") == 1
    rt.book.drain()
    with sessions() as session:
        installed = queries.list_worker_voices(session=session, worker_id=rt.worker_id)
    assert [(w.voice_id, w.pinned) for w in installed] == [(voice_id, 0)]
    assert not list((rt.artifacts.root / "outputs").glob("*.part"))


def test_the_job_that_settles_a_chapters_last_segment_sends_its_book_chapter_after_the_commit(
        make_runtime, sessions) -> None:
    rt = make_runtime()
    voice_id = prepare_ahead(rt, VOICE_A)
    jobs = [submit(rt, sessions, VOICE_A, n_tokens=n) for n in (30, 31)]
    book_id, keys = str(uuid.uuid4()), [("k" * 64)[:63] + str(i) for i in range(2)]
    with sessions() as session:  # one chapter of two segments, one of which is each job
        queries.create_book(session=session, new=queries.NewBook(
            id=book_id, voice_id=voice_id, title="t", author="", language="en", output_format="wav",
            m4b=False, target_lufs=None, seed=7, priority=0))
        lifecycle.add_book_plan(session=session, book_id=book_id, title="t", author="", language="en",
                                plan_key="p", chapters=[queries.PlannedChapter(
                                  "one", [(k, "tokens", voice_id) for k in keys], 2.0)])
        lifecycle.claim_next_chapter(session=session, book_id=book_id)
        for key, job_id in zip(keys, jobs, strict=True):
            lifecycle.link_segment_job(session=session, key=key, job_id=job_id, replacing=None, n_tokens=30)
        session.commit()
    first, last = RecordingTask(), RecordingTask()
    assert JobRun(rt, first, jobs[0]).run()["status"] == "succeeded"
    assert rt.sender.sent == []  # the chapter still waits for its other segment
    assert JobRun(rt, last, jobs[1]).run()["status"] == "succeeded"
    assert rt.sender.sent == [("book.chapter", [book_id, 0])]
    with sessions() as session:
        chapter = queries.list_chapters(session=session, book_id=book_id)[0]
    assert (chapter.keys_done, chapter.tokens_done, chapter.ready_at is not None) == (2, 61, True)


def test_first_audio_is_stamped_even_when_the_job_ends_inside_one_progress_interval(make_runtime,
                                                                                    sessions) -> None:
    rt = make_runtime(progress_interval_s=3600.0, job_lease_s=3 * 3600.0)
    prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sessions, VOICE_A, n_tokens=30)
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "succeeded"
    row = job_row(sessions, job_id)
    assert row.first_audio_at is not None and row.first_audio_at >= row.started_at


def test_a_worker_on_a_model_folder_uses_its_checkpoints_and_speaker_models(make_runtime, sessions,
                                                                              tmp_path) -> None:
    folder = tmp_path / "token2wav"
    write_official_layout(folder, ModelArgs.tiny(), seed=3, tokenizer_dtype=np.float16)
    rt = make_runtime(model_dir=folder)
    prepare_ahead(rt, VOICE_A)
    result = JobRun(rt, RecordingTask(), submit(rt, sessions, VOICE_A, n_tokens=30)).run()
    assert result["status"] == "succeeded" and result["prep_path"] == "prepared_ahead"
    audio, _ = sf.read(rt.artifacts.path(result["output_path"]), dtype="float32")
    assert audio.shape == (30 * 960,) and abs(audio).max() > 0


def test_engine_metrics_are_exported_from_the_worker_process(make_runtime, sessions, monkeypatch) -> None:
    from prometheus_client import generate_latest

    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    JobRun(rt, RecordingTask(), submit(rt, sessions, VOICE_A, n_tokens=30)).run()
    text = generate_latest(rt.metrics.registry).decode()
    assert "wavefarm_worker_frames_total 60.0" in text
    assert 'wavefarm_worker_voice_installs_total{event="installed"} 1.0' in text
    for name in ("wavefarm_worker_steps_total", "wavefarm_worker_rows_per_step_bucket",
                 "wavefarm_worker_first_audio_seconds_bucket", "wavefarm_worker_live_jobs 0.0"):
        assert name in text


def test_inline_output_equals_prepared_ahead_output_bit_for_bit(make_runtime, sessions) -> None:
    inline_rt = make_runtime(prep_wait_ms=0)
    inline_job = submit(inline_rt, sessions, VOICE_B, n_tokens=40, seed=3)
    inline = JobRun(inline_rt, RecordingTask(), inline_job).run()
    assert inline["prep_path"] == "inline"
    voice_id = job_row(sessions, inline_job).voice_id
    assert inline_rt.store.get(voice_id) is not None  # kept for later jobs and other workers
    with sessions() as session:
        assert queries.require_voice(session=session, voice_id=voice_id).status == "ready"
    ahead_rt = make_runtime()  # a second worker: nothing installed yet, features already in the store
    ahead_job = submit(ahead_rt, sessions, VOICE_B, n_tokens=40, seed=3)
    ahead = JobRun(ahead_rt, RecordingTask(), ahead_job).run()
    assert ahead["prep_path"] == "prepared_ahead"
    a = ahead_rt.artifacts.path(ahead["output_path"]).read_bytes()
    b = inline_rt.artifacts.path(inline["output_path"]).read_bytes()
    assert a == b


def test_unreadable_stored_features_fall_back_to_inline_and_the_job_succeeds(make_runtime, sessions) -> None:
    rt = make_runtime()
    _, voice_id = load_reference(VOICE_A)
    rt.store.client.set(feature_key(voice_id), b"\x00" * 64)  # not safetensors: a corrupt entry
    job_id = submit(rt, sessions, VOICE_A, n_tokens=20)
    result = JobRun(rt, RecordingTask(), job_id).run()
    assert result["status"] == "succeeded" and result["prep_path"] == "failed"
    assert PromptHostFeatures.from_bytes(rt.store.get(voice_id)).voice_id == voice_id  # repaired


def test_an_unreachable_store_reads_as_unavailable() -> None:
    store = StoreFeatures(FeatureStore.from_url("redis://127.0.0.1:1/0", ttl_s=60))
    with pytest.raises(ConnectionError):
        store.get("0" * 64)


def test_jobs_sharing_a_voice_prepare_it_once(make_runtime, sessions) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    jobs = [submit(rt, sessions, VOICE_A, n_tokens=n, seed=n) for n in (30, 50, 40)]
    results: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda j=j: results.update({j: JobRun(rt, RecordingTask(), j).run()}))
               for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    paths = sorted(r["prep_path"] for r in results.values())
    assert paths == ["already_installed", "already_installed", "prepared_ahead"]
    assert rt.loop.engine.stats["batches"] < rt.loop.engine.stats["rows"]  # rows of jobs shared steps


def test_a_failing_job_fails_alone_and_leaves_no_partial_file(make_runtime, sessions) -> None:
    rt = make_runtime(prep_wait_ms=0)
    bad = submit(rt, sessions, VOICE_A, n_tokens=30)
    assert rt.artifacts.remove(_reference_of(sessions, bad))
    with pytest.raises(EngineFailure):
        JobRun(rt, RecordingTask(), bad).run()
    row = job_row(sessions, bad)
    assert row.status == JobStatus.FAILED and "No such file" in (row.error or "")
    good = submit(rt, sessions, VOICE_B, n_tokens=30)
    assert JobRun(rt, RecordingTask(), good).run()["status"] == "succeeded"
    assert not list((rt.artifacts.root / "outputs").glob("*.part"))


def _reference_of(sessions, job_id: str) -> str:
    with sessions() as session:
        voice = queries.require_voice(session=session, voice_id=job_row(sessions, job_id).voice_id)
        return voice.reference_path


def test_cancel_while_running_stops_the_job_and_removes_its_temp_file(make_runtime, sessions) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sessions, VOICE_A, n_tokens=600)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(JobRun(rt, RecordingTask(), job_id).run()))
    runner.start()
    deadline = time.monotonic() + 60
    while job_row(sessions, job_id).frames_done == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    duplicate = JobRun(rt, RecordingTask(), job_id).run()  # the broker delivered it twice
    assert duplicate["status"] == "skipped" and job_row(sessions, job_id).attempts == 1
    rt.store.request_cancel(job_id, ttl_s=60)
    with sessions() as session:
        assert lifecycle.cancel(session=session, job_id=job_id)
        session.commit()
    runner.join(60)
    assert result["status"] == "cancelled"
    assert job_row(sessions, job_id).status == JobStatus.CANCELLED
    assert not list((rt.artifacts.root / "outputs").iterdir())
    assert rt.loop.engine.live_jobs() == []
    assert rt.store.get(job_row(sessions, job_id).voice_id) is None  # its only job was cancelled
    assert list(rt.loop.engine.voices) == []  # and no job finished with the install


def test_cancel_while_waiting_for_the_voice_abandons_it_without_installing(make_runtime, sessions) -> None:
    rt = make_runtime(prep_wait_ms=60_000)  # the CPU preparation never comes in this test
    job_id = submit(rt, sessions, VOICE_B, n_tokens=30)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(JobRun(rt, RecordingTask(), job_id).run()))
    runner.start()
    deadline = time.monotonic() + 30
    while not rt.loop.engine.live_jobs() and time.monotonic() < deadline:
        time.sleep(0.02)
    with sessions() as session:
        assert lifecycle.cancel(session=session, job_id=job_id)
        session.commit()
    runner.join(30)
    assert result["status"] == "cancelled" and result["prep_path"] == "abandoned"
    assert rt.store.count(COUNTER_PREP_PATH, "abandoned") == 1
    assert list(rt.loop.engine.voices) == [] and rt.loop.engine.counters["abandoned"] == 1
    with sessions() as session:
        assert queries.require_voice(session=session, voice_id=job_row(sessions, job_id).voice_id).status \
            == "pending"  # ready to be prepared again by a later job


def test_a_job_cut_short_by_shutdown_goes_back_to_the_queue_unfailed(make_runtime, sessions) -> None:
    rt = make_runtime(prep_wait_ms=60_000)
    job_id = submit(rt, sessions, VOICE_A, n_tokens=30)
    threading.Timer(0.3, rt.loop.stop).start()
    with pytest.raises(Reject) as info:
        JobRun(rt, RecordingTask(), job_id).run()
    assert info.value.requeue
    assert job_row(sessions, job_id).status in ("preparing", "running")  # the next delivery resumes it
    assert not list((rt.artifacts.root / "outputs").iterdir())


def test_a_finished_job_is_not_run_again(make_runtime, sessions) -> None:
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    job_id = submit(rt, sessions, VOICE_A, n_tokens=10)
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "succeeded"
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "skipped"  # a redelivered message
    assert JobRun(rt, RecordingTask(), str(uuid.uuid4())).run()["status"] == "skipped"  # not ours


def test_a_delivery_of_a_job_cancelled_after_its_worker_died_removes_that_workers_partial(
        make_runtime, sessions) -> None:
    """A worker killed mid-job leaves `.<job>.wav.*.part`; the job is cancelled while nobody holds it.
    Its message (RabbitMQ hands it on at once; Redis after the visibility timeout) reaches a live worker:
    the job is not run, and the partial goes (else the sweep's orphan-file rule removes it)."""
    rt = make_runtime()
    job_id = submit(rt, sessions, VOICE_A, n_tokens=30)
    partial = rt.artifacts.root / "outputs" / f".{job_id}.wav.k1ll3d.part"
    partial.write_bytes(b"RIFF half a file")
    with sessions.begin() as session:
        assert lifecycle.cancel(session=session, job_id=job_id)
    assert JobRun(rt, RecordingTask(), job_id).run()["status"] == "skipped"
    assert not partial.exists() and job_row(sessions, job_id).status == "cancelled"


@pytest.mark.parametrize("garbage, reason", [(-1.0, "the constant -1 in all 28800 samples"),
                                             (float("nan"), "NaN or infinite samples")])
def test_audio_that_is_not_audio_fails_the_job_instead_of_succeeding(make_runtime, sessions, monkeypatch,
                                                                     garbage: float, reason: str) -> None:
    """What a voice with NaN features decoded to (a constant -1.0) was recorded as a success."""
    rt = make_runtime()
    prepare_ahead(rt, VOICE_A)
    decoder = rt.loop.engine.decoder
    step = decoder.step
    monkeypatch.setattr(decoder, "step", lambda rows: [torch.full_like(a, garbage) for a in step(rows)])
    job_id = submit(rt, sessions, VOICE_A, n_tokens=30)
    with pytest.raises(EngineFailure, match=reason):
        JobRun(rt, RecordingTask(), job_id).run()
    row = job_row(sessions, job_id)
    assert row.status == JobStatus.FAILED and reason in (row.error or "") and row.output_path is None
    assert not list((rt.artifacts.root / "outputs").iterdir())


def test_stored_features_with_a_nan_are_not_installed_the_job_prepares_inline(make_runtime, sessions) -> None:
    rt = make_runtime()
    pcm, voice_id = load_reference(VOICE_A)
    host = host_half(pcm, voice_id)
    host.mel80[0, 0] = float("nan")  # written by a broken or older preparer
    rt.store.put(voice_id, host.to_bytes())
    result = JobRun(rt, RecordingTask(), submit(rt, sessions, VOICE_A, n_tokens=20)).run()
    assert result["status"] == "succeeded" and result["prep_path"] == "failed"
    repaired = PromptHostFeatures.from_bytes(rt.store.get(voice_id))
    assert bool(torch.isfinite(repaired.mel80).all())


def test_a_voice_waiting_behind_a_deep_cpu_queue_is_prepared_inline_at_once(make_runtime, sessions) -> None:
    """The cpu queue really holds more than `prep_queue_full` (default 64) preparations: a job whose voice
    is still pending there does not wait out its prep wait (here five minutes) but is prepared at once."""
    rt = make_runtime(prep_wait_ms=300_000)
    bound = rt.settings.prep_queue_full
    assert bound == Settings().prep_queue_full == 64
    producer = make_celery(rt.settings)
    broker = open_broker(rt.settings.broker_url)
    try:
        for n in range(bound):
            send_prepare(producer, rt.settings, f"{n:064x}")
        assert broker.queue_depth(rt.settings.queue_cpu) == bound
        time.sleep(rt.cpu_backlog.TTL_S)
        assert not rt.cpu_backlog.full()  # as deep as the bound: the preparation may still come in time
        send_prepare(producer, rt.settings, f"{bound:064x}")
        time.sleep(rt.cpu_backlog.TTL_S)
        job_id = submit(rt, sessions, VOICE_B, n_tokens=30)  # its voice is pending: nobody consumes the queue
        assert job_row(sessions, job_id).prep_path is None
        started = time.monotonic()
        result = JobRun(rt, RecordingTask(), job_id).run()
        took = time.monotonic() - started
    finally:
        broker.purge(rt.settings.queue_cpu)
        broker.close()
        producer.close()
    assert result["status"] == "succeeded" and result["prep_path"] == "queue_full"
    assert job_row(sessions, job_id).prep_path == "queue_full"
    # Half the prep wait: a job that waited it out would take five minutes; this one takes seconds.
    assert took < 150, f"{took:.1f} s: it waited for a preparation that could not start in time"
