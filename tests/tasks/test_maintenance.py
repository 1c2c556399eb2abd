"""`maintenance.sweep`: orphan files, jobs without a broker message, abandoned voices; also as a CLI
command. Real Redis (broker and feature store), both databases."""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import timedelta

import numpy as np
from sqlalchemy import update

from app import cli
from app.artifacts import ArtifactStore
from app.books.service import submit_book
from app.db import queries
from app.db.models import Book, Job, JobStatus, VoiceStatus, utcnow
from app.features import host_half
from app.jobs import submit_job
from app.maintenance import broker_task_ids, sweep
from app.settings import Settings
from app.store import FeatureStore
from tests.app.helpers import queued
from tests.conftest import settings_env
from tests.support.audio import wav_bytes


def run(settings, sessions, artifacts, store, broker, celery, **kw):
    return sweep(settings=settings, sessions=sessions, artifacts=artifacts, store=store, broker=broker,
                 sender=celery, **kw)


def submit(settings: Settings, sessions, store, artifacts, celery, reference: bytes | None = None,
           n_tokens: int = 3) -> str:
    with sessions() as session:
        return submit_job(settings=settings, session=session, sender=celery, store=store, artifacts=artifacts,
                          tokens=[1] * n_tokens, reference_bytes=reference or wav_bytes())


