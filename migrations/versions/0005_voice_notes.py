"""voices.reference_notes: what normalising the reference changed (cut to 6 s, padded, scaled down)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

Told to the client in the voice's record and by the CLI; before, only the worker's log said it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("voices") as batch:
        batch.add_column(sa.Column("reference_notes", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("voices") as batch:
        batch.drop_column("reference_notes")
