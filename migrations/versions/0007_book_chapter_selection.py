"""books.chapters_selected: a render of some of a book's chapters ("3-7,12")

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

NULL for a render of the whole book. The rendered book holds only the selected chapters
(`app.books.select`).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("chapters_selected", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.drop_column("chapters_selected")
