"""`maintenance.sweep`, the reconciler: orphan files, leases that passed, doorbells due or rung on a gone
worker's queue, abandoned voices; also as a CLI command. Real Redis (broker and feature store), both
databases."""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import timedelta

import numpy as np
from sqlalchemy import update

from app import cli, lifecycle
from app.books.service import submit_book
from app.broker.queues import open_broker
from app.context import Context
from app.db import queries
from app.db.models import Job, JobStatus, VoiceStatus, Worker, utcnow
from app.reconcile.dead_workers import WORKER_GONE_S
from app.reconcile.jobs import RING_GROUP
from app.reconcile.sweep import sweep
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission import routing
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.features import host_half
from tests.app.helpers import queued
from tests.conftest import settings_env
from tests.support.audio import wav_bytes
from tests.support.books import book_request


def run(ctx: Context, **kw):
    return sweep(ctx=ctx, **kw)


def submit(ctx: Context, reference: bytes | None = None, n_tokens: int = 3) -> str:
    with ctx.session() as session:
        return submit_job(ctx=ctx, session=session, request=JobRequest(
            tokens=[1] * n_tokens, reference_bytes=reference or wav_bytes()))


def age(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_old_orphan_files_are_removed_and_referenced_or_young_ones_kept(
        ctx, settings, sessions, artifacts: ArtifactStore, store, broker, celery) -> None:
    job_id = submit(ctx)
    with sessions() as session:
        reference = queries.require_voice(
            session=session, voice_id=queries.require_job(session=session, job_id=job_id).voice_id
        ).reference_path
    partial = artifacts.root / "outputs" / f".{job_id}.wav.abc123.part"  # a killed worker's partial output
    partial.write_bytes(b"RIFF")
    stray_tmp = artifacts.temp_path(".wav")
    stray_tmp.write_bytes(b"x")
    orphan_ref = artifacts.put_reference(b"not referenced by any voice row", "WAV")
    young = artifacts.root / "outputs" / ".young.part"
    young.write_bytes(b"x")
    for path in (partial, stray_tmp, artifacts.path(orphan_ref), artifacts.path(reference)):
        age(path, 7200)
    report = run(ctx, grace_s=3600)
    assert sorted(report.orphans_removed) == sorted(
        [f"outputs/{partial.name}", f"tmp/{stray_tmp.name}", orphan_ref])
    assert artifacts.path(reference).exists() and young.exists() and not partial.exists()
    assert report.errors == []


def test_a_book_folder_without_a_row_is_removed_and_a_book_whose_reader_died_is_read_again(
        ctx, settings, sessions, artifacts: ArtifactStore, store, broker, celery) -> None:
    stray = artifacts.root / "books" / str(uuid.uuid4())  # the API died between the upload and its row
    stray.mkdir(parents=True)
    (stray / "source").write_bytes(b"a book")
    with sessions() as session:
        kept = submit_book(ctx=ctx, session=session, data=b"Title\n\nSome text.", request=book_request(
            filename="b.txt", reference_bytes=wav_bytes()))
        dying = submit_book(ctx=ctx, session=session, data=b"Title\n\nMore text.", request=book_request(
            filename="c.txt", voice_id=queries.require_book(session=session, book_id=kept).voice_id))
        past = utcnow() - timedelta(seconds=settings.book_parse_timeout_s + settings.stuck_job_after_s + 5)
        # a reader started, then died (its claim stamped then, and the book's row not touched since)
        assert lifecycle.claim_reading(session=session, book_id=dying, now=past, stale_before=past) == 1
        session.commit()
    for folder in (stray, stray.parent / kept, stray.parent / dying):
        age(folder, 7200)
    for key in broker.keys(f"{settings.queue_cpu}*"):
        broker.delete(key)
    report = run(ctx, grace_s=3600)
    assert (report.books_removed, report.books_reparsed, report.errors) == ([stray.name], [dying], [])
    assert not stray.exists() and (stray.parent / kept / "source").exists()
    assert [(m["task"], m["args"]) for m in queued(broker, settings.queue_cpu)] == [("book.parse", [dying])]
    assert run(ctx, grace_s=3600).books_reparsed == []


def depth(settings: Settings) -> int:
    return open_broker(settings.broker_url).queue_depth(settings.queue_gpu)


def lose_messages(settings: Settings) -> None:
    """The broker lost what waited in the gpu queue (a flush, a crash without persistence)."""
    open_broker(settings.broker_url).purge(settings.queue_gpu)


def test_a_queued_job_not_claimed_in_time_is_rung_again_with_growing_waits(
        ctx, settings, sessions, artifacts, store, broker, celery) -> None:
    lost = submit(ctx)
    submit(ctx)  # recent: left alone
    lose_messages(settings)
    with sessions() as session:  # `lost` went quiet long ago; the other was just submitted
        session.execute(update(Job).where(Job.id == lost).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    grace = timedelta(seconds=settings.stuck_job_after_s)
    before = utcnow()
    report = run(ctx)
    after = utcnow()
    assert report.jobs_requeued == [lost] and depth(settings) == 1
    assert run(ctx).jobs_requeued == []  # not due yet
    with sessions() as session:  # due one grace after the ring (stamped between `before` and `after`)
        due = queries.require_job(session=session, job_id=lost).ring_due_at
        assert before + grace <= due <= after + grace
        session.execute(update(Job).where(Job.id == lost).values(ring_due_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    before = utcnow()
    assert run(ctx).jobs_requeued == [lost]  # due again
    after = utcnow()
    with sessions() as session:
        job = queries.require_job(session=session, job_id=lost)
    assert job.rings == 2 and job.status == JobStatus.QUEUED
    assert before + 2 * grace <= job.ring_due_at <= after + 2 * grace  # the wait doubles
    assert depth(settings) == 2  # a duplicate doorbell: its delivery finds the job claimed and is skipped


def test_many_due_jobs_are_rung_a_group_at_a_time_each_once_and_spread_over_the_live_workers(
        ctx, settings, sessions, artifacts, store, broker, celery) -> None:
    """A sweep that finds a long backlog due (a book's chapter waiting behind the GPU) rings it RING_GROUP
    jobs at a time: each job once, its ring recorded, and each group routed after the one before it was
    committed, so one voice's backlog still spills over to the free worker, as job-by-job rings did."""
    workers = ["gpu-a@host", "gpu-b@host"]
    with sessions() as session:
        for name in workers:
            queries.register_worker(session=session, name=name, slots=2)
        session.commit()
    jobs = [submit(ctx) for _ in range(2 * RING_GROUP + 3)]
    queues = [settings.queue_gpu, *(routing.worker_queue(settings, name) for name in workers)]
    for queue in queues:
        open_broker(settings.broker_url).purge(queue)
    with sessions() as session:
        session.execute(update(Job).where(Job.id.in_(jobs)).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    assert sorted(run(ctx).jobs_requeued) == sorted(jobs)
    with sessions() as session:
        rows = [queries.require_job(session=session, job_id=job_id) for job_id in jobs]
    assert {(row.status, row.rings) for row in rows} == {(JobStatus.QUEUED, 1)}
    assert {row.routed_to for row in rows} == set(workers)  # the backlog spread over both
    sent = [m["args"][0] for queue in queues for m in queued(broker, queue) if m["task"] == "synth"]
    assert sorted(sent) == sorted(jobs)  # one doorbell each
    for row in rows:  # each job's doorbell went where its row says
        assert row.id in [m["args"][0] for m in queued(broker, routing.worker_queue(settings, row.routed_to))]


def test_a_claimed_job_whose_lease_passed_is_queued_and_rung_again_and_a_leased_one_is_left_alone(
        ctx, settings, sessions, artifacts, store, broker, celery) -> None:
    dead = submit(ctx)
    alive = submit(ctx)
    lose_messages(settings)
    with sessions() as session:
        assert lifecycle.claim(session=session, job_id=dead, worker="gpu@dead", max_attempts=3, lease_s=0)
        assert lifecycle.claim(session=session, job_id=alive, worker="gpu@alive", max_attempts=3, lease_s=60)
        session.commit()
    report = run(ctx)
    assert report.jobs_resumed == [dead] and depth(settings) == 1
    with sessions() as session:
        resumed = queries.require_job(session=session, job_id=dead)
        assert (resumed.status, resumed.attempts, resumed.lease_until) == (JobStatus.QUEUED, 1, None)
        assert queries.require_job(session=session, job_id=alive).status == JobStatus.PREPARING
        assert not lifecycle.renew(session=session, job_id=dead, frames_done=5, attempt=1, lease_s=30)
    assert run(ctx).jobs_resumed == []  # once


def test_a_queued_job_rung_on_a_gone_workers_own_queue_is_rung_again_on_the_shared_queue(
        ctx, settings, sessions, artifacts, store, broker, celery) -> None:
    job_id = submit(ctx)
    lose_messages(settings)
    with sessions() as session:
        queries.register_worker(session=session, name="gpu@gone")
        queries.set_job_route(session=session, job_ids=[job_id], routed_to="gpu@gone", route="holder")
        session.commit()
    assert run(ctx).jobs_rerouted == []  # it beat just now
    with sessions() as session:
        session.execute(update(Worker).values(heartbeat_at=utcnow() - timedelta(seconds=WORKER_GONE_S + 5)))
        session.commit()
    assert run(ctx).jobs_rerouted == [job_id]
    assert depth(settings) == 1
    with sessions() as session:
        job = queries.require_job(session=session, job_id=job_id)
        assert (job.routed_to, job.route) == (None, "shared_worker_gone")


def test_finished_and_recent_jobs_are_left_alone(ctx, settings, sessions, artifacts, store, broker,
                                                 celery) -> None:
    done = submit(ctx)
    recent = submit(ctx)
    lose_messages(settings)
    with sessions() as session:
        lifecycle.finish(session=session, job_id=done, status=JobStatus.FAILED, error="x")
        session.execute(update(Job).where(Job.id == done).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    report = run(ctx)
    assert report.jobs_requeued == [] and recent not in report.jobs_requeued


def test_features_left_for_a_voice_whose_jobs_were_all_cancelled_are_reclaimed(
        ctx, settings, sessions, artifacts, store: FeatureStore, broker, celery) -> None:
    job_id = submit(ctx)
    with sessions() as session:
        voice_id = queries.require_job(session=session, job_id=job_id).voice_id
        lifecycle.cancel(session=session, job_id=job_id)
        session.commit()
    # A preparation that finished after the cancel, on a worker that died before reclaiming it.
    store.put(voice_id, host_half(np.zeros(24000 * 3, np.float32) + 0.1, voice_id).to_bytes())
    with sessions() as session:
        queries.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=1)
        session.commit()
    report = run(ctx)
    assert report.voices_reclaimed == [voice_id] and not store.exists(voice_id)
    with sessions() as session:
        assert queries.require_voice(session=session, voice_id=voice_id).status == VoiceStatus.PENDING


def test_the_cli_command_sweeps_and_prints_its_report(settings, sessions, artifacts, store, broker, celery,
                                                      monkeypatch, capsys) -> None:
    stray = artifacts.temp_path(".wav")
    stray.write_bytes(b"x")
    age(stray, 10)
    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    from app.settings import get_settings

    get_settings.cache_clear()
    try:
        assert cli.main(["maintenance", "--grace-s", "1"]) == 0
    finally:
        get_settings.cache_clear()
    report = json.loads(capsys.readouterr().out)
    assert report["orphans_removed"] == [f"tmp/{stray.name}"] and report["errors"] == []


def test_the_task_is_registered_on_the_cpu_app() -> None:
    from tasks.celery_app import celery_app

    celery_app.loader.import_default_modules()
    assert "maintenance.sweep" in celery_app.tasks


def test_the_partial_output_a_killed_worker_left_of_a_job_cancelled_since_goes_once_a_lease_has_passed(
        ctx, settings, sessions, artifacts: ArtifactStore, store, broker, celery) -> None:
    cancelled, recent, live = (submit(ctx) for _ in range(3))
    partials = {job_id: artifacts.root / "outputs" / f".{job_id}.wav.k1ll3d.part"
                for job_id in (cancelled, recent, live)}
    for path in partials.values():
        path.write_bytes(b"RIFF half a file")
    with sessions() as session:
        for job_id in (cancelled, recent):
            assert lifecycle.cancel(session=session, job_id=job_id)
        long_ago = utcnow() - timedelta(seconds=settings.job_lease_s + 5)
        session.execute(update(Job).where(Job.id == cancelled).values(finished_at=long_ago))
        session.commit()
    report = run(ctx)  # orphan grace: the default hour
    assert report.orphans_removed == [f"outputs/.{cancelled}.wav.k1ll3d.part"]
    assert not partials[cancelled].exists() and partials[recent].exists() and partials[live].exists()


def test_a_text_job_due_is_rung_on_the_gpu_queue_while_its_speech_is_stored_else_spoken_again(
        ctx, settings, sessions, artifacts, store, broker, celery) -> None:
    from app.text.guide_speech import GuideSpeech

    def text_job() -> str:
        with ctx.session() as session:
            return submit_job(ctx=ctx, session=session, request=JobRequest(
                text="A sentence.", language="en", reference_bytes=wav_bytes()))

    stored, lost = text_job(), text_job()
    cpu = open_broker(settings.broker_url)
    cpu.purge(settings.queue_cpu)
    lose_messages(settings)
    speech = GuideSpeech.from_waves([np.full(16_000, 0.1, dtype=np.float32)])
    store.put_guide_speech(stored, speech.encode())
    with sessions() as session:
        session.execute(update(Job).where(Job.id.in_([stored, lost]))
                        .values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    assert sorted(run(ctx).jobs_requeued) == sorted([stored, lost])
    # the stored speech's job goes straight to the GPU worker; the other is spoken again on a CPU worker
    assert depth(settings) == 1 and cpu.queue_depth(settings.queue_cpu) == 1
    with sessions() as session:
        assert {queries.require_job(session=session, job_id=j).rings for j in (stored, lost)} == {1}
