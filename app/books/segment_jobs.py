"""`book.tokenize`'s work: a group of a book's segments spoken (or their tokens read), their jobs made and
rung together.

A group is up to `GROUP` segments of one chapter, in order. What a segment costs a CPU worker is its
speech by the guide voice (about 3 ms of CPU a second of audio) and, per task, Celery's message, the
book's checks, the plan's read, a transaction and a ring: about as much again per segment when each
segment was a task of its own (docs/SCALING.md, issue 44). A group pays that once: the book and its plan
read once, the speech stored in one Redis round trip, the jobs routed once per voice and their `synth`
messages sent in one broker round (`lifecycle.ring_many`). Each segment's job is still made in a
transaction of its own: when another render linked its job to a segment first, only that segment's new job
is rolled back.

Redelivered (or sent twice), a group makes no second job: a segment whose job is queued is rung again, one
claimed or finished is left alone, and only the others are spoken. A segment that cannot be spoken is
recorded failed with the reason and the error raised (the task fails the book, as it did for one segment);
the segments spoken before it in the group are not lost work worth keeping (their speech is made again by
the next render).
"""

from __future__ import annotations

from app import lifecycle
from app.books import files, service
from app.books.planning.plan import PlanSegment
from app.books.planning.tokens import BookContext, source_for
from app.context import Context
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES
from app.db.session import session_scope
from app.errors import WavefarmError
from app.text.guide_speech import GuideSpeech

GROUP = 8  # segments a `book.tokenize` task: 32 waiting segments (the book's window) are four tasks


class BookStopped(WavefarmError):
    """The book was cancelled or failed meanwhile: the task stops without failing the book again, logs
    one INFO line and is ignored (Celery's `Ignore`: acknowledged, logged at INFO without a traceback, and
    a message of the old format does not send its chained `synth`)."""


def groups(keys: list[str]) -> list[list[str]]:
    """`keys` in order, in groups of at most GROUP."""
    return [keys[start:start + GROUP] for start in range(0, len(keys), GROUP)]


def make_jobs(book_id: str, keys: list[str], ctx: Context) -> list[str]:
    """The segments' jobs, made where needed and rung; returns their job ids in the order of `keys`."""
    jobs: dict[str, str] = {}
    replacing: dict[str, str | None] = {}
    with session_scope(ctx.sessions) as session:
        if queries.require_book(session=session, book_id=book_id).status not in LIVE_BOOK_STATUSES:
            raise BookStopped(f"book {book_id} was cancelled or failed; {len(keys)} segment(s) not rendered")
        for key in keys:
            state = queries.segment_state(session=session, key=key)
            if state is None:
                raise WavefarmError(f"segment {key[:12]} is not in book {book_id}")
            if state.job_id and state.live:  # speech perhaps still waiting for the GPU worker: synth again
                lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=state.job_id,
                               speech_stored=ctx.store.has_guide_speech(state.job_id))
            if state.job_id and (state.live or state.done):
                jobs[key] = state.job_id
            else:
                replacing[key] = state.job_id
    if replacing:
        jobs.update(_speak_and_make(book_id, replacing, ctx))
    return [jobs[key] for key in keys]


def _speak_and_make(book_id: str, replacing: dict[str, str | None], ctx: Context) -> dict[str, str]:
    """Speak the segments of `replacing` (key -> the job a finished render left, or None), then make their
    jobs (a transaction each), store their speech and ring them together."""
    book_plan = files.load_plan(ctx.artifacts, book_id)
    segments: dict[str, PlanSegment] = {s.key: s for _, s in book_plan.segments() if s.key in replacing}
    context = BookContext(language=book_plan.language, base_dir=files.base_dir_of(ctx.artifacts, book_id),
                          model_dir=ctx.settings.model_dir)
    made: dict[str, list[int] | GuideSpeech] = {}
    for key in replacing:
        try:
            made[key] = source_for(segments[key]).tokens(segments[key], context)
        except (WavefarmError, OSError, RuntimeError) as exc:
            with session_scope(ctx.sessions) as session:
                lifecycle.fail_segment(session=session, key=key,
                                       error=f"tokenize: {type(exc).__name__}: {exc}")
            raise
    jobs: dict[str, str] = {}
    speech: dict[str, bytes] = {}
    with session_scope(ctx.sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        for key, job_id in replacing.items():
            jobs[key], created = service.segment_job_of(
                ctx=ctx, session=session, book=book, key=key, replacing=job_id,
                voice_id=book_plan.voice_of(segments[key]), made=made[key], spoken=segments[key].spoken)
            # each segment's job in a transaction of its own: a link another render won first rolls
            # back this segment's job only
            session.commit()
            spoken = made[key]
            if created and isinstance(spoken, GuideSpeech):
                speech[jobs[key]] = spoken.encode()
        ctx.store.put_guide_speeches(speech)  # before any message: the GPU worker reads it at once
        made_ids = list(dict.fromkeys(jobs.values()))
        lifecycle.ring_many(session=session, sender=ctx.sender, settings=ctx.settings, job_ids=made_ids,
                            speech_stored=made_ids)  # each made from its speech or with its tokens
    return jobs
