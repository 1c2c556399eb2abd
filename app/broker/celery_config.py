"""Celery configuration shared by every process: queues, serialisation and delivery guarantees.

`tasks.celery_app` (the CPU workers), `gpu_worker.worker.process` (the GPU worker) and the producers (API,
CLI, demo) all build their Celery app here, so the wire contract is written once and neither worker
package imports the other; the task names and priorities are `app.broker.wire`'s. JSON only; a task is
acknowledged after it finishes and redelivered if its worker dies.

Two brokers: kombu's Redis transport (`redis://`, the embedded default) and RabbitMQ (`amqp://`).
On Redis, a dead worker's messages come back after the visibility timeout, as duplicates: what brings
its jobs back is their lease (`app.lifecycle`); priorities are kombu's lists (0 first). On RabbitMQ,
queues are durable with `x-max-priority`, publishes are confirmed by the broker, a dead consumer's
messages are requeued as soon as its connection closes, and the broker priorities are turned into
RabbitMQ's order as they are published (`app.broker.wire`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, bootsteps, signals
from celery.app.amqp import AMQP
from kombu import Queue
from kombu.utils.objects import cached_property

from app.broker.queues import is_amqp
from app.broker.wire import MAX_PRIORITY, PREPARE_TASK, PRIORITY_STEPS, SYNTH_TASK, amqp_priority
from app.settings import Settings

log = logging.getLogger(__name__)


class RabbitPriorities(AMQP):
    """Celery's publishing, with each task's broker priority (0 first) turned into RabbitMQ's (9 first)."""

    @cached_property
    def send_task_message(self) -> Callable[..., Any]:
        send = self._create_task_sender()

        def publish(producer: Any, name: str, message: Any, *args: Any, **options: Any) -> Any:
            headers = message[0]
            # A retry copies the priority RabbitMQ delivered its message with: already in RabbitMQ's order.
            if not headers.get("retries"):
                options["priority"] = amqp_priority(options.get("priority"))
            return send(producer, name, message, *args, **options)

        return publish


class PromptShutdown(bootsteps.StartStopStep):
    """A timer that fires every second, so a warm shutdown starts within a second on RabbitMQ.

    An idle worker's event loop sleeps in poll() until its next timer (up to 10 s); a SIGTERM only sets a
    flag the loop reads when it wakes. kombu's Redis transport keeps short timers of its own; on RabbitMQ
    every stop took 10.9 s."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        self.tref = worker.timer.call_repeatedly(1.0, _wake)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


def _wake() -> None:
    pass


def make_celery(settings: Settings, include: Sequence[str] = (), name: str = "wavefarm") -> Celery:
    """A Celery app speaking wavefarm's wire contract; `include` names the task modules it runs."""
    amqp = is_amqp(settings.broker_url)
    app = Celery(name, broker=settings.broker_url, backend=settings.result_backend, include=list(include),
                 amqp=RabbitPriorities if amqp else None)
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
        broker_transport_options=amqp_options() if amqp else redis_options(settings),
        broker_connection_retry_on_startup=True,
        task_queues=(Queue(settings.queue_cpu), Queue(settings.queue_gpu)),
        task_default_queue=settings.queue_cpu,
        task_routes={PREPARE_TASK: {"queue": settings.queue_cpu}, SYNTH_TASK: {"queue": settings.queue_gpu}},
        result_expires=7 * 24 * 3600,
    )
    if amqp:  # every queue Celery declares (both task queues) gets RabbitMQ's priority levels 0..9
        app.conf.task_queue_max_priority = MAX_PRIORITY
        app.steps["worker"].add(PromptShutdown)
    return app


def redis_options(settings: Settings) -> dict[str, Any]:
    """kombu's Redis transport: redelivery after the visibility timeout, priority lists."""
    return {
        # Longer than the longest job, or a running job is handed to a second worker.
        "visibility_timeout": settings.visibility_timeout_s,
        # kombu's own options (wavefarm reads none of its keys): a dead worker's unacknowledged messages,
        # duplicates by then (the lease brought their jobs back), are restored by the scan of a live one
        # every few seconds (kombu: about every 100 s) under a lock that expires soon (kombu: 300 s).
        "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 2)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 30,
        # Job priority: the Redis transport serves priority 0 first (app.broker.wire.broker_priority).
        "queue_order_strategy": "priority",
        "priority_steps": list(PRIORITY_STEPS),
    }


def amqp_options() -> dict[str, Any]:
    """RabbitMQ: a publish returns once the broker has the message (a sent job is never only in flight)."""
    return {"confirm_publish": True}


def where_line(settings: Settings, hostname: str, queues: Sequence[str]) -> str:
    """What a worker serves, passwords hidden: two stacks on one Redis show up in their logs at once."""
    from kombu.utils.url import maybe_sanitize_url
    from sqlalchemy import make_url

    database = make_url(settings.database_url).render_as_string(hide_password=True)
    return (f"worker {hostname}: broker {maybe_sanitize_url(settings.broker_url)}, database {database}, "
            f"feature store {maybe_sanitize_url(settings.feature_store_url)}, results "
            f"{maybe_sanitize_url(settings.result_backend)}, queues {', '.join(sorted(queues))}")


@signals.worker_ready.connect
def _say_where(sender: Any = None, **_: Any) -> None:
    """Each worker (CPU or GPU) logs its broker, database and queues once it consumes."""
    from app.settings import get_settings

    app = getattr(sender, "app", None)
    if app is None:
        return
    queues = list(app.amqp.queues.consume_from or app.amqp.queues)
    log.info("%s", where_line(get_settings(), getattr(sender, "hostname", "?"), queues))
