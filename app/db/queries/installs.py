"""Worker installs: which voices each GPU worker holds, their pins and last use, and the history of
installs (`install_events`: every install, when it ended and how)."""

from __future__ import annotations

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from app.db.models import InstallEvent, Worker, WorkerVoice, utcnow


def get_worker_voice(*, session: Session, worker_id: str, voice_id: str) -> WorkerVoice | None:
    return session.get(WorkerVoice, (worker_id, voice_id), populate_existing=True)


def record_install(*, session: Session, worker_id: str, voice_id: str, nbytes: int) -> WorkerVoice:
    """Record (or refresh) a voice installed on a worker; unpinned until a job pins it."""
    now = utcnow()
    row = get_worker_voice(session=session, worker_id=worker_id, voice_id=voice_id)
    if row is None:
        row = WorkerVoice(
            worker_id=worker_id, voice_id=voice_id, installed_at=now, last_used=now, pinned=0, nbytes=nbytes
        )
        session.add(row)
    else:
        row.installed_at, row.last_used, row.nbytes = now, now, nbytes
    _close_events(session, worker_id, voice_id, lost=False)  # installed again: the earlier one ended
    session.add(InstallEvent(worker_id=worker_id, voice_id=voice_id, installed_at=now, nbytes=nbytes,
                             lost=False))
    # The router's tie-break among idle workers (app.submission.routing), kept here so it never counts
    # installs.
    session.execute(update(Worker).where(Worker.name == worker_id).values(last_install_at=now))
    session.flush()
    return row


def _close_events(session: Session, worker_id: str, voice_id: str | None, *, lost: bool) -> None:
    stmt = update(InstallEvent).where(InstallEvent.worker_id == worker_id, InstallEvent.evicted_at.is_(None))
    if voice_id is not None:
        stmt = stmt.where(InstallEvent.voice_id == voice_id)
    session.execute(stmt.values(evicted_at=utcnow(), lost=lost))


def list_install_events(*, session: Session, worker_id: str | None = None) -> list[InstallEvent]:
    """Every install (of one worker, when given), oldest first."""
    stmt = select(InstallEvent).order_by(InstallEvent.id)
    if worker_id is not None:
        stmt = stmt.where(InstallEvent.worker_id == worker_id)
    return list(session.scalars(stmt))


def pin_worker_voice(*, session: Session, worker_id: str, voice_id: str, delta: int = 1) -> None:
    """Add `delta` (+1 pin, -1 unpin) live jobs to an install and touch last_used."""
    session.execute(
        update(WorkerVoice)
        .where(WorkerVoice.worker_id == worker_id, WorkerVoice.voice_id == voice_id)
        .values(
            pinned=case((WorkerVoice.pinned + delta < 0, 0), else_=WorkerVoice.pinned + delta),
            last_used=utcnow(),
        )
    )


def remove_worker_voice(*, session: Session, worker_id: str, voice_id: str) -> bool:
    _close_events(session, worker_id, voice_id, lost=False)
    row = get_worker_voice(session=session, worker_id=worker_id, voice_id=voice_id)
    if row is None:
        return False
    session.delete(row)
    session.flush()
    return True


def list_worker_voices(*, session: Session, worker_id: str) -> list[WorkerVoice]:
    """A worker's installs, least recently used first."""
    stmt = select(WorkerVoice).where(WorkerVoice.worker_id == worker_id).order_by(WorkerVoice.last_used)
    return list(session.scalars(stmt))


def clear_worker_voices(*, session: Session, worker_id: str) -> int:
    """Forget every install of a worker (it restarted: its device memory is gone); their events end as
    lost."""
    _close_events(session, worker_id, None, lost=True)
    rows = list_worker_voices(session=session, worker_id=worker_id)
    for row in rows:
        session.delete(row)
    session.flush()
    return len(rows)
