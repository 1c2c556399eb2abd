"""workers.dummy_weights: whether a GPU worker runs without a model folder (its audio is noise), as it
registered; /healthz counts the live ones so the web page can say so.

Revision ID: 0015_worker_weights
Revises: 0014_list_paging
Create Date: 2026-12-04

Workers registered before this revision have NULL (not recorded) until they next start.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_worker_weights"
down_revision: str | None = "0014_list_paging"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("dummy_weights", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("dummy_weights")
