"""books.parse_started_at and books.parse_lane: a book's reading is claimed, and a reading cut at the quick
lane's budget is read again in the long lane; book_chapters.render_owner and render_until: a chapter's
render is a lease, so a book.chapter sent again while it renders does not render it twice

Revision ID: 0019_reading_and_chapter_leases
Revises: 0018_chapter_counters
Create Date: 2026-12-07

Books parsing at the upgrade are in the quick lane and not being read (their message, or the sweep's,
reads them); no chapter holds a lease. Downgrading drops the four columns.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019_reading_and_chapter_leases"
down_revision: str | None = "0018_chapter_counters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("books") as batch:
        batch.add_column(sa.Column("parse_started_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("parse_lane", sa.String(8), nullable=False, server_default="quick"))
    with op.batch_alter_table("book_chapters") as batch:
        batch.add_column(sa.Column("render_owner", sa.String(200), nullable=True))
        batch.add_column(sa.Column("render_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("book_chapters") as batch:
        batch.drop_column("render_until")
        batch.drop_column("render_owner")
    with op.batch_alter_table("books") as batch:
        batch.drop_column("parse_lane")
        batch.drop_column("parse_started_at")
