"""A book's way in: accepted by the API without being read, then read by a CPU worker in a bounded child.

    accept_book   the API's half (and the CLI's `--local`): what can be refused without reading the book
                  (`Submission.check`, sizes), the upload streamed to books/<id>/source, the voice stored
                  and queued for preparation, a `parsing` row, `book.parse` sent. Answers at once.
    read_book     `book.parse`'s half, a doorbell: the fairest book waiting (`app.books.lanes`: the quick
                  lane first, the long lane's books a few at a time) is read by the child
                  (`app.books.intake_child`) within the lane's limits (`WAVEFARM_BOOK_PARSE_*`); then the rows
                  (`queries.add_book_plan`), the cast's voices, `queued`, `book.plan` sent. A refusal or a
                  limit fails the book with the reason (a quick reading out of time moves the book to the
                  long lane instead); a cancel while it reads kills the child.

A book that cannot be read leaves no files: its folder is removed when it fails (its row keeps the
reason); a folder whose row was never written (the API died between the two) is the sweep's
(`app.reconcile.sweep`, once `orphan_grace_s` old).
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from sqlalchemy.orm import Session

from app import lifecycle
from app.books import lanes
from app.books.bounded import ChildExit, run_child
from app.books.files import book_dir
from app.books.intake_child import OUTCOME, ChildLimits, ParseJob
from app.books.planning import cast as cast_files
from app.books.planning import lexicon as lexicon_files
from app.books.reading.source import DEFAULT_LIMITS, BookLimits
from app.books.submission import BookRequest, Submission, SubmittedFiles
from app.broker import wire
from app.db import queries
from app.db.models import BookStatus
from app.db.session import session_scope
from app.errors import BadInput
from app.settings import Settings
from app.voices import service as voices

if TYPE_CHECKING:
    from app.context import Context

log = logging.getLogger(__name__)

COPY_CHUNK = 1 << 20
QUICK_WALL_PER_CPU = 4.0  # a quick reading's wall-clock limit, in its CPU budgets (a loaded machine)
JOB_FILE, LOG_FILE = "parse-job.json", "parse.log"


# The API's half ----------------------------------------------------------------------------------

def accept_book(*, ctx: Context, session: Session, source: BinaryIO, request: BookRequest,
                limits: BookLimits = DEFAULT_LIMITS) -> str:
    """Store a book (`source`, read in chunks) without reading it and send `book.parse`; returns its id.
    BadInput (and kin) for what can be refused at once; nothing is left behind when it is refused."""
    submission, lexicon, cast = request.submission, request.lexicon_bytes, request.cast_bytes
    submission.check(limits)
    _check_size("lexicon", lexicon, lexicon_files.MAX_BYTES)
    _check_size("cast", cast, cast_files.MAX_BYTES)
    voice = voices.resolve_voice(ctx=ctx, session=session, reference_bytes=request.reference_bytes,
                                 voice_id=request.voice_id)
    voices.queue_preparation(ctx=ctx, session=session, voice=voice)
    book_id = str(uuid.uuid4())
    files = SubmittedFiles(book_dir(ctx.artifacts, book_id))
    try:
        files.folder.mkdir(parents=True)
        store_upload(source, files.source, limits.max_epub_bytes)
        files.request.write_text(submission.to_json(), encoding="utf-8")
        for data, path in ((lexicon, files.lexicon), (cast, files.cast)):
            if data is not None:
                path.write_bytes(data)
        options = submission.options
        queries.create_book(session=session, new=queries.NewBook(
            id=book_id, voice_id=voice.id, title=_title(submission), author=submission.author or "",
            language=submission.language or "en", output_format=options.output_format, m4b=options.m4b,
            mp3=options.mp3, timed=options.timed, epub3=options.epub3, target_lufs=options.target_lufs,
            seed=options.seed, priority=options.priority, quality=options.quality,
            encoding={"bitrate_kbps": options.bitrate_kbps, "mp3_bitrate_kbps": options.mp3_bitrate_kbps,
                      "sample_rate": options.sample_rate}))
        session.commit()
    except BaseException:
        session.rollback()
        shutil.rmtree(files.folder, ignore_errors=True)
        raise
    _send(ctx.sender, ctx.settings, wire.BOOK_PARSE_TASK, book_id, options.priority, session, files)
    log.info("book %s accepted (%s, %d bytes); reading it on a CPU worker", book_id,
             submission.filename or submission.book_format or "?", files.source.stat().st_size)
    return book_id


def store_upload(source: BinaryIO, path: Path, limit: int) -> int:
    """Copy an upload to `path` in chunks (never all of it in memory); BadInput when it is empty or
    larger than `limit` bytes."""
    size = 0
    with open(path, "wb") as out:
        while chunk := source.read(COPY_CHUNK):
            size += len(chunk)
            if size > limit:
                raise BadInput(f"the book is larger than {limit} bytes")
            out.write(chunk)
    if size == 0:
        raise BadInput("the book is empty")
    return size


def _check_size(what: str, data: bytes | None, limit: int) -> None:
    if data is not None and len(data) > limit:
        raise BadInput(f"the {what} is {len(data)} bytes or more; the limit is {limit}")


def _title(submission: Submission) -> str:
    """What the book is called until it is read (its own title, or the request's, replaces it then)."""
    if submission.title and submission.title.strip():
        return " ".join(submission.title.split())
    stem = Path(submission.filename or "").stem
    return " ".join(stem.split())[:200] or "Untitled"


def _send(sender: wire.TaskSender, settings: Settings, task: str, book_id: str, priority: int,
          session: Session, files: SubmittedFiles | None = None) -> None:
    """Send one of the book's tasks; if the broker refuses, the book fails (nothing would ever run it)."""
    try:
        sender.send_task(task, args=[book_id], queue=settings.queue_cpu,
                         priority=wire.broker_priority(priority))
    except Exception:
        log.exception("book %s: could not enqueue %s; marking it failed", book_id, task)
        lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED,
                                  error="could not be queued")
        session.commit()
        if files is not None:
            shutil.rmtree(files.folder, ignore_errors=True)
        raise


