"""Books as a service: submit a book, follow it, cancel it. Used by the API, the CLI and `tasks.books`.

    submit_book   parse + plan now (a bad book is refused here, 4xx), store the plan, write the rows,
                  prepare the voice once, then send `book.plan` to a CPU worker
    book_status   progress per book and chapter from the database: segments done/total, audio seconds
                  rendered, ETA from the rate so far
    cancel_book   stop a book: its live segment jobs (not shared with another live book) are cancelled
    make_segment_job  one segment's speech tokens -> a queued synth job linked to the segment's key

Resume: segments are rows keyed by content (`app.books.plan`), each pointing at the job whose output
is its audio. Rendering a book again - after a crash, a cancel or an edit - plans the same keys, finds
their finished jobs and renders only the keys without one; a crash or cancel loses at most the
segments that were being rendered.

Files of a book live under `<artifact root>/books/<book id>/`: plan.json, meta.json (cover type, the
manifest's folder), cover, and out/ (chapter files, book.m4b, chapters.json, chapters.vtt).
Nothing here imports Celery tasks: tasks are sent by name.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from app import submit
from app.artifacts import ArtifactStore
from app.books import BookLimits, SourceBook
from app.books.assemble import write_text
from app.books.parse import parse_book
from app.books.plan import BookPlan, plan_book
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES, Book, BookStatus, OutputFormat, utcnow
from app.errors import BadInput, NotFound
from app.settings import Settings
from app.store import FeatureStore

if TYPE_CHECKING:
    from app.books.guide_voice import GuideOptions

log = logging.getLogger(__name__)

PLAN_TASK = "book.plan"
DEFAULT_SEED = 0  # a fixed seed: the same book rendered again has the same keys, so it resumes
BOOKS_DIR = "books"
TOKENS_PER_SECOND = 25.0


@dataclass(frozen=True)
class BookOptions:
    output_format: str = "flac"
    m4b: bool = True
    target_lufs: float | None = None
    seed: int = DEFAULT_SEED
    priority: int = 0  # job priority of the segments (0..9, larger first); 0 yields to every other job

    def check(self) -> None:
        if self.output_format not in tuple(OutputFormat):
            raise BadInput(f"book format {self.output_format!r} is not one of "
                           f"{[f.value for f in OutputFormat]} (the M4B comes with either)")
        if isinstance(self.priority, bool) or not 0 <= self.priority <= submit.MAX_PRIORITY:
            raise BadInput(f"priority must be an integer 0..{submit.MAX_PRIORITY}")
        if isinstance(self.seed, bool) or not 0 <= self.seed <= submit.MAX_SEED:
            raise BadInput("seed must be an integer 0..2**63-1")
        if self.target_lufs is not None and not -70.0 <= self.target_lufs <= -5.0:
            raise BadInput("target loudness must be between -70 and -5 LUFS")


# Files -------------------------------------------------------------------------------------------

def book_dir(artifacts: ArtifactStore, book_id: str) -> Path:
    return artifacts.root / BOOKS_DIR / str(uuid.UUID(book_id))


def output_dir(artifacts: ArtifactStore, book_id: str) -> Path:
    return book_dir(artifacts, book_id) / "out"


def load_plan(artifacts: ArtifactStore, book_id: str) -> BookPlan:
    data = json.loads((book_dir(artifacts, book_id) / "plan.json").read_text(encoding="utf-8"))
    return BookPlan.from_dict(data)


def load_meta(artifacts: ArtifactStore, book_id: str) -> dict[str, Any]:
    return dict(json.loads((book_dir(artifacts, book_id) / "meta.json").read_text(encoding="utf-8")))


def load_cover(artifacts: ArtifactStore, book_id: str) -> tuple[bytes | None, str | None]:
    meta = load_meta(artifacts, book_id)
    path = book_dir(artifacts, book_id) / "cover"
    if not meta.get("cover_type") or not path.is_file():
        return None, None
    return path.read_bytes(), meta["cover_type"]


def _store_files(artifacts: ArtifactStore, book_id: str, plan: BookPlan, source: SourceBook,
                 base_dir: Path | None) -> None:
    folder = book_dir(artifacts, book_id)
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "plan.json", json.dumps(plan.to_dict(), ensure_ascii=False))
    if source.cover:
        (folder / "cover").write_bytes(source.cover)
    meta = {"cover_type": source.cover_type if source.cover else None,
            "base_dir": str(base_dir.resolve()) if base_dir is not None else None}
    write_text(folder / "meta.json", json.dumps(meta))


# Submission --------------------------------------------------------------------------------------

def render_options(settings: Settings, options: BookOptions) -> dict[str, Any]:
    """What goes into every segment key besides content and voice: the seed and the model."""
    return {"seed": options.seed, "model": str(settings.model_dir) if settings.model_dir else "dummy",
            "preset": settings.model_preset}


@lru_cache(maxsize=64)
def guide_options(language: str) -> GuideOptions:
    """The espeak-ng voice for a book's language: the tag itself, else its primary language ("en-gb" ->
    "en", "pt-pt" -> "pt"); BadInput when espeak-ng speaks neither."""
    from app.books.guide_voice import GuideOptions, speak

    first = GuideOptions.for_language(language)
    candidates = dict.fromkeys([first.voice, language.split("-")[0]])
    for voice in candidates:
        options = GuideOptions(voice=voice, rate_wpm=first.rate_wpm, pitch=first.pitch)
        try:
            speak("a", options)
        except BadInput:
            continue
        return options
    raise BadInput(f"no guide voice speaks language {language!r} (espeak-ng has none of {list(candidates)})")


def plan_source(source: SourceBook, *, settings: Settings, voice_id: str, options: BookOptions) -> BookPlan:
    guide: dict[str, Any] | None = None
    if any(c.paragraphs for c in source.chapters):
        from app.books.guide_voice import identity

        guide = identity(guide_options(source.language))
    return plan_book(source, voice_id=voice_id, render_options=render_options(settings, options),
                     guide_options=guide)


def _voice(*, settings: Settings, session: Session, sender: submit.TaskSender, store: FeatureStore,
           artifacts: ArtifactStore, reference_bytes: bytes | None, voice_id: str | None) -> str:
    """The book's voice, stored and queued for preparation once (the segments then share it)."""
    if reference_bytes is not None and voice_id is None:
        voice_id, _ = submit.register_voice(settings=settings, session=session, sender=sender, store=store,
                                            artifacts=artifacts, reference_bytes=reference_bytes)
        return voice_id
    voice = submit.resolve_voice(settings=settings, session=session, artifacts=artifacts,
                                  reference_bytes=reference_bytes, voice_id=voice_id)
    prepare = submit.needs_prepare(session=session, store=store, voice=voice)
    session.commit()
    if prepare:
        sender.send_task(submit.PREPARE_TASK, args=[voice.id], queue=settings.queue_cpu,
                         priority=submit.broker_priority(0))
    return voice.id


