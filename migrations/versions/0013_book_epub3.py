"""books.epub3: a read-along EPUB 3 (the book's text, its chapter audio, Media Overlays) beside the M4B;
books.notes: what its audio is (dummy weights, the stand-in tokenizer), gathered from its segment jobs;
books.bitrate_kbps, mp3_bitrate_kbps, sample_rate: how the M4B and the MP3s are encoded

Revision ID: 0013_book_epub3
Revises: 0012_voice_names
Create Date: 2026-12-04

Books submitted before this revision made no EPUB (false), have no notes (NULL: none gathered) and were
encoded at 64 kbit/s at the render's own rate (NULL), as every book was then.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_book_epub3"
down_revision: str | None = "0012_voice_names"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("epub3", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("notes", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("bitrate_kbps", sa.Integer(), nullable=False, server_default="64"))
        batch.add_column(sa.Column("mp3_bitrate_kbps", sa.Integer(), nullable=False, server_default="64"))
        batch.add_column(sa.Column("sample_rate", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.drop_column("sample_rate")
        batch.drop_column("mp3_bitrate_kbps")
        batch.drop_column("bitrate_kbps")
        batch.drop_column("notes")
        batch.drop_column("epub3")
