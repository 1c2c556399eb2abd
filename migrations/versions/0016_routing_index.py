"""The routing decision (`app.routing.route_voice`) at many workers, installs and finished jobs:
workers.last_install_at          each worker's latest install, kept as installs are recorded (the
                                 tie-break among idle workers), so the decision reads the workers' rows
                                 and neither counts their installs (28 ms at 100,000) nor probes an index
                                 per worker (7.6 ms at 576); filled in from worker_voices on upgrade;
ix_worker_voices_voice_id        which workers hold a voice: one probe, not one per live worker;
ix_jobs_voice_status             a voice's live jobs, without reading its finished ones;
ix_jobs_status_worker,           each worker's backlog counted from the index alone (with only the
ix_jobs_status_routed_to         status index, PostgreSQL planned a parallel scan at 512 workers whose
                                 start-up took 10 ms of a 10.4 ms statement).
Measured with scripts/bench_routing.py (docs/SCALING.md).

Revision ID: 0016_routing_index
Revises: 0015_worker_weights
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_routing_index"
down_revision: str | None = "0015_worker_weights"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("last_install_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE workers SET last_install_at = "
               "(SELECT max(installed_at) FROM worker_voices WHERE worker_voices.worker_id = workers.name)")
    op.create_index("ix_worker_voices_voice_id", "worker_voices", ["voice_id"])
    op.create_index("ix_jobs_voice_status", "jobs", ["voice_id", "status"])
    op.create_index("ix_jobs_status_worker", "jobs", ["status", "worker"])
    op.create_index("ix_jobs_status_routed_to", "jobs", ["status", "routed_to"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status_routed_to", table_name="jobs")
    op.drop_index("ix_jobs_status_worker", table_name="jobs")
    op.drop_index("ix_jobs_voice_status", table_name="jobs")
    op.drop_index("ix_worker_voices_voice_id", table_name="worker_voices")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("last_install_at")
