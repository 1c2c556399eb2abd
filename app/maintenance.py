"""Maintenance: put back what crashes and cancellations can leave behind, and report it.

One pass, safe to run at any time and from anywhere (the `maintenance.sweep` task on a CPU worker,
`wavefarm maintenance`, a cron):
1. orphan files: files under the artifact root that no database row refers to (partial outputs of a
   killed worker, temp files, references whose rows never committed), older than `orphan_grace_s`, are
   removed (the age guard keeps a file whose row is still being committed, or one being written);
2. stranded messages: the messages waiting in the own queue of a GPU worker that is gone (stopped, or
   no heartbeat for `WORKER_GONE_S`: `app.routing` sent them there) are moved to the shared gpu queue,
   where any worker takes them (`Broker.move_queue`), and their jobs are recorded as routed there;
3. orphaned jobs: a job claimed by a GPU worker that is gone (stopped, no heartbeat for `WORKER_GONE_S`,
   or started again since the claim: `queries.list_orphaned_jobs`) goes back to `queued` and gets its
   message back (`resume_orphans`). On Redis the killed worker's message sits in kombu's `unacked` hash
   until the visibility timeout (6 h by default): it is put back in the queue now, or sent again when
   the kill lost it. RabbitMQ requeues a dead consumer's messages by itself, so there a job is sent
   again only when it also stayed quiet for `stuck_job_after_s` (the broker lost it). A restarted GPU
   worker runs the same part for the jobs its previous process held, as it starts (`gpu_worker.worker`).
   The same pass looks at the jobs such a worker held that ended while it was gone (cancelled, mostly):
   on Redis their messages wait in `unacked` for the visibility timeout, each beside the partial output
   the killed worker was writing; they are put back now (`return_settled`), so that a live worker takes
   each one, finds its job ended, removes the partial and acknowledges the message;
4. stuck jobs: a live job not updated for `stuck_job_after_s` whose `synth` message is nowhere in the
   broker (waiting, or delivered and unacknowledged) is sent again: the job would otherwise wait forever
   (a broker that lost its data, a message a killed worker had just popped). A job that is running
   updates its row every `progress_interval_s`, so it is never stale. Redis only: RabbitMQ cannot list a
   queue's messages, and it loses none of a dead consumer's (part 2 covers the jobs of gone workers).
   A text job not tokenized yet has no `synth`: its `job.tokenize` (cpu queue) is looked for instead,
   and sent again when it is missing. "The broker" is the shared gpu queue and every GPU worker's own.
   A job still `queued` (never claimed, or released) whose only message is delivered and
   unacknowledged is not held by any live worker either: a GPU worker takes one message per free slot
   (prefetch multiplier 1) and claims it at once, so such a message belonged to a worker killed before
   its claim (no claim, so part 3 cannot see it). Its message is put back at the head of its queue (on
   Redis it would wait for the visibility timeout, 6 h by default);
5. abandoned voices: features still stored for a voice whose every job was cancelled are reclaimed;
6. ready chapters: the transaction that settles a chapter's last segment records it ready
   (`app.db.queries.chapters`, an outbox) and the settling code sends its `book.chapter` after the
   commit; a ready chapter of a rendering book that `book.chapter` has not checked
   `UNCHECKED_CHAPTER_AFTER_S` after it was recorded (or last sent again) gets it sent again: the send
   was lost (a broker away, a process killed between commit and send, a job settled by a path that does
   not send: a cancel through the API, a job out of attempts). `book.chapter` is idempotent, so
   sending it again is always safe. A scheduled chapter with a segment that has no job (and no error)
   for `stuck_job_after_s` was being sent when its CPU worker died: no SQL row would ever make that
   segment render (a text segment has no job until `book.tokenize` made one), so its book gets its
   `book.plan` again, which sends every scheduled, unassembled chapter's segments that are neither done
   nor rendering (idempotent too: a text segment's tokenize finds a job made meanwhile);
7. books: a book folder without a row (the API died before committing it) is removed once older than
   `orphan_grace_s`, and a book left `parsing` by a reader that died gets `book.parse` again
   (`app.books.upkeep`).
It does not touch the GPU workers' installs (theirs to reclaim) and does not retry failed jobs.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import redis
from sqlalchemy.orm import Session, sessionmaker

from app import keys
from app.artifacts import ArtifactStore
from app.books import upkeep
from app.broker import Broker, RedisBroker, as_broker, open_broker
from app.db import queries
from app.db.models import JobStatus, utcnow
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.routing import QUEUE_SEP, send_routed, worker_queue
from app.settings import Settings
from app.store import FeatureStore
from app.voices import reclaim_abandoned_voice
from app.wire import BOOK_PLAN_TASK, TaskSender, send_chapter, send_tokenize, tokenize_task_id

log = logging.getLogger(__name__)

# A ready chapter's book.chapter is sent as its last segment's job commits and runs within seconds (it
# goes ahead of every job's work on the cpu queue); unchecked after this, it is sent again.
UNCHECKED_CHAPTER_AFTER_S = 60.0
# What a sweep found, counted in the feature store (`keys.COUNTER_SWEEP`) and exported by the API as
# wavefarm_sweep_found_total{kind}: the SweepReport fields, errors aside. Work that was stuck: all but the
# files and voices, which are leftovers, not waiting work.
SWEEP_FINDINGS = ("orphans_removed", "jobs_resumed", "messages_returned", "jobs_requeued", "jobs_rerouted",
                  "voices_reclaimed", "chapters_resumed", "books_removed", "books_reparsed")
WORKER_GONE_S = 60.0  # a GPU worker beats every gpu_worker.runtime.HEARTBEAT_S (10 s): six missed beats


@dataclass
class SweepReport:
    orphans_removed: list[str] = field(default_factory=list)  # root-relative paths
    jobs_resumed: list[str] = field(default_factory=list)  # orphaned: their worker is gone
    messages_returned: list[str] = field(default_factory=list)  # of jobs that ended while it was gone
    jobs_requeued: list[str] = field(default_factory=list)  # stuck: no message anywhere
    jobs_rerouted: list[str] = field(default_factory=list)  # moved from a gone worker's own queue
    voices_reclaimed: list[str] = field(default_factory=list)
    chapters_resumed: list[str] = field(default_factory=list)  # "<book id>/<chapter index>"
    books_removed: list[str] = field(default_factory=list)  # folders without a row
    books_reparsed: list[str] = field(default_factory=list)  # book.parse sent again
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def broker_task_ids(broker: Broker | redis.Redis, queue: str) -> set[str]:
    """Task ids with a message for `queue` in a Redis broker: waiting (every priority) or unacked."""
    return as_broker(broker).task_ids(queue) or set()


def gpu_queues(settings: Settings, sessions: sessionmaker[Session]) -> list[str]:
    """The shared gpu queue and the own queue of every GPU worker the database knows."""
    with session_scope(sessions) as session:
        names = queries.list_worker_names(session=session)
    return [settings.queue_gpu, *(worker_queue(settings, name) for name in names)]


def move_stranded(*, settings: Settings, sessions: sessionmaker[Session], broker: Broker | redis.Redis,
                  report: SweepReport) -> None:
    """Part 2 (module docstring): a gone worker's own queue, emptied into the shared gpu queue."""
    broker = as_broker(broker)
    with session_scope(sessions) as session:
        silent_before = utcnow() - timedelta(seconds=WORKER_GONE_S)
        gone = queries.list_gone_workers(session=session, silent_before=silent_before)
    for name in gone:
        moved = broker.move_queue(worker_queue(settings, name), settings.queue_gpu)
        if not moved:
            continue
        with session_scope(sessions) as session:
            queries.set_job_route(session=session, job_ids=moved, routed_to=None, route="shared_worker_gone")
        log.warning("maintenance: %d jobs waiting on the queue of GPU worker %s, which is gone, moved to the "
                    "shared queue", len(moved), name)
        report.jobs_rerouted.extend(moved)


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


