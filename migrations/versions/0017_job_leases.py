"""jobs.lease_until, jobs.ring_due_at, jobs.rings: leases and doorbells (`app.lifecycle`).

Revision ID: 0017_job_leases
Revises: 0016_routing_index
Create Date: 2026-12-04

A job claimed when the database is upgraded (a worker of the previous version streaming it) gets a lease
of `IN_FLIGHT_LEASE_S` from the upgrade: a worker of this version that holds it renews it with its next
progress report; one of the previous version does not, and its job is claimable again once the lease has
passed (stop the previous version's GPU workers before the upgrade to avoid rendering such a job twice).
Queued jobs keep no ring due (NULL): the reconciler rings them once they are `stuck_job_after_s` old.
"""

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision: str = "0017_job_leases"
down_revision: str | None = "0016_routing_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

IN_FLIGHT_LEASE_S = 120.0


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("ring_due_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("rings", sa.Integer(), nullable=False, server_default="0"))
    jobs = sa.table("jobs", sa.column("status", sa.String),
                    sa.column("lease_until", sa.DateTime(timezone=True)))
    until = datetime.now(UTC) + timedelta(seconds=IN_FLIGHT_LEASE_S)
    op.execute(jobs.update().where(jobs.c.status.in_(("preparing", "running"))).values(lease_until=until))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("rings")
        batch.drop_column("ring_due_at")
        batch.drop_column("lease_until")
