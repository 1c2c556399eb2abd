"""Voices: rows, preparation states, uses and live jobs, the artifact paths the database points at."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.orm import Session

from app.db.models import LIVE_JOB_STATUSES, Job, JobStatus, Voice, VoiceStatus, utcnow
from app.db.queries._common import _clip, _insert, _rowcount
from app.errors import NotFound


def get_voice(*, session: Session, voice_id: str) -> Voice | None:
    return session.get(Voice, voice_id, populate_existing=True)


def require_voice(*, session: Session, voice_id: str) -> Voice:
    voice = get_voice(session=session, voice_id=voice_id)
    if voice is None:
        raise NotFound(f"no voice {voice_id}")
    return voice


class VoiceUse(NamedTuple):
    """What a submission reads of the voice it used: its id and how far its preparation got."""

    id: str
    status: str


def use_voice(*, session: Session, voice_id: str) -> VoiceUse:
    """Count one more use of the voice and return its id and status, in one statement; NotFound if there is
    none. Loads no Voice entity (a Voice already in the session keeps its old `uses` until refreshed)."""
    row = session.execute(_use_voice(), {"voice_id": voice_id, "now": utcnow()}).first()
    if row is None:
        raise NotFound(f"no voice {voice_id}")
    return VoiceUse(row[0], row[1])


@functools.cache
def _use_voice() -> Any:
    """The submission's voice UPDATE, built once as Core with its values as parameters: SQLAlchemy compiles
    it once per dialect, and the row comes back as a tuple of two columns (through the ORM, `RETURNING`
    the whole Voice built an entity and filled the identity map on every submission)."""
    table = cast(Table, Voice.__table__)
    return (update(table).where(table.c.id == bindparam("voice_id"))
            .values(uses=table.c.uses + 1, updated_at=bindparam("now"))
            .returning(table.c.id, table.c.status))


def get_voice_by_name(*, session: Session, name: str) -> Voice | None:
    return session.scalars(select(Voice).where(Voice.name == name)).one_or_none()


def voice_names(*, session: Session) -> list[tuple[str, str]]:
    """(id, name) of every named voice: a new name is compared with them all (`app.voices.names`)."""
    rows = session.execute(select(Voice.id, Voice.name).where(Voice.name.is_not(None)))
    return [(str(voice_id), str(name)) for voice_id, name in rows]


def voice_ids_with_prefix(*, session: Session, prefix: str, limit: int = 10) -> list[str]:
    """Ids starting with `prefix` (lowercase hex, checked by the caller), at most `limit`, by id."""
    stmt = select(Voice.id).where(Voice.id.startswith(prefix, autoescape=True)).order_by(Voice.id)
    return list(session.scalars(stmt.limit(limit)))


def set_voice_name(*, session: Session, voice_id: str, name: str | None) -> None:
    """Flushes at once: a name taken meanwhile raises IntegrityError here, for the caller to refuse."""
    session.execute(update(Voice).where(Voice.id == voice_id).values(name=name, updated_at=utcnow()))
    session.flush()


def get_or_create_voice(*, session: Session, voice_id: str, reference_path: str) -> tuple[Voice, bool]:
    """The voice row, created pending if new. Returns (voice, created)."""
    now = utcnow()
    stmt = (
        _insert(session, Voice)
        .values(
            id=voice_id,
            status=VoiceStatus.PENDING,
            reference_path=reference_path,
            prepare_attempts=0,
            uses=0,
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(Voice.id)
    )
    # RETURNING, not rowcount: drivers disagree on rowcount for ON CONFLICT DO NOTHING.
    created = session.execute(stmt).first() is not None
    return require_voice(session=session, voice_id=voice_id), created


def list_voices(*, session: Session, limit: int = 100) -> list[Voice]:
    """Newest first."""
    return list(session.scalars(select(Voice).order_by(Voice.created_at.desc(), Voice.id).limit(limit)))


def add_voice_use(*, session: Session, voice_id: str, delta: int = 1) -> None:
    session.execute(
        update(Voice).where(Voice.id == voice_id).values(uses=Voice.uses + delta, updated_at=utcnow())
    )


def mark_voice_pending(*, session: Session, voice_id: str) -> None:
    """Back to pending (features evicted, or an earlier preparation failed) before a new prepare."""
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(status=VoiceStatus.PENDING, error=None, prepare_attempts=0, updated_at=utcnow())
    )


def mark_voice_preparing(*, session: Session, voice_id: str) -> int:
    """Start a preparation attempt; returns the attempt number (1 for the first since the last success)."""
    now = utcnow()
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(
            status=VoiceStatus.PREPARING,
            prepare_started_at=now,
            prepare_attempts=Voice.prepare_attempts + 1,
            error=None,
            updated_at=now,
        )
    )
    return require_voice(session=session, voice_id=voice_id).prepare_attempts


def mark_voice_ready(*, session: Session, voice_id: str, prepare_ms: float, feature_nbytes: int) -> None:
    now = utcnow()
    result = session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(
            status=VoiceStatus.READY,
            prepared_at=now,
            prepare_ms=prepare_ms,
            feature_nbytes=feature_nbytes,
            prepare_attempts=0,
            error=None,
            updated_at=now,
        )
    )
    if _rowcount(result) != 1:
        raise NotFound(f"no voice {voice_id}")


def mark_voice_failed(*, session: Session, voice_id: str, error: str) -> None:
    session.execute(
        update(Voice)
        .where(Voice.id == voice_id)
        .values(status=VoiceStatus.FAILED, error=_clip(error), updated_at=utcnow())
    )


def count_live_jobs(*, session: Session, voice_id: str, exclude_job_id: str | None = None) -> int:
    """Jobs of this voice that are not finished (a cancelled job's voice is reclaimed only at zero)."""
    stmt = (
        select(func.count())
        .select_from(Job)
        .where(Job.voice_id == voice_id, Job.status.in_(LIVE_JOB_STATUSES))
    )
    if exclude_job_id is not None:
        stmt = stmt.where(Job.id != exclude_job_id)
    return int(session.execute(stmt).scalar_one())


def is_voice_abandoned(*, session: Session, voice_id: str) -> bool:
    """The voice was wanted only by jobs that have all been cancelled (so its preparation leaked).

    A voice uploaded on its own (no jobs) or used by any job that was not cancelled is not abandoned."""
    total, cancelled = session.execute(
        select(func.count(), func.count().filter(Job.status == JobStatus.CANCELLED)).where(
            Job.voice_id == voice_id
        )
    ).one()
    return total > 0 and total == cancelled


def referenced_paths(*, session: Session) -> set[str]:
    """Every artifact path the database points at (references, token files, outputs)."""
    paths: set[str] = set(
        session.scalars(select(Voice.reference_path).where(Voice.reference_path.is_not(None)))
    )
    for column in (Job.tokens_path, Job.output_path):
        paths.update(session.scalars(select(column).where(column.is_not(None))))
    return paths
