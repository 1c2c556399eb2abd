"""workers.slots: how many jobs a GPU worker streams at once

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

Recorded by each GPU worker as it registers (`WAVEFARM_WORKER_SLOTS`). Voice-affinity routing reads it:
a job whose voice's holder has every slot taken goes to a worker with a free one (`app.routing`).
NULL for rows written before this revision: the router then assumes its own `worker_slots`.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("slots", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("slots")
