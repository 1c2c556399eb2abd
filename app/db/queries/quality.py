"""The quality gate's reads on book segments: what the gate last heard of each (its writes:
`app.lifecycle.quality`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import BookSegment, Segment


@dataclass(frozen=True)
class HeardSegment:
    key: str
    job_id: str | None  # the render the verdict is about (None: never heard)
    verdict: str | None  # 'pass' or 'fail'
    attempts: int  # renders of this key the gate has heard


def heard_segments(*, session: Session, keys: Sequence[str]) -> dict[str, HeardSegment]:
    rows = session.execute(select(Segment.key, Segment.quality_job_id, Segment.quality_verdict,
                                  Segment.quality_attempts).where(Segment.key.in_(list(keys))))
    return {str(k): HeardSegment(str(k), job_id, verdict, int(n or 0)) for k, job_id, verdict, n in rows}


@dataclass(frozen=True)
class SegmentQuality:
    chapter: int
    key: str
    job_id: str | None  # the render the verdict is about
    verdict: str | None
    attempts: int
    report: dict[str, Any] | None


def book_segment_quality(*, session: Session, book_id: str) -> list[SegmentQuality]:
    """Each distinct segment of each chapter of a book with the gate's verdict, in reading order."""
    stmt = (select(BookSegment.chapter, Segment.key, Segment.quality_job_id, Segment.quality_verdict,
                   Segment.quality_attempts, Segment.quality_report)
            .join(Segment, Segment.key == BookSegment.key).where(BookSegment.book_id == book_id)
            .order_by(BookSegment.chapter, BookSegment.position))
    seen: dict[tuple[int, str], SegmentQuality] = {}
    for chapter, key, job_id, verdict, attempts, report in session.execute(stmt):
        seen.setdefault((int(chapter), str(key)),
                        SegmentQuality(int(chapter), str(key), job_id, verdict, int(attempts or 0), report))
    return list(seen.values())
