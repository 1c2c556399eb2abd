"""Voices, jobs and GPU workers with their installs: tables and their states (`app.db.models`)."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db.models.base import Base, one_of, utcnow
from app.speech import OutputFormat


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
