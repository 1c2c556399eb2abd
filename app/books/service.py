"""Books as a service: submit a book, cancel it, make its segment jobs. Used by the API, the CLI and
`tasks.books`; a book's progress is `app.books.status`, its files `app.books.files`.

    submit_book       accept a book without reading it (`app.books.intake.accept_book`): it is `parsing`
                      until a CPU worker has read it in a bounded child process (`book.parse`)
    cancel            stop a live book (idempotent): a book being read stops its reader; its live
                      segment jobs that no other live book needs are cancelled; Conflict if it had
                      already finished
    make_segment_job  one segment's speech tokens -> a queued synth job linked to the segment's key

Resume: segments are rows keyed by content (`app.books.planning.plan`), each pointing at the job whose output
is its audio. Rendering a book again - after a crash, a cancel or an edit - plans the same keys, finds
their finished jobs and renders only the keys without one; a crash or cancel loses at most the
segments that were being rendered. Nothing here imports Celery tasks: tasks are sent by name.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from app import lifecycle
from app.books.intake import accept_book
from app.books.reading.source import BookLimits
from app.books.status import require_book
from app.books.submission import DEFAULT_SEED, BookOptions, BookRequest, Submission, target_lufs_field
from app.db import queries
from app.db.models import Book, BookStatus
from app.errors import Conflict, NotFound
from app.speech import check_tokens
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission import jobs
from app.submission.request import Request
from app.text.tokens import STAND_IN_NOTE

if TYPE_CHECKING:
    from app.context import Context
    from app.text.guide_speech import GuideSpeech

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SEED", "BookOptions", "BookRequest", "Submission", "cancel", "cancel_book",
           "SpokenSegment", "make_segment_job", "submit_book", "target_lufs_field"]


def submit_book(*, ctx: Context, session: Session, data: bytes, request: BookRequest,
                limits: BookLimits | None = None) -> str:
    """Accept a book (its bytes in memory) and return its id, `parsing`; what cannot be decided without
    reading it is decided by `book.parse`, which leaves the book `queued` or `failed` with the reason.

    The request's `base_dir` (CLI only) lets a manifest name source audio files inside that folder;
    `chapters` ("3-7,12", `app.books.planning.select`) renders only those chapters; its `lexicon`
    (`app.books.planning.lexicon`) is laid over the service's default one; its `cast`
    (`app.books.planning.cast`) maps the voice names of the text's markup to stored voices, each prepared
    once; publisher, year, isbn and genres (`app.books.reading.publication`) stand over the book's."""
    return accept_book(ctx=ctx, session=session, source=io.BytesIO(data), request=request,
                       **({"limits": limits} if limits is not None else {}))


# Segment jobs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpokenSegment:
    """A text segment's job before its tokens: its text, in the book's language, and the token count of
    the guide speech the caller stores for the GPU worker to tokenize."""

    text: str
    n_tokens: int


def make_segment_job(*, session: Session, artifacts: ArtifactStore, book: Book, key: str,
                     content: list[int] | SpokenSegment, replacing: str | None,
                     voice_id: str | None = None, seed: int | None = None) -> tuple[str, bool]:
    """A queued job for segment `key` in `voice_id` (default: the book's voice) with `seed` (default: the
    book's; the quality gate renders a failed segment again with another), linked to the key: rendering
    `content`'s speech tokens, or a text job of a `SpokenSegment`. Returns (job id, created).

    When another render linked its own job first, that job is returned and nothing is created. The
    caller commits, then sends `synth` for a created job."""
    spoken = content if isinstance(content, SpokenSegment) else None
    token_list = None if isinstance(content, SpokenSegment) else check_tokens(content)
    if spoken is not None and spoken.n_tokens <= 0:
        raise ValueError(f"segment {key[:12]}: a text job needs its token count")
    voice_id = voice_id or book.voice_id
    seed = book.seed if seed is None else seed
    request = Request(tokens=token_list, text=spoken.text if spoken else None,
                      language=book.language if spoken else None, seed=seed,
                      output_format=book.output_format, priority=book.priority)
    job, _ = jobs.new_job(session=session, artifacts=artifacts, voice_id=voice_id, request=request,
                          seed=seed)
    n_tokens = spoken.n_tokens if spoken is not None else len(token_list or [])
    job_id, tokens_path = job.id, job.tokens_path
    if lifecycle.link_segment_job(session=session, key=key, job_id=job_id, replacing=replacing,
                                  n_tokens=n_tokens):
        queries.add_voice_use(session=session, voice_id=voice_id)
        return job_id, True
    session.rollback()
    if tokens_path:
        artifacts.remove(tokens_path)
    segment = queries.get_segment(session=session, key=key)
    if segment is None or segment.job_id is None:
        raise NotFound(f"segment {key[:12]} lost its job while linking")
    return segment.job_id, False


