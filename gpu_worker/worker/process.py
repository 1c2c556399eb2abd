"""The GPU worker process: a Celery worker on the `gpu` queue whose `synth` tasks feed one engine.

    celery -A gpu_worker.worker.process worker -Q gpu -P threads -c <slots> -E

It consumes the shared gpu queue and a queue of its own, `gpu.<node name>`
(`app.submission.routing.worker_queue`), where the jobs of the voices it holds are sent (voice affinity:
`app.submission.routing`).

Each `synth` task (JSON args `[job_id]`) is a thin adapter over `gpu_worker.worker.job.JobRun`, which streams
the job through the process's runtime (`gpu_worker.worker.runtime`): the N threads of the pool are the N slots
of continuous batching, and one engine thread owns the model and the device. The runtime is built when
the worker is ready; a watchdog exits the process when a step hangs, so its supervisor restarts it.

Restarts and duplicates (docs/RELIABILITY.md, `app.lifecycle`): a message is a doorbell, the job's row
is the truth. A claim leases the job to this worker, renewed by its progress reports. A delivery of a job
that an attempt holds the lease of (here or elsewhere), or that ended, is acknowledged without work
(`skipped`): if that holder dies, its lease passes and the reconciler rings the job again. A job sent back
to the queue (`Reject`, the database or Redis away) is released first, so its next delivery claims it at
once. When the worker is ready it releases, and rings, the jobs its previous process under the same node
name claimed (`resume_previous`: killed, so they would wait for their leases).

Peers: every live GPU worker also runs the reconciler's job rules every heartbeat (`recover_peers`):
jobs whose lease passed (a SIGKILLed peer's) are queued and rung again, and jobs rung on a gone worker's
own queue are rung again where `app.submission.routing` says now, so with several GPU workers a killed one's
jobs run again about `job_lease_s` after it died, whatever the sweep's interval. Of two workers doing it at
once, each job is released by one (the releases are conditional UPDATEs).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import Reject
from kombu import Queue

from app import lifecycle
from app.broker.celery_config import make_celery
from app.broker.wire import SYNTH_TASK
from app.db.session import session_scope
from app.reconcile.sweep import SweepReport, reconcile_jobs, release_previous
from app.settings import Settings, get_settings
from app.submission.routing import worker_queue
from gpu_worker.worker.job import TRANSIENT, JobRun
from gpu_worker.worker.runtime import HEARTBEAT_S, Runtime, current_runtime, runtime
from gpu_worker.worker.watchdog import Watchdog

log = logging.getLogger(__name__)


def make_gpu_celery(settings: Settings) -> Celery:
    """The GPU worker's Celery app: the shared wire contract, its own queue and a thread pool of slots."""
    app = make_celery(settings, name="wavefarm-gpu")
    app.conf.update(task_queues=(Queue(settings.queue_gpu),), task_default_queue=settings.queue_gpu,
                    worker_concurrency=settings.worker_slots, worker_pool="threads",
                    worker_hijack_root_logger=False)
    return app


celery = make_gpu_celery(get_settings())


@celery.task(name=SYNTH_TASK, bind=True)
def synth(self: Task, job_id: str) -> dict[str, Any]:
    rt = runtime(self.request.hostname or "gpu-worker", celery)
    try:
        return JobRun(rt, self, job_id).run()
    except Reject:
        release(rt, job_id)
        raise


def release(rt: Runtime, job_id: str) -> None:
    """A job this worker sends back to the queue is no longer held by it: its next delivery claims it at
    once. Best effort: when the database is away the lease lapses by itself (`job_lease_s`)."""
    try:
        with session_scope(rt.sessions) as session:
            lifecycle.release(session=session, job_id=job_id, worker=rt.worker_id)
    except TRANSIENT as exc:
        log.warning("synth %s: claim not released: %s", job_id, exc)


def recover_peers(rt: Runtime) -> SweepReport:
    """The reconciler's job rules, once (module docstring): leases that passed, bells on gone workers."""
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


@signals.celeryd_after_setup.connect
def _consume_own_queue(sender: str, instance: Any, **_: Any) -> None:
    """Besides `-Q gpu`: this node's own queue, where `app.submission.routing` sends the jobs of its
    voices."""
    instance.app.amqp.queues.select_add(worker_queue(get_settings(), sender))


@signals.worker_ready.connect
def _build_on_start(sender: Any = None, **_: Any) -> None:
    rt = runtime(getattr(sender, "hostname", None) or "gpu-worker", celery)
    Watchdog(rt.loop, rt.settings.step_deadline_s).start()
    resume_previous(rt)
    PeerWatch(rt).start()


@signals.worker_shutdown.connect
def _close_on_shutdown(**_: Any) -> None:
    rt = current_runtime()
    if rt is not None:
        rt.close()
