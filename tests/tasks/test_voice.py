"""`voice.prepare` in process (`tasks.voice.prepare_voice`) on both databases and the real feature store:
the features and the voice row, no-ops and failures counted, cancelled jobs leaving nothing behind, a
store that cannot be reached."""

from collections.abc import Iterator
from dataclasses import replace

import pytest
from celery import Celery

from app import lifecycle
from app.context import Context
from app.db import queries as q
from app.db.models import VoiceStatus
from app.settings import Settings
from app.storage.feature_store import FeatureStore
from app.storage.keys import COUNTER_PREPARE
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.features import PromptHostFeatures
from tasks.celery_app import make_celery
from tasks.voice import prepare_voice
from tests.support.audio import wav_bytes


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, include=())
    yield app
    app.close()


def submitted_voice(ctx: Context, celery: Celery, reference: bytes | None = None) -> str:
    return submitted_job(ctx, celery, reference)[1]


def voice_row(ctx: Context, voice_id: str):
    with ctx.sessions() as session:
        return q.require_voice(session=session, voice_id=voice_id)


def test_prepare_puts_features_in_the_store_and_marks_the_voice_ready(ctx: Context, celery: Celery):
    voice_id = submitted_voice(ctx, celery)
    assert prepare_voice(voice_id, ctx) == "prepared"
    blob = ctx.store.get(voice_id)
    assert blob is not None and PromptHostFeatures.from_bytes(blob).voice_id == voice_id
    assert 0 < (ctx.store.ttl(voice_id) or 0) <= ctx.settings.feature_ttl_s
    voice = voice_row(ctx, voice_id)
    assert (voice.status, voice.feature_nbytes, voice.error) == (VoiceStatus.READY, len(blob), None)
    assert voice.prepare_ms and voice.prepare_ms > 0 and voice.prepared_at and voice.prepare_started_at
    assert ctx.store.counters(COUNTER_PREPARE) == {"prepared": 1}
    assert ctx.store.claim_prepare(voice_id, 10)  # the submission's claim was released


def test_preparing_a_ready_voice_again_is_a_counted_no_op(ctx: Context, celery: Celery):
    voice_id = submitted_voice(ctx, celery)
    prepare_voice(voice_id, ctx)
    before = voice_row(ctx, voice_id).prepared_at
    assert ctx.store.claim_prepare(voice_id, 60)  # as a second submission would have claimed it
    assert prepare_voice(voice_id, ctx) == "noop"
    assert voice_row(ctx, voice_id).prepared_at == before
    assert ctx.store.counters(COUNTER_PREPARE) == {"prepared": 1, "noop": 1}
    # A finished task, whatever its outcome, leaves no claim: the next submission may queue one.
    assert ctx.store.claim_prepare(voice_id, 60)
    ctx.store.release_prepare(voice_id)
    ctx.store.delete(voice_id)  # evicted: preparing again is real work
    assert prepare_voice(voice_id, ctx) == "prepared" and ctx.store.exists(voice_id)


def test_a_reference_that_cannot_be_prepared_fails_the_voice_without_raising(ctx: Context, celery: Celery):
    voice_id = submitted_voice(ctx, celery)
    path = ctx.artifacts.path(voice_row(ctx, voice_id).reference_path or "")
    path.write_bytes(wav_bytes(freq=330.0))  # a different voice under this one's name
    assert prepare_voice(voice_id, ctx) == "failed"
    voice = voice_row(ctx, voice_id)
    assert voice.status == VoiceStatus.FAILED and "normalises to voice" in (voice.error or "")
    path.unlink()
    assert prepare_voice(voice_id, ctx) == "failed"
    assert "FileNotFoundError" in (voice_row(ctx, voice_id).error or "")
    assert not ctx.store.exists(voice_id) and ctx.store.counters(COUNTER_PREPARE) == {"failed": 2}


def test_an_unknown_voice_is_a_counted_failure(ctx: Context):
    assert prepare_voice("0" * 64, ctx) == "failed"
    assert ctx.store.count(COUNTER_PREPARE, "failed") == 1


def test_a_voice_whose_attempts_keep_dying_is_given_up(ctx: Context, celery: Celery):
    voice_id = submitted_voice(ctx, celery)
    with ctx.sessions() as session:  # deliveries that started and never finished (worker killed)
        for _ in range(ctx.settings.job_max_attempts):
            q.mark_voice_preparing(session=session, voice_id=voice_id)
        session.commit()
    assert prepare_voice(voice_id, ctx) == "failed"
    voice = voice_row(ctx, voice_id)
    assert voice.status == VoiceStatus.FAILED and "unfinished attempts" in (voice.error or "")


def submitted_job(ctx: Context, celery: Celery, reference: bytes | None = None) -> tuple[str, str]:
    with ctx.sessions() as session:
        job_id = submit_job(
            ctx=ctx, session=session,
            request=JobRequest(tokens=[1, 2, 3], reference_bytes=reference or wav_bytes()),
        )
        return job_id, q.require_job(session=session, job_id=job_id).voice_id