def submit_book(*, settings: Settings, session: Session, sender: submit.TaskSender, store: FeatureStore,
                artifacts: ArtifactStore, data: bytes, filename: str | None = None,
                book_format: str | None = None, reference_bytes: bytes | None = None,
                voice_id: str | None = None, options: BookOptions = BookOptions(), title: str | None = None,
                author: str | None = None, language: str | None = None,
                base_dir: Path | None = None, limits: BookLimits | None = None) -> str:
    """Accept a book and return its id. Raises BadInput (and kin) or NotFound before anything runs.

    `base_dir` (CLI only) lets a manifest name source audio files inside that folder."""
    options.check()
    source = parse_book(data, fmt=book_format, filename=filename, title=title, author=author,
                        language=language, base_dir=base_dir, limits=limits or BookLimits())
    voice = _voice(settings=settings, session=session, sender=sender, store=store, artifacts=artifacts,
                   reference_bytes=reference_bytes, voice_id=voice_id)
    plan = plan_source(source, settings=settings, voice_id=voice, options=options)
    book_id = str(uuid.uuid4())
    _store_files(artifacts, book_id, plan, source, base_dir)
    chapters = [queries.PlannedChapter(c.title, [(s.key, s.kind) for s in c.segments],
                                       sum(s.est_tokens for s in c.segments) / TOKENS_PER_SECOND)
                for c in plan.chapters]
    queries.create_book(session=session, book_id=book_id, voice_id=voice, title=plan.title,
                        author=plan.author, language=plan.language, plan_key=plan.key,
                        output_format=options.output_format, m4b=options.m4b,
                        target_lufs=options.target_lufs, seed=options.seed, priority=options.priority,
                        chapters=chapters)
    session.commit()
    try:
        sender.send_task(PLAN_TASK, args=[book_id], queue=settings.queue_cpu,
                         priority=submit.broker_priority(options.priority))
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
                     tokens: list[int], replacing: str | None) -> tuple[str, bool]:
    """A queued job rendering `tokens` for segment `key`, linked to the key. Returns (job id, created).

    When another render linked its own job first, that job is returned and nothing is created. The
    caller commits, then sends `synth` for a created job."""
    token_list = submit.check_tokens(tokens, max_tokens=max(len(tokens), 1))
    job_id = str(uuid.uuid4())
    inline = len(token_list) <= submit.INLINE_TOKENS_MAX
    tokens_path = None if inline else artifacts.put_tokens(job_id, token_list)
    queries.create_job(session=session, job_id=job_id, voice_id=book.voice_id,
                       tokens=token_list if inline else None, n_tokens=len(token_list), seed=book.seed,
                       output_format=book.output_format, priority=book.priority, tokens_path=tokens_path)
    if queries.link_segment_job(session=session, key=key, job_id=job_id, replacing=replacing,
                                n_tokens=len(token_list)):
        queries.add_voice_use(session=session, voice_id=book.voice_id)
        return job_id, True
    session.rollback()
    if tokens_path:
        artifacts.remove(tokens_path)
    segment = queries.get_segment(session=session, key=key)
    if segment is None or segment.job_id is None:
        raise NotFound(f"segment {key[:12]} lost its job while linking")
    return segment.job_id, False


