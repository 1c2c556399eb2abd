"""The quality gate in books: before a chapter is assembled, its `book.chapter` (a CPU worker) hears each
of the chapter's segment renders not heard yet; a render that fails is rendered again with another seed,
up to `WAVEFARM_QUALITY_RERENDERS` times, and then kept with its failure recorded.

    policy_of(settings, mode)            how many re-renders, and whether the listeners run
    hear(path, ...) -> Report            the checks on one segment's audio file
    hold_chapter(ctx, book_id, index)    -> how many re-renders were sent (the chapter waits for them);
                                         0: every segment is heard, assemble it

The book's gate (`books.quality`, chosen when it is submitted): on (the above), report (heard and
reported, never rendered again) or off (not heard at all: the chapter is assembled as it was rendered).

What is heard: the signal checks (NaN/Inf, silence, clipping, the length its token count predicts)
always; the listeners (DNSMOS, and the words of a text segment) only with real weights. Dummy weights'
audio is noise: it is not listened to (every listener would fail it, and another seed makes more noise),
each listener's check is reported skipped for that reason, and the book's report says so once
(`app.books.quality_view`). A signal failure (silence, NaN) is rendered again on any weights, at most
`WAVEFARM_QUALITY_RERENDERS` times. The voice check is skipped: the segment's reference voice is not
loaded here.

Nothing is lost on a crash: each verdict is recorded in the segment's row as it is heard
(`lifecycle.record_quality`), so a `book.chapter` sent again hears only the rest. A re-render is a new
segment job, linked in the same transaction as the verdict and rung after its commit (a lost doorbell is
rung again by the reconciler's job rules); linking it counts the segment open again, which takes back
the chapter's ready record, and its settling records the chapter ready and rings book.chapter anew.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis
import soundfile as sf

from app import lifecycle
from app.books import files, service
from app.books.quality_view import DUMMY_REASON
from app.db import queries
from app.db.models import LIVE_BOOK_STATUSES
from app.db.queries import SegmentState
from app.db.session import session_scope
from app.quality.gate import Thresholds, check_audio, check_signal
from app.quality.report import GateMode, Report
from app.settings import Settings
from app.speech import MAX_SEED, TOKEN_RATE
from app.storage.keys import COUNTER_QUALITY
from app.submission import jobs

if TYPE_CHECKING:
    from app.context import Context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatePolicy:
    rerenders: int  # renders again a failing segment this many times at most
    listen: bool  # the listeners run besides the signal checks

    @classmethod
    def from_settings(cls, settings: Settings, mode: str = GateMode.ON) -> GatePolicy:
        return cls(rerenders=settings.quality_rerenders if mode == GateMode.ON else 0,
                   listen=settings.model_dir is not None)


def policy_of(settings: Settings, mode: str) -> GatePolicy:
    return GatePolicy.from_settings(settings, mode)


def hear(path: Path, *, n_tokens: int | None, text: str, language: str, thresholds: Thresholds,
         listen: bool) -> Report:
    wave, rate = sf.read(str(path), dtype="float32", always_2d=True)
    expected_s = n_tokens / TOKEN_RATE if n_tokens else None
    if not listen:
        return check_signal(wave.mean(axis=1), rate, expected_s=expected_s, thresholds=thresholds,
                            unheard_reason=DUMMY_REASON)
    return check_audio(wave.mean(axis=1), rate, text=text or None, language=language, expected_s=expected_s,
                       thresholds=thresholds)


def hold_chapter(ctx: Context, book_id: str, index: int) -> int:
    """Hear the chapter's unheard renders once all of its segments are rendered; -> re-renders sent.
    A book whose gate is off is not heard."""
    mode, unheard = _unheard(ctx, book_id, index)
    if not unheard:
        return 0
    policy = policy_of(ctx.settings, mode)
    book_plan = files.load_plan(ctx.artifacts, book_id)
    texts = {s.key: s.say or s.text for s in book_plan.chapters[index].segments}
    thresholds = Thresholds.from_settings(ctx.settings)
    sent = 0
    for state in unheard:
        report = hear(ctx.artifacts.path(state.output_path or ""), n_tokens=state.n_tokens,
                      text=texts.get(state.key, ""), language=book_plan.language, thresholds=thresholds,
                      listen=policy.listen)
        sent += _judge(ctx, book_id, state, report, policy)
    return sent


def _unheard(ctx: Context, book_id: str, index: int) -> tuple[str, list[SegmentState]]:
    """The book's gate, and the chapter's renders not heard yet: none while the book is not live, its gate
    is off, or a segment is not rendered (book.chapter then waits, or fails the book, as it did before the
    gate)."""
    with session_scope(ctx.sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        if book.status not in LIVE_BOOK_STATUSES or book.quality == GateMode.OFF:
            return book.quality, []
        states = queries.book_segment_states(session=session, book_id=book_id, chapter=index)
        if not all(s.done for s in states):
            return book.quality, []
        heard = queries.heard_segments(session=session, keys=[s.key for s in states])
    return book.quality, [s for s in states if s.key not in heard or heard[s.key].job_id != s.job_id]


def _count(ctx: Context, report: Report) -> None:
    """The metrics' counters (wavefarm_quality_checks_total); best effort: a Redis away costs a count."""
    try:
        for check in report.checks:
            ctx.store.incr(COUNTER_QUALITY, f"{check.name}:{check.verdict}")
    except redis.RedisError as exc:
        log.warning("quality counters not counted: %s", exc)


def _judge(ctx: Context, book_id: str, state: SegmentState, report: Report, policy: GatePolicy) -> int:
    """Record the verdict; a failure with re-renders left is rendered again (1), else it is kept (0)."""
    assert state.job_id is not None
    with session_scope(ctx.sessions) as session:
        attempts = lifecycle.record_quality(session=session, key=state.key, job_id=state.job_id,
                                            verdict="pass" if report.passed else "fail",
                                            report=report.to_dict())
        if attempts is not None:
            _count(ctx, report)
        if attempts is None or report.passed or attempts > policy.rerenders:
            if attempts is not None and not report.passed:
                log.warning("book %s: segment %s kept after %d renders: %s", book_id, state.key[:12],
                            attempts, "; ".join(report.reasons))
            session.commit()
            return 0
        book = queries.require_book(session=session, book_id=book_id)
        failed = queries.require_job(session=session, job_id=state.job_id)
        job_id, created = service.make_segment_job(
            session=session, artifacts=ctx.artifacts, book=book, key=state.key,
            content=jobs.job_tokens(job=failed, artifacts=ctx.artifacts), replacing=state.job_id,
            voice_id=failed.voice_id, seed=(failed.seed + 1) % (MAX_SEED + 1))
        if not created:  # another render was linked first (its transaction won): this verdict is void
            return 0
        session.commit()  # the verdict and the new job together; then its doorbell
        log.info("book %s: segment %s failed the gate (%s); rendered again as job %s", book_id,
                 state.key[:12], "; ".join(report.reasons), job_id)
        lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
    return 1