def age(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_old_orphan_files_are_removed_and_referenced_or_young_ones_kept(
        settings, sessions, artifacts: ArtifactStore, store, broker, celery) -> None:
    job_id = submit(settings, sessions, store, artifacts, celery)
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
    report = run(settings, sessions, artifacts, store, broker, celery, grace_s=3600)
    assert sorted(report.orphans_removed) == sorted(
        [f"outputs/{partial.name}", f"tmp/{stray_tmp.name}", orphan_ref])
    assert artifacts.path(reference).exists() and young.exists() and not partial.exists()
    assert report.errors == []


def test_a_book_folder_without_a_row_is_removed_and_a_book_whose_reader_died_is_read_again(
        settings, sessions, artifacts: ArtifactStore, store, broker, celery) -> None:
    stray = artifacts.root / "books" / str(uuid.uuid4())  # the API died between the upload and its row
    stray.mkdir(parents=True)
    (stray / "source").write_bytes(b"a book")
    with sessions() as session:
        kept = submit_book(settings=settings, session=session, sender=celery, store=store,
                           artifacts=artifacts, data=b"Title\n\nSome text.", filename="b.txt",
                           reference_bytes=wav_bytes())
        dying = submit_book(settings=settings, session=session, sender=celery, store=store,
                            artifacts=artifacts, data=b"Title\n\nMore text.", filename="c.txt",
                            voice_id=queries.require_book(session=session, book_id=kept).voice_id)
        assert queries.start_book_parse(session=session, book_id=dying) == 1  # a reader started, then died
        session.execute(update(Book).where(Book.id == dying).values(
            updated_at=utcnow() - timedelta(seconds=settings.book_parse_timeout_s + settings.stuck_job_after_s
                                            + 5)))
        session.commit()
    for folder in (stray, stray.parent / kept, stray.parent / dying):
        age(folder, 7200)
    for key in broker.keys(f"{settings.queue_cpu}*"):
        broker.delete(key)
    report = run(settings, sessions, artifacts, store, broker, celery, grace_s=3600)
    assert (report.books_removed, report.books_reparsed, report.errors) == ([stray.name], [dying], [])
    assert not stray.exists() and (stray.parent / kept / "source").exists()
    assert [(m["task"], m["args"]) for m in queued(broker, settings.queue_cpu)] == [("book.parse", [dying])]
    assert run(settings, sessions, artifacts, store, broker, celery, grace_s=3600).books_reparsed == []


def test_a_stale_job_without_a_broker_message_is_sent_again_once(
        settings, sessions, artifacts, store, broker, celery) -> None:
    waiting = submit(settings, sessions, store, artifacts, celery)
    lost = submit(settings, sessions, store, artifacts, celery)
    broker.delete(settings.queue_gpu, *[f"{settings.queue_gpu}\x06\x16{n}" for n in range(1, 10)])
    celery.send_task("synth", args=[waiting], queue=settings.queue_gpu, task_id=waiting)  # still queued
    with sessions() as session:  # both went quiet long ago
        session.execute(update(Job).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    report = run(settings, sessions, artifacts, store, broker, celery)
    assert report.jobs_requeued == [lost]
    ids = broker_task_ids(broker, settings.queue_gpu)
    assert {waiting, lost} <= ids
    assert run(settings, sessions, artifacts, store, broker, celery).jobs_requeued == []  # now it has one


def _deliver_without_ack(broker, settings) -> str:
    """Pop the queued synth message into kombu's unacked hash, as a consumer that took it would: its tag."""
    raw = broker.rpop(settings.queue_gpu) or next(
        broker.rpop(f"{settings.queue_gpu}\x06\x16{n}") for n in range(1, 10)
        if broker.llen(f"{settings.queue_gpu}\x06\x16{n}"))
    tag = json.loads(raw)["properties"]["delivery_tag"]
    broker.hset("unacked", tag, json.dumps([json.loads(raw), "", settings.queue_gpu]))
    broker.zadd("unacked_index", {tag: time.time()})
    return tag


def test_an_unacknowledged_message_of_a_claimed_job_counts_as_present(settings, sessions, artifacts, store,
                                                                      broker, celery) -> None:
    job_id = submit(settings, sessions, store, artifacts, celery)
    tag = _deliver_without_ack(broker, settings)
    try:
        with sessions() as session:  # claimed (its worker's fate is part 3's), quiet for long
            session.execute(update(Job).values(status="running", attempts=1, worker="gpu@elsewhere",
                                               updated_at=utcnow() - timedelta(hours=2)))
            session.commit()
        assert run(settings, sessions, artifacts, store, broker, celery).jobs_requeued == []
        assert broker.hexists("unacked", tag)
    finally:
        broker.hdel("unacked", tag)
        broker.zrem("unacked_index", tag)
    assert job_id


def test_a_quiet_queued_job_delivered_to_a_worker_that_never_claimed_it_goes_back_to_its_queue(
        settings, sessions, artifacts, store, broker, celery) -> None:
    """A GPU worker SIGKILLed between taking a message and claiming its job: no claim for part 3 to see,
    and on Redis the message would sit unacknowledged for the visibility timeout (6 h)."""
    job_id = submit(settings, sessions, store, artifacts, celery)
    tag = _deliver_without_ack(broker, settings)
    with sessions() as session:
        session.execute(update(Job).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    assert run(settings, sessions, artifacts, store, broker, celery).jobs_requeued == [job_id]
    assert not broker.hexists("unacked", tag)  # moved, not copied: one message
    assert broker_task_ids(broker, settings.queue_gpu) == {job_id}
    assert run(settings, sessions, artifacts, store, broker, celery).jobs_requeued == []  # waiting now


def test_finished_and_recent_jobs_are_left_alone(settings, sessions, artifacts, store, broker,
                                                 celery) -> None:
    done = submit(settings, sessions, store, artifacts, celery)
    recent = submit(settings, sessions, store, artifacts, celery)
    broker.delete(settings.queue_gpu, *[f"{settings.queue_gpu}\x06\x16{n}" for n in range(1, 10)])
    with sessions() as session:
        queries.finish_job(session=session, job_id=done, status=JobStatus.FAILED, error="x")
        session.execute(update(Job).where(Job.id == done).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    report = run(settings, sessions, artifacts, store, broker, celery)
    assert report.jobs_requeued == [] and recent not in report.jobs_requeued


def test_features_left_for_a_voice_whose_jobs_were_all_cancelled_are_reclaimed(
        settings, sessions, artifacts, store: FeatureStore, broker, celery) -> None:
    job_id = submit(settings, sessions, store, artifacts, celery)
    with sessions() as session:
        voice_id = queries.require_job(session=session, job_id=job_id).voice_id
        queries.cancel_job(session=session, job_id=job_id)
        session.commit()
    # A preparation that finished after the cancel, on a worker that died before reclaiming it.
    store.put(voice_id, host_half(np.zeros(24000 * 3, np.float32) + 0.1, voice_id).to_bytes())
    with sessions() as session:
        queries.mark_voice_ready(session=session, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=1)
        session.commit()
    report = run(settings, sessions, artifacts, store, broker, celery)
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