# Status ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChapterStatus:
    index: int
    title: str
    segments_total: int
    segments_done: int
    audio_seconds: float
    est_seconds: float
    eta_s: float | None
    seconds: float | None  # length of the assembled chapter file
    file: str | None  # its name in the output folder, once assembled


@dataclass(frozen=True)
class BookStatusView:
    book: Book
    chapters: list[ChapterStatus]
    segments_total: int
    segments_done: int
    audio_seconds: float
    eta_s: float | None
    files: list[str]


def _rate(book: Book, audio_seconds: float, now: datetime) -> float | None:
    """Audio seconds rendered per wall second since the book started."""
    if book.started_at is None or audio_seconds <= 0:
        return None
    elapsed = (now - book.started_at).total_seconds()
    return audio_seconds / elapsed if elapsed > 0 else None


def book_status(*, session: Session, artifacts: ArtifactStore, book_id: str) -> BookStatusView:
    book = queries.require_book(session=session, book_id=book_id)
    progress = {p.index: p for p in queries.book_progress(session=session, book_id=book_id)}
    rows = queries.list_chapters(session=session, book_id=book_id)
    done_s = sum(p.tokens_done for p in progress.values()) / TOKENS_PER_SECOND
    rate = _rate(book, done_s, utcnow())
    live = book.status in LIVE_BOOK_STATUSES
    out = output_dir(artifacts, book_id)
    chapters = []
    for row in rows:
        p = progress.get(row.index)
        total, done = (p.segments_total, p.segments_done) if p else (0, 0)
        audio_s = (p.tokens_done if p else 0) / TOKENS_PER_SECOND
        left = max(row.est_seconds - audio_s, 0.0) if done < total else 0.0
        file = f"chapter-{row.index + 1:03d}.{book.output_format}"
        chapters.append(ChapterStatus(
            index=row.index, title=row.title, segments_total=total, segments_done=done, audio_seconds=audio_s,
            est_seconds=row.est_seconds, eta_s=round(left / rate, 1) if live and rate else None,
            seconds=row.seconds, file=file if row.assembled_at and (out / file).is_file() else None))
    left = sum(max(c.est_seconds - c.audio_seconds, 0.0) for c in chapters
               if c.segments_done < c.segments_total)
    files = sorted(p.name for p in out.iterdir() if _is_output(p.name)) if out.is_dir() else []
    return BookStatusView(book=book, chapters=chapters,
                          segments_total=sum(c.segments_total for c in chapters),
                          segments_done=sum(c.segments_done for c in chapters), audio_seconds=done_s,
                          eta_s=round(left / rate, 1) if live and rate else (0.0 if not live else None),
                          files=files)


def _is_output(name: str) -> bool:
    """A finished output's name: the M4B, the index, a chapter file (not sidecars or temp files)."""
    return name in ("book.m4b", "chapters.json", "chapters.vtt") or (
        name.startswith("chapter-") and name.endswith((".wav", ".flac")) and "/" not in name)


def output_file(*, session: Session, artifacts: ArtifactStore, book_id: str, name: str) -> Path:
    """A finished output file of a book by its name in the output folder; NotFound otherwise."""
    queries.require_book(session=session, book_id=book_id)
    path = output_dir(artifacts, book_id) / name
    if not _is_output(name) or not path.is_file():
        raise NotFound(f"book {book_id} has no file {name!r} (yet)")
    return path


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


def _needed_elsewhere(session: Session, key: str, book_id: str) -> bool:
    return queries.count_live_books_with_segment(session=session, key=key, exclude_book_id=book_id) > 0
