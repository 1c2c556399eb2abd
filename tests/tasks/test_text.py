"""Text jobs: submission (a queued job without tokens, `job.tokenize` on the cpu queue and no `synth`),
refusals before anything is stored, idempotency by text; the `job.tokenize` task in process (guide
speech stored, `synth` sent, the GPU worker's lane tokenizes it into the tokens each segment gets alone,
with the stand-in's note; a cancelled job left alone; a redelivery on either side; speech over the limit
and a language without a guide voice fail the job); the sweep sends a lost `job.tokenize` again. Real
Redis, both databases."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import update

import tasks.text as text_task
from app.broker.queues import open_broker
from app.context import Context
from app.db import queries
from app.db.models import Job, JobKind, JobStatus, Voice, utcnow
from app.errors import BadInput, BadTokens, Conflict
from app.reconcile.sweep import sweep
from app.s3 import StandInTokenizer, speech_tokens
from app.speech import MEL_PER_TOKEN
from app.submission.jobs import cancel_job, job_tokens, submit_job
from app.submission.request import JobRequest
from app.text.guide_speech import GuideSpeech
from app.text.segment import estimate_tokens
from app.text.tokens import STAND_IN_NOTE, text_job_tokens
from gpu_worker.worker.guide import TokenizeLane, tokenize_text_job
from tests.app.helpers import count, queued
from tests.support.audio import wav_bytes

TEXT = "Dr. Smith walked 3 miles north.\n\nThen he rested, and the wind blew N.N.E., force 7."


@pytest.fixture
def task_celery(celery: Celery, monkeypatch: pytest.MonkeyPatch) -> Celery:
    """The task sends on the test's producer: its broker and queues (nobody consumes them)."""
    monkeypatch.setattr(text_task, "celery_app", celery)
    return celery


def submit(ctx: Context, celery: Celery, **kw) -> str:
    kw.setdefault("text", TEXT)
    with ctx.sessions() as session:
        return submit_job(ctx=ctx, session=session, request=JobRequest(reference_bytes=wav_bytes(), **kw))


def job(ctx: Context, job_id: str) -> Job:
    with ctx.sessions() as session:
        row = queries.require_job(session=session, job_id=job_id)
        session.expunge(row)
        return row


def test_a_text_job_is_queued_without_tokens_and_tokenized_before_it_is_rendered(
        ctx: Context, celery: Celery, broker) -> None:
    job_id = submit(ctx, celery, language="en-GB", priority=4)
    row = job(ctx, job_id)
    assert (row.kind, row.text, row.language, row.tokens, row.n_tokens, row.status) == (
        JobKind.TEXT, TEXT, "en-GB", None, 0, JobStatus.QUEUED)
    cpu = queued(broker, ctx.settings.queue_cpu)
    assert [(m["task"], m["args"]) for m in cpu] == [("voice.prepare", [row.voice_id]),
                                                     ("job.tokenize", [job_id])]
    assert cpu[1]["id"] == f"tokenize-{job_id}" and cpu[1]["priority"] == 5  # job priority 4 of 9
    assert queued(broker, ctx.settings.queue_gpu) == []  # synth waits for the tokens


