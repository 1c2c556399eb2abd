"""voices, jobs, worker_voices

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Migrations spell out plain SQLAlchemy types (never app types) so that they
keep working as the app changes.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "voices",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reference_path", sa.String(length=255), nullable=True),
        _ts("prepare_started_at"),
        _ts("prepared_at"),
        sa.Column("prepare_ms", sa.Double(), nullable=True),
        sa.Column("feature_nbytes", sa.BigInteger(), nullable=True),
        sa.Column("prepare_attempts", sa.Integer(), nullable=False),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at", nullable=False),
        _ts("updated_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_voices")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("voice_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tokens", sa.JSON(), nullable=True),
        sa.Column("tokens_path", sa.String(length=255), nullable=True),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("output_format", sa.String(length=8), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=True),
        sa.Column("frames_done", sa.Integer(), nullable=False),
        sa.Column("frames_total", sa.Integer(), nullable=False),
        _ts("submitted_at", nullable=False),
        _ts("started_at"),
        _ts("first_audio_at"),
        _ts("finished_at"),
        sa.Column("prep_path", sa.String(length=32), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("output_path", sa.String(length=255), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        _ts("updated_at", nullable=False),
        sa.ForeignKeyConstraint(["voice_id"], ["voices.id"], name=op.f("fk_jobs_voice_id_voices")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_jobs_idempotency_key")),
    )
    op.create_index("ix_jobs_status_priority", "jobs", ["status", "priority"])
    op.create_index("ix_jobs_voice_id", "jobs", ["voice_id"])
    op.create_table(
        "worker_voices",
        sa.Column("worker_id", sa.String(length=255), nullable=False),
        sa.Column("voice_id", sa.String(length=64), nullable=False),
        _ts("installed_at", nullable=False),
        _ts("last_used", nullable=False),
        sa.Column("pinned", sa.Integer(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["voice_id"], ["voices.id"], name=op.f("fk_worker_voices_voice_id_voices"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("worker_id", "voice_id", name=op.f("pk_worker_voices")),
    )


def downgrade() -> None:
    op.drop_table("worker_voices")
    op.drop_index("ix_jobs_voice_id", table_name="jobs")
    op.drop_index("ix_jobs_status_priority", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("voices")