def resume_orphans(*, settings: Settings, sessions: sessionmaker[Session], broker: Broker | redis.Redis,
                   sender: TaskSender, report: SweepReport, worker: str | None = None) -> None:
    """Part 3 (module docstring): the jobs of gone workers (only `worker`'s, when given) are queued again,
    and the messages of those that ended meanwhile are put back to be cleared."""
    broker = as_broker(broker)
    return_settled(settings=settings, sessions=sessions, broker=broker, report=report, worker=worker)
    now = utcnow()
    quiet = now - timedelta(seconds=settings.stuck_job_after_s) if broker.redelivers_dead_consumers else None
    with session_scope(sessions) as session:
        orphans = [(job.id, job.priority, job.attempts) for job in queries.list_orphaned_jobs(
            session=session, silent_before=now - timedelta(seconds=WORKER_GONE_S), worker=worker,
            quiet_before=quiet)]
    if not orphans:
        return
    put_back = _PutBack(settings, sessions, broker, sender)
    for job_id, priority, attempts in orphans:
        if put_back.waiting(job_id):
            continue  # its message is in the queue: the next delivery claims it (its worker is gone)
        with session_scope(sessions) as session:
            if not queries.release_job(session=session, job_id=job_id, attempts=attempts):
                continue  # claimed again, finished or cancelled meanwhile
            put_back.message(session, job_id, priority)
        log.warning("maintenance: job %s was held by a worker that is gone; queued again", job_id)
        report.jobs_resumed.append(job_id)