def segment_job_of(*, ctx: Context, session: Session, book: Book, key: str, replacing: str | None,
                   voice_id: str, made: list[int] | GuideSpeech, spoken: str) -> tuple[str, bool]:
    """`book.tokenize`'s job for a segment, from what its token source `made`: its tokens, or a text job
    whose guide speech the caller stores in the feature store for the GPU worker before it rings the job.
    Returns (job id, created): a job another render linked first is returned, and nothing is made (the
    transaction is rolled back, as `make_segment_job` does). The caller commits, then rings it."""
    if not isinstance(made, list):
        return make_segment_job(session=session, artifacts=ctx.artifacts, book=book, key=key,
                                replacing=replacing, voice_id=voice_id,
                                content=SpokenSegment(spoken, sum(made.token_counts())))
    job_id, created = make_segment_job(session=session, artifacts=ctx.artifacts, book=book, key=key,
                                       content=made, replacing=replacing, voice_id=voice_id)
    if ctx.settings.model_dir is None:  # the tokens say nothing: the job's notes (and so the book's) say so
        queries.add_job_note(session=session, job_id=job_id, note=STAND_IN_NOTE)
    return job_id, created


# Cancel ------------------------------------------------------------------------------------------

def cancel_book(*, session: Session, store: FeatureStore, book_id: str, cancel_ttl_s: int) -> bool:
    """Cancel a live book and its live segment jobs that no other live book needs; False if it had
    already finished. Finished segments stay: rendering the book again reuses them."""
    queries.require_book(session=session, book_id=book_id)
    if not lifecycle.set_book_status(session=session, book_id=book_id, status=BookStatus.CANCELLED,
                                     error="cancelled"):
        return False
    cancelled = []
    for state in queries.book_segment_states(session=session, book_id=book_id):
        if state.live and state.job_id and not _needed_elsewhere(session, state.key, book_id):
            if lifecycle.cancel(session=session, job_id=state.job_id):
                cancelled.append(state.job_id)
    session.commit()
    for job_id in cancelled:  # after the commit: the GPU worker polls these between steps
        store.request_cancel(job_id, ttl_s=cancel_ttl_s)
    log.info("book %s cancelled (%d segment jobs stopped)", book_id, len(cancelled))
    return True


def cancel(*, ctx: Context, session: Session, book_id: str) -> Book:
    """Cancel a book as a client asks it (idempotent: a cancelled book stays cancelled); commits.
    Conflict if it had finished otherwise."""
    book_id = require_book(session=session, book_id=book_id).id  # an id prefix: its book's id
    cancel_book(session=session, store=ctx.store, book_id=book_id,
                cancel_ttl_s=ctx.settings.visibility_timeout_s)
    book = queries.require_book(session=session, book_id=book_id)
    if book.status != BookStatus.CANCELLED:
        raise Conflict(f"book {book_id} already {book.status}")
    return book


def _needed_elsewhere(session: Session, key: str, book_id: str) -> bool:
    return queries.count_live_books_with_segment(session=session, key=key, exclude_book_id=book_id) > 0
