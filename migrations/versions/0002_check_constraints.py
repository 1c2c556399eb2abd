"""CHECK constraints on statuses, formats, prep paths and priority

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

SQLite cannot add a constraint to an existing table: batch mode rebuilds the
table (copy, drop, rename), which is why env.py renders SQLite in batch mode.
The allowed values are spelled out here, frozen at this revision.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VOICE_STATUS = "status IN ('pending', 'preparing', 'ready', 'failed')"
JOB_CHECKS = {
    "status": "status IN ('queued', 'preparing', 'running', 'succeeded', 'failed', 'cancelled')",
    "output_format": "output_format IN ('wav', 'flac')",
    "prep_path": "prep_path IS NULL OR prep_path IN "
    "('prepared_ahead', 'already_installed', 'inline', 'late', 'failed', 'unavailable', 'queue_full', "
    "'abandoned')",
    "priority": "priority BETWEEN 0 AND 9",
}


def upgrade() -> None:
    with op.batch_alter_table("voices") as batch:
        batch.create_check_constraint("status", VOICE_STATUS)
    with op.batch_alter_table("jobs") as batch:
        for name, condition in JOB_CHECKS.items():
            batch.create_check_constraint(name, condition)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in reversed(JOB_CHECKS):
            batch.drop_constraint(op.f(f"ck_jobs_{name}"), type_="check")
    with op.batch_alter_table("voices") as batch:
        batch.drop_constraint(op.f("ck_voices_status"), type_="check")
