"""The producers' sender: a Celery app's task messages, without what a producer that never reads results
pays for on every message.

`Celery.send_task` subscribes the result backend to each task's result channel (a Redis SUBSCRIBE per
task, when the backend is Redis), builds an `AsyncResult` whose finaliser unsubscribes it again, and, with
`task_send_sent_event` on, publishes a `task-sent` event beside the message. The API and the CLI never
read a task's result (the database is the record), so `Publisher` builds the very message Celery builds
(the same routing, headers and priorities: `app.broker.celery_config.RabbitPriorities` still applies) and
publishes it alone. The message still asks for its result to be stored (a worker stores it as before), and
the workers still send their task-received, task-started and task-succeeded events: Flower follows a job
from its arrival at a worker on; only the producer's `task-sent` is gone.
"""

from __future__ import annotations

import uuid
from typing import Any


class Publisher:
    """A `TaskSender` over a Celery app (`make_celery`), publishing messages only (module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def send_task(self, name: str, args: Any = None, *, task_id: str | None = None, producer: Any = None,
                  **options: Any) -> None:
        amqp = self.app.amqp
        task_id = task_id or str(uuid.uuid4())
        args = list(args or ())
        options = amqp.router.route(options, name, args, {}, None)  # `queue` -> its exchange and key
        message = amqp.create_task_message(task_id, name, args, {}, reply_to=self.app.thread_oid,
                                           create_sent_event=False, **options)
        with self.app.producer_or_acquire(producer) as pooled:
            with pooled.connection._reraise_as_library_errors():
                amqp.send_task_message(pooled, name, message, **options)

    def producer_or_acquire(self, producer: Any = None) -> Any:
        """One producer from the app's pool for a round of messages (`app.broker.wire.one_connection`)."""
        return self.app.producer_or_acquire(producer)

    def close(self) -> None:
        self.app.close()
