"""books.quality: the book's quality gate, chosen when it is submitted: on (hear each segment, render a
failing one again, report), report (hear and report, never render again) or off (not heard)

Revision ID: 0021_book_quality_gate
Revises: 0020_segment_quality
Create Date: 2026-12-07

Books submitted before the upgrade keep the gate they had then: on. Downgrading drops the column (and its
CHECK constraint with it).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021_book_quality_gate"
down_revision: str | None = "0020_segment_quality"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUALITY = "quality IN ('on', 'report', 'off')"  # app.quality.report.GateMode


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("quality", sa.String(8), nullable=False, server_default="on"))
        batch.create_check_constraint("quality", QUALITY)


def downgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.drop_constraint("quality", type_="check")
        batch.drop_column("quality")
