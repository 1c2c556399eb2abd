"""Read-only listings the API needs that `app.db.queries` does not offer (yet).

Keyword-only, like the queries module, so they can move there unchanged: job listing filtered by
voice, voice listing, and job counts by status for /metrics.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import Job, Voice


def list_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              limit: int = 100) -> list[Job]:
    """Newest first."""
    stmt = select(Job).order_by(Job.submitted_at.desc(), Job.id).limit(limit)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if voice_id is not None:
        stmt = stmt.where(Job.voice_id == voice_id)
    return list(session.scalars(stmt))


def list_voices(*, session: Session, limit: int = 100) -> list[Voice]:
    """Newest first."""
    return list(session.scalars(select(Voice).order_by(Voice.created_at.desc(), Voice.id).limit(limit)))


def count_jobs_by_status(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status))
    return {str(status): int(count) for status, count in rows}
