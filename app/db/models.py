"""SQLAlchemy 2.0 models: the source of truth for voices, jobs, GPU workers and their installs, and books.

Only table definitions live here; reading and writing goes through
`app.db.queries`. Types are chosen to behave the same on SQLite and
PostgreSQL (strings for enums and ids, JSON for token lists, UTC datetimes).
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.speech import OutputFormat

# Named constraints: Alembic's batch mode on SQLite needs names to drop or alter them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite drops the zone; we put it back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: wavefarm stores UTC-aware datetimes only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class VoiceStatus(enum.StrEnum):
    PENDING = "pending"
    PREPARING = "preparing"
    READY = "ready"
    FAILED = "failed"


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.PREPARING, JobStatus.RUNNING)
DONE_JOB_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobKind(enum.StrEnum):
    TOKENS = "tokens"  # the client sent speech tokens
    TEXT = "text"  # the client sent text: a CPU worker makes the tokens (`job.tokenize`) before `synth`


class PrepPath(enum.StrEnum):
    """How a job's voice came to be installed on the GPU worker (each path is counted)."""

    PREPARED_AHEAD = "prepared_ahead"
    ALREADY_INSTALLED = "already_installed"
    INLINE = "inline"
    LATE = "late"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"  # the feature store could not be reached
    QUEUE_FULL = "queue_full"
    ABANDONED = "abandoned"


def one_of(column: str, values: type[enum.StrEnum]) -> str:
    """SQL for `column IN (...)` over an enum's values (CHECK constraints, shared with the migrations)."""
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: dict[Any, Any] = {datetime: UTCDateTime()}


class Voice(Base):
    """A reference voice, identified by the sha256 of its normalised PCM (+ sample rate)."""

    __tablename__ = "voices"
    __table_args__ = (CheckConstraint(one_of("status", VoiceStatus), name="status"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(64), unique=True)  # app.voices.names: usable as the id
    status: Mapped[str] = mapped_column(String(16), default=VoiceStatus.PENDING)
    # Relative to the artifact root: references/<sha256 of the file>.<ext>
    reference_path: Mapped[str | None] = mapped_column(String(255))
    # what normalising the upload changed, one note per line (cut to 6 s, padded, scaled down); None: nothing
    reference_notes: Mapped[str | None] = mapped_column(Text)
    prepare_started_at: Mapped[datetime | None]
    prepared_at: Mapped[datetime | None]
    prepare_ms: Mapped[float | None]  # host half, wall time of the last successful preparation
    feature_nbytes: Mapped[int | None] = mapped_column(BigInteger)
    prepare_attempts: Mapped[int] = mapped_column(Integer, default=0)  # since the last success
    uses: Mapped[int] = mapped_column(Integer, default=0)  # jobs submitted with this voice
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Job(Base):
    """One synthesis request: tokens (or text, tokenized on a CPU worker) in a voice -> an output file."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_status_priority", "status", "priority"),
        Index("ix_jobs_voice_id", "voice_id"),
        Index("ix_jobs_voice_status", "voice_id", "status"),  # a voice's live jobs (app.submission.routing)
        Index("ix_jobs_status_worker", "status", "worker"),  # workers' backlogs from the index
        # (app.submission.routing)
        Index("ix_jobs_status_routed_to", "status", "routed_to"),
        Index("ix_jobs_submitted_at_id", "submitted_at", "id"),  # newest-first pages (queries.paging)
        CheckConstraint(one_of("status", JobStatus), name="status"),
        CheckConstraint(one_of("output_format", OutputFormat), name="output_format"),
        CheckConstraint(f"prep_path IS NULL OR {one_of('prep_path', PrepPath)}", name="prep_path"),
        CheckConstraint("priority BETWEEN 0 AND 9", name="priority"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=lambda: str(uuid.uuid4()))
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id"))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    kind: Mapped[str] = mapped_column(String(16), default=JobKind.TOKENS)
    # Inline JSON list of ints, or None when the list lives in the artifact store (tokens_path).
    tokens: Mapped[list[int] | None] = mapped_column(JSON)
    tokens_path: Mapped[str | None] = mapped_column(String(255))
    n_tokens: Mapped[int] = mapped_column(Integer)  # 0 for a text job until it is tokenized
    text: Mapped[str | None] = mapped_column(Text)  # a text job's text, as the client sent it
    language: Mapped[str | None] = mapped_column(String(32))  # a text job's language tag
    # What the client should know about how its audio was made (dummy weights, the stand-in
    # tokenizer): a JSON list of sentences, each added once.
    notes: Mapped[list[str] | None] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    output_format: Mapped[str] = mapped_column(String(8), default=OutputFormat.WAV)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(128), unique=True)
    frames_done: Mapped[int] = mapped_column(Integer, default=0)
    frames_total: Mapped[int] = mapped_column(Integer, default=0)
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    first_audio_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    prep_path: Mapped[str | None] = mapped_column(String(32))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    output_path: Mapped[str | None] = mapped_column(String(255))
    worker: Mapped[str | None] = mapped_column(String(255))
    # Where its latest `synth` was sent (`app.submission.routing`): a GPU worker's own queue (that worker's
    # name), or None for the shared gpu queue; `route` says why (`app.submission.routing.ROUTES`).
    routed_to: Mapped[str | None] = mapped_column(String(255))
    route: Mapped[str | None] = mapped_column(String(32))
    # The lease (`app.lifecycle`): a claimed job is its worker's until `lease_until`, which the running
    # attempt pushes on with every progress report; once it passed, the job is anyone's. A queued job's
    # doorbell (its message) is rung again when `ring_due_at` passed (NULL: never rung again yet, due
    # once the row is `stuck_job_after_s` old); `rings` counts the rings since its last claim.
    lease_until: Mapped[datetime | None]
    ring_due_at: Mapped[datetime | None]
    rings: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Worker(Base):
    """A GPU worker process under its node name: when its current incarnation started, when it last said
    it was alive. A job claimed before its worker's `started_at` was held by an earlier incarnation (a
    killed process); a worker whose heartbeat is old, or NULL (it stopped), holds nothing."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)  # the Celery node name (jobs.worker)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=utcnow)
    slots: Mapped[int | None]  # jobs it streams at once (WAVEFARM_WORKER_SLOTS); NULL: not recorded
    dummy_weights: Mapped[bool | None]  # runs without a model folder (noise); NULL: not recorded
    last_install_at: Mapped[datetime | None]  # this incarnation's latest install (app.submission.routing);
    # NULL: none


