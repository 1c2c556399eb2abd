"""Books, their chapters and segments: tables and their states (`app.db.models`)."""

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
    false,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db.models.base import Base, one_of, utcnow
from app.quality.report import GateMode
from app.speech import OutputFormat


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
        CheckConstraint(one_of("quality", GateMode), name="quality"),
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
    quality: Mapped[str] = mapped_column(String(8), default=GateMode.ON, server_default=GateMode.ON.value)
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
    # The quality gate's word on the audio of `quality_job_id` (app.books.quality): 'pass' or 'fail'
    # (NULL: not checked), the report as JSON, and how many renders the gate has heard for this key.
    quality_verdict: Mapped[str | None] = mapped_column(String(8))
    quality_report: Mapped[dict | None] = mapped_column(JSON)
    quality_job_id: Mapped[str | None] = mapped_column(String(36))
    quality_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
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
