"""Maintenance: stale live jobs and abandoned ready voices, for the sweep."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.db.models import LIVE_JOB_STATUSES, Job, JobStatus, Voice, VoiceStatus, utcnow


def list_stale_live_jobs(*, session: Session, updated_before: Any, limit: int = 1000) -> list[Job]:
    """Live jobs (queued, preparing, running) not updated since `updated_before`, oldest first."""
    stmt = (
        select(Job)
        .where(Job.status.in_(LIVE_JOB_STATUSES), Job.updated_at < updated_before)
        .order_by(Job.updated_at)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def touch_job(*, session: Session, job_id: str) -> None:
    """Stamp updated_at (a job sent again is not stale until it has had time to run)."""
    session.execute(update(Job).where(Job.id == job_id).values(updated_at=utcnow()))


def list_abandoned_ready_voices(*, session: Session) -> list[str]:
    """Voices still marked ready although every job that wanted them was cancelled."""
    cancelled = func.count().filter(Job.status == JobStatus.CANCELLED)
    stmt = (
        select(Voice.id)
        .join(Job, Job.voice_id == Voice.id)
        .where(Voice.status == VoiceStatus.READY)
        .group_by(Voice.id)
        .having(func.count() == cancelled)
    )
    return list(session.scalars(stmt))
