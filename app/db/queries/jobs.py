"""Jobs: creation (idempotent), tokens, notes, listing. Their state changes are `app.lifecycle`'s."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, bindparam, delete, func, select, text, update
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.models import Job, JobKind, JobStatus, utcnow
from app.db.queries import paging
from app.db.queries._common import _insert, _rowcount
from app.db.queries.voices import VoiceUse, _use_voice, use_voice
from app.errors import NotFound
from app.speech import MEL_PER_TOKEN


def get_job(*, session: Session, job_id: str) -> Job | None:
    return session.get(Job, job_id, populate_existing=True)


def get_jobs(*, session: Session, job_ids: Sequence[str]) -> list[Job]:
    """The jobs of `job_ids` that exist, as the database has them now, in the order given."""
    found = {job.id: job for job in session.scalars(
        select(Job).where(Job.id.in_(list(job_ids))).execution_options(populate_existing=True))}
    return [found[job_id] for job_id in job_ids if job_id in found]


def require_job(*, session: Session, job_id: str) -> Job:
    job = get_job(session=session, job_id=job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def get_job_by_idempotency_key(*, session: Session, idempotency_key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.idempotency_key == idempotency_key)).one_or_none()


def create_job(*, session: Session, new: NewJob) -> tuple[Job, bool]:
    """Insert a queued job (with its route, when decided: `app.submission.routing`). With an idempotency key
    already used, returns that job instead. A text job has no tokens yet (None, n_tokens 0) until
    `set_job_tokens`.

    Returns (job, created)."""
    [row] = _rows([new])
    if session.execute(_insert_job(session.get_bind().dialect.name), row).first() is not None:
        return _written_job(row), True
    existing = get_job_by_idempotency_key(session=session, idempotency_key=new.idempotency_key or "")
    assert existing is not None, "conflicting insert without a row to conflict with"
    return existing, False


def create_job_using_voice(*, session: Session, new: NewJob) -> tuple[VoiceUse, Job, bool]:
    """`use_voice` and `create_job` together: one more use of `new.voice_id` counted, and the job inserted
    (or, with an idempotency key already used, that job: created False; the use is counted all the same,
    as `use_voice` then `create_job` count it). NotFound, and nothing written, if there is no such voice.

    On PostgreSQL one statement (`_use_voice_and_insert`): a submission's one round trip to the database
    before its commit. SQLite cannot write in a `WITH`: there the two statements, in the same transaction.

    Returns (the voice's use, the job, created)."""
    if session.get_bind().dialect.name != "postgresql":
        used = use_voice(session=session, voice_id=new.voice_id)
        return (used, *create_job(session=session, new=new))
    [row] = _rows([new])
    params = {f"job_{name}": value for name, value in row.items()}
    found = session.execute(_use_voice_and_insert(tuple(row)),
                            {**params, "voice_id": new.voice_id, "now": row["updated_at"]}).first()
    if found is None:
        raise NotFound(f"no voice {new.voice_id}")
    used = VoiceUse(new.voice_id, found[0])
    if found[1] is not None:
        return used, _written_job(row), True
    existing = get_job_by_idempotency_key(session=session, idempotency_key=new.idempotency_key or "")
    assert existing is not None, "conflicting insert without a row to conflict with"
    return used, existing, False


@functools.cache
def _use_voice_and_insert(names: tuple[str, ...]) -> Any:
    """PostgreSQL: the voice's use (`_use_voice`, its `UPDATE ... RETURNING`) and the job's INSERT as one
    statement of two data-modifying `WITH` parts; the INSERT takes its voice id from the UPDATE's row, so
    no job is written for a voice that does not exist. One row (the voice's status, and the new job's id
    or NULL when the idempotency key was taken), or none when there is no such voice. Built once, the
    row as parameters named `job_<column>` (a parameter named as a voices column would join the UPDATE's
    SET), each cast to its column's type (a parameter in a SELECT list has none of its own)."""
    table = cast(Table, Job.__table__)
    used = _use_voice().cte("used")
    values = [used.c.id if name == "voice_id"
              else sql_cast(bindparam(f"job_{name}", type_=table.c[name].type), table.c[name].type)
              for name in names]
    inserted = (postgresql.insert(table)  # a column the row leaves out takes the database's default
                .from_select(list(names), select(*values).select_from(used), include_defaults=False)
                .on_conflict_do_nothing(index_elements=["idempotency_key"]).returning(table.c.id)
                .cte("inserted"))
    return select(used.c.status, select(inserted.c.id).scalar_subquery())


@functools.cache
def _insert_job(dialect: str) -> Any:
    """The one job INSERT of a dialect, built once: the row goes in as execute parameters, so SQLAlchemy
    compiles it once per process and caches it (`.values(row)` with `.returning(Job)` through the ORM
    was compiled again on every submission: a quarter of the API's CPU for one)."""
    if dialect not in ("postgresql", "sqlite"):
        raise NotImplementedError(f"unsupported database dialect {dialect!r}")
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # RETURNING the id: whether the row went in (psycopg's rowcount is -1 for it)
    table = cast(Table, Job.__table__)
    return insert(table).on_conflict_do_nothing(index_elements=["idempotency_key"]).returning(table.c.id)


def _written_job(row: dict[str, Any]) -> Job:
    """The job as its row was written (a Job outside the session: answering needs no read after the
    insert); the columns the row leaves out are their defaults."""
    return Job(**row, rings=0)


@dataclass(frozen=True)
class NewJob:
    """One row for `create_job` or `insert_jobs`: a queued job (a text job: tokens None, n_tokens 0, its
    text)."""

    id: str
    voice_id: str
    tokens: Sequence[int] | None
    n_tokens: int
    seed: int
    output_format: str
    priority: int = 0
    idempotency_key: str | None = None
    tokens_path: str | None = None
    kind: str = JobKind.TOKENS
    text: str | None = None
    language: str | None = None
    routed_to: str | None = None  # where its `synth` goes, decided before the insert
    # (`app.submission.routing`)
    route: str | None = None


def insert_jobs(*, session: Session, jobs: Sequence[NewJob]) -> set[str]:
    """Insert queued jobs in one statement; a job whose idempotency key another job holds is skipped.
    Returns the ids inserted. On PostgreSQL the rows go in as one array a column (`_insert_unnest`); on
    SQLite as SQLAlchemy's insertmanyvalues writes them (one statement a page of rows)."""
    if not jobs:
        return set()
    rows = _rows(jobs)
    if session.get_bind().dialect.name == "postgresql":
        columns = {name: [row[name] for row in rows] for name in rows[0]}
        columns["tokens"] = [None if t is None else json.dumps(t) for t in columns["tokens"]]
        return set(session.scalars(_insert_unnest(tuple(rows[0])), columns))
    stmt = _insert(session, Job).on_conflict_do_nothing(index_elements=["idempotency_key"])
    return set(session.scalars(stmt.returning(Job.id), rows))


@functools.cache
def _insert_unnest(names: tuple[str, ...]) -> Any:
    """PostgreSQL's INSERT of many jobs as `SELECT ... FROM unnest(one array a column)`: one short
    statement whatever the rows (psycopg caches its parse, and the database plans it once), where a
    1,000-row VALUES list was 20,000 parameters that psycopg parsed again on every batch (most of the
    batch's insert CPU). The arrays are cast to each column's type; `tokens` goes as JSON text."""
    table = cast(Table, Job.__table__)
    dialect = postgresql.dialect()
    arrays = ", ".join(f"CAST(:{n} AS {table.c[n].type.compile(dialect=dialect)}[])" for n in names)
    listed = ", ".join(names)
    return text(f"INSERT INTO jobs ({listed}) SELECT {listed} FROM unnest({arrays}) AS new_jobs ({listed}) "
                "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id")


def _rows(jobs: Sequence[NewJob]) -> list[dict[str, Any]]:
    now = utcnow()
    return [{"id": j.id, "voice_id": j.voice_id, "status": JobStatus.QUEUED, "kind": j.kind, "text": j.text,
             "language": j.language, "tokens": list(j.tokens) if j.tokens is not None else None,
             "tokens_path": j.tokens_path, "n_tokens": j.n_tokens, "seed": j.seed,
             "output_format": j.output_format, "priority": j.priority, "idempotency_key": j.idempotency_key,
             "frames_done": 0, "frames_total": MEL_PER_TOKEN * j.n_tokens, "submitted_at": now, "attempts": 0,
             "updated_at": now, "routed_to": j.routed_to, "route": j.route} for j in jobs]


def jobs_by_idempotency_keys(*, session: Session, keys: Collection[str]) -> dict[str, Job]:
    """The jobs holding these idempotency keys, by key (a key no job holds is absent)."""
    if not keys:
        return {}
    found = session.scalars(select(Job).where(Job.idempotency_key.in_(list(keys))))
    return {job.idempotency_key: job for job in found if job.idempotency_key is not None}


def delete_jobs(*, session: Session, job_ids: Collection[str]) -> None:
    """Take jobs out again (their messages could not be sent: `app.submission.batch`)."""
    if job_ids:
        session.execute(delete(Job).where(Job.id.in_(list(job_ids))))


def set_job_tokens(*, session: Session, job_id: str, tokens: Sequence[int] | None, n_tokens: int,
                   tokens_path: str | None = None) -> bool:
    """A text job's tokens, made on a CPU worker (inline, or in the artifact store at `tokens_path`);
    False when the job is no longer queued (cancelled meanwhile, or tokenized by an earlier delivery)."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED, Job.n_tokens == 0)
        .values(tokens=list(tokens) if tokens is not None else None, tokens_path=tokens_path,
                n_tokens=n_tokens, frames_total=MEL_PER_TOKEN * n_tokens, updated_at=utcnow())
    )
    return _rowcount(result) == 1


def is_tokenized(job: Job) -> bool:
    """Whether the job's tokens exist (always for a tokens job; for a text job once `job.tokenize` ran)."""
    return job.kind != JobKind.TEXT or job.n_tokens > 0


def add_job_note(*, session: Session, job_id: str, note: str) -> None:
    """Add a sentence to what the client is told about the job's audio (each sentence once)."""
    job = require_job(session=session, job_id=job_id)
    notes = list(job.notes or [])
    if note not in notes:
        job.notes = [*notes, note]


def list_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              limit: int = 100) -> list[Job]:
    """Newest first, optionally of one status and one voice."""
    return page_jobs(session=session, status=status, voice_id=voice_id, limit=limit)[0]


def page_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              after: str | None = None, limit: int = 100) -> tuple[list[Job], str | None]:
    """A page of jobs newest first after the cursor `after`, and the next page's cursor (None: last)."""
    stmt = paging.page(select(Job), Job, after, limit)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if voice_id is not None:
        stmt = stmt.where(Job.voice_id == voice_id)
    return paging.split(list(session.scalars(stmt)), limit)


def count_jobs_by_status(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status))
    return {str(status): int(count) for status, count in rows}


def job_ids_with_prefix(*, session: Session, prefix: str, limit: int = 10) -> list[str]:
    """Ids starting with `prefix` (lowercase hex and hyphens, checked by the caller), at most `limit`."""
    stmt = select(Job.id).where(Job.id.startswith(prefix, autoescape=True)).order_by(Job.id).limit(limit)
    return list(session.scalars(stmt))