def test_the_language_defaults_to_english(ctx: Context, celery: Celery) -> None:
    assert job(ctx, submit(ctx, celery)).language == "en"


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"tokens": [1, 2]}, BadInput, "exactly one of tokens or text"),
    ({"text": None}, BadTokens, "tokens are missing"),
    ({"text": "  \n "}, BadInput, "text is empty"),
    ({"text": "...", "language": "en"}, BadInput, "nothing to speak"),
    ({"language": "../../etc"}, BadInput, "language must be a tag"),
    ({"text": None, "tokens": [1], "language": "de"}, BadInput, "language goes with text"),
    ({"text": None, "tokens": []}, BadTokens, "empty"),
])
def test_bad_text_requests_are_refused_before_anything_is_stored(
        ctx: Context, celery: Celery, broker, kwargs: dict, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        submit(ctx, celery, **kwargs)
    with ctx.sessions() as session:
        assert count(session, Job) == 0 and count(session, Voice) == 0
    assert queued(broker, ctx.settings.queue_cpu) == [] and queued(broker, ctx.settings.queue_gpu) == []


def test_the_length_limit_is_the_estimate_the_books_use(ctx: Context, celery: Celery) -> None:
    """15 characters a second, 25 tokens a second: a text job's limit of 600 s (15,000 tokens) is about
    9,000 characters; a longer text is told how to render it as a book."""
    limit = text_job_tokens(ctx.settings)
    assert limit == 600 * 25 < ctx.settings.max_tokens
    under, over = "word " * (limit * 15 // 25 // 5 * 9 // 10), "word " * (limit * 15 // 25 // 5 * 11 // 10)
    assert estimate_tokens(under.strip()) < limit < estimate_tokens(over.strip())
    submit(ctx, celery, text=under)
    with pytest.raises(BadInput, match=f"over the job limit of {limit} \\(600 s\\); render it as a book, "
                                       "in chapters: wavefarm book render FILE.txt"):
        submit(ctx, celery, text=over)


def test_an_idempotency_key_names_the_text_and_its_language(ctx: Context, celery: Celery) -> None:
    first = submit(ctx, celery, idempotency_key="text-1", seed=3)
    assert submit(ctx, celery, idempotency_key="text-1", seed=3) == first
    with pytest.raises(Conflict, match="which has another text; "):
        submit(ctx, celery, idempotency_key="text-1", seed=3, text="Something else.")
    with pytest.raises(Conflict, match="which has another text; "):
        submit(ctx, celery, idempotency_key="text-1", seed=3, language="de")
    with pytest.raises(Conflict, match="which has another tokens; "):
        submit(ctx, celery, idempotency_key="text-1", seed=3, text=None, tokens=[1, 2])


def test_tokenize_stores_the_guide_speech_and_sends_synth_and_the_gpu_worker_tokenizes_it_once(
        ctx: Context, celery: Celery, task_celery: Celery, broker) -> None:
    job_id = submit(ctx, celery, priority=2)
    assert text_task.tokenize_job(job_id, ctx) == "sent"
    assert job(ctx, job_id).n_tokens == 0 and ctx.store.has_guide_speech(job_id)  # the GPU tokenizes
    gpu = queued(broker, ctx.settings.queue_gpu)
    assert [(m["task"], m["args"], m["id"], m["priority"]) for m in gpu] == [("synth", [job_id], job_id, 7)]
    stored = GuideSpeech.decode(ctx.store.get_guide_speech(job_id) or b"", max_tokens=ctx.settings.max_tokens)
    lane = TokenizeLane(StandInTokenizer())
    try:
        assert tokenize_text_job(ctx, lane, job_id) == "ready"
        row = job(ctx, job_id)
        tokens = job_tokens(job=row, artifacts=ctx.artifacts)
        # Two paragraphs, about 5 s of guide speech with pauses: 25 tokens per second of it.
        assert 60 < row.n_tokens == len(tokens) < 400 and row.frames_total == MEL_PER_TOKEN * row.n_tokens
        # The same tokens as each segment of its speech tokenized alone on the CPU (the path before this),
        # from the speech as it was spoken (espeak-ng's rate), resampled to 16 kHz on the GPU worker
        per_segment = [speech_tokens(w.numpy(), StandInTokenizer()) for w in stored.waves16k()]
        assert stored.rate == 22_050 and stored.token_counts() == [len(t) for t in per_segment]
        alone = [t for segment in per_segment for t in segment]
        assert tokens == alone and lane.stats["segments"] == len(stored.segments) == 2
        assert row.notes == [STAND_IN_NOTE] and row.status == JobStatus.QUEUED
        assert not ctx.store.has_guide_speech(job_id)  # done with once the tokens are stored
        # Redelivered on either side: synth is sent again; nothing is spoken or tokenized twice
        assert text_task.tokenize_job(job_id, ctx) == "sent" and not ctx.store.has_guide_speech(job_id)
        assert tokenize_text_job(ctx, lane, job_id) == "ready"
        assert lane.stats["segments"] == len(stored.segments)
    finally:
        lane.close()
    again = job(ctx, job_id)
    assert job_tokens(job=again, artifacts=ctx.artifacts) == tokens and again.notes == [STAND_IN_NOTE]
    assert len(queued(broker, ctx.settings.queue_gpu)) == 2  # the GPU worker claims the job once


def test_speech_over_the_token_limit_fails_the_job_on_the_cpu_worker(
        ctx: Context, celery: Celery, task_celery: Celery, broker) -> None:
    job_id = submit(ctx, celery)
    ctx.settings = ctx.settings.model_copy(update={"max_tokens": 50})
    assert text_task.tokenize_job(job_id, ctx) == "failed"
    row = job(ctx, job_id)
    assert row.status == JobStatus.FAILED and "over the job limit of 50" in (row.error or "")
    assert not ctx.store.has_guide_speech(job_id) and queued(broker, ctx.settings.queue_gpu) == []


def test_a_cancelled_text_job_is_not_tokenized(ctx: Context, celery: Celery, task_celery: Celery,
                                               broker) -> None:
    job_id = submit(ctx, celery)
    with ctx.sessions() as session:
        cancel_job(ctx=ctx, session=session, job_id=job_id)
    assert text_task.tokenize_job(job_id, ctx) == "stopped"
    assert job(ctx, job_id).n_tokens == 0 and queued(broker, ctx.settings.queue_gpu) == []


def test_a_language_without_a_guide_voice_fails_the_job_with_the_reason(
        ctx: Context, celery: Celery, task_celery: Celery, broker) -> None:
    with pytest.raises(BadInput, match="no guide voice speaks language 'xq'"):
        submit(ctx, celery, language="xq")  # refused at submission now
    job_id = submit(ctx, celery, language="en")  # a worker whose espeak-ng lacks the job's voice:
    with ctx.sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(language="xq"))
        session.commit()
    assert text_task.tokenize_job(job_id, ctx) == "failed"
    row = job(ctx, job_id)
    assert row.status == JobStatus.FAILED and "no guide voice speaks language 'xq'" in (row.error or "")
    assert queued(broker, ctx.settings.queue_gpu) == []


def test_the_sweep_sends_a_lost_tokenize_again_and_never_a_synth_without_tokens(
        ctx: Context, celery: Celery, broker) -> None:
    job_id = submit(ctx, celery)
    open_broker(ctx.settings.broker_url).purge(ctx.settings.queue_cpu)  # the broker lost the job's message
    with ctx.sessions() as session:
        session.execute(update(Job).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    report = sweep(ctx=ctx)
    assert (report.jobs_requeued, report.errors) == ([job_id], [])
    assert [m["task"] for m in queued(broker, ctx.settings.queue_cpu)] == ["job.tokenize"]
    assert queued(broker, ctx.settings.queue_gpu) == []
    with ctx.sessions() as session:  # quiet again, but rung just now: not due before stuck_job_after_s
        session.execute(update(Job).values(updated_at=utcnow() - timedelta(hours=2)))
        session.commit()
    again = sweep(ctx=ctx)
    assert again.jobs_requeued == [] and len(queued(broker, ctx.settings.queue_cpu)) == 1


def test_the_task_is_registered_on_the_cpu_app() -> None:
    from tasks.celery_app import celery_app

    assert "job.tokenize" in celery_app.tasks
