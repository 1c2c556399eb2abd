"""The quality gate's word on a book segment's render, recorded in the segment's row
(`app.books.quality` hears it).

    record_quality(session=, key=, job_id=, verdict=, report=) -> attempts heard, or None

A conditional UPDATE: recorded only while the segment's audio is still `job_id`'s and that render was
not heard yet, so two `book.chapter`s hearing the same render count it once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from app.db.models import Segment, utcnow


def record_quality(*, session: Session, key: str, job_id: str, verdict: str,
                   report: dict[str, Any]) -> int | None:
    """Record the verdict on `job_id`'s audio of segment `key`; -> how many renders of the key the gate
    has now heard, or None when nothing was recorded (the segment moved on, or this render was heard)."""
    row = session.execute(
        update(Segment)
        .where(Segment.key == key, Segment.job_id == job_id,
               or_(Segment.quality_job_id.is_(None), Segment.quality_job_id != job_id))
        .values(quality_verdict=verdict, quality_report=report, quality_job_id=job_id,
                quality_attempts=Segment.quality_attempts + 1, updated_at=utcnow())
        .returning(Segment.quality_attempts)
        .execution_options(synchronize_session=False)).first()
    return None if row is None else int(row[0])
