"""`voice.prepare`: the host half of prompt preparation, ahead of the GPU, on a CPU worker.

Reference file -> normalise -> host features -> feature store (with TTL) ->
voice row ready (timings, size). Idempotent: a voice that is ready with its
features in the store is a counted no-op. A voice whose only jobs were all
cancelled is not prepared, or, if they were cancelled while it was being
prepared, its features are reclaimed once it settles. A reference that cannot be
prepared marks the voice failed (the GPU worker then prepares inline or
fails the job); only infrastructure errors (Redis, database) are retried,
a bounded number of times, and a voice that keeps killing its worker is
given up after `job_max_attempts` deliveries.
"""

from __future__ import annotations

import logging
import time
from functools import cache

import redis
from celery import Task
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app.broker import wire
from app.context import Context
from app.db import queries
from app.db.models import VoiceStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.settings import get_settings
from app.storage.keys import COUNTER_PREPARE, check_voice_id
from app.voices import preparation
from app.voices.service import reclaim_abandoned_voice
from tasks.celery_app import celery_app

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (redis.ConnectionError, redis.TimeoutError, OperationalError)
MAX_RETRIES = 3


@cache
def resources() -> Context:
    """This worker process's clients, built once; tasks are sent with the tasks' own Celery app."""
    return Context.build(get_settings(), sender=celery_app)


def _start(voice_id: str, ctx: Context) -> tuple[str | None, str]:
    """Record the start of an attempt: (reference path to prepare, "") or (None, outcome) to stop."""
    with session_scope(ctx.sessions) as session:
        voice = queries.get_voice(session=session, voice_id=voice_id)
        if voice is None:
            log.error("voice.prepare %s: no such voice", voice_id)
            _count(ctx, "failed")
            return None, "failed"
        if voice.status == VoiceStatus.READY and ctx.store.exists(voice_id):
            _count(ctx, "noop")
            return None, "noop"
        if reclaim_abandoned_voice(session=session, store=ctx.store, voice_id=voice_id):
            _count(ctx, "abandoned")  # its only jobs were cancelled before we started
            return None, "abandoned"
        if voice.reference_path is None:
            _fail(session, ctx, voice_id, "voice has no stored reference audio")
            return None, "failed"
        attempt = queries.mark_voice_preparing(session=session, voice_id=voice_id)
        if attempt > ctx.settings.job_max_attempts:
            # Earlier attempts never finished (worker killed, or Redis/database errors): stop here.
            _fail(session, ctx, voice_id, f"gave up after {attempt - 1} unfinished attempts")
            return None, "failed"
        return voice.reference_path, ""


def _fail(session: Session, ctx: Context, voice_id: str, error: str) -> None:
    log.error("voice.prepare %s failed: %s", voice_id, error)
    queries.mark_voice_failed(session=session, voice_id=voice_id, error=error)
    _count(ctx, "failed")
    _release(ctx, voice_id)


def _count(ctx: Context, outcome: str) -> None:
    """Best effort: a counter that cannot be written must not undo or retry the work it counts."""
    try:
        ctx.store.incr(COUNTER_PREPARE, outcome)
    except redis.RedisError as exc:
        log.warning("voice.prepare: could not count %s: %s", outcome, exc)


def _release(ctx: Context, voice_id: str) -> None:
    """Best effort: an unreleased claim only expires later (app.voices.service.PREPARE_CLAIM_TTL_S)."""
    try:
        ctx.store.release_prepare(voice_id)
    except redis.RedisError as exc:
        log.warning("voice.prepare %s: could not release the claim: %s", voice_id, exc)


def prepare_voice(voice_id: str, ctx: Context) -> str:
    """Prepare one voice; returns the outcome: prepared, noop, failed, abandoned or reclaimed."""
    reference_path, outcome = _start(voice_id, ctx)
    if reference_path is None:
        _release(ctx, voice_id)  # whatever the outcome, no preparation is queued for the voice any more
        return outcome
    started = time.perf_counter()
    try:
        host = preparation.compute(settings=ctx.settings, artifacts=ctx.artifacts, voice_id=voice_id,
                                   reference_path=reference_path)
    except TRANSIENT_ERRORS:
        raise
    except Exception as exc:  # boundary: any failure of the host half fails the voice, not the worker
        if not isinstance(exc, WavefarmError | OSError):
            log.exception("voice.prepare %s: unexpected error", voice_id)
        with session_scope(ctx.sessions) as session:
            _fail(session, ctx, voice_id, f"{type(exc).__name__}: {exc}")
        return "failed"
    prepare_ms = (time.perf_counter() - started) * 1000.0
    published = preparation.publish(sessions=ctx.sessions, store=ctx.store, host=host, prepare_ms=prepare_ms,
                                    ttl_s=ctx.settings.feature_ttl_s)
    _release(ctx, voice_id)
    _count(ctx, "prepared")
    log.info("voice.prepare %s: %d bytes in %.0f ms", voice_id, published.nbytes, prepare_ms)
    if published.reclaimed:
        _count(ctx, "reclaimed")
        return "reclaimed"
    return "prepared"


def _give_up(voice_id: str, ctx: Context, exc: Exception) -> None:
    """Retries spent on an infrastructure error: record the failure if we still can."""
    try:
        with session_scope(ctx.sessions) as session:
            _fail(session, ctx, voice_id, f"infrastructure error after {MAX_RETRIES} retries: {exc}")
    except TRANSIENT_ERRORS:
        log.exception("voice.prepare %s: could not record the failure", voice_id)


@celery_app.task(name=wire.PREPARE_TASK, bind=True, max_retries=MAX_RETRIES)
def prepare(self: Task, voice_id: str) -> str:
    """Celery adapter: voice id in, voice id out; outcomes are in the database and the counters."""
    try:
        check_voice_id(voice_id)
    except ValueError:
        log.error("voice.prepare: refusing malformed voice id %r", voice_id)
        return voice_id
    ctx = resources()
    try:
        prepare_voice(voice_id, ctx)
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= MAX_RETRIES:
            _give_up(voice_id, ctx, exc)
            return voice_id
        log.warning("voice.prepare %s: %s; retrying", voice_id, exc)
        raise self.retry(exc=exc, countdown=2**self.request.retries) from exc
    return voice_id
