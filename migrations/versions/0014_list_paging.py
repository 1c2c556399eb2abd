"""ix_jobs_submitted_at_id, ix_books_submitted_at_id: the newest-first lists page by keyset
(submitted_at, id) after a cursor (`app.db.queries.paging`), read off these indexes backwards.

Revision ID: 0014_list_paging
Revises: 0013_book_epub3
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014_list_paging"
down_revision: str | None = "0013_book_epub3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_submitted_at_id", "jobs", ["submitted_at", "id"])
    op.create_index("ix_books_submitted_at_id", "books", ["submitted_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_books_submitted_at_id", table_name="books")
    op.drop_index("ix_jobs_submitted_at_id", table_name="jobs")