class WorkerVoice(Base):
    """A voice installed on one GPU worker (prompt + setup caches resident on its device)."""

    __tablename__ = "worker_voices"
    __table_args__ = (Index("ix_worker_voices_voice_id", "voice_id"),)  # who holds a voice
    # (app.submission.routing)

    worker_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id", ondelete="CASCADE"), primary_key=True)
    installed_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used: Mapped[datetime] = mapped_column(default=utcnow)
    pinned: Mapped[int] = mapped_column(Integer, default=0)  # live jobs using the install
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0)


class InstallEvent(Base):
    """The history of installs: one row per voice installed on a GPU worker, closed when it was evicted
    or when the worker's process ended without evicting it (a restart: `evicted_at` with `lost`).
    `worker_voices` says what a worker holds now; this says what every worker installed, and for how
    long (the cluster test and the affinity benchmark count installs here)."""

    __tablename__ = "install_events"
    __table_args__ = (Index("ix_install_events_worker_voice", "worker_id", "voice_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(255))
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id", ondelete="CASCADE"))
    installed_at: Mapped[datetime] = mapped_column(default=utcnow)
    evicted_at: Mapped[datetime | None]
    lost: Mapped[bool] = mapped_column(Boolean, default=False)  # its process ended holding it
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0)


class BookStatus(enum.StrEnum):
    PARSING = "parsing"  # accepted and stored; a CPU worker reads and plans it in a bounded child process
    QUEUED = "queued"  # planned: chapters and segments recorded, book.plan sent
    RENDERING = "rendering"
    ASSEMBLING = "assembling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE_BOOK_STATUSES = (BookStatus.PARSING, BookStatus.QUEUED, BookStatus.RENDERING, BookStatus.ASSEMBLING)


class SegmentKind(enum.StrEnum):
    TEXT = "text"
    TOKENS = "tokens"
    AUDIO = "audio"


class Book(Base):
    """One render of a book: its plan lives in a file under books/<id>/, its audio in books/<id>/out/."""

    __tablename__ = "books"
    __table_args__ = (
        Index("ix_books_status", "status"),
        Index("ix_books_submitted_at_id", "submitted_at", "id"),  # newest-first pages (queries.paging)
        CheckConstraint(one_of("status", BookStatus), name="status"),
        CheckConstraint(one_of("output_format", OutputFormat), name="output_format"),
        CheckConstraint("priority BETWEEN 0 AND 9", name="priority"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=lambda: str(uuid.uuid4()))
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default=BookStatus.QUEUED)
    parse_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # book.parse runs
    # Its reading (`app.lifecycle.parsing`): when the latest one began (a claim: no other reader takes it
    # until it could no longer be running), and its lane: "quick" first, "long" once a quick reading ran
    # out of the quick lane's budget.
    parse_started_at: Mapped[datetime | None]
    parse_lane: Mapped[str] = mapped_column(String(8), default="quick", server_default="quick")
    title: Mapped[str] = mapped_column(Text)
    author: Mapped[str] = mapped_column(Text, default="")
    language: Mapped[str] = mapped_column(String(35), default="en")
    plan_key: Mapped[str] = mapped_column(String(64))  # app.books.planning.plan.BookPlan.key
    output_format: Mapped[str] = mapped_column(String(8), default=OutputFormat.FLAC)
    m4b: Mapped[bool] = mapped_column(Boolean, default=True)
    mp3: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # MP3s per chapter too
    timed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # cues at their times
    epub3: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # read-along EPUB too
    notes: Mapped[list[str] | None] = mapped_column(JSON)  # how its audio was made (its segment jobs' notes)
    bitrate_kbps: Mapped[int] = mapped_column(Integer, default=64, server_default="64")  # M4B (AAC)
    mp3_bitrate_kbps: Mapped[int] = mapped_column(Integer, default=64, server_default="64")
    sample_rate: Mapped[int | None] = mapped_column(Integer)  # of M4B and MP3s; NULL: the render's own
    target_lufs: Mapped[float | None]
    seed: Mapped[int] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    segments_total: Mapped[int] = mapped_column(Integer, default=0)  # planned, repeats included
    est_seconds: Mapped[float] = mapped_column(default=0.0)  # planned speech, before rendering
    chapters_selected: Mapped[str | None] = mapped_column(Text)  # "3-7,12" (`app.books.planning.select`);
    # None: all
    error: Mapped[str | None] = mapped_column(Text)
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class BookChapter(Base):
    """A planned chapter of a book; `seconds` is the assembled file's length once it exists."""

    __tablename__ = "book_chapters"

    book_id: Mapped[str] = mapped_column(ForeignKey("books.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    title: Mapped[str] = mapped_column(Text)
    segments_total: Mapped[int] = mapped_column(Integer)
    est_seconds: Mapped[float]
    seconds: Mapped[float | None]
    loudness_lufs: Mapped[float | None]  # of the assembled file as written (app.books.writing.loudness)
    true_peak_dbtp: Mapped[float | None]
    scheduled_at: Mapped[datetime | None]  # its segments were sent to render (book.plan's window)
    assembled_at: Mapped[datetime | None]
    # Progress, kept by the transactions that settle its segments (`app.lifecycle.books`), in distinct
    # segment keys: a sentence repeated in the chapter renders once and counts once.
    keys_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    keys_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # job succeeded
    keys_failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # failed, cancelled
    tokens_done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # of done keys
    # The outbox of its `book.chapter`: recorded by the transaction that settled its last segment, sent
    # after that commit, sent again by the sweep (rung_at) until book.chapter has checked it.
    ready_at: Mapped[datetime | None]
    rung_at: Mapped[datetime | None]
    checked_at: Mapped[datetime | None]
    # A render of its file is a lease (`app.lifecycle.chapters`): whose it is and until when, renewed
    # while it renders; a book.chapter that finds it held leaves the chapter to its holder.
    render_owner: Mapped[str | None] = mapped_column(String(200))
    render_until: Mapped[datetime | None]


class Segment(Base):
    """A rendered-or-to-render piece of speech, by content key (app.books.planning.plan.segment_key).

    Shared by every book (and every render of a book) that plans the same key: the audio is the output
    of `job_id` once that job succeeded. A failed or cancelled job is replaced by a new one."""

    __tablename__ = "segments"
    __table_args__ = (
        CheckConstraint(one_of("kind", SegmentKind), name="kind"),
        Index("ix_segments_job_id", "job_id"),  # a finishing job finds its segment (queries.chapters)
    )

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    n_tokens: Mapped[int | None] = mapped_column(Integer)  # known once tokenized
    jobs_created: Mapped[int] = mapped_column(Integer, default=0)  # renders asked for, over all time
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class BookSegment(Base):
    """Where a segment sits in a book (a repeated sentence is one segment at several places)."""

    __tablename__ = "book_segments"
    __table_args__ = (Index("ix_book_segments_key", "key"),)

    book_id: Mapped[str] = mapped_column(ForeignKey("books.id", ondelete="CASCADE"), primary_key=True)
    chapter: Mapped[int] = mapped_column(Integer, primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(ForeignKey("segments.key", ondelete="CASCADE"))
