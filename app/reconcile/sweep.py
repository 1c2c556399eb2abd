"""The reconciler: one pass over SQL state that puts back what crashes, kills and lost messages leave.

The database is the truth and a message is only a doorbell (`app.lifecycle`), so every rule below is a
query over rows, each followed by an idempotent action; the pass is safe to run at any time, from
anywhere, by several processes at once (the `maintenance.sweep` task on a CPU worker every
`maintenance_interval_s`, `wavefarm maintenance`, a cron; the job rules also run in every GPU worker
each heartbeat, `gpu_worker.worker.process.PeerWatch`, so a killed worker's jobs run again within a lease):
1. orphan files: files under the artifact root that no database row refers to (partial outputs of a
   killed worker, temp files, references whose rows never committed), older than `orphan_grace_s`, are
   removed (the age guard keeps a file whose row is still being committed, or one being written); the
   partial outputs of jobs that ended more than `job_lease_s` ago go at once (nobody writes them);
2. leases that passed: a claimed job whose lease (`job_lease_s`, renewed by each progress report) has
   passed was held by a worker that died, hung or lost the database: it goes back to `queued` and its
   bell is rung (`lifecycle.ring`). A GPU worker that starts again under a name releases at once the
   claims its previous process made (`release_previous`). The dead worker's own message, if the broker
   still has one (RabbitMQ requeues it at once, Redis after its visibility timeout), is a duplicate: its
   delivery finds the job claimed or ended and is acknowledged without work;
3. bells to gone workers: a queued job whose latest doorbell went to the own queue of a GPU worker that
   is gone (stopped, or no heartbeat for `WORKER_GONE_S`) is rung again, where `app.submission.routing` says
   now (a live holder of its voice, or the shared queue);
4. bells due: a queued job not claimed within `stuck_job_after_s` of its last ring (then twice as long,
   and so on) is rung again: its message may have been lost (a broker that lost its data, a kill between
   the commit and the send, a consumer killed before its claim); a text job without tokens gets its
   `job.tokenize`;
5. abandoned voices: features still stored for a voice whose every job was cancelled are reclaimed;
6. ready chapters: the transaction that settles a chapter's last segment records it ready
   (`app.lifecycle.books`, an outbox) and the settling code sends its `book.chapter` after the
   commit; a ready chapter of a rendering book that `book.chapter` has not checked
   `UNCHECKED_CHAPTER_AFTER_S` after it was recorded (or last sent again) gets it sent again: the send
   was lost (a broker away, a process killed between commit and send, a job settled by a path that does
   not send: a cancel through the API, a job out of attempts). `book.chapter` is idempotent, so
   sending it again is always safe; a chapter whose file is being rendered holds a render lease
   (`app.lifecycle.chapters`, renewed while it renders) and is not sent again while the lease lasts,
   so no chapter renders twice at once; a lease that passed (its renderer died) is cleared and the
   chapter's `book.chapter` sent again at once. A scheduled chapter with a segment that has no job (and
   no error) for `stuck_job_after_s` was being sent when its CPU worker died: no SQL row would ever make that
   segment render (a text segment has no job until `book.tokenize` made one), so its book gets its
   `book.plan` again, which sends every scheduled, unassembled chapter's segments that are neither done
   nor rendering (idempotent too: a text segment's tokenize finds a job made meanwhile);
7. books: a book folder without a row (the API died before committing it) is removed once older than
   `orphan_grace_s`, and a book left `parsing` by a reader that died gets `book.parse` again
   (`app.books.upkeep`).
It never reads the broker: it does not need to know where a message is. It does not touch the GPU
workers' installs (theirs to reclaim) and does not retry failed jobs.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from sqlalchemy.orm import Session, sessionmaker

from app import lifecycle
from app.books import upkeep
from app.broker.wire import BOOK_PLAN_TASK, TaskSender, send_chapter
from app.context import Context
from app.db import queries
from app.db.models import utcnow
from app.db.session import session_scope
from app.settings import Settings
from app.storage import keys
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.voices.service import reclaim_abandoned_voice

log = logging.getLogger(__name__)

# A ready chapter's book.chapter is sent as its last segment's job commits and runs within seconds (it
# goes ahead of every job's work on the cpu queue); unchecked after this, it is sent again.
UNCHECKED_CHAPTER_AFTER_S = 60.0
# What a sweep found, counted in the feature store (`keys.COUNTER_SWEEP`) and exported by the API as
# wavefarm_sweep_found_total{kind}: the SweepReport fields, errors aside. Work that was stuck: all but the
# files and voices, which are leftovers, not waiting work.
SWEEP_FINDINGS = ("orphans_removed", "jobs_resumed", "jobs_requeued", "jobs_rerouted", "voices_reclaimed",
                  "chapters_resumed", "books_removed", "books_reparsed")
WORKER_GONE_S = 60.0  # a GPU worker beats every gpu_worker.worker.runtime.HEARTBEAT_S (10 s): six missed
# beats


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


def reconcile_jobs(*, ctx: Context, report: SweepReport) -> None:
    """Rules 2 and 3 (module docstring): the jobs of dead and gone workers, queued and rung again; and
    the partial outputs the dead ones left of jobs that ended."""
    expire_leases(ctx=ctx, report=report)
    reroute_gone(ctx=ctx, report=report)
    drop_settled_partials(ctx=ctx, report=report)


def expire_leases(*, ctx: Context, report: SweepReport) -> None:
    """Rule 2 (module docstring): claimed jobs whose lease passed go back to the queue, rung."""
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


def release_previous(*, ctx: Context, worker: str, started_at: datetime) -> list[str]:
    """Rule 2 for a GPU worker starting under `worker`: the claims its previous process made (before
    `started_at`) are released and rung now, without waiting for their leases. -> their ids."""
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


def reroute_gone(*, ctx: Context, report: SweepReport) -> None:
    """Rule 3 (module docstring): queued jobs whose bell rang on a gone worker's own queue, rung again."""
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
    """Rule 1's quick half (module docstring): the partial outputs of jobs that ended more than a lease
    ago. A live attempt removes its own at its next report; one left by a killed worker of a job that was
    cancelled meanwhile would otherwise wait for `orphan_grace_s` (nothing claims that job again)."""
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


