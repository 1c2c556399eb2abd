"""book_chapters.loudness_lufs, book_chapters.true_peak_dbtp: a chapter file's measured loudness;
books.mp3: an MP3 per chapter besides the chapter files; books.timed: subtitle cues at their start times

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03

Integrated loudness (LUFS, ITU-R BS.1770-4) and true peak (dBTP) of the assembled chapter as written,
after normalisation (`app.books.loudness`); NULL until the chapter is assembled, and for silence.
Books submitted before this revision made no MP3s and were not timed (false).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("mp3", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("timed", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("book_chapters") as batch:
        batch.add_column(sa.Column("loudness_lufs", sa.Double(), nullable=True))
        batch.add_column(sa.Column("true_peak_dbtp", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("book_chapters") as batch:
        batch.drop_column("true_peak_dbtp")
        batch.drop_column("loudness_lufs")
    with op.batch_alter_table("books") as batch:
        batch.drop_column("timed")
        batch.drop_column("mp3")
