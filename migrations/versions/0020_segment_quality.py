"""segments.quality_verdict, quality_report, quality_job_id and quality_attempts: the quality gate's word on
a book segment's audio (app.books.quality)

Revision ID: 0020_segment_quality
Revises: 0019_reading_and_chapter_leases
Create Date: 2026-12-07

Segments rendered before the upgrade are unchecked (NULL verdict, no attempts heard). Downgrading drops the
four columns.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020_segment_quality"
down_revision: str | None = "0019_reading_and_chapter_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("segments") as batch:
        batch.add_column(sa.Column("quality_verdict", sa.String(8), nullable=True))
        batch.add_column(sa.Column("quality_report", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("quality_job_id", sa.String(36), nullable=True))
        batch.add_column(sa.Column("quality_attempts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("segments") as batch:
        batch.drop_column("quality_attempts")
        batch.drop_column("quality_job_id")
        batch.drop_column("quality_report")
        batch.drop_column("quality_verdict")
