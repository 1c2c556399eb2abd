"""The reconciler: one pass over SQL state that puts back what crashes, kills and lost messages leave.

The database is the truth and a message is only a doorbell (`app.lifecycle`), so every rule is a query
over rows, each followed by an idempotent action; the pass is safe to run at any time, from anywhere, by
several processes at once (the `maintenance.sweep` task on a CPU worker every `maintenance_interval_s`,
`wavefarm maintenance`, a cron). This module composes the rules; each is described where it lives:
1. orphan files, older than `orphan_grace_s` (`app.reconcile.jobs.remove_orphans`), and the partial
   outputs of jobs that ended more than `job_lease_s` ago (`app.reconcile.dead_workers`);
2. leases that passed: the jobs of workers that died or hung, queued and rung again
   (`app.reconcile.dead_workers`; a GPU worker that starts again under a name releases its previous
   process's claims at once itself, `gpu_worker.worker.recovery`);
3. bells to gone workers: queued jobs rung on a gone GPU worker's own queue, rung again where
   `app.submission.routing` says now (`app.reconcile.dead_workers`);
4. bells due: queued jobs not claimed in time, rung again (`app.reconcile.jobs`);
5. abandoned voices: features of voices whose every job was cancelled, reclaimed (`app.reconcile.jobs`);
6. ready chapters whose `book.chapter` was lost, chapters whose render lease passed, chapters whose
   sending died (`app.reconcile.books`);
7. book folders without a row, and books left `parsing` by a reader that died (`app.reconcile.books`).
The rules of 1 to 3 about dead workers also run in every GPU worker each heartbeat
(`gpu_worker.worker.recovery.PeerWatch`), so a killed worker's jobs run again within a lease.
It never reads the broker: it does not need to know where a message is. It does not touch the GPU
workers' installs (theirs to reclaim) and does not retry failed jobs.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.broker.wire import TaskSender
from app.context import Context
from app.db.session import session_scope
from app.reconcile import books, dead_workers, jobs
from app.reconcile.report import SweepReport, count_findings
from app.settings import Settings

log = logging.getLogger(__name__)


def sweep(*, ctx: Context, grace_s: float | None = None) -> SweepReport:
    """One maintenance pass (see the module docstring); each part runs even if another failed."""
    report = SweepReport()
    grace = ctx.settings.orphan_grace_s if grace_s is None else grace_s
    parts = (
        ("orphans", lambda: _in_session(ctx.sessions, lambda s: jobs.remove_orphans(
            session=s, artifacts=ctx.artifacts, grace_s=grace, report=report))),
        ("partials", lambda: dead_workers.drop_settled_partials(ctx=ctx, report=report)),
        ("leases", lambda: dead_workers.expire_leases(ctx=ctx, report=report)),
        ("gone workers", lambda: dead_workers.reroute_gone(ctx=ctx, report=report)),
        ("bells due", lambda: jobs.ring_due(ctx=ctx, report=report)),
        ("abandoned voices", lambda: jobs.reclaim_voices(ctx=ctx, report=report)),
        ("ready chapters", lambda: books.resume_chapters(ctx=ctx, report=report)),
        ("book folders", lambda: report.books_removed.extend(books.remove_orphan_books(
            sessions=ctx.sessions, artifacts=ctx.artifacts, grace_s=grace))),
        ("books parsing", lambda: report.books_reparsed.extend(books.resume_parsing(ctx=ctx))),
    )
    for name, part in parts:
        try:
            part()
        except Exception as exc:  # one failing part must not stop the others
            log.exception("maintenance: %s failed", name)
            report.errors.append(f"{name}: {type(exc).__name__}: {exc}")
    log.info("maintenance: %d orphan files removed, %d jobs rung off gone workers' queues, %d jobs whose "
             "lease passed queued again, %d jobs rung again, %d voices reclaimed, %d chapters checked again, "
             "%d book folders removed, %d books read again, %d errors",
             len(report.orphans_removed), len(report.jobs_rerouted), len(report.jobs_resumed),
             len(report.jobs_requeued), len(report.voices_reclaimed),
             len(report.chapters_resumed), len(report.books_removed), len(report.books_reparsed),
             len(report.errors))
    count_findings(ctx.store, report)
    return report


def _in_session(sessions: sessionmaker[Session], work: Any) -> None:
    with session_scope(sessions) as session:
        work(session)


def run_sweep(settings: Settings, sender: TaskSender | None = None,
              grace_s: float | None = None) -> SweepReport:
    """Build the clients from `settings` (a producer Celery app unless `sender` is given), sweep once,
    close them."""
    ctx = Context.build(settings, sender)
    try:
        return sweep(ctx=ctx, grace_s=grace_s)
    finally:
        ctx.close()
