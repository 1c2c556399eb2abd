"""The GPU worker process: a Celery worker on the `gpu` queue whose `synth` tasks feed one engine.

    celery -A gpu_worker.worker worker -Q gpu -P threads -c <slots> -E

Each `synth` task (JSON args `[job_id]`) is a thin adapter over `gpu_worker.job.JobRun`, which streams
the job through the process's runtime (`gpu_worker.runtime`): the N threads of the pool are the N slots
of continuous batching, and one engine thread owns the model and the device. The runtime is built when
the worker is ready; a watchdog exits the process when a step hangs, so its supervisor restarts it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task, signals
from kombu import Queue

from app.celery_config import make_celery
from app.settings import Settings, get_settings
from app.wire import SYNTH_TASK
from gpu_worker.job import JobRun
from gpu_worker.runtime import current_runtime, runtime
from gpu_worker.watchdog import Watchdog


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
    return JobRun(runtime(self.request.hostname or "gpu-worker"), self, job_id).run()


@signals.worker_ready.connect
def _build_on_start(sender: Any = None, **_: Any) -> None:
    rt = runtime(getattr(sender, "hostname", None) or "gpu-worker")
    Watchdog(rt.loop, rt.settings.step_deadline_s).start()


@signals.worker_shutdown.connect
def _close_on_shutdown(**_: Any) -> None:
    rt = current_runtime()
    if rt is not None:
        rt.close()
