"""books.status 'parsing' and books.parse_attempts: a book is read in a bounded worker, not the API

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03

`POST /v1/books` now stores the upload and answers at once with the book in `parsing`; a CPU worker
reads and plans it in a child process with hard limits (`app.books.intake`), then the book is `queued`
or `failed` with the parser's reason. `parse_attempts` counts the runs of `book.parse`, so a book whose
reading keeps failing for reasons outside the child (a worker killed each time) is given up.
The allowed values are spelled out here, frozen at this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUS = "status IN ('queued', 'rendering', 'assembling', 'succeeded', 'failed', 'cancelled')"
NEW_STATUS = ("status IN ('parsing', 'queued', 'rendering', 'assembling', 'succeeded', 'failed', "
              "'cancelled')")


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("parse_attempts", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_constraint("status", type_="check")
        batch.create_check_constraint("status", NEW_STATUS)


def downgrade() -> None:
    op.execute("UPDATE books SET status = 'failed', error = 'parsing when the schema was downgraded' "
               "WHERE status = 'parsing'")
    with op.batch_alter_table("books") as batch:
        batch.drop_constraint("status", type_="check")
        batch.create_check_constraint("status", OLD_STATUS)
        batch.drop_column("parse_attempts")
