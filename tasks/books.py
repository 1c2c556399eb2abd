"""Book tasks on the CPU queue: read a book, fan it out into segment jobs, tokenize, assemble its files.

    book.parse(book_id)            read and plan a submitted book in a bounded child process
                                   (`app.books.intake.read_book`): queued and book.plan sent, or failed
                                   with the reason
    book.plan(book_id)             the segments without finished audio of the first chapters, each started
                                   on its own: a segment whose token source is ready at planning gets its
                                   job here, rung (`lifecycle.ring`); the others get a book.tokenize
    book.tokenize(book_id, key)    the segment's token source (`app.books.planning.tokens`) -> a queued
                                   job, rung: text through the guide voice makes a text job whose speech
                                   goes to the feature store and whose `synth` goes at once (the GPU worker
                                   tokenizes it). Redelivered, it makes no second job
    book.chapter(book_id, index)   rung once the chapter is recorded ready (by the transaction settling its
                                   last segment, and by the sweep until it has run): the quality gate
                                   (`app.books.quality`: 'waiting' while a failed segment renders again),
                                   the chapter file, then the next chapters of the window, or book.assemble.
                                   An early, late or repeated call is harmless ('waiting' while a segment
                                   renders; 'busy' while another holds the chapter's render lease)
    book.assemble(book_id)         chapter files (reused), M4B, chapter index -> book succeeded

Segment jobs are ordinary jobs at the book's priority (default 0, the lowest: any job asking for more
overtakes every queued segment), and their doorbells are the lifecycle's: `lifecycle.ring` routes each job
(`app.submission.routing`: the voice's holder's own queue, or the shared gpu queue), records the route and
when the bell is due again, commits and sends `synth`; the reconciler (`app.reconcile.sweep`) rings a job
that is still queued then. Every message is sent by name through `app.broker.wire`, so this module imports
neither the GPU worker nor Celery's canvas. Nothing waits on a segment: no chain, no chord, no polling. The
work itself (plans, token sources, chapter files, progress) is `app.books`'s; this module schedules it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import Ignore
from sqlalchemy.orm import Session

from app import lifecycle
from app.books import files, intake, quality, render, service
from app.books.planning.plan import BookPlan, PlanSegment
from app.books.planning.tokens import BookContext, source_for
from app.broker import wire
from app.context import Context
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES, Book, BookStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.storage.keys import check_job_id
from app.text.guide_speech import GuideSpeech
from tasks.celery_app import celery_app
from tasks.voice import TRANSIENT_ERRORS, resources

log = logging.getLogger(__name__)


class BookStopped(WavefarmError):
    """The book was cancelled or failed meanwhile: the task stops without failing the book again, logs
    one INFO line and is ignored (Celery's `Ignore`: acknowledged, logged at INFO without a traceback, and
    a message of the old format does not send its chained `synth`)."""


# Chapters are sent in order while fewer segments than this wait to render: the gpu queue holds a
# window of the book, not all of it, so a job at the book's own priority waits behind at most this
# many segments (plus the chapter that crosses the line).
LOOKAHEAD_SEGMENTS = 32
MAX_RETRIES = 3  # infrastructure errors (Redis, database) before a task gives up


# book.parse --------------------------------------------------------------------------------------

def parse(book_id: str, ctx: Context) -> str:
    return intake.read_book(book_id, ctx)


# book.plan ---------------------------------------------------------------------------------------

def _start(ctx: Context, session: Session, book: Book, segment: PlanSegment, voice_id: str,
           state: queries.SegmentState) -> bool:
    """Send what renders one segment; False when nothing needs sending (done, or already rendering). A
    segment whose token source is ready at planning gets its job now, rung through `lifecycle.ring`
    (routed job by job: the chapter's next line of the voice finds this one queued on its worker, so a
    voice's lines keep to its holder until its slots are full); the others get a `book.tokenize`, which
    makes the job and rings it."""
    if state.done and ctx.artifacts.path(state.output_path or "").is_file():
        return False
    if state.live:
        return False  # queued or rendering from an earlier submission: its settling counts this chapter too
    source = source_for(segment)
    if source.ready_at_plan:  # the segment's own tokens: its job is made now
        tokens = source.tokens(segment, BookContext())
        assert isinstance(tokens, list)  # a source ready at planning speaks nothing
        job_id, created = service.make_segment_job(session=session, artifacts=ctx.artifacts, book=book,
                                                   key=segment.key, content=tokens, replacing=state.job_id,
                                                   voice_id=voice_id)
        session.commit()  # the job stays made if its ring fails: the reconciler rings it when due
        if not created:
            return False  # another render linked its job first, and rings it
        lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
        return True
    if state.job_id is not None or state.error is not None:  # done but its audio is gone: start afresh
        lifecycle.unlink_segment_job(session=session, key=segment.key, job_id=state.job_id or "")
        lifecycle.fail_segment(session=session, key=segment.key, error=None)
        session.commit()
    wire.send_book_tokenize(ctx.sender, ctx.settings, book.id, segment.key, book.priority)
    return True


def _send_chapter(ctx: Context, book: Book, book_plan: BookPlan, index: int, seen: set[str]) -> int:
    """Send the chapter's segments without audio (already rendering, or sent for an earlier chapter in
    `seen`: left alone), each on its own: nothing waits on them, their jobs settling count the chapter
    (`app.lifecycle.books`). A chapter whose segments had all settled already is recorded ready
    here and its book.chapter sent. Returns how many segments were sent."""
    sent = 0
    with session_scope(ctx.sessions) as session:
        for segment in book_plan.chapters[index].segments:
            if segment.key in seen:
                continue  # a sentence repeated in the book renders once
            seen.add(segment.key)
            state = queries.segment_state(session=session, key=segment.key)
            assert state is not None  # create_book inserted every key
            sent += _start(ctx, session, book, segment, book_plan.voice_of(segment), state)
    with session_scope(ctx.sessions) as session:
        ready = lifecycle.record_ready(session=session, book_id=book.id, index=index)
    if ready:
        wire.send_chapter(ctx.sender, ctx.settings, book.id, index)
    return sent


def schedule(book_id: str, ctx: Context, seen: set[str] | None = None) -> int:
    """Send chapters, in order, while fewer than LOOKAHEAD_SEGMENTS of the book's segments are waiting
    to render: a long book never floods the gpu queue ahead of other jobs. Returns segments sent."""
    book_plan = files.load_plan(ctx.artifacts, book_id)
    seen = set() if seen is None else seen
    sent = 0
    while True:
        with session_scope(ctx.sessions) as session:
            book = queries.require_book(session=session, book_id=book_id)
            if book.status != BookStatus.RENDERING:
                return sent
            if queries.count_rendering_segments(session=session, book_id=book_id) >= LOOKAHEAD_SEGMENTS:
                return sent
            index = lifecycle.claim_next_chapter(session=session, book_id=book_id)
            if index is not None:  # in the claim's transaction: no failure of before counts it settled
                lifecycle.reopen_failed_segments(session=session, book_id=book_id, index=index)
        if index is None:
            return sent
        sent += _send_chapter(ctx, book, book_plan, index, seen)


def plan(book_id: str, ctx: Context) -> int:
    """Start (or, redelivered after a crash, resume) a book: send its first chapters; returns how many
    segments were sent to render."""
    with session_scope(ctx.sessions) as session:
        if not lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.RENDERING,
                                         only_from=(BookStatus.QUEUED, BookStatus.RENDERING)):
            log.info("book.plan %s: not live; nothing to do", book_id)
            return 0
        book = queries.require_book(session=session, book_id=book_id)
        pending = [c.index for c in queries.list_chapters(session=session, book_id=book_id)
                   if c.scheduled_at is not None and c.assembled_at is None]
    book_plan = files.load_plan(ctx.artifacts, book_id)
    seen: set[str] = set()
    sent = 0
    for index in pending:  # redelivered, or sent again by the sweep: their failures render again too
        with session_scope(ctx.sessions) as session:
            lifecycle.reopen_failed_segments(session=session, book_id=book_id, index=index)
        sent += _send_chapter(ctx, book, book_plan, index, seen)
    sent += schedule(book_id, ctx, seen)
    log.info("book.plan %s: %d segments sent to render, %d distinct in the book", book_id, sent,
             len(book_plan.unique_keys()))
    return sent


# book.tokenize -----------------------------------------------------------------------------------

def tokenize(book_id: str, key: str, ctx: Context) -> str:
    """Tokens for one segment -> its queued job (reusing one another render made meanwhile), rung through
    `lifecycle.ring`; returns the job id. Redelivered: the segment's job is not made twice; a queued one
    is rung again (a duplicate doorbell costs one claim that finds it taken), a claimed or finished one
    is left alone (`ring` sends nothing for a job that is not queued)."""
    with session_scope(ctx.sessions) as session:
        if queries.require_book(session=session, book_id=book_id).status not in LIVE_BOOK_STATUSES:
            raise BookStopped(f"book {book_id} was cancelled or failed; segment {key[:12]} is not rendered")
        state = queries.segment_state(session=session, key=key)
        if state is None:
            raise WavefarmError(f"segment {key[:12]} is not in book {book_id}")
        if state.job_id and state.live:  # its speech still waiting for the GPU worker: synth, not tokenize
            lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=state.job_id,
                           speech_stored=ctx.store.has_guide_speech(state.job_id))
        if state.job_id and (state.live or state.done):
            return state.job_id
    book_plan = files.load_plan(ctx.artifacts, book_id)
    segment = next(s for _, s in book_plan.segments() if s.key == key)
    context = BookContext(language=book_plan.language, base_dir=files.base_dir_of(ctx.artifacts, book_id),
                          model_dir=ctx.settings.model_dir)
    try:
        made = source_for(segment).tokens(segment, context)
    except (WavefarmError, OSError, RuntimeError) as exc:
        with session_scope(ctx.sessions) as session:
            lifecycle.fail_segment(session=session, key=key, error=f"tokenize: {type(exc).__name__}: {exc}")
        raise
    with session_scope(ctx.sessions) as session:
        job_id = service.segment_job_of(ctx=ctx, session=session, book_id=book_id, key=key,
                                        replacing=state.job_id, voice_id=book_plan.voice_of(segment),
                                        made=made, spoken=segment.spoken)
        session.commit()  # the job stays made if its ring fails: the reconciler rings it when due
        lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id,
                       speech_stored=isinstance(made, GuideSpeech))
    return job_id


# book.chapter ------------------------------------------------------------------------------------

def check_chapter(book_id: str, index: int, ctx: Context) -> str:
    """'waiting' (segments still rendering), 'failed', 'stopped' (book not live), 'busy' (another
    book.chapter holds the chapter's render lease and renders it) or 'assembled'; after the book's last
    chapter, book.assemble is sent, else the window of chapters moves on."""
    if quality.hold_chapter(ctx, book_id, index):
        return "waiting"
    outcome, last = render.settle_chapter(sessions=ctx.sessions, artifacts=ctx.artifacts, book_id=book_id,
                                          index=index)
    if last:
        wire.send_assemble(ctx.sender, ctx.settings, book_id)
    elif outcome == "assembled":
        schedule(book_id, ctx)
    return outcome


# book.assemble -----------------------------------------------------------------------------------

def assemble(book_id: str, ctx: Context) -> str:
    return render.assemble(sessions=ctx.sessions, artifacts=ctx.artifacts, book_id=book_id)


def _fail_book(book_id: str, ctx: Context, error: str) -> None:
    try:
        with session_scope(ctx.sessions) as session:
            lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED, error=error)
    except TRANSIENT_ERRORS:
        log.exception("book %s: could not record the failure", book_id)


# Celery adapters ---------------------------------------------------------------------------------

def _run(task: Task, book_id: str, body: Any) -> Any:
    """Retry infrastructure errors a few times; anything else fails the book with its reason."""
    check_job_id(book_id)
    ctx = resources()
    try:
        return body(ctx)
    except TRANSIENT_ERRORS as exc:
        if task.request.retries >= MAX_RETRIES:
            _fail_book(book_id, ctx, f"infrastructure error after {MAX_RETRIES} retries: {exc}")
            raise
        raise task.retry(exc=exc, countdown=2**task.request.retries) from exc
    except BookStopped as exc:  # a cancelled (or failed) book is not an error: one line, no traceback
        log.info("%s %s: %s", task.name, book_id, exc)
        raise Ignore() from None  # acknowledged, no state recorded, no chained task run
    except MemoryError:  # Celery treats it as fatal to the worker: here it fails the book, the worker goes on
        log.exception("%s %s: out of memory", task.name, book_id)
        _fail_book(book_id, ctx, f"{task.name}: ran out of memory on the CPU worker")
        raise BookStopped(f"book {book_id}: out of memory") from None
    except Exception as exc:  # boundary: one book fails with the reason, the worker goes on
        if not isinstance(exc, WavefarmError | OSError):
            log.exception("%s %s: unexpected error", task.name, book_id)
        _fail_book(book_id, ctx, f"{task.name}: {type(exc).__name__}: {exc}")
        raise


@celery_app.task(name=wire.BOOK_PARSE_TASK, bind=True, max_retries=MAX_RETRIES)
def parse_task(self: Task, book_id: str) -> str:
    return str(_run(self, book_id, lambda ctx: parse(book_id, ctx)))


@celery_app.task(name=wire.BOOK_PLAN_TASK, bind=True, max_retries=MAX_RETRIES)
def plan_task(self: Task, book_id: str) -> int:
    return int(_run(self, book_id, lambda ctx: plan(book_id, ctx)))


@celery_app.task(name=wire.BOOK_TOKENIZE_TASK, bind=True, max_retries=MAX_RETRIES)
def tokenize_task(self: Task, book_id: str, key: str, routed_to: str | None = None,
                  route: str | None = None) -> str:
    """-> the segment's job id. `routed_to` and `route` are ignored: a message sent before the job was rung
    here (`book.tokenize | synth`, the route chosen at planning) still runs after an upgrade; its chained
    `synth` gets the job id returned here, a duplicate doorbell."""
    return str(_run(self, book_id, lambda ctx: tokenize(book_id, key, ctx)))


@celery_app.task(name=wire.BOOK_CHAPTER_TASK, bind=True, max_retries=MAX_RETRIES)
def chapter_task(self: Task, book_id: str, index: int) -> str:
    """Rung when the chapter is recorded ready; 'waiting' (a segment became live again): nothing to do,
    the segment's own settling rings it again."""
    return str(_run(self, book_id, lambda ctx: check_chapter(book_id, index, ctx)))


@celery_app.task(name=wire.BOOK_ASSEMBLE_TASK, bind=True, max_retries=MAX_RETRIES)
def assemble_task(self: Task, book_id: str) -> str:
    return str(_run(self, book_id, lambda ctx: assemble(book_id, ctx)))