# The worker's half -------------------------------------------------------------------------------

def read_book(book_id: str, ctx: Context) -> str:
    """`book.parse`, a doorbell: read the fairest `parsing` book nobody reads (its own first, if it is in
    the quick lane; `queries.reading_candidates`) in a bounded child and plan it: 'planned', 'failed',
    'stopped' (cancelled while it was read), 'long' (it needs more than the quick lane's budget: read
    again in the long lane) or 'skipped' (nothing to read now: a duplicate message, or the long lane is
    full). Then one more doorbell if a book still waits, so none waits for a message that was used."""
    picked = lanes.claim_next(ctx, book_id)
    if picked is None:
        return "skipped"
    read_id, attempts, lane = picked
    try:
        return _read(ctx, read_id, attempts, lane)
    finally:
        lanes.ring_waiting(ctx)


def _read(ctx: Context, book_id: str, attempts: int, lane: str) -> str:
    settings = ctx.settings
    with session_scope(ctx.sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        voice_id, seed, priority = book.voice_id, book.seed, book.priority
    files = SubmittedFiles(book_dir(ctx.artifacts, book_id))
    if attempts > settings.job_max_attempts:
        return _fail(ctx, book_id, files, f"gave up reading the book after {attempts - 1} attempts")
    if not files.source.is_file():
        return _fail(ctx, book_id, files, "the uploaded book is missing from the artifact root")
    quick_wall_s = QUICK_WALL_PER_CPU * settings.book_parse_quick_cpu_s
    quick = (lane == lifecycle.QUICK and settings.book_parse_quick_cpu_s < settings.book_parse_cpu_s
             and quick_wall_s < settings.book_parse_timeout_s)  # else one reading has the full limits
    job = parse_job(settings, files.folder, voice_id, seed, quick=quick)
    (files.folder / OUTCOME).unlink(missing_ok=True)
    (files.folder / JOB_FILE).write_text(job.to_json(), encoding="utf-8")
    ended = run_child("app.books.intake_child", [str(files.folder / JOB_FILE)],
                      wall_s=quick_wall_s if quick else settings.book_parse_timeout_s,
                      stderr=files.folder / LOG_FILE, stopped=lambda: not _parsing(ctx, book_id))
    how = "stopped" if ended.stopped else f"exit {ended.returncode}, signal {ended.signal}"
    log.info("book %s read in %.1f s (%.1f s CPU, peak %.0f MB): %s", book_id, ended.wall_s, ended.cpu_s,
             ended.max_rss_mb, how)
    if ended.stopped:
        shutil.rmtree(files.folder, ignore_errors=True)
        return "stopped"
    outcome = _outcome(files.folder)
    if outcome is None and quick and _out_of_time(ended, job.limits):
        with session_scope(ctx.sessions) as session:
            lifecycle.demote_reading(session=session, book_id=book_id)
        log.info("book %s needs more than the quick lane's %d CPU s; read again in the long lane", book_id,
                 job.limits.cpu_s)
        return "long"
    if outcome is None or not outcome.get("ok"):
        reason = outcome["error"] if outcome else death_reason(ended, job.limits, settings)
        return _fail(ctx, book_id, files, str(reason))
    return _settle(ctx, book_id, files, outcome, priority)


def _out_of_time(ended: ChildExit, limits: ChildLimits) -> bool:
    return ended.timed_out or ended.cpu_s >= limits.cpu_s - 1


def parse_job(settings: Settings, folder: Path, voice_id: str, seed: int, quick: bool = False) -> ParseJob:
    cpu_s = settings.book_parse_quick_cpu_s if quick else settings.book_parse_cpu_s
    limits = ChildLimits(cpu_s=cpu_s, memory_mb=settings.book_parse_memory_mb,
                         output_mb=settings.book_parse_output_mb)
    return ParseJob(folder=str(folder), voice_id=voice_id, render_options=render_options(settings, seed),
                    limits=limits, max_timed_span_s=settings.book_max_timed_span_s,
                    lexicon_budget_s=settings.lexicon_budget_s,
                    default_lexicon=str(settings.lexicon) if settings.lexicon else None)


def render_options(settings: Settings, seed: int) -> dict[str, Any]:
    """What goes into every segment key besides content and voice: the seed and the model."""
    return {"seed": seed, "model": str(settings.model_dir) if settings.model_dir else "dummy",
            "preset": settings.model_preset}


def death_reason(ended: ChildExit, limits: ChildLimits, settings: Settings) -> str:
    """Why a child that left no outcome ended, as its client should read it."""
    if ended.timed_out:
        return (f"reading the book took longer than {settings.book_parse_timeout_s:g} s "
                "(WAVEFARM_BOOK_PARSE_TIMEOUT_S)")
    if ended.cpu_s >= limits.cpu_s - 1:
        return f"reading the book took more than {limits.cpu_s} s of CPU (WAVEFARM_BOOK_PARSE_CPU_S)"
    if ended.max_rss_mb >= 0.9 * limits.memory_mb:
        return f"reading the book needs more than {limits.memory_mb} MB (WAVEFARM_BOOK_PARSE_MEMORY_MB)"
    how = f"signal {ended.signal}" if ended.signal is not None else f"exit status {ended.returncode}"
    return f"the book's reader stopped without an answer ({how}); the CPU worker's log has its output"


def _outcome(folder: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((folder / OUTCOME).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def _parsing(ctx: Context, book_id: str) -> bool:
    """Whether the book is still wanted (the child is stopped once it is not); a database that does not
    answer is not a reason to stop."""
    try:
        with session_scope(ctx.sessions) as session:
            book = queries.get_book(session=session, book_id=book_id)
            return book is not None and book.status == BookStatus.PARSING
    except Exception:  # asked every half second: the next ask decides
        return True


def _fail(ctx: Context, book_id: str, files: SubmittedFiles, reason: str) -> str:
    with session_scope(ctx.sessions) as session:
        lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.FAILED, error=reason,
                                  only_from=(BookStatus.PARSING,))
    shutil.rmtree(files.folder, ignore_errors=True)
    log.info("book %s refused: %s", book_id, reason)
    return "failed"


def _settle(ctx: Context, book_id: str, files: SubmittedFiles, outcome: dict[str, Any],
            priority: int) -> str:
    """The read book's rows, its cast's voices prepared, `queued`, and `book.plan` sent."""
    chapters = [queries.PlannedChapter(title, [(k[0], k[1], k[2]) for k in keys], est)
                for title, est, keys in outcome["chapters"]]
    book = outcome["book"]
    with session_scope(ctx.sessions) as session:
        missing = [v for v in outcome["voices"] if queries.get_voice(session=session, voice_id=v) is None]
    if missing:
        return _fail(ctx, book_id, files, f"the cast names voices that are not stored: {', '.join(missing)}")
    with session_scope(ctx.sessions) as session:
        if not lifecycle.add_book_plan(session=session, book_id=book_id, title=book["title"],
                                       author=book["author"], language=book["language"],
                                       plan_key=book["plan_key"], chapters=chapters,
                                       chapters_selected=book["chapters_selected"]):
            session.rollback()
            shutil.rmtree(files.folder, ignore_errors=True)
            return "stopped"
        session.commit()
        for voice_id in outcome["voices"]:  # each cast voice prepared once for all its lines
            voice = queries.require_voice(session=session, voice_id=voice_id)
            voices.queue_preparation(ctx=ctx, session=session, voice=voice)
        files.remove_inputs()
        for name in (JOB_FILE, OUTCOME):
            (files.folder / name).unlink(missing_ok=True)
        _send(ctx.sender, ctx.settings, wire.BOOK_PLAN_TASK, book_id, priority, session)
    log.info("book %s planned: %d chapters, %d segments", book_id, len(chapters),
             sum(len(c.keys) for c in chapters))
    return "planned"
