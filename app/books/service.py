"""Books as a service: submit a book, cancel it, make its segment jobs. Used by the API, the CLI and
`tasks.books`; a book's progress is `app.books.status`, its files `app.books.files`.

    submit_book       parse + plan now (a bad book is refused here, 4xx), store the plan, write the rows,
                      queue the voice's preparation once, then send `book.plan` to a CPU worker
    cancel            stop a live book (idempotent): its live segment jobs that no other live book needs
                      are cancelled; Conflict if it had already finished
    make_segment_job  one segment's speech tokens -> a queued synth job linked to the segment's key

Resume: segments are rows keyed by content (`app.books.plan`), each pointing at the job whose output
is its audio. Rendering a book again - after a crash, a cancel or an edit - plans the same keys, finds
their finished jobs and renders only the keys without one; a crash or cancel loses at most the
segments that were being rendered. Nothing here imports Celery tasks: tasks are sent by name.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app import jobs, voices, wire
from app.artifacts import ArtifactStore
from app.books.cast import parse_cast
from app.books.files import store_files
from app.books.guide_voice import identity, options_for
from app.books.lexicon import EMPTY, Lexicon, load_lexicon, parse_lexicon
from app.books.loudness import DEFAULT_TARGET_LUFS
from app.books.parse import parse_book
from app.books.plan import BookPlan, plan_book
from app.books.select import describe, parse_chapters
from app.books.source import BookLimits, SourceBook, with_metadata
from app.books.status import require_book
from app.db import queries
from app.db.models import Book, BookStatus
from app.errors import BadInput, Conflict, NotFound
from app.settings import Settings
from app.speech import TOKEN_RATE, OutputFormat, check_tokens
from app.store import FeatureStore

log = logging.getLogger(__name__)

DEFAULT_SEED = 0  # a fixed seed: the same book rendered again has the same keys, so it resumes


@dataclass(frozen=True)
class BookOptions:
    output_format: str = OutputFormat.FLAC
    m4b: bool = True
    mp3: bool = False  # an MP3 per chapter too (ID3-tagged), beside the chapter files
    timed: bool = False  # subtitles: each cue's speech at its start time
    target_lufs: float | None = DEFAULT_TARGET_LUFS  # None: chapters are measured, not normalised
    seed: int = DEFAULT_SEED
    priority: int = 0  # job priority of the segments (0..9, larger first); 0 yields to every other job

    def check(self) -> None:
        if self.output_format not in tuple(OutputFormat):
            raise BadInput(f"book format {self.output_format!r} is not one of "
                           f"{[f.value for f in OutputFormat]} (the M4B comes with either)")
        if isinstance(self.priority, bool) or not 0 <= self.priority <= wire.MAX_PRIORITY:
            raise BadInput(f"priority must be an integer 0..{wire.MAX_PRIORITY}")
        if isinstance(self.seed, bool) or not 0 <= self.seed <= jobs.MAX_SEED:
            raise BadInput("seed must be an integer 0..2**63-1")
        if self.target_lufs is not None and not -70.0 <= self.target_lufs <= -5.0:
            raise BadInput("target loudness must be between -70 and -5 LUFS")


def target_lufs_field(text: str | None) -> float | None:
    """A target loudness as a form or the CLI gives it: absent or empty is the default, "off" (or "none")
    turns normalisation off, anything else is a number of LUFS."""
    if text is None or not text.strip():
        return DEFAULT_TARGET_LUFS
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise BadInput(f"target loudness must be a number of LUFS or 'off', not {text!r}") from None


# Submission --------------------------------------------------------------------------------------

def render_options(settings: Settings, options: BookOptions) -> dict[str, Any]:
    """What goes into every segment key besides content and voice: the seed and the model."""
    return {"seed": options.seed, "model": str(settings.model_dir) if settings.model_dir else "dummy",
            "preset": settings.model_preset}


def plan_source(source: SourceBook, *, settings: Settings, voice_id: str, options: BookOptions,
                lexicon: Lexicon = EMPTY, cast: Mapping[str, str] | None = None) -> BookPlan:
    guide = identity(options_for(source.language)) if any(c.paragraphs for c in source.chapters) else None
    return plan_book(source, voice_id=voice_id, render_options=render_options(settings, options),
                     guide_options=guide, lexicon=lexicon, cast=cast)


def _voice(*, settings: Settings, session: Session, sender: wire.TaskSender, store: FeatureStore,
           artifacts: ArtifactStore, reference_bytes: bytes | None, voice_id: str | None) -> str:
    """The book's voice, stored and queued for preparation once (the segments then share it)."""
    voice = voices.resolve_voice(settings=settings, session=session, artifacts=artifacts,
                                 reference_bytes=reference_bytes, voice_id=voice_id)
    voices.queue_preparation(settings=settings, session=session, sender=sender, store=store, voice=voice)
    return voice.id


