"""Book tasks on the CPU queue: read a book, fan it out into segment jobs, tokenize, assemble its files.

    book.parse(book_id)            read and plan a submitted book in a bounded child process
                                   (`app.books.intake.read_book`): queued and book.plan sent, or failed
                                   with the reason
    book.plan(book_id)             the segments without finished audio of the first chapters, each started
                                   on its own: a segment whose token source is ready at planning gets its
                                   job here, rung (`lifecycle.ring`); the others get a book.tokenize
    book.tokenize(book_id, keys)   a group of up to 8 of a chapter's segments (`app.books.segment_jobs`):
                                   each segment's token source (`app.books.planning.tokens`) -> a queued
                                   job; the group's jobs are made in one transaction and rung together:
                                   text through the guide voice makes a text job whose speech goes to the
                                   feature store and whose `synth` goes at once (the GPU worker tokenizes
                                   it). Redelivered, it makes no second job
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
from app.books import files, intake, quality, render, segment_jobs, service
from app.books.planning.plan import BookPlan, PlanSegment
from app.books.planning.tokens import BookContext, source_for
from app.books.segment_jobs import BookStopped
from app.broker import wire
from app.context import Context
from app.db import queries
from app.db.models import Book, BookStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.storage.keys import check_job_id
from tasks.celery_app import celery_app
from tasks.voice import TRANSIENT_ERRORS, resources

log = logging.getLogger(__name__)


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
           state: queries.SegmentState) -> str | None:
    """Start what renders one segment: "rung" or "tokenize" (the caller sends its key in a `book.tokenize`
    group, which makes the job and rings it); None when nothing needs sending (done, or already
    rendering). A segment whose token source is ready at planning gets its job now, rung through
    `lifecycle.ring` (routed job by job: the chapter's next line of the voice finds this one queued on its
    worker, so a voice's lines keep to its holder until its slots are full)."""
    if state.done and ctx.artifacts.path(state.output_path or "").is_file():
        return None
    if state.live:
        return None  # queued or rendering from an earlier submission: its settling counts this chapter too
    source = source_for(segment)
    if source.ready_at_plan:  # the segment's own tokens: its job is made now
        tokens = source.tokens(segment, BookContext())
        assert isinstance(tokens, list)  # a source ready at planning speaks nothing
        job_id, created = service.make_segment_job(session=session, artifacts=ctx.artifacts, book=book,
                                                   key=segment.key, content=tokens, replacing=state.job_id,
                                                   voice_id=voice_id)
        session.commit()  # the job stays made if its ring fails: the reconciler rings it when due
        if not created:
            return None  # another render linked its job first, and rings it
        lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
        return "rung"
    if state.job_id is not None or state.error is not None:  # done but its audio is gone: start afresh
        lifecycle.unlink_segment_job(session=session, key=segment.key, job_id=state.job_id or "")
        lifecycle.fail_segment(session=session, key=segment.key, error=None)
        session.commit()
    return "tokenize"


def _send_chapter(ctx: Context, book: Book, book_plan: BookPlan, index: int, seen: set[str]) -> int:
    """Send the chapter's segments without audio (already rendering, or sent for an earlier chapter in
    `seen`: left alone), each on its own: nothing waits on them, their jobs settling count the chapter
    (`app.lifecycle.books`). A chapter whose segments had all settled already is recorded ready
    here and its book.chapter sent. Returns how many segments were sent."""
    sent = 0
    to_tokenize: list[str] = []
    with session_scope(ctx.sessions) as session:
        for segment in book_plan.chapters[index].segments:
            if segment.key in seen:
                continue  # a sentence repeated in the book renders once
            seen.add(segment.key)
            state = queries.segment_state(session=session, key=segment.key)
            assert state is not None  # create_book inserted every key
            how = _start(ctx, session, book, segment, book_plan.voice_of(segment), state)
            sent += how is not None
            if how == "tokenize":
                to_tokenize.append(segment.key)
    for group in segment_jobs.groups(to_tokenize):
        wire.send_book_tokenize(ctx.sender, ctx.settings, book.id, group, book.priority)
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

def tokenize(book_id: str, keys: list[str], ctx: Context) -> list[str]:
    """Tokens (or guide speech) for a group of segments -> their queued jobs, rung together
    (`app.books.segment_jobs`); returns the job ids in the order of `keys`."""
    return segment_jobs.make_jobs(book_id, keys, ctx)


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
def tokenize_task(self: Task, book_id: str, keys: str | list[str], routed_to: str | None = None,
                  route: str | None = None) -> str | list[str]:
    """-> the segments' job ids (a group of keys), or the one job id (a message of the old format, one
    key). `routed_to` and `route` are ignored: a message sent before the job was rung here
    (`book.tokenize | synth`, the route chosen at planning) still runs after an upgrade; its chained
    `synth` gets the job id returned here, a duplicate doorbell."""
    group = [keys] if isinstance(keys, str) else list(keys)  # a message of the old format names one key
    made = _run(self, book_id, lambda ctx: tokenize(book_id, group, ctx))
    return str(made[0]) if isinstance(keys, str) else [str(job_id) for job_id in made]


@celery_app.task(name=wire.BOOK_CHAPTER_TASK, bind=True, max_retries=MAX_RETRIES)
def chapter_task(self: Task, book_id: str, index: int) -> str:
    """Rung when the chapter is recorded ready; 'waiting' (a segment became live again): nothing to do,
    the segment's own settling rings it again."""
    return str(_run(self, book_id, lambda ctx: check_chapter(book_id, index, ctx)))


@celery_app.task(name=wire.BOOK_ASSEMBLE_TASK, bind=True, max_retries=MAX_RETRIES)
def assemble_task(self: Task, book_id: str) -> str:
    return str(_run(self, book_id, lambda ctx: assemble(book_id, ctx)))
