"""books.epub3: a read-along EPUB 3 (the book's text, its chapter audio, Media Overlays) beside the M4B;
books.notes: what its audio is (dummy weights, the stand-in tokenizer), gathered from its segment jobs

Revision ID: 0012_book_epub3
Revises: 0011
Create Date: 2026-12-04

Books submitted before this revision made no EPUB (false) and have no notes (NULL: none gathered).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_book_epub3"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("epub3", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("notes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.drop_column("notes")
        batch.drop_column("epub3")
