"""The quality gate's reads on book segments: what the gate last heard of each (its writes:
`app.lifecycle.quality`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Segment


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
