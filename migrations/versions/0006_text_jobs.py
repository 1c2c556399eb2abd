"""jobs.text, jobs.language, jobs.notes: text jobs, and what the client should know about its audio

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

A text job keeps the client's text and language; a CPU worker makes its tokens (`job.tokenize`).
Notes tell the client when its audio came from dummy weights or the stand-in tokenizer.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("text", sa.Text(), nullable=True))
        batch.add_column(sa.Column("language", sa.String(32), nullable=True))
        batch.add_column(sa.Column("notes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("notes")
        batch.drop_column("language")
        batch.drop_column("text")