def submit_book(*, settings: Settings, session: Session, sender: wire.TaskSender, store: FeatureStore,
                artifacts: ArtifactStore, data: bytes, filename: str | None = None,
                book_format: str | None = None, reference_bytes: bytes | None = None,
                voice_id: str | None = None, options: BookOptions = BookOptions(), title: str | None = None,
                author: str | None = None, language: str | None = None,
                base_dir: Path | None = None, limits: BookLimits | None = None,
                chapters: str | None = None, narrator: str | None = None,
                description: str | None = None, lexicon: bytes | Mapping[str, Any] | None = None,
                cast: bytes | Mapping[str, Any] | None = None) -> str:
    """Accept a book and return its id. Raises BadInput (and kin) or NotFound before anything runs.

    `base_dir` (CLI only) lets a manifest name source audio files inside that folder; `chapters` ("3-7,12",
    `app.books.select`) renders only those chapters; `lexicon` (a JSON/YAML file's bytes or parsed data,
    `app.books.lexicon`) is laid over the service's default one; `cast` (JSON/YAML bytes or parsed data,
    `app.books.cast`) maps the voice names of the text's markup to stored voices, each prepared once."""
    options.check()
    limits = limits or BookLimits()
    source = with_metadata(parse_book(data, fmt=book_format, filename=filename, title=title, author=author,
                                      language=language, base_dir=base_dir, limits=limits),
                           narrator=narrator, description=description, limits=limits)
    own = parse_lexicon(lexicon) if lexicon is not None else EMPTY
    pronounce = own.over(load_lexicon(settings.lexicon))
    selected = None
    if chapters is not None:
        indices = parse_chapters(chapters, len(source.chapters))
        source = replace(source, chapters=tuple(source.chapters[i] for i in indices))
        selected = describe(indices)
    voice = _voice(settings=settings, session=session, sender=sender, store=store, artifacts=artifacts,
                   reference_bytes=reference_bytes, voice_id=voice_id)
    plan = plan_source(source, settings=settings, voice_id=voice, options=options, lexicon=pronounce,
                       cast=parse_cast(cast) if cast is not None else {})
    for member in plan.voices()[1:]:  # the cast's voices the book uses: each prepared once for all its lines
        _voice(settings=settings, session=session, sender=sender, store=store, artifacts=artifacts,
               reference_bytes=None, voice_id=member)
    book_id = str(uuid.uuid4())
    store_files(artifacts, book_id, plan, source, base_dir)
    planned = [queries.PlannedChapter(c.title, [(s.key, s.kind, plan.voice_of(s)) for s in c.segments],
                                      sum(s.est_tokens for s in c.segments) / TOKEN_RATE)
               for c in plan.chapters]
    queries.create_book(session=session, book_id=book_id, voice_id=voice, title=plan.title,
                        author=plan.author, language=plan.language, plan_key=plan.key,
                        output_format=options.output_format, m4b=options.m4b, mp3=options.mp3,
                        timed=options.timed,
                        target_lufs=options.target_lufs, seed=options.seed, priority=options.priority,
                        chapters=planned, chapters_selected=selected)
    session.commit()
    try:
        sender.send_task(wire.BOOK_PLAN_TASK, args=[book_id], queue=settings.queue_cpu,
                         priority=wire.broker_priority(options.priority))
    except Exception:
        log.exception("book %s: could not enqueue; marking it failed", book_id)
        queries.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED,
                                error="could not be queued")
        session.commit()
        raise
    log.info("book %s: %d chapters, %d segments (%d distinct), about %.0f s of speech", book_id,
             len(plan.chapters), sum(len(c.segments) for c in plan.chapters), len(plan.unique_keys()),
             plan.est_seconds)
    return book_id