def cancel(ctx: Context, job_id: str) -> None:
    with ctx.sessions() as session:
        assert lifecycle.cancel(session=session, job_id=job_id)
        session.commit()


def test_a_voice_whose_only_job_was_cancelled_before_preparation_is_not_prepared(
    ctx: Context, celery: Celery
):
    job_id, voice_id = submitted_job(ctx, celery)
    cancel(ctx, job_id)
    assert prepare_voice(voice_id, ctx) == "abandoned"
    assert not ctx.store.exists(voice_id) and voice_row(ctx, voice_id).status == VoiceStatus.PENDING
    assert ctx.store.counters(COUNTER_PREPARE) == {"abandoned": 1}


def test_a_job_cancelled_while_its_voice_prepares_leaves_no_features(
    ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch
):
    import tasks.voice

    job_id, voice_id = submitted_job(ctx, celery)
    real = tasks.voice.preparation.compute

    def cancelled_meanwhile(*args, **kwargs):
        cancel(ctx, job_id)
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks.voice.preparation, "compute", cancelled_meanwhile)
    assert prepare_voice(voice_id, ctx) == "reclaimed"
    assert not ctx.store.exists(voice_id) and voice_row(ctx, voice_id).status == VoiceStatus.PENDING
    assert ctx.store.claim_prepare(voice_id, 10)


def test_a_voice_shared_with_a_live_job_is_kept_when_one_job_is_cancelled(
    ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch
):
    import tasks.voice

    job_a, voice_id = submitted_job(ctx, celery)
    submitted_job(ctx, celery)
    real = tasks.voice.preparation.compute

    def one_cancelled_meanwhile(*args, **kwargs):
        cancel(ctx, job_a)
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks.voice.preparation, "compute", one_cancelled_meanwhile)
    assert prepare_voice(voice_id, ctx) == "prepared"
    assert ctx.store.exists(voice_id) and voice_row(ctx, voice_id).status == VoiceStatus.READY


def test_a_failed_preparation_of_a_cancelled_job_leaves_nothing_behind(ctx: Context, celery: Celery):
    job_id, voice_id = submitted_job(ctx, celery)
    ctx.artifacts.path(voice_row(ctx, voice_id).reference_path or "").unlink()
    assert prepare_voice(voice_id, ctx) == "failed"
    cancel(ctx, job_id)
    assert not ctx.store.exists(voice_id) and ctx.store.claim_prepare(voice_id, 10)


def test_an_unreachable_store_is_retried_a_bounded_number_of_times_then_fails_the_voice(
    ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch
):
    import tasks.voice

    voice_id = submitted_voice(ctx, celery)
    down = FeatureStore.from_url("redis://127.0.0.1:1/0", ttl_s=60)  # nothing listens on port 1
    monkeypatch.setattr(tasks.voice, "resources", lambda: replace(ctx, store=down))
    monkeypatch.setattr(tasks.voice.time, "sleep", lambda _s: None)
    result = tasks.voice.prepare.apply(args=[voice_id])
    assert result.get() == voice_id  # the task ends; it does not retry forever
    voice = voice_row(ctx, voice_id)
    assert voice.status == VoiceStatus.FAILED and "unfinished attempts" in (voice.error or "")


def test_a_reference_peaking_at_1e18_prepares_a_ready_voice_with_finite_features(ctx: Context,
                                                                                 celery: Celery):
    """It used to be `ready` with NaN features, and its jobs `succeeded` with a constant -1.0."""
    import io

    import numpy as np
    import soundfile as sf
    import torch

    buf = io.BytesIO()
    loud = (1e18 * np.sin(np.arange(48_000) * 0.0864)).astype(np.float32)  # a 220 Hz sine at 16 kHz
    sf.write(buf, loud, 16000, "FLOAT", format="WAV")
    voice_id = submitted_voice(ctx, celery, buf.getvalue())
    assert prepare_voice(voice_id, ctx) == "prepared"
    host = PromptHostFeatures.from_bytes(ctx.store.get(voice_id) or b"")
    assert all(bool(torch.isfinite(t).all()) for t in (host.logmel128, host.fbank80, host.mel80))
    assert voice_row(ctx, voice_id).status == VoiceStatus.READY


def test_features_that_are_not_finite_fail_the_voice_with_the_reason(ctx: Context, celery: Celery,
                                                                    monkeypatch: pytest.MonkeyPatch):
    from app.voices import features

    voice_id = submitted_voice(ctx, celery)
    overflow = features.s3_log_mel
    monkeypatch.setattr(features, "s3_log_mel", lambda wave: overflow(wave) * float("inf"))
    assert prepare_voice(voice_id, ctx) == "failed"
    voice = voice_row(ctx, voice_id)
    assert voice.status == VoiceStatus.FAILED
    assert "logmel128 feature are NaN or infinite" in (voice.error or "")
    assert not ctx.store.exists(voice_id)
