"""The GPU worker process: a Celery worker on the `gpu` queue whose `synth` tasks feed one engine.

    celery -A gpu_worker.worker worker -Q gpu -P threads -c <slots> -E

It consumes the shared gpu queue and a queue of its own, `gpu.<node name>` (`app.routing.worker_queue`),
where the jobs of the voices it holds are sent (voice affinity: `app.routing`).

Each `synth` task (JSON args `[job_id]`) is a thin adapter over `gpu_worker.job.JobRun`, which streams
the job through the process's runtime (`gpu_worker.runtime`): the N threads of the pool are the N slots
of continuous batching, and one engine thread owns the model and the device. The runtime is built when
the worker is ready; a watchdog exits the process when a step hangs, so its supervisor restarts it.

Restarts and duplicates (docs/RELIABILITY.md): when the worker is ready it puts back the jobs its
previous process under the same node name held (`resume_previous`: on Redis their messages would sit in
kombu's `unacked` hash until the visibility timeout). A delivery of a job that a live worker is
streaming does not claim it (`queries.is_held`); it is not dropped either, but checked again a little
later (a Celery retry with a countdown), so that if that worker dies the job still has a message. A job
sent back to the queue (`Reject`, the database or Redis away) is released first, so its next delivery
claims it at once.

Peers: every live GPU worker also looks after the ones that died (`recover_peers`, every heartbeat):
the jobs waiting on a gone worker's own queue are moved to the shared queue and the jobs it held are put
back, as the maintenance sweep does (parts 2 and 3), so with several GPU workers a SIGKILLed one's jobs
run again about `WORKER_GONE_S` after it died, whatever the sweep's interval. Of two workers doing it at
once, each job is put back by one (the moves and releases are atomic).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import Reject
from kombu import Queue

from app.broker import open_broker
from app.celery_config import make_celery
from app.db import queries
from app.db.models import LIVE_JOB_STATUSES
from app.db.session import session_scope
from app.maintenance import SweepReport, move_stranded, resume_orphans
from app.routing import worker_queue
from app.settings import Settings, get_settings
from app.wire import SYNTH_TASK, TaskSender
from gpu_worker.job import TRANSIENT, JobRun
from gpu_worker.runtime import HEARTBEAT_S, Runtime, current_runtime, runtime
from gpu_worker.watchdog import Watchdog

log = logging.getLogger(__name__)

RECHECK_MAX_S = 30.0  # a duplicate of a job streaming elsewhere looks again after 1, 2, 4 .. 30 s


def make_gpu_celery(settings: Settings) -> Celery:
    """The GPU worker's Celery app: the shared wire contract, its own queue and a thread pool of slots."""
    app = make_celery(settings, name="wavefarm-gpu")
    app.conf.update(task_queues=(Queue(settings.queue_gpu),), task_default_queue=settings.queue_gpu,
                    worker_concurrency=settings.worker_slots, worker_pool="threads",
                    worker_hijack_root_logger=False)
    return app


celery = make_gpu_celery(get_settings())


@celery.task(name=SYNTH_TASK, bind=True, max_retries=None)
def synth(self: Task, job_id: str) -> dict[str, Any]:
    rt = runtime(self.request.hostname or "gpu-worker")
    try:
        result = JobRun(rt, self, job_id).run()
    except Reject:
        release(rt, job_id)
        raise
    if result.get("status") == "skipped" and still_live(rt, job_id):
        # Streamed by a live worker (here or elsewhere): look again later rather than drop the message.
        raise self.retry(countdown=recheck_s(rt.settings, self.request.retries))
    return result


def recheck_s(settings: Settings, retries: int) -> float:
    """Growing waits; on Redis well inside the visibility timeout, or kombu would hand the waiting
    message (held unacknowledged until its countdown ends) to another worker as well."""
    return min(2.0 ** min(retries, 8), RECHECK_MAX_S, settings.visibility_timeout_s / 3)


