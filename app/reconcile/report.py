"""What one reconciler pass found (`SweepReport`) and its counters in the feature store: shared by the
job rules, the book rules and the GPU workers' watch over their peers (`gpu_worker.worker.recovery`)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from app.storage import keys
from app.storage.feature_store import FeatureStore

log = logging.getLogger(__name__)

# What a sweep found, counted in the feature store (`keys.COUNTER_SWEEP`) and exported by the API as
# wavefarm_sweep_found_total{kind}: the SweepReport fields, errors aside. Work that was stuck: all but the
# files and voices, which are leftovers, not waiting work.
SWEEP_FINDINGS = ("orphans_removed", "jobs_resumed", "jobs_requeued", "jobs_rerouted", "voices_reclaimed",
                  "chapters_resumed", "books_removed", "books_reparsed")


@dataclass
class SweepReport:
    orphans_removed: list[str] = field(default_factory=list)  # root-relative paths
    jobs_resumed: list[str] = field(default_factory=list)  # their lease passed: queued and rung again
    jobs_requeued: list[str] = field(default_factory=list)  # queued, not claimed in time: rung again
    jobs_rerouted: list[str] = field(default_factory=list)  # rung on a gone worker's queue: rung again
    voices_reclaimed: list[str] = field(default_factory=list)
    chapters_resumed: list[str] = field(default_factory=list)  # "<book id>/<chapter index>"
    books_removed: list[str] = field(default_factory=list)  # folders without a row
    books_reparsed: list[str] = field(default_factory=list)  # book.parse sent again
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_findings(store: FeatureStore, report: SweepReport) -> None:
    """Adds what the pass found to the sweep counters (an unreachable store costs only the count)."""
    found = {kind: len(getattr(report, kind)) for kind in SWEEP_FINDINGS}
    try:
        for kind, n in found.items():
            if n:
                store.incr(keys.COUNTER_SWEEP, kind, n)
    except redis.RedisError:
        log.warning("maintenance: the sweep's findings could not be counted", exc_info=True)
