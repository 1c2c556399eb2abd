"""A book's quality as the gate heard it (`app.books.quality`), for GET /v1/books/{id}/quality: per
chapter its segments passed, re-rendered (passed after more than one render), failed (kept with their
failure) and not heard; and the worst segments, with their text and where to play them. One query over
the book's segments: O(segments), so it is its own endpoint, not part of the book's status.

    book_quality(session=, artifacts=, book_id=, worst=10) -> BookQuality
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from app.books import files
from app.books.status import require_book
from app.db import queries
from app.storage.artifacts import ArtifactStore

OUTCOMES = ("passed", "rerendered", "failed", "unheard")  # a closed set: also the metrics' labels


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
    totals: dict[str, int]
    chapters: list[dict[str, int]]  # per chapter: its index and a count per outcome
    worst: list[WorstSegment] = field(default_factory=list)


def outcome(verdict: str | None, attempts: int) -> str:
    if verdict is None:
        return "unheard"
    if verdict == "fail":
        return "failed"
    return "rerendered" if attempts > 1 else "passed"


def book_quality(*, session: Session, artifacts: ArtifactStore, book_id: str, worst: int = 10) -> BookQuality:
    book_id = require_book(session=session, book_id=book_id).id  # an id prefix: its book's id
    rows = queries.book_segment_quality(session=session, book_id=book_id)
    chapters: dict[int, dict[str, int]] = {}
    totals = dict.fromkeys(OUTCOMES, 0)
    failed = []
    for row in rows:
        kind = outcome(row.verdict, row.attempts)
        counts = chapters.setdefault(row.chapter, {"index": row.chapter, **dict.fromkeys(OUTCOMES, 0)})
        counts[kind] += 1
        totals[kind] += 1
        if kind == "failed":
            failed.append(row)
    failed.sort(key=lambda r: (-r.attempts, r.chapter))
    texts = _texts(artifacts, book_id) if failed else {}
    return BookQuality(book_id=book_id, totals=totals, chapters=[chapters[i] for i in sorted(chapters)],
                       worst=[WorstSegment(chapter=r.chapter, key=r.key, attempts=r.attempts,
                                           reasons=list((r.report or {}).get("reasons", [])),
                                           text=texts.get(r.key, ""), audio=f"/v1/jobs/{r.job_id}/audio")
                              for r in failed[:worst]])


def _texts(artifacts: ArtifactStore, book_id: str) -> dict[str, str]:
    return {s.key: s.text for c in files.load_plan(artifacts, book_id).chapters for s in c.segments}
