"""workers: GPU worker incarnations and heartbeats

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

One row per GPU worker node name: when its current process started and when it last beat. A restarted
worker (same name) and the maintenance sweep use it to tell the jobs of a dead process from those of a
live one; job routing by installed voice will read it too.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_workers")),
    )


def downgrade() -> None:
    op.drop_table("workers")
