"""`job.tokenize`: a text job's guide speech, on a CPU worker, then its `synth`.

    job.tokenize(job_id)   the job's text through the guide voice (`app.text.tokens.text_speech`) -> its
                           speech in the feature store (`app.text.guide_speech`, with the store's TTL)
                           -> `synth` sent to a GPU worker (`app.submission.routing`), which
                           S3-tokenizes it in batches with other jobs' (`gpu_worker.worker.guide`)

The CPU worker keeps the cheap half (espeak-ng); the tokenizer, 40 times its cost, runs on the GPU.
Idempotent: a redelivery after the speech (or the tokens) was stored only sends `synth` again (the GPU
worker claims a job once, so a second message is dropped there); a job cancelled meanwhile is left alone.
A text that cannot be spoken (a language without a guide voice, speech over the token limit, known from
its length) fails the job with the reason; infrastructure errors (Redis, database) are retried a bounded
number of times.
"""

from __future__ import annotations

import logging
import time

from celery import Task

from app import lifecycle
from app.broker import wire
from app.context import Context
from app.db import queries
from app.db.models import JobStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.storage.keys import check_job_id
from app.submission import routing
from app.text.tokens import segment_speech, text_speech
from tasks.celery_app import celery_app
from tasks.voice import TRANSIENT_ERRORS, resources

log = logging.getLogger(__name__)

MAX_RETRIES = 3


def tokenize_job(job_id: str, ctx: Context) -> str:
    """'sent' (the job's synth is queued), 'stopped' (not queued any more) or 'failed' (its text could not
    be spoken: the job failed with the reason)."""
    with session_scope(ctx.sessions) as session:
        job = queries.get_job(session=session, job_id=job_id)
        if job is None or job.status != JobStatus.QUEUED:
            log.info("job.tokenize %s: %s; nothing to do", job_id,
                     "no such job" if job is None else job.status)
            return "stopped"
        done, text, language, priority = queries.is_tokenized(job), job.text, job.language, job.priority
        voice_id, segment = job.voice_id, queries.renders_segment(session=session, job_id=job_id)
    if not done and not ctx.store.has_guide_speech(job_id):
        if text is None:
            raise WavefarmError(f"job {job_id} has neither tokens nor text")
        started = time.perf_counter()
        try:
            # a book segment's job (its speech lost from the store) is spoken as the book speaks it
            speech = (segment_speech(text, language or "en") if segment
                      else text_speech(text, language or "en", max_tokens=ctx.settings.max_tokens))
        except (WavefarmError, OSError, RuntimeError) as exc:
            with session_scope(ctx.sessions) as session:
                lifecycle.finish(session=session, job_id=job_id, status=JobStatus.FAILED,
                                   error=f"tokenize: {exc}")
            log.warning("job.tokenize %s: %s: %s", job_id, type(exc).__name__, exc)
            return "failed"
        ctx.store.put_guide_speech(job_id, speech.encode())
        ctx.store.note_phase(job_id, {"phase": "tokenizing",
                                      "speak_ms": round((time.perf_counter() - started) * 1000, 1)})
        log.info("job.tokenize %s: %d segments of guide speech (%d tokens) from %d characters", job_id,
                 len(speech.segments), sum(speech.token_counts()), len(text))
    with session_scope(ctx.sessions) as session:
        routing.send_routed(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id,
                            voice_id=voice_id, priority=priority)
    return "sent"


@celery_app.task(name=wire.JOB_TOKENIZE_TASK, bind=True, max_retries=MAX_RETRIES)
def tokenize(self: Task, job_id: str) -> str:
    """Celery adapter: job id in, outcome out; the job's row says the rest."""
    try:
        check_job_id(job_id)
    except ValueError:
        log.error("job.tokenize: refusing malformed job id %r", job_id)
        return "stopped"
    ctx = resources()
    try:
        return tokenize_job(job_id, ctx)
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= MAX_RETRIES:
            with session_scope(ctx.sessions) as session:
                lifecycle.finish(session=session, job_id=job_id, status=JobStatus.FAILED,
                                   error=f"tokenize: infrastructure error after {MAX_RETRIES} retries: {exc}")
            raise
        log.warning("job.tokenize %s: %s; retrying", job_id, exc)
        raise self.retry(exc=exc, countdown=2**self.request.retries) from exc
