"""The reconciler's reads (`app.reconcile.sweep`): leases that passed, doorbells due, abandoned ready
voices."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from app.db.models import DONE_JOB_STATUSES, Job, JobStatus, Voice, VoiceStatus, Worker

CLAIMED = (JobStatus.PREPARING, JobStatus.RUNNING)


def list_expired_leases(*, session: Session, now: datetime, limit: int = 1000) -> list[Job]:
    """Claimed jobs whose lease passed before `now`, oldest lease first."""
    stmt = (select(Job).where(Job.status.in_(CLAIMED), or_(Job.lease_until.is_(None), Job.lease_until <= now))
            .order_by(Job.lease_until).limit(limit))
    return list(session.scalars(stmt))


def list_claims_before(*, session: Session, worker: str, claimed_before: datetime) -> list[Job]:
    """Jobs `worker`'s name claimed before `claimed_before` (its previous process's, killed) still claimed."""
    stmt = select(Job).where(Job.status.in_(CLAIMED), Job.worker == worker, Job.started_at < claimed_before)
    return list(session.scalars(stmt.order_by(Job.started_at)))


def list_queued_on_gone_workers(*, session: Session, silent_before: datetime, limit: int = 1000) -> list[Job]:
    """Queued jobs whose latest doorbell went to the own queue of a GPU worker that is gone (stopped, or
    silent since `silent_before`): nobody will take it there."""
    gone = or_(Worker.heartbeat_at.is_(None), Worker.heartbeat_at < silent_before)
    stmt = (select(Job).join(Worker, Worker.name == Job.routed_to)
            .where(Job.status == JobStatus.QUEUED, gone).order_by(Job.submitted_at).limit(limit))
    return list(session.scalars(stmt))


def list_due_rings(*, session: Session, now: datetime, quiet_before: datetime,
                   limit: int = 1000) -> list[Job]:
    """Queued jobs whose doorbell is due again: its `ring_due_at` passed, or never rung again and not
    updated since `quiet_before`; highest priority, then oldest, first."""
    due = or_(Job.ring_due_at <= now, and_(Job.ring_due_at.is_(None), Job.updated_at < quiet_before))
    stmt = (select(Job).where(Job.status == JobStatus.QUEUED, due)
            .order_by(Job.priority.desc(), Job.submitted_at).limit(limit))
    return list(session.scalars(stmt))


def list_ended_jobs(*, session: Session, job_ids: list[str], finished_before: datetime) -> list[str]:
    """Of `job_ids`, those that ended (succeeded, failed, cancelled) before `finished_before`."""
    if not job_ids:
        return []
    stmt = select(Job.id).where(Job.id.in_(job_ids), Job.status.in_(DONE_JOB_STATUSES),
                                Job.finished_at < finished_before)
    return list(session.scalars(stmt.order_by(Job.id)))


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
