"""jobs.routed_to / jobs.route and install_events: voice-affinity routing and the install history

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

`jobs.routed_to` names the GPU worker whose own queue a job's latest `synth` went to (NULL: the shared
gpu queue) and `jobs.route` why (`app.routing`). `install_events` keeps one row per voice installed on a
GPU worker, closed when it is evicted or its process ends.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("routed_to", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("route", sa.String(length=32), nullable=True))
    op.create_table(
        "install_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("worker_id", sa.String(length=255), nullable=False),
        sa.Column("voice_id", sa.String(length=64), nullable=False),
        sa.Column("installed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("evicted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lost", sa.Boolean(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["voice_id"], ["voices.id"], name=op.f("fk_install_events_voice_id_voices"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_install_events")),
    )
    op.create_index("ix_install_events_worker_voice", "install_events", ["worker_id", "voice_id"])


def downgrade() -> None:
    op.drop_index("ix_install_events_worker_voice", table_name="install_events")
    op.drop_table("install_events")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("route")
        batch.drop_column("routed_to")
