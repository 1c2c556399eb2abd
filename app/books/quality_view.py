"""A book's quality as the gate heard it (`app.books.quality`), for GET /v1/books/{id}/quality: the
book's gate (on, report, off); per chapter its segments passed, re-rendered (passed after more than one
render), failed (kept with their failure) and not heard; per check the verdicts of the renders kept; the
worst segments, with their text and where to play them; and notes, each said once: the gate was off, or
it heard dummy weights' noise (only the signal checks ran). One query over the book's segments:
O(segments), so it is its own endpoint, not part of the book's status.

    book_quality(session=, artifacts=, book_id=, worst=10) -> BookQuality
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from app.books import files
from app.books.status import require_book
from app.db import queries
from app.quality.report import CHECKS, VERDICTS, GateMode
from app.storage.artifacts import ArtifactStore

OUTCOMES = ("passed", "rerendered", "failed", "unheard")  # a closed set: also the metrics' labels
# Why a listener's check was skipped on dummy weights (`app.books.quality.hear`), and the book's note then.
DUMMY_REASON = "dummy weights: the audio is noise"
DUMMY_NOTE = ("dummy weights: only the signal checks ran (NaN/Inf, silence, clipping, length); the audio is "
              "noise, so its quality, voice and words were not judged")
OFF_NOTE = "the quality gate was off for this book: its segments were not heard"


@dataclass(frozen=True)
class WorstSegment:
    chapter: int
    key: str
    attempts: int  # renders heard
    reasons: list[str]
    text: str  # what it says ("" for a tokens or source-audio segment)
    audio: str  # where to play the kept render: the job's audio URL path


@dataclass(frozen=True)
class BookQuality:
    book_id: str
    mode: str  # the book's gate: on, report or off (`app.quality.report.GateMode`)
    totals: dict[str, int]
    chapters: list[dict[str, int]]  # per chapter: its index and a count per outcome
    checks: dict[str, dict[str, int]]  # per check: how many kept renders passed, failed, skipped it
    worst: list[WorstSegment] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # plain sentences, each once


def outcome(verdict: str | None, attempts: int) -> str:
    if verdict is None:
        return "unheard"
    if verdict == "fail":
        return "failed"
    return "rerendered" if attempts > 1 else "passed"


def book_quality(*, session: Session, artifacts: ArtifactStore, book_id: str, worst: int = 10) -> BookQuality:
    book = require_book(session=session, book_id=book_id)  # an id prefix: its book
    rows = queries.book_segment_quality(session=session, book_id=book.id)
    chapters: dict[int, dict[str, int]] = {}
    totals = dict.fromkeys(OUTCOMES, 0)
    checks = {name: dict.fromkeys(VERDICTS, 0) for name in CHECKS}
    failed, dummy = [], False
    for row in rows:
        kind = outcome(row.verdict, row.attempts)
        counts = chapters.setdefault(row.chapter, {"index": row.chapter, **dict.fromkeys(OUTCOMES, 0)})
        counts[kind] += 1
        totals[kind] += 1
        for name, check in ((row.report or {}).get("checks") or {}).items():
            if name in checks and check.get("verdict") in VERDICTS:
                checks[name][check["verdict"]] += 1
                dummy = dummy or check.get("reason") == DUMMY_REASON
        if kind == "failed":
            failed.append(row)
    failed.sort(key=lambda r: (-r.attempts, r.chapter))
    texts = _texts(artifacts, book.id) if failed else {}
    notes = [OFF_NOTE] if book.quality == GateMode.OFF else []
    return BookQuality(book_id=book.id, mode=book.quality, totals=totals, checks=checks,
                       chapters=[chapters[i] for i in sorted(chapters)],
                       worst=[WorstSegment(chapter=r.chapter, key=r.key, attempts=r.attempts,
                                           reasons=list((r.report or {}).get("reasons", [])),
                                           text=texts.get(r.key, ""), audio=f"/v1/jobs/{r.job_id}/audio")
                              for r in failed[:worst]],
                       notes=notes + ([DUMMY_NOTE] if dummy else []))


def _texts(artifacts: ArtifactStore, book_id: str) -> dict[str, str]:
    return {s.key: s.text for c in files.load_plan(artifacts, book_id).chapters for s in c.segments}
