"""Maintenance: put back what crashes and cancellations can leave behind, and report it.

One pass, safe to run at any time and from anywhere (the `maintenance.sweep` task on a CPU worker,
`wavefarm maintenance`, a cron):
1. orphan files: files under the artifact root that no database row refers to (partial outputs of a
   killed worker, temp files, references whose rows never committed), older than `orphan_grace_s`, are
   removed (the age guard keeps a file whose row is still being committed, or one being written);
2. stuck jobs: a live job (queued, preparing, running) not updated for `stuck_job_after_s` whose `synth`
   message is nowhere in the broker (waiting, or delivered and unacknowledged) is sent again: the job
   would otherwise wait forever (a broker that lost its data, a worker that died while the database was
   away). A job that is running updates its row every `progress_interval_s`, so it is never stale;
3. abandoned voices: features still stored for a voice whose every job was cancelled are reclaimed;
4. stalled chapters: a rendering book's scheduled chapter whose segments have all settled (finished,
   failed or cancelled) for `STALLED_CHAPTER_AFTER_S` without the chapter being assembled gets its
   `book.chapter` sent again. Its trigger, the chord over the chapter's segment jobs, never fires when
   one of them was sent again by part 2 (a re-sent message carries no chord), and `book.chapter` is
   idempotent, so sending it again is always safe.
It does not touch the GPU workers' installs (theirs to reclaim) and does not retry failed jobs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import redis
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.db import queries
from app.db.models import utcnow
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from app.store import FeatureStore
from app.voices import reclaim_abandoned_voice
from app.wire import BOOK_CHAPTER_TASK, UNACKED_KEY, TaskSender, priority_lists, send_synth

log = logging.getLogger(__name__)

STALLED_CHAPTER_AFTER_S = 60.0  # a chapter's chord fires within seconds of its last segment


@dataclass
class SweepReport:
    orphans_removed: list[str] = field(default_factory=list)  # root-relative paths
    jobs_requeued: list[str] = field(default_factory=list)
    voices_reclaimed: list[str] = field(default_factory=list)
    chapters_resumed: list[str] = field(default_factory=list)  # "<book id>/<chapter index>"
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def broker_task_ids(broker: redis.Redis, queue: str) -> set[str]:
    """Task ids with a message for `queue` in the broker: waiting (every priority) or unacked."""
    ids: set[str] = set()
    for key in priority_lists(queue):
        for raw in broker.lrange(key, 0, -1):
            ids.update(_task_id(raw))
    for raw in broker.hvals(UNACKED_KEY):
        ids.update(_task_id(raw, wrapped=True))
    return ids


def _task_id(raw: bytes | str, wrapped: bool = False) -> Iterator[str]:
    try:
        message = json.loads(raw)
        if wrapped:  # unacked entries are [message, exchange, routing_key]
            message = message[0]
        task_id = message["headers"]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return
    if isinstance(task_id, str):
        yield task_id


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


def requeue_stuck(*, settings: Settings, sessions: sessionmaker[Session], broker: redis.Redis,
                  sender: TaskSender, report: SweepReport) -> None:
    cutoff = utcnow() - timedelta(seconds=settings.stuck_job_after_s)
    with session_scope(sessions) as session:
        jobs = queries.list_stale_live_jobs(session=session, updated_before=cutoff)
        stale = [(job.id, job.priority) for job in jobs]
    if not stale:
        return
    present = broker_task_ids(broker, settings.queue_gpu)
    for job_id, priority in stale:
        if job_id in present:
            continue  # waiting its turn, or held by a worker (redelivered after the visibility timeout)
        with session_scope(sessions) as session:
            queries.touch_job(session=session, job_id=job_id)
        send_synth(sender, settings, job_id, priority)
        log.warning("maintenance: job %s had no broker message; sent again", job_id)
        report.jobs_requeued.append(job_id)


def reclaim_voices(*, sessions: sessionmaker[Session], store: FeatureStore, report: SweepReport) -> None:
    with session_scope(sessions) as session:
        for voice_id in queries.list_abandoned_ready_voices(session=session):
            if reclaim_abandoned_voice(session=session, store=store, voice_id=voice_id):
                report.voices_reclaimed.append(voice_id)


def resume_chapters(*, settings: Settings, sessions: sessionmaker[Session], sender: TaskSender,
                    report: SweepReport) -> None:
    cutoff = utcnow() - timedelta(seconds=STALLED_CHAPTER_AFTER_S)
    with session_scope(sessions) as session:
        stalled = queries.list_stalled_chapters(session=session, settled_before=cutoff)
    for book_id, index in stalled:
        with session_scope(sessions) as session:
            queries.touch_chapter(session=session, book_id=book_id, index=index)
        sender.send_task(BOOK_CHAPTER_TASK, args=[book_id, index], queue=settings.queue_cpu)
        log.warning("maintenance: book %s chapter %d had settled without being assembled; checked again",
                    book_id, index)
        report.chapters_resumed.append(f"{book_id}/{index}")


def sweep(*, settings: Settings, sessions: sessionmaker[Session], artifacts: ArtifactStore,
          store: FeatureStore, broker: redis.Redis, sender: TaskSender,
          grace_s: float | None = None) -> SweepReport:
    """One maintenance pass (see the module docstring); each part runs even if another failed."""
    report = SweepReport()
    grace = settings.orphan_grace_s if grace_s is None else grace_s
    parts = (
        ("orphans", lambda: _in_session(sessions, lambda s: remove_orphans(
            session=s, artifacts=artifacts, grace_s=grace, report=report))),
        ("stuck jobs", lambda: requeue_stuck(settings=settings, sessions=sessions, broker=broker,
                                             sender=sender, report=report)),
        ("abandoned voices", lambda: reclaim_voices(sessions=sessions, store=store, report=report)),
        ("stalled chapters", lambda: resume_chapters(settings=settings, sessions=sessions, sender=sender,
                                                     report=report)),
    )
    for name, part in parts:
        try:
            part()
        except Exception as exc:  # one failing part must not stop the others
            log.exception("maintenance: %s failed", name)
            report.errors.append(f"{name}: {type(exc).__name__}: {exc}")
    log.info("maintenance: %d orphan files removed, %d jobs sent again, %d voices reclaimed, %d chapters "
             "checked again, %d errors", len(report.orphans_removed), len(report.jobs_requeued),
             len(report.voices_reclaimed), len(report.chapters_resumed), len(report.errors))
    return report


def _in_session(sessions: sessionmaker[Session], work: Any) -> None:
    with session_scope(sessions) as session:
        work(session)


def run_sweep(settings: Settings, sender: TaskSender, grace_s: float | None = None) -> SweepReport:
    """Build the clients from `settings`, sweep once, close them."""
    engine = make_engine(settings.database_url)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    broker = redis.Redis.from_url(settings.broker_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        return sweep(settings=settings, sessions=make_sessionmaker(engine),
                     artifacts=ArtifactStore(settings.artifact_root), store=store, broker=broker,
                     sender=sender, grace_s=grace_s)
    finally:
        broker.close()
        store.close()
        engine.dispose()
