"""Celery configuration shared by every process: queues, serialisation and delivery guarantees.

`tasks.celery_app` (the CPU workers), `gpu_worker.worker` (the GPU worker) and the producers (API,
CLI, demo) all build their Celery app here, so the wire contract is written once and neither worker
package imports the other; the task names and priorities are `app.wire`'s. JSON only; a task is
acknowledged after it finishes and redelivered if its worker dies.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from kombu import Queue

from app.settings import Settings
from app.wire import PREPARE_TASK, PRIORITY_STEPS, SYNTH_TASK


def make_celery(settings: Settings, include: Sequence[str] = (), name: str = "wavefarm") -> Celery:
    """A Celery app speaking wavefarm's wire contract; `include` names the task modules it runs."""
    app = Celery(name, broker=settings.broker_url, backend=settings.result_backend, include=list(include))
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # At-least-once: ack after the task ran, requeue if the worker process dies.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Flower: every task (and so every job) visible from sent to done.
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        broker_transport_options={
            # Longer than the longest job, or a running job is handed to a second worker.
            "visibility_timeout": settings.visibility_timeout_s,
            # A dead worker's unacknowledged messages are restored by the scan of a live one: scan every
            # few seconds (kombu's default is about every 100 s), and let the scan's lock expire soon
            # (a worker SIGKILLed while holding it would block redelivery for kombu's 300 s).
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 2)),
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 30,
            # Job priority: the Redis transport serves priority 0 first (app.wire.broker_priority).
            "queue_order_strategy": "priority",
            "priority_steps": list(PRIORITY_STEPS),
        },
        broker_connection_retry_on_startup=True,
        task_queues=(Queue(settings.queue_cpu), Queue(settings.queue_gpu)),
        task_default_queue=settings.queue_cpu,
        task_routes={PREPARE_TASK: {"queue": settings.queue_cpu}, SYNTH_TASK: {"queue": settings.queue_gpu}},
        result_expires=7 * 24 * 3600,
    )
    return app

