"""Book tasks on the CPU queue: read a book, fan it out into segment jobs, tokenize, assemble chapters and
the book.

    book.parse(book_id)            read and plan a submitted book in a bounded child process
                                   (`app.books.intake.read_book`): queued and book.plan sent, or failed
                                   with the reason
    book.plan(book_id)             the segments without finished audio of the first chapters, each sent on
                                   its own: `synth` (a segment whose token source is ready at planning:
                                   its job is made here) or book.tokenize | synth (the others)
    book.tokenize(book_id, key)    the segment's token source (`app.books.tokens`: text through the guide
                                   voice, or source speech) -> a queued job; returns its id, which the
                                   chained `synth` (GPU worker) renders
    book.chapter(book_id, index)   rung once the chapter is recorded ready (`app.db.queries.chapters`: the
                                   transaction that settles its last segment records it and the settling
                                   code sends this after its commit; the sweep sends it again until it
                                   has run): the chapter file, then the next chapters of the window, or,
                                   after the last chapter, book.assemble. It checks the database, so an
                                   early, late or repeated call is harmless; one that finds a segment
                                   rendering again just returns ('waiting'): that segment rings it again
    book.assemble(book_id)         chapter files (reused), M4B, chapter index -> book succeeded

Segment jobs are ordinary jobs at the book's priority (default 0, the lowest: any job asking for more
overtakes every queued segment); `synth` is sent by name to the queue `app.routing` chooses for the
book's voice (one GPU worker's own, or the shared gpu queue), so this module never imports the GPU worker.
Nothing waits on a segment: no chord, no polling. The work itself (plans, token sources, chapter files,
progress) is `app.books`'s; this module schedules it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, chain
from celery.canvas import Signature
from sqlalchemy.orm import Session

from app import lifecycle, routing, wire
from app.books import files, intake, render, service
from app.books.plan import BookPlan, PlanSegment
from app.books.tokens import BookContext, source_for
from app.context import Context as Resources  # renamed after the merge of the book-sending work
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES, Book, BookStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.keys import check_job_id
from app.text.tokens import STAND_IN_NOTE
from tasks.celery_app import celery_app
from tasks.voice import TRANSIENT_ERRORS, resources

log = logging.getLogger(__name__)


class BookStopped(WavefarmError):
    """The book was cancelled or failed meanwhile: the rest of a chain is not run."""


# Chapters are sent in order while fewer segments than this wait to render: the gpu queue holds a
# window of the book, not all of it, so a job at the book's own priority waits behind at most this
# many segments (plus the chapter that crosses the line).
LOOKAHEAD_SEGMENTS = 32
MAX_RETRIES = 3  # infrastructure errors (Redis, database) before a task gives up


def _sig(name: str, *args: Any, immutable: bool = True, **options: Any) -> Signature:
    return celery_app.signature(name, args=args, immutable=immutable, **options)


# book.parse --------------------------------------------------------------------------------------

def parse(book_id: str, res: Resources) -> str:
    return intake.read_book(book_id, res)


# book.plan ---------------------------------------------------------------------------------------

def _member(res: Resources, session: Session, book: Book, segment: PlanSegment, voice_id: str,
            state: queries.SegmentState, route: routing.Route) -> Signature | None:
    """What renders one segment, or None when nothing needs sending (done, or already rendering). Its
    `synth` goes where `route` says (one route per voice and chapter)."""
    if state.done and res.artifacts.path(state.output_path or "").is_file():
        return None
    if state.live:
        return None  # queued or rendering from an earlier submission: its settling counts this chapter too
    gpu: dict[str, Any] = {"queue": route.queue, "priority": wire.broker_priority(book.priority)}
    source = source_for(segment)
    if source.ready_at_plan:  # the segment's own tokens: its job is made now
        tokens = source.tokens(segment, BookContext())
        job_id, created = service.make_segment_job(session=session, artifacts=res.artifacts, book=book,
                                                   key=segment.key, tokens=tokens, replacing=state.job_id,
                                                   voice_id=voice_id)
        if created:
            queries.set_job_route(session=session, job_ids=[job_id], routed_to=route.worker,
                                  route=route.reason)
        session.commit()
        return _sig(wire.SYNTH_TASK, job_id, task_id=job_id, **gpu) if created else None
    if state.job_id is not None or state.error is not None:  # done but its audio is gone: start afresh
        lifecycle.unlink_segment_job(session=session, key=segment.key, job_id=state.job_id or "")
        lifecycle.fail_segment(session=session, key=segment.key, error=None)
        session.commit()
    tokenize = _sig(wire.BOOK_TOKENIZE_TASK, book.id, segment.key, route.worker, route.reason,
                    queue=res.settings.queue_cpu, priority=wire.broker_priority(book.priority))
    return chain(tokenize, celery_app.signature(wire.SYNTH_TASK, **gpu))


def _send_chapter(res: Resources, book: Book, book_plan: BookPlan, index: int, seen: set[str]) -> int:
    """Send the chapter's segments without audio (already rendering, or sent for an earlier chapter in
    `seen`: left alone), each on its own: nothing waits on them, their jobs settling count the chapter
    (`app.db.queries.chapters`). A chapter whose segments had all settled already is recorded ready
    here and its book.chapter sent. Returns how many segments were sent."""
    members = []
    with session_scope(res.sessions) as session:
        routes: dict[str, routing.Route] = {}
        for segment in book_plan.chapters[index].segments:
            if segment.key in seen:
                continue  # a sentence repeated in the book renders once
            seen.add(segment.key)
            state = queries.segment_state(session=session, key=segment.key)
            assert state is not None  # create_book inserted every key
            voice = book_plan.voice_of(segment)
            if voice not in routes:  # one route per voice and chapter: a voice's lines keep to one worker
                routes[voice] = routing.route_voice(session=session, settings=res.settings, voice_id=voice)
            member = _member(res, session, book, segment, voice, state, routes[voice])
            if member is not None:
                members.append(member)
    for member in members:
        member.apply_async()
    with session_scope(res.sessions) as session:
        ready = lifecycle.record_ready(session=session, book_id=book.id, index=index)
    if ready:
        wire.send_chapter(celery_app, res.settings, book.id, index)
    return len(members)


def schedule(book_id: str, res: Resources, seen: set[str] | None = None) -> int:
    """Send chapters, in order, while fewer than LOOKAHEAD_SEGMENTS of the book's segments are waiting
    to render: a long book never floods the gpu queue ahead of other jobs. Returns segments sent."""
    book_plan = files.load_plan(res.artifacts, book_id)
    seen = set() if seen is None else seen
    sent = 0
    while True:
        with session_scope(res.sessions) as session:
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
        sent += _send_chapter(res, book, book_plan, index, seen)


def plan(book_id: str, res: Resources) -> int:
    """Start (or, redelivered after a crash, resume) a book: send its first chapters; returns how many
    segments were sent to render."""
    with session_scope(res.sessions) as session:
        if not lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.RENDERING,
                                         only_from=(BookStatus.QUEUED, BookStatus.RENDERING)):
            log.info("book.plan %s: not live; nothing to do", book_id)
            return 0
        book = queries.require_book(session=session, book_id=book_id)
        pending = [c.index for c in queries.list_chapters(session=session, book_id=book_id)
                   if c.scheduled_at is not None and c.assembled_at is None]
    book_plan = files.load_plan(res.artifacts, book_id)
    seen: set[str] = set()
    sent = 0
    for index in pending:  # redelivered, or sent again by the sweep: their failures render again too
        with session_scope(res.sessions) as session:
            lifecycle.reopen_failed_segments(session=session, book_id=book_id, index=index)
        sent += _send_chapter(res, book, book_plan, index, seen)
    sent += schedule(book_id, res, seen)
    log.info("book.plan %s: %d segments sent to render, %d distinct in the book", book_id, sent,
             len(book_plan.unique_keys()))
    return sent


# book.tokenize -----------------------------------------------------------------------------------

def tokenize(book_id: str, key: str, res: Resources, routed_to: str | None = None,
             route: str | None = None) -> str:
    """Tokens for one segment -> its queued job (reusing one another render made meanwhile); the route
    its chained `synth` was given (`app.routing`) is recorded on a job made here."""
    with session_scope(res.sessions) as session:
        if queries.require_book(session=session, book_id=book_id).status not in LIVE_BOOK_STATUSES:
            raise BookStopped(f"book {book_id} was cancelled or failed; segment {key[:12]} is not rendered")
        state = queries.segment_state(session=session, key=key)
        if state is None:
            raise WavefarmError(f"segment {key[:12]} is not in book {book_id}")
        if state.job_id and (state.live or state.done):
            return state.job_id
    book_plan = files.load_plan(res.artifacts, book_id)
    segment = next(s for _, s in book_plan.segments() if s.key == key)
    context = BookContext(language=book_plan.language, base_dir=files.base_dir_of(res.artifacts, book_id),
                          model_dir=res.settings.model_dir)
    try:
        tokens = source_for(segment).tokens(segment, context)
    except (WavefarmError, OSError, RuntimeError) as exc:
        with session_scope(res.sessions) as session:
            lifecycle.fail_segment(session=session, key=key, error=f"tokenize: {type(exc).__name__}: {exc}")
        raise
    with session_scope(res.sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        job_id, created = service.make_segment_job(session=session, artifacts=res.artifacts, book=book,
                                                   key=key, tokens=tokens, replacing=state.job_id,
                                                   voice_id=book_plan.voice_of(segment))
        if created and route is not None:
            queries.set_job_route(session=session, job_ids=[job_id], routed_to=routed_to, route=route)
        if context.model_dir is None:  # the tokens say nothing: the job's notes (and so the book's) say so
            queries.add_job_note(session=session, job_id=job_id, note=STAND_IN_NOTE)
    return job_id


# book.chapter ------------------------------------------------------------------------------------

def check_chapter(book_id: str, index: int, res: Resources) -> str:
    """'waiting' (segments still rendering), 'failed', 'stopped' (book not live) or 'assembled'; after the
    book's last chapter, book.assemble is sent, else the window of chapters moves on."""
    outcome, last = render.settle_chapter(sessions=res.sessions, artifacts=res.artifacts, book_id=book_id,
                                          index=index)
    if last:
        _sig(wire.BOOK_ASSEMBLE_TASK, book_id, queue=res.settings.queue_cpu).apply_async()
    elif outcome == "assembled":
        schedule(book_id, res)
    return outcome