# Segment jobs ------------------------------------------------------------------------------------

def make_segment_job(*, session: Session, artifacts: ArtifactStore, book: Book, key: str,
                     tokens: list[int], replacing: str | None,
                     voice_id: str | None = None) -> tuple[str, bool]:
    """A queued job rendering `tokens` for segment `key` in `voice_id` (default: the book's voice), linked
    to the key. Returns (job id, created).

    When another render linked its own job first, that job is returned and nothing is created. The
    caller commits, then sends `synth` for a created job."""
    token_list = check_tokens(tokens)
    voice_id = voice_id or book.voice_id
    job, _ = jobs.new_job(session=session, artifacts=artifacts, voice_id=voice_id, tokens=token_list,
                          seed=book.seed, output_format=book.output_format, priority=book.priority)
    job_id, tokens_path = job.id, job.tokens_path
    if queries.link_segment_job(session=session, key=key, job_id=job_id, replacing=replacing,
                                n_tokens=len(token_list)):
        queries.add_voice_use(session=session, voice_id=voice_id)
        return job_id, True
    session.rollback()
    if tokens_path:
        artifacts.remove(tokens_path)
    segment = queries.get_segment(session=session, key=key)
    if segment is None or segment.job_id is None:
        raise NotFound(f"segment {key[:12]} lost its job while linking")
    return segment.job_id, False


# Cancel ------------------------------------------------------------------------------------------

def cancel_book(*, session: Session, store: FeatureStore, book_id: str, cancel_ttl_s: int) -> bool:
    """Cancel a live book and its live segment jobs that no other live book needs; False if it had
    already finished. Finished segments stay: rendering the book again reuses them."""
    queries.require_book(session=session, book_id=book_id)
    if not queries.set_book_status(session=session, book_id=book_id, status=BookStatus.CANCELLED,
                                   error="cancelled"):
        return False
    cancelled = []
    for state in queries.book_segment_states(session=session, book_id=book_id):
        if state.live and state.job_id and not _needed_elsewhere(session, state.key, book_id):
            if queries.cancel_job(session=session, job_id=state.job_id):
                cancelled.append(state.job_id)
    session.commit()
    for job_id in cancelled:  # after the commit: the GPU worker polls these between steps
        store.request_cancel(job_id, ttl_s=cancel_ttl_s)
    log.info("book %s cancelled (%d segment jobs stopped)", book_id, len(cancelled))
    return True


def cancel(*, settings: Settings, session: Session, store: FeatureStore, book_id: str) -> Book:
    """Cancel a book as a client asks it (idempotent: a cancelled book stays cancelled); commits.
    Conflict if it had finished otherwise."""
    require_book(session=session, book_id=book_id)
    cancel_book(session=session, store=store, book_id=book_id, cancel_ttl_s=settings.visibility_timeout_s)
    book = queries.require_book(session=session, book_id=book_id)
    if book.status != BookStatus.CANCELLED:
        raise Conflict(f"book {book_id} already {book.status}")
    return book


def _needed_elsewhere(session: Session, key: str, book_id: str) -> bool:
    return queries.count_live_books_with_segment(session=session, key=key, exclude_book_id=book_id) > 0