def return_settled(*, settings: Settings, sessions: sessionmaker[Session], broker: Broker,
                   report: SweepReport, worker: str | None = None) -> None:
    """Part 3's other half (module docstring): Redis only, RabbitMQ redelivers a dead consumer's
    messages by itself."""
    if not isinstance(broker, RedisBroker):
        return
    shared = settings.queue_gpu
    unacked = broker.unacked(shared, prefix=shared + QUEUE_SEP)
    if not unacked:
        return
    with session_scope(sessions) as session:
        ended = queries.list_ended_on_gone_workers(
            session=session, job_ids=list(unacked), worker=worker,
            silent_before=utcnow() - timedelta(seconds=WORKER_GONE_S))
    for job_id in ended:
        if broker.restore(unacked[job_id], shared):
            log.warning("maintenance: job %s ended while the worker holding it was gone; its message is back "
                        "in %s, for a live worker to clear", job_id, shared)
            report.messages_returned.append(job_id)


class _PutBack:
    """An orphaned job's message, back in the shared gpu queue: the one a dead worker left in kombu's
    `unacked` hash (Redis; taken from the shared queue or the worker's own), or a new one, routed again,
    when there is none (a kill that lost it; RabbitMQ: a broker that lost it)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], broker: Broker,
                 sender: TaskSender) -> None:
        self.settings, self.sender = settings, sender
        self.redis = broker if isinstance(broker, RedisBroker) else None
        self.queued: set[str] = set()
        if self.redis is not None:
            for queue in gpu_queues(settings, sessions):
                self.queued |= self.redis.waiting_ids(queue)
        shared = settings.queue_gpu
        self.unacked = self.redis.unacked(shared, prefix=shared + QUEUE_SEP) if self.redis else {}

    def waiting(self, job_id: str) -> bool:
        return job_id in self.queued

    def message(self, session: Session, job_id: str, priority: int) -> None:
        tag = self.unacked.get(job_id)
        if self.redis is not None and tag is not None and self.redis.restore(tag, self.settings.queue_gpu):
            queries.set_job_route(session=session, job_ids=[job_id], routed_to=None,
                                  route="shared_worker_gone")
            return
        job = queries.require_job(session=session, job_id=job_id)
        send_routed(session=session, sender=self.sender, settings=self.settings, job_id=job_id,
                    voice_id=job.voice_id, priority=priority)


def requeue_stuck(*, settings: Settings, sessions: sessionmaker[Session], broker: Broker | redis.Redis,
                  sender: TaskSender, report: SweepReport) -> None:
    """Part 4 (module docstring): quiet live jobs without any message are sent again (Redis only)."""
    present: set[str] | None = set()
    queues = gpu_queues(settings, sessions)
    for queue in queues:
        found = as_broker(broker).task_ids(queue)
        present = None if found is None or present is None else present | found
    if present is None:
        return  # RabbitMQ: cannot tell; it keeps every message it confirmed (part 3 covers gone workers)
    redis_broker = as_broker(broker)
    assert isinstance(redis_broker, RedisBroker)  # only kombu's Redis transport lists its messages
    waiting = set().union(*(redis_broker.waiting_ids(q) for q in queues)) if queues else set()
    held = {task: (tag, q) for q in queues for task, tag in redis_broker.unacked(q).items()}
    cutoff = utcnow() - timedelta(seconds=settings.stuck_job_after_s)
    with session_scope(sessions) as session:
        jobs = queries.list_stale_live_jobs(session=session, updated_before=cutoff)
        stale = [(job.id, job.priority, job.attempts, job.status, queries.is_tokenized(job)) for job in jobs]
    tokenizing: set[str] | None = None
    for job_id, priority, attempts, status, tokenized in stale:
        if not tokenized:  # a text job: its message is job.tokenize on the cpu queue, which sends synth
            tokenizing = as_broker(broker).task_ids(settings.queue_cpu) if tokenizing is None else tokenizing
            if tokenize_task_id(job_id) not in (tokenizing or set()):
                with session_scope(sessions) as session:
                    queries.touch_job(session=session, job_id=job_id)
                send_tokenize(sender, settings, job_id, priority)
                log.warning("maintenance: text job %s had no job.tokenize message; sent again", job_id)
                report.jobs_requeued.append(job_id)
            continue
        if job_id in held and job_id not in waiting and status == JobStatus.QUEUED:
            tag, queue = held[job_id]  # unclaimed, quiet, delivered: its consumer died before claiming it
            with session_scope(sessions) as session:
                queries.touch_job(session=session, job_id=job_id)
            if redis_broker.restore(tag, queue):
                log.warning("maintenance: job %s was delivered to a worker that never claimed it; its "
                            "message is back in %s", job_id, queue)
                report.jobs_requeued.append(job_id)
            continue
        if job_id in present:
            continue  # waiting its turn, or held by a worker that claimed it (part 3 covers gone ones)
        with session_scope(sessions) as session:
            if status == JobStatus.QUEUED:
                queries.touch_job(session=session, job_id=job_id)
            elif not queries.release_job(session=session, job_id=job_id, attempts=attempts):
                continue  # claimed again meanwhile
            job = queries.require_job(session=session, job_id=job_id)
            send_routed(session=session, sender=sender, settings=settings, job_id=job_id,
                        voice_id=job.voice_id, priority=priority)
        log.warning("maintenance: job %s had no broker message; sent again", job_id)
        report.jobs_requeued.append(job_id)


def reclaim_voices(*, sessions: sessionmaker[Session], store: FeatureStore, report: SweepReport) -> None:
    with session_scope(sessions) as session:
        for voice_id in queries.list_abandoned_ready_voices(session=session):
            if reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id):
                report.voices_reclaimed.append(voice_id)


def resume_chapters(*, settings: Settings, sessions: sessionmaker[Session], sender: TaskSender,
                    report: SweepReport) -> None:
    """Part 6 (module docstring): ready chapters' lost doorbells, and chapters whose sending died."""
    now = utcnow()
    with session_scope(sessions) as session:
        unchecked = queries.list_unchecked_chapters(
            session=session, rung_before=now - timedelta(seconds=UNCHECKED_CHAPTER_AFTER_S))
        for book_id, index in unchecked:  # stamped before sending: a send that fails waits a period
            queries.mark_chapter_rung(session=session, book_id=book_id, index=index)
        unsent = queries.list_unsent_chapters(
            session=session, scheduled_before=now - timedelta(seconds=settings.stuck_job_after_s))
        for book_id, index in unsent:
            queries.touch_chapter(session=session, book_id=book_id, index=index)
    for book_id, index in unchecked:
        send_chapter(sender, settings, book_id, index)
        log.warning("maintenance: book %s chapter %d was ready and not checked; book.chapter sent again",
                    book_id, index)
        report.chapters_resumed.append(f"{book_id}/{index}")
    for book_id in dict.fromkeys(book for book, _ in unsent):
        sender.send_task(BOOK_PLAN_TASK, args=[book_id], queue=settings.queue_cpu)
        chapters = [index for book, index in unsent if book == book_id]
        log.warning("maintenance: book %s chapters %s were scheduled but some segments never sent; "
                    "book.plan sent again", book_id, [i + 1 for i in chapters])
        report.chapters_resumed += [f"{book_id}/{i}" for i in chapters]


