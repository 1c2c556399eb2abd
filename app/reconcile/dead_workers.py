"""What the reconciler does for the jobs of workers that died, hung or went away (rules 2 and 3 of
`app.reconcile.sweep`); the sweep runs these rules, and every live GPU worker runs them each heartbeat
for its peers (`gpu_worker.worker.recovery.PeerWatch`), so nothing here may import the books' code.

- leases that passed (`expire_leases`): a claimed job whose lease (`job_lease_s`, renewed by each
  progress report) has passed was held by a worker that died, hung or lost the database: it goes back to
  `queued` and its bell is rung (`lifecycle.ring`). The dead worker's own message, if the broker still
  has one (RabbitMQ requeues it at once, Redis after its visibility timeout), is a duplicate: its delivery
  finds the job claimed or ended and is acknowledged without work;
- bells to gone workers (`reroute_gone`): a queued job whose latest doorbell went to the own queue of a
  GPU worker that is gone (stopped, or no heartbeat for `WORKER_GONE_S`) is rung again, where
  `app.submission.routing` says now (a live holder of its voice, or the shared queue);
- partial outputs (`drop_settled_partials`): those a killed worker left of jobs that ended more than a
  lease ago go at once (nobody writes them).
A worker that starts again under its name does not wait for its own leases: it releases its previous
process's claims itself (`gpu_worker.worker.recovery.resume_previous`).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import utcnow
from app.db.session import session_scope
from app.reconcile.report import SweepReport

log = logging.getLogger(__name__)

WORKER_GONE_S = 60.0  # a GPU worker beats every gpu_worker.worker.runtime.HEARTBEAT_S (10 s): six missed
# beats


def reconcile_jobs(*, ctx: Context, report: SweepReport) -> None:
    """Every rule of this module, once: the jobs of dead and gone workers, queued and rung again; and
    the partial outputs the dead ones left of jobs that ended."""
    expire_leases(ctx=ctx, report=report)
    reroute_gone(ctx=ctx, report=report)
    drop_settled_partials(ctx=ctx, report=report)


def expire_leases(*, ctx: Context, report: SweepReport) -> None:
    """Claimed jobs whose lease passed go back to the queue, rung (module docstring)."""
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        expired = [(job.id, job.attempts, job.worker) for job in queries.list_expired_leases(
            session=session, now=now)]
    for job_id, attempts, worker in expired:
        with session_scope(ctx.sessions) as session:
            if not lifecycle.release(session=session, job_id=job_id, attempts=attempts, expired_by=now):
                continue  # renewed, claimed again, finished or cancelled meanwhile
            lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
        log.warning("maintenance: job %s: the lease of worker %s passed; queued again", job_id, worker)
        report.jobs_resumed.append(job_id)


def reroute_gone(*, ctx: Context, report: SweepReport) -> None:
    """Queued jobs whose bell rang on a gone worker's own queue, rung again (module docstring)."""
    silent_before = utcnow() - timedelta(seconds=WORKER_GONE_S)
    with session_scope(ctx.sessions) as session:
        stranded = [(job.id, job.routed_to) for job in queries.list_queued_on_gone_workers(
            session=session, silent_before=silent_before)]
    for job_id, worker in stranded:
        with session_scope(ctx.sessions) as session:
            if lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id,
                              route_note="shared_worker_gone") is None:
                continue
        log.warning("maintenance: job %s waited on the queue of GPU worker %s, which is gone; rung again",
                    job_id, worker)
        report.jobs_rerouted.append(job_id)


def drop_settled_partials(*, ctx: Context, report: SweepReport) -> None:
    """The partial outputs of jobs that ended more than a lease ago. A live attempt removes its own at
    its next report; one left by a killed worker of a job that was cancelled meanwhile would otherwise
    wait for `orphan_grace_s` (nothing claims that job again)."""
    partials = ctx.artifacts.partial_outputs()
    if not partials:
        return
    with session_scope(ctx.sessions) as session:
        ended = queries.list_ended_jobs(session=session, job_ids=sorted(partials), finished_before=utcnow()
                                        - timedelta(seconds=ctx.settings.job_lease_s))
    for job_id in ended:
        for path in partials[job_id]:
            path.unlink(missing_ok=True)
            report.orphans_removed.append(str(path.relative_to(ctx.artifacts.root)))