# book.assemble -----------------------------------------------------------------------------------

def assemble(book_id: str, res: Resources) -> str:
    return render.assemble(sessions=res.sessions, artifacts=res.artifacts, book_id=book_id)


def _fail_book(book_id: str, res: Resources, error: str) -> None:
    try:
        with session_scope(res.sessions) as session:
            lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED, error=error)
    except TRANSIENT_ERRORS:
        log.exception("book %s: could not record the failure", book_id)


# Celery adapters ---------------------------------------------------------------------------------

def _run(task: Task, book_id: str, body: Any) -> Any:
    """Retry infrastructure errors a few times; anything else fails the book with its reason."""
    check_job_id(book_id)
    res = resources()
    try:
        return body(res)
    except TRANSIENT_ERRORS as exc:
        if task.request.retries >= MAX_RETRIES:
            _fail_book(book_id, res, f"infrastructure error after {MAX_RETRIES} retries: {exc}")
            raise
        raise task.retry(exc=exc, countdown=2**task.request.retries) from exc
    except BookStopped:
        raise
    except MemoryError:  # Celery treats it as fatal to the worker: here it fails the book, the worker goes on
        log.exception("%s %s: out of memory", task.name, book_id)
        _fail_book(book_id, res, f"{task.name}: ran out of memory on the CPU worker")
        raise BookStopped(f"book {book_id}: out of memory") from None
    except Exception as exc:  # boundary: one book fails with the reason, the worker goes on
        if not isinstance(exc, WavefarmError | OSError):
            log.exception("%s %s: unexpected error", task.name, book_id)
        _fail_book(book_id, res, f"{task.name}: {type(exc).__name__}: {exc}")
        raise


