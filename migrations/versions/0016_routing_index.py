"""Indexes for the routing decision (`app.routing.route_voice`) at many workers and installs:
ix_worker_voices_voice_id        which workers hold a voice: one probe, not one per live worker;
ix_worker_voices_worker_installed each live worker's latest install (the tie-break among idle workers),
                                 read as one index probe per worker instead of counting its installs;
ix_jobs_voice_status             a voice's live jobs, without reading its finished ones.
Measured with scripts/bench_routing.py (docs/SCALING.md).

Revision ID: 0016_routing_index
Revises: 0015_worker_weights
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016_routing_index"
down_revision: str | None = "0015_worker_weights"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_worker_voices_voice_id", "worker_voices", ["voice_id"])
    op.create_index("ix_worker_voices_worker_installed", "worker_voices", ["worker_id", "installed_at"])
    op.create_index("ix_jobs_voice_status", "jobs", ["voice_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_voice_status", table_name="jobs")
    op.drop_index("ix_worker_voices_worker_installed", table_name="worker_voices")
    op.drop_index("ix_worker_voices_voice_id", table_name="worker_voices")
