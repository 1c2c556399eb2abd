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
(`skipped`): if that holder dies, its lease passes and the reconciler rings the job again. Worker death,
this process's side of it (a job sent back with `Reject` released first; its previous self's jobs
resumed when it is ready; its peers' looked after every heartbeat), is `gpu_worker.worker.recovery`.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import Reject
from kombu import Queue

from app.broker.celery_config import make_celery
from app.broker.wire import SYNTH_TASK
from app.settings import Settings, get_settings
from app.submission.routing import worker_queue
from gpu_worker.worker.job import JobRun
from gpu_worker.worker.recovery import PeerWatch, release, resume_previous
from gpu_worker.worker.runtime import current_runtime, runtime
from gpu_worker.worker.watchdog import Watchdog


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