def still_live(rt: Runtime, job_id: str) -> bool:
    """The job has not ended (unknown if the database is away: then it is checked again too)."""
    try:
        with session_scope(rt.sessions) as session:
            job = queries.get_job(session=session, job_id=job_id)
            return job is not None and job.status in LIVE_JOB_STATUSES
    except TRANSIENT as exc:
        log.warning("synth %s: cannot tell whether the job ended: %s; checked again later", job_id, exc)
        return True


def release(rt: Runtime, job_id: str) -> None:
    """A job this worker sends back to the queue is no longer held by it: its next delivery claims it at
    once. Best effort: when the database is away the hold lapses by itself (`queries.CLAIM_HOLD_S`)."""
    try:
        with session_scope(rt.sessions) as session:
            queries.release_job(session=session, job_id=job_id, worker=rt.worker_id)
    except TRANSIENT as exc:
        log.warning("synth %s: claim not released: %s", job_id, exc)


def recover_peers(rt: Runtime, sender: TaskSender) -> SweepReport:
    """One look at the GPU workers that are gone (module docstring): their queues and their jobs."""
    report = SweepReport()
    broker = open_broker(rt.settings.broker_url)
    try:
        move_stranded(settings=rt.settings, sessions=rt.sessions, broker=broker, report=report)
        resume_orphans(settings=rt.settings, sessions=rt.sessions, broker=broker, sender=sender,
                       report=report)
    except TRANSIENT as exc:  # the next beat tries again
        log.warning("worker %s: gone peers not looked after: %s", rt.worker_id, exc)
    finally:
        broker.close()
    if report.jobs_rerouted or report.jobs_resumed:
        log.warning("worker %s: %d jobs moved off gone workers' queues, %d of their jobs queued again",
                    rt.worker_id, len(report.jobs_rerouted), len(report.jobs_resumed))
    return report


class PeerWatch(threading.Thread):
    """`recover_peers` every heartbeat, on its own thread, until the worker stops."""

    def __init__(self, rt: Runtime, sender: TaskSender, every_s: float = HEARTBEAT_S) -> None:
        super().__init__(name="wavefarm-peer-watch", daemon=True)
        self.rt, self.sender, self.every_s = rt, sender, every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                recover_peers(self.rt, self.sender)
            except Exception:  # never stop looking: the next beat may succeed
                log.exception("worker %s: looking after gone peers failed", self.rt.worker_id)


def resume_previous(rt: Runtime, sender: TaskSender) -> list[str]:
    """Put back the jobs this node name's previous process held when it died (its claims predate this
    process's registration); the maintenance sweep does the same for workers that never come back."""
    report = SweepReport()
    broker = open_broker(rt.settings.broker_url)
    try:
        resume_orphans(settings=rt.settings, sessions=rt.sessions, broker=broker, sender=sender,
                       report=report, worker=rt.worker_id)
    except TRANSIENT as exc:  # the sweep will find them once this worker's predecessor looks gone
        log.warning("worker %s: the jobs of its previous process not resumed: %s", rt.worker_id, exc)
    finally:
        broker.close()
    if report.jobs_resumed:
        log.warning("worker %s: resumed %d jobs its previous process held: %s", rt.worker_id,
                    len(report.jobs_resumed), report.jobs_resumed)
    return report.jobs_resumed


@signals.celeryd_after_setup.connect
def _consume_own_queue(sender: str, instance: Any, **_: Any) -> None:
    """Besides `-Q gpu`: this node's own queue, where `app.routing` sends the jobs of its voices."""
    instance.app.amqp.queues.select_add(worker_queue(get_settings(), sender))


@signals.worker_ready.connect
def _build_on_start(sender: Any = None, **_: Any) -> None:
    rt = runtime(getattr(sender, "hostname", None) or "gpu-worker")
    Watchdog(rt.loop, rt.settings.step_deadline_s).start()
    resume_previous(rt, celery)
    PeerWatch(rt, celery).start()


@signals.worker_shutdown.connect
def _close_on_shutdown(**_: Any) -> None:
    rt = current_runtime()
    if rt is not None:
        rt.close()