@celery_app.task(name=wire.BOOK_PARSE_TASK, bind=True, max_retries=MAX_RETRIES)
def parse_task(self: Task, book_id: str) -> str:
    return str(_run(self, book_id, lambda res: parse(book_id, res)))


@celery_app.task(name=wire.BOOK_PLAN_TASK, bind=True, max_retries=MAX_RETRIES)
def plan_task(self: Task, book_id: str) -> int:
    return int(_run(self, book_id, lambda res: plan(book_id, res)))


@celery_app.task(name=wire.BOOK_TOKENIZE_TASK, bind=True, max_retries=MAX_RETRIES)
def tokenize_task(self: Task, book_id: str, key: str, routed_to: str | None = None,
                  route: str | None = None) -> str:
    return str(_run(self, book_id, lambda res: tokenize(book_id, key, res, routed_to, route)))


@celery_app.task(name=wire.BOOK_CHAPTER_TASK, bind=True, max_retries=MAX_RETRIES)
def chapter_task(self: Task, book_id: str, index: int) -> str:
    """Rung when the chapter is recorded ready; 'waiting' (a segment became live again): nothing to do,
    the segment's own settling rings it again."""
    return str(_run(self, book_id, lambda res: check_chapter(book_id, index, res)))


@celery_app.task(name=wire.BOOK_ASSEMBLE_TASK, bind=True, max_retries=MAX_RETRIES)
def assemble_task(self: Task, book_id: str) -> str:
    return str(_run(self, book_id, lambda res: assemble(book_id, res)))