def sweep(*, settings: Settings, sessions: sessionmaker[Session], artifacts: ArtifactStore,
          store: FeatureStore, broker: Broker | redis.Redis, sender: TaskSender,
          grace_s: float | None = None) -> SweepReport:
    """One maintenance pass (see the module docstring); each part runs even if another failed."""
    report = SweepReport()
    grace = settings.orphan_grace_s if grace_s is None else grace_s
    parts = (
        ("orphans", lambda: _in_session(sessions, lambda s: remove_orphans(
            session=s, artifacts=artifacts, grace_s=grace, report=report))),
        ("stranded messages", lambda: move_stranded(settings=settings, sessions=sessions, broker=broker,
                                                    report=report)),
        ("orphaned jobs", lambda: resume_orphans(settings=settings, sessions=sessions, broker=broker,
                                                 sender=sender, report=report)),
        ("stuck jobs", lambda: requeue_stuck(settings=settings, sessions=sessions, broker=broker,
                                             sender=sender, report=report)),
        ("abandoned voices", lambda: reclaim_voices(sessions=sessions, store=store, report=report)),
        ("ready chapters", lambda: resume_chapters(settings=settings, sessions=sessions, sender=sender,
                                                     report=report)),
        ("book folders", lambda: report.books_removed.extend(upkeep.remove_orphan_books(
            sessions=sessions, artifacts=artifacts, grace_s=grace))),
        ("books parsing", lambda: report.books_reparsed.extend(upkeep.resume_parsing(
            settings=settings, sessions=sessions, sender=sender))),
    )
    for name, part in parts:
        try:
            part()
        except Exception as exc:  # one failing part must not stop the others
            log.exception("maintenance: %s failed", name)
            report.errors.append(f"{name}: {type(exc).__name__}: {exc}")
    log.info("maintenance: %d orphan files removed, %d jobs moved off gone workers' queues, %d jobs of gone "
             "workers queued again, %d messages of their ended jobs put back, %d jobs sent again, %d voices "
             "reclaimed, %d chapters checked again, %d book folders removed, %d books read again, %d errors",
             len(report.orphans_removed), len(report.jobs_rerouted), len(report.jobs_resumed),
             len(report.messages_returned), len(report.jobs_requeued), len(report.voices_reclaimed),
             len(report.chapters_resumed), len(report.books_removed), len(report.books_reparsed),
             len(report.errors))
    count_findings(store, report)
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


def run_sweep(settings: Settings, sender: TaskSender, grace_s: float | None = None) -> SweepReport:
    """Build the clients from `settings`, sweep once, close them."""
    engine = make_engine(settings.database_url)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    broker = open_broker(settings.broker_url, timeout_s=10)
    try:
        return sweep(settings=settings, sessions=make_sessionmaker(engine),
                     artifacts=ArtifactStore(settings.artifact_root), store=store, broker=broker,
                     sender=sender, grace_s=grace_s)
    finally:
        broker.close()
        store.close()
        engine.dispose()