def remove_orphans(*, session: Session, artifacts: ArtifactStore, grace_s: float,
                   report: SweepReport) -> None:
    referenced = queries.referenced_paths(session=session)
    for path in artifacts.list_orphans(referenced=referenced, older_than_s=grace_s):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.errors.append(f"could not remove {path.name}: {exc}")
            continue
        report.orphans_removed.append(str(path.relative_to(artifacts.root)))


def ring_due(*, ctx: Context, report: SweepReport) -> None:
    """Rule 4 (module docstring): queued jobs not claimed within their ring's wait, rung again."""
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        due = [job.id for job in queries.list_due_rings(
            session=session, now=now, quiet_before=now - timedelta(seconds=ctx.settings.stuck_job_after_s))]
    for job_id in due:
        with session_scope(ctx.sessions) as session:
            sent = lifecycle.ring(session=session, sender=ctx.sender, settings=ctx.settings, job_id=job_id)
        if sent is not None:
            log.warning("maintenance: job %s was not claimed in time; its %s sent again", job_id, sent)
            report.jobs_requeued.append(job_id)


def reclaim_voices(*, ctx: Context, report: SweepReport) -> None:
    with session_scope(ctx.sessions) as session:
        for voice_id in queries.list_abandoned_ready_voices(session=session):
            if reclaim_abandoned_voice(session=session, store=ctx.store, voice_id=voice_id):
                report.voices_reclaimed.append(voice_id)


def resume_chapters(*, ctx: Context, report: SweepReport) -> None:
    """Part 6 (module docstring): ready chapters' lost doorbells, and chapters whose sending died."""
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        lapsed = lifecycle.expire_renders(session=session, now=now)  # their renderer died or hung
        unchecked = queries.list_unchecked_chapters(
            session=session, rung_before=now - timedelta(seconds=UNCHECKED_CHAPTER_AFTER_S), now=now)
        unchecked = sorted({*unchecked, *lapsed})
        for book_id, index in unchecked:  # stamped before sending: a send that fails waits a period
            lifecycle.mark_chapter_rung(session=session, book_id=book_id, index=index)
        unsent = queries.list_unsent_chapters(
            session=session, scheduled_before=now - timedelta(seconds=ctx.settings.stuck_job_after_s))
        for book_id, index in unsent:
            lifecycle.touch_chapter(session=session, book_id=book_id, index=index)
    for book_id, index in unchecked:
        send_chapter(ctx.sender, ctx.settings, book_id, index)
        why = "its render lease passed" if (book_id, index) in lapsed else "it was ready and not checked"
        log.warning("maintenance: book %s chapter %d: %s; book.chapter sent again", book_id, index, why)
        report.chapters_resumed.append(f"{book_id}/{index}")
    for book_id in dict.fromkeys(book for book, _ in unsent):
        ctx.sender.send_task(BOOK_PLAN_TASK, args=[book_id], queue=ctx.settings.queue_cpu)
        chapters = [index for book, index in unsent if book == book_id]
        log.warning("maintenance: book %s chapters %s were scheduled but some segments never sent; "
                    "book.plan sent again", book_id, [i + 1 for i in chapters])
        report.chapters_resumed += [f"{book_id}/{i}" for i in chapters]


def sweep(*, ctx: Context, grace_s: float | None = None) -> SweepReport:
    """One maintenance pass (see the module docstring); each part runs even if another failed."""
    report = SweepReport()
    grace = ctx.settings.orphan_grace_s if grace_s is None else grace_s
    parts = (
        ("orphans", lambda: _in_session(ctx.sessions, lambda s: remove_orphans(
            session=s, artifacts=ctx.artifacts, grace_s=grace, report=report))),
        ("partials", lambda: drop_settled_partials(ctx=ctx, report=report)),
        ("leases", lambda: expire_leases(ctx=ctx, report=report)),
        ("gone workers", lambda: reroute_gone(ctx=ctx, report=report)),
        ("bells due", lambda: ring_due(ctx=ctx, report=report)),
        ("abandoned voices", lambda: reclaim_voices(ctx=ctx, report=report)),
        ("ready chapters", lambda: resume_chapters(ctx=ctx, report=report)),
        ("book folders", lambda: report.books_removed.extend(upkeep.remove_orphan_books(
            sessions=ctx.sessions, artifacts=ctx.artifacts, grace_s=grace))),
        ("books parsing", lambda: report.books_reparsed.extend(upkeep.resume_parsing(ctx=ctx))),
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


def count_findings(store: FeatureStore, report: SweepReport) -> None:
    """Adds what the pass found to the sweep counters (an unreachable store costs only the count)."""
    found = {kind: len(getattr(report, kind)) for kind in SWEEP_FINDINGS}
    try:
        for kind, n in found.items():
            if n:
                store.incr(keys.COUNTER_SWEEP, kind, n)
    except redis.RedisError:
        log.warning("maintenance: the sweep's findings could not be counted", exc_info=True)


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
