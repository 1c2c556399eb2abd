"""Worker death, as a GPU worker process meets it; the reconciler's rules for dead workers' jobs are
`app.reconcile.dead_workers`, which this module runs for its peers.

- a job this process gives back (`release`): `JobRun` raises `Reject` when the engine stops under a job
  (the process is shutting down) or the database, the broker or Redis is away; the job is released
  first, so its next delivery claims it at once instead of waiting for the lease;
- its previous self's jobs (`resume_previous`): when the worker is ready it releases, and rings, the jobs
  its previous process under the same node name claimed (killed, so they would wait for their leases);
- its peers' jobs (`PeerWatch`): every heartbeat it runs the reconciler's dead-worker rules
  (`recover_peers`): jobs whose lease passed (a SIGKILLed peer's) are queued and rung again, and jobs
  rung on a gone worker's own queue are rung again where `app.submission.routing` says now, so with
  several GPU workers a killed one's jobs run again about `job_lease_s` after it died, whatever the
  sweep's interval. Of two workers doing it at once, each job is released by one (the releases are
  conditional UPDATEs).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.session import session_scope
from app.reconcile.dead_workers import reconcile_jobs
from app.reconcile.report import SweepReport
from gpu_worker.worker.job import TRANSIENT
from gpu_worker.worker.runtime import HEARTBEAT_S, Runtime

log = logging.getLogger(__name__)


def release(rt: Runtime, job_id: str) -> None:
    """A job this worker sends back to the queue is no longer held by it: its next delivery claims it at
    once. Best effort: when the database is away the lease lapses by itself (`job_lease_s`)."""
    try:
        with session_scope(rt.sessions) as session:
            lifecycle.release(session=session, job_id=job_id, worker=rt.worker_id)
    except TRANSIENT as exc:
        log.warning("synth %s: claim not released: %s", job_id, exc)


def release_previous(*, ctx: Context, worker: str, started_at: datetime) -> list[str]:
    """The claims a previous process under `worker` made (before `started_at`), released and rung now,
    without waiting for their leases. -> their ids."""
    with session_scope(ctx.sessions) as session:
        held = [(job.id, job.attempts) for job in queries.list_claims_before(
            session=session, worker=worker, claimed_before=started_at)]
    resumed = []
    for job_id, attempts in held:
        with session_scope(ctx.sessions) as session:
            if lifecycle.release(session=session, job_id=job_id, attempts=attempts, worker=worker,
                                 claimed_before=started_at):
                lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
                resumed.append(job_id)
    return resumed


def resume_previous(rt: Runtime) -> list[str]:
    """Release and ring the jobs this node name's previous process claimed before it died (before this
    process registered); the reconciler does the same for workers that never come back, once their leases
    pass."""
    try:
        resumed = release_previous(ctx=rt, worker=rt.worker_id, started_at=rt.presence.started_at)
    except TRANSIENT as exc:  # their leases pass and the reconciler finds them
        log.warning("worker %s: the jobs of its previous process not resumed: %s", rt.worker_id, exc)
        return []
    if resumed:
        log.warning("worker %s: resumed %d jobs its previous process held: %s", rt.worker_id,
                    len(resumed), resumed)
    return resumed


def recover_peers(rt: Runtime) -> SweepReport:
    """The reconciler's dead-worker rules, once (module docstring): leases that passed, bells on gone
    workers, partial outputs of jobs that ended."""
    report = SweepReport()
    try:
        reconcile_jobs(ctx=rt, report=report)
    except TRANSIENT as exc:  # the next beat tries again
        log.warning("worker %s: gone peers not looked after: %s", rt.worker_id, exc)
    if report.jobs_rerouted or report.jobs_resumed:
        log.warning("worker %s: %d jobs rung off gone workers' queues, %d jobs whose lease passed queued "
                    "again", rt.worker_id, len(report.jobs_rerouted), len(report.jobs_resumed))
    return report


class PeerWatch(threading.Thread):
    """`recover_peers` every heartbeat, on its own thread, until the worker stops."""

    def __init__(self, rt: Runtime, every_s: float = HEARTBEAT_S) -> None:
        super().__init__(name="wavefarm-peer-watch", daemon=True)
        self.rt, self.every_s = rt, every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                recover_peers(self.rt)
            except Exception:  # never stop looking: the next beat may succeed
                log.exception("worker %s: looking after gone peers failed", self.rt.worker_id)
