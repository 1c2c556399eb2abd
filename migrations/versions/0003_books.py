"""books, book_chapters, segments, book_segments

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

Books render through ordinary jobs: a segment (by content key) points at the job whose output is its
audio. Deleting a voice deletes its books and segments; deleting a job only unlinks its segment.
Allowed values are spelled out here, frozen at this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BOOK_STATUS = "status IN ('queued', 'rendering', 'assembling', 'succeeded', 'failed', 'cancelled')"
SEGMENT_KIND = "kind IN ('text', 'tokens', 'audio')"


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "books",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("voice_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("author", sa.Text(), nullable=False),
        sa.Column("language", sa.String(length=35), nullable=False),
        sa.Column("plan_key", sa.String(length=64), nullable=False),
        sa.Column("output_format", sa.String(length=8), nullable=False),
        sa.Column("m4b", sa.Boolean(), nullable=False),
        sa.Column("target_lufs", sa.Double(), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("segments_total", sa.Integer(), nullable=False),
        sa.Column("est_seconds", sa.Double(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("submitted_at", nullable=False),
        _ts("started_at"),
        _ts("finished_at"),
        _ts("updated_at", nullable=False),
        sa.ForeignKeyConstraint(["voice_id"], ["voices.id"], name=op.f("fk_books_voice_id_voices"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_books")),
        sa.CheckConstraint(BOOK_STATUS, name=op.f("ck_books_status")),
        sa.CheckConstraint("output_format IN ('wav', 'flac')", name=op.f("ck_books_output_format")),
        sa.CheckConstraint("priority BETWEEN 0 AND 9", name=op.f("ck_books_priority")),
    )
    op.create_index("ix_books_status", "books", ["status"])
    op.create_table(
        "book_chapters",
        sa.Column("book_id", sa.String(length=36), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("segments_total", sa.Integer(), nullable=False),
        sa.Column("est_seconds", sa.Double(), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=True),
        _ts("scheduled_at"),
        _ts("assembled_at"),
        sa.ForeignKeyConstraint(["book_id"], ["books.id"], name=op.f("fk_book_chapters_book_id_books"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("book_id", "index", name=op.f("pk_book_chapters")),
    )
    op.create_table(
        "segments",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("voice_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("n_tokens", sa.Integer(), nullable=True),
        sa.Column("jobs_created", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at", nullable=False),
        _ts("updated_at", nullable=False),
        sa.ForeignKeyConstraint(["voice_id"], ["voices.id"], name=op.f("fk_segments_voice_id_voices"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_segments_job_id_jobs"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_segments")),
        sa.CheckConstraint(SEGMENT_KIND, name=op.f("ck_segments_kind")),
    )
    op.create_table(
        "book_segments",
        sa.Column("book_id", sa.String(length=36), nullable=False),
        sa.Column("chapter", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["book_id"], ["books.id"], name=op.f("fk_book_segments_book_id_books"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["key"], ["segments.key"], name=op.f("fk_book_segments_key_segments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("book_id", "chapter", "position", name=op.f("pk_book_segments")),
    )
    op.create_index("ix_book_segments_key", "book_segments", ["key"])


def downgrade() -> None:
    op.drop_index("ix_book_segments_key", table_name="book_segments")
    op.drop_table("book_segments")
    op.drop_table("segments")
    op.drop_table("book_chapters")
    op.drop_index("ix_books_status", table_name="books")
    op.drop_table("books")
