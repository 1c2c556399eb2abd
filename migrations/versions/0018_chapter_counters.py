"""book_chapters counters and ready record; segments.job_id indexed: a book's progress is kept as its
segments settle, and a chapter's `book.chapter` is sent from the record its last segment's transaction
makes (no chord, no polling)

Revision ID: 0018_chapter_counters
Revises: 0017_job_leases
Create Date: 2026-12-04

The counters of every chapter are filled from its segments as they stand (distinct keys, as the API
reports them). A scheduled, unassembled chapter of a rendering book whose segments have all settled
already (its chord or poll was pending at the upgrade) is recorded ready now, so the sweep sends its
`book.chapter`. Downgrading drops the columns and the index; the counts are in the rows they came from.
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0018_chapter_counters"
down_revision: str | None = "0017_job_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTERS = ("keys_total", "keys_done", "keys_failed")
MOMENTS = ("ready_at", "rung_at", "checked_at")

# The chapter's distinct keys; frozen here (the models may change later).
_KEYS = ('(SELECT bs."key" FROM book_segments bs '
         'WHERE bs.book_id = book_chapters.book_id AND bs.chapter = book_chapters."index")')
_OVER_KEYS = 'FROM segments s LEFT JOIN jobs j ON j.id = s.job_id WHERE s."key" IN ' + _KEYS
BACKFILL = f"""
UPDATE book_chapters SET
  keys_total = (SELECT count(*) {_OVER_KEYS}),
  keys_done = (SELECT count(*) {_OVER_KEYS} AND j.status = 'succeeded'),
  keys_failed = (SELECT count(*) {_OVER_KEYS}
                 AND ((s.job_id IS NOT NULL AND j.status IN ('failed', 'cancelled'))
                      OR (s.job_id IS NULL AND s.error IS NOT NULL))),
  tokens_done = (SELECT coalesce(sum(j.n_tokens), 0) {_OVER_KEYS} AND j.status = 'succeeded')
"""
READY = """
UPDATE book_chapters SET ready_at = :now
WHERE scheduled_at IS NOT NULL AND assembled_at IS NULL AND keys_done + keys_failed >= keys_total
  AND book_id IN (SELECT id FROM books WHERE status = 'rendering')
"""


def upgrade() -> None:
    with op.batch_alter_table("book_chapters") as batch:
        for name in COUNTERS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("tokens_done", sa.BigInteger(), nullable=False, server_default="0"))
        for name in MOMENTS:
            batch.add_column(sa.Column(name, sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_segments_job_id", "segments", ["job_id"])
    op.execute(BACKFILL)
    # bound as the application binds it: book.chapter marks the record checked by comparing the time
    now = sa.bindparam("now", datetime.now(UTC), type_=sa.DateTime(timezone=True))
    op.get_bind().execute(sa.text(READY).bindparams(now))


def downgrade() -> None:
    op.drop_index("ix_segments_job_id", table_name="segments")
    with op.batch_alter_table("book_chapters") as batch:
        for name in (*COUNTERS, "tokens_done", *MOMENTS):
            batch.drop_column(name)
