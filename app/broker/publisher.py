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

`Publisher.round` sends many messages (a batch's) as one round: on Redis one pipeline, on RabbitMQ the
frames written a chunk at a time and the confirms awaited once. Not here: which tasks exist and how they
are named (`app.broker.wire`), the Celery app's configuration (`app.broker.celery_config`).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.app.routes import MapRoute
from kombu import Queue

CONFIRM_TIMEOUT_S = 30.0  # a round's confirms, all together
PLAIN_ID = re.compile(r"[A-Za-z0-9_.:-]*")  # an argument whose repr is Celery's saferepr (no escapes)
WRITE_CHUNK = 256 * 1024  # bytes of a RabbitMQ round written at once (`_Gathered`)
ROUND_PIPELINE_MAX = 5000  # Redis commands a round buffers before it sends them (a batch's 1,000 jobs: one)


class Publisher:
    """A `TaskSender` over a Celery app (`make_celery`), publishing messages only (module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.shapes: dict[tuple[Any, ...], _Shape] = {}  # messages built once, by task and options

    def send_task(self, name: str, args: Any = None, *, task_id: str | None = None, producer: Any = None,
                  declared: set[str] | None = None, **options: Any) -> None:
        """Celery's message for the task, published. `declared`: the queues a round declared already (its
        later messages to them skip kombu's declare check, which binds a copy of the queue each time)."""
        amqp = self.app.amqp
        task_id = task_id or str(uuid.uuid4())
        args = list(args or ())
        argsrepr = _args_repr(amqp, args)
        if argsrepr is not None and (shape := self._shape(name, options)) is not None:
            options = dict(shape.options)
            message = shape.message(task_id, args, argsrepr, reply_to=self.app.thread_oid)
        else:
            options = amqp.router.route(options, name, args, {}, None)  # `queue` -> its exchange and key
            ignore_result = options.pop("ignore_result", None)  # as `Celery.send_task` writes it
            message = amqp.create_task_message(task_id, name, args, {}, reply_to=self.app.thread_oid,
                                               create_sent_event=False, ignore_result=ignore_result,
                                               argsrepr=argsrepr, kwargsrepr="{}", **options)
        if declared is not None:
            queue = str(getattr(options.get("queue"), "name", options.get("queue")))
            if queue in declared:
                options["declare"] = []
            declared.add(queue)
        if producer is not None:  # a round's: used as it is (what `producer_or_acquire` does, for less)
            with producer.connection._reraise_as_library_errors():
                amqp.send_task_message(producer, name, message, **options)
            return
        with self.app.producer_or_acquire() as pooled:
            if _declared(pooled, options.get("queue")):
                options["declare"] = []
            with pooled.connection._reraise_as_library_errors():
                amqp.send_task_message(pooled, name, message, **options)

    def _shape(self, name: str, options: dict[str, Any]) -> _Shape | None:
        """The task's message as Celery builds it for these options (queue, priority), built once per
        process; None when the options are not plain values or the routes could depend on the arguments
        (only `task_routes` maps are known not to)."""
        if not all(type(v) in (str, int, type(None)) for v in options.values()):
            return None
        key = (name, os.getpid(), *sorted(options.items()))  # the message names its process (`origin`)
        shape = self.shapes.get(key)
        if shape is None:
            amqp = self.app.amqp
            if not all(isinstance(route, MapRoute) for route in amqp.router.routes):
                return None
            routed = amqp.router.route(dict(options), name, [], {}, None)
            ignore_result = routed.pop("ignore_result", None)
            template = amqp.create_task_message("", name, [], {}, reply_to="",
                                                create_sent_event=False, ignore_result=ignore_result,
                                                argsrepr="[]", kwargsrepr="{}", **routed)
            shape = self.shapes[key] = _Shape(routed, template)
        return shape

    def producer_or_acquire(self, producer: Any = None) -> Any:
        """One producer from the app's pool for a round of messages (`app.broker.wire.one_connection`)."""
        return self.app.producer_or_acquire(producer)

    def close(self) -> None:
        self.app.close()

    @contextmanager
    def round(self) -> Iterator[Any]:
        """A sender for many messages at once, over one pooled connection. On RabbitMQ (publisher confirms)
        they go out on a channel of their own, written a chunk at a time (`_Gathered`) and without waiting
        for each message's confirm, and the round
        waits for all the confirms once, as it ends: one round trip for the round instead of one a
        message. On Redis the messages (each the very LPUSH kombu's transport makes) are buffered in one
        pipeline (kombu's `Producer.batch`) and sent as the round ends: one round trip too. Raises, as it
        ends, if the broker refused a message, did not confirm them all in `CONFIRM_TIMEOUT_S`, or the
        pipeline failed; then no message of the round may be counted as sent (some may be delivered: their
        jobs, taken back out, are not found by the workers)."""
        with self.app.producer_or_acquire() as producer:
            if not getattr(producer.channel.connection, "confirm_publish", False):  # Redis: no confirms
                # kombu's publish batch: the round's LPUSHes buffered in one pipeline, sent as it ends
                with producer.batch(max_size=ROUND_PIPELINE_MAX):
                    yield _Through(self, producer, deferred=True)
                return
            channel = producer.connection.channel()
            try:
                confirms = _Confirms(channel)
                writes = _Gathered(channel.connection.transport)
                try:
                    yield _Through(self, type(producer)(channel, auto_declare=False), deferred=True)
                    writes.flush()
                finally:
                    writes.close()
                confirms.wait(CONFIRM_TIMEOUT_S)
            finally:
                channel.close()


def _declared(producer: Any, queue: Any) -> bool:
    """Whether kombu declared `queue` on the producer's connection already, by kombu's own record of it
    (`Connection.declared_entities`, emptied when the connection is): what kombu's `maybe_declare` finds
    out on every publish only after binding copies of the queue and its exchange (a quarter of a
    message's CPU on Redis)."""
    return (isinstance(queue, Queue) and queue.can_cache_declaration
            and hash(queue) in producer.connection.declared_entities)


def _args_repr(amqp: Any, args: list[Any]) -> str | None:
    """The message's `argsrepr` header as Celery writes it (`saferepr`, which is `repr` for a short list of
    plain ids and numbers) at a fraction of its cost; None (Celery's own) for anything else."""
    if all(type(a) is int or (type(a) is str and PLAIN_ID.fullmatch(a)) for a in args):
        text = repr(args)
        if len(text) <= amqp.argsrepr_maxsize:
            return text
    return None


class _Shape:
    """One task's message for one set of options, built by Celery once: each job's copy differs in its id
    (headers `id` and `root_id`, the `correlation_id` property), its arguments (the body) and `argsrepr`,
    which are all that Celery's `create_task_message` writes from them, and in `reply_to`, the sending
    thread's id in the app (`Celery.thread_oid`). Every part a message is sent with is copied, since
    Celery's `send_task_message` updates its headers and properties in place."""

    def __init__(self, options: dict[str, Any], template: Any) -> None:
        self.options, self.template = options, template

    def message(self, task_id: str, args: list[Any], argsrepr: str, reply_to: str) -> Any:
        headers, properties, (_, kwargs, embed), sent_event = self.template
        headers = {**headers, "id": task_id, "root_id": task_id, "argsrepr": argsrepr}
        properties = {**properties, "correlation_id": task_id, "reply_to": reply_to}
        return type(self.template)(headers, properties, (args, dict(kwargs), dict(embed)), sent_event)


class _Through:
    """A sender whose every message goes through one producer; `deferred`: none of them counts as sent
    before the round's confirms are in."""

    def __init__(self, publisher: Publisher, producer: Any, deferred: bool = False) -> None:
        self.publisher, self.producer, self.deferred = publisher, producer, deferred
        self.declared: set[str] = set()

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        self.publisher.send_task(name, args, producer=self.producer, declared=self.declared, **options)


class _Gathered:
    """A py-amqp connection's writes, gathered: py-amqp writes each message's frames with a system call of
    their own (a sixth of a RabbitMQ batch's CPU, and a wake-up of the broker each); a round's go out
    `WRITE_CHUNK` bytes at a time instead, the rest at `flush`, or before the connection waits to read (a
    queue's declaration waits for its answer). Each write is whole frames, so what `close` drops unflushed
    (a round that raised) leaves the stream intact. Only for a connection nothing else writes to
    meanwhile (a round's, taken from the pool)."""

    def __init__(self, transport: Any) -> None:
        self.transport, self.own = transport, "_write" in vars(transport)
        self.write, self.read_frame = transport._write, transport.read_frame
        self.chunks: list[bytes] = []
        self.size = 0
        transport._write, transport.read_frame = self._add, self._read_frame

    def _read_frame(self, *args: Any, **kwargs: Any) -> Any:
        if self.transport.sock.gettimeout() != 0:  # not py-amqp's poll before each publish: may wait
            self.flush()
        return self.read_frame(*args, **kwargs)

    def _add(self, data: Any) -> None:
        self.chunks.append(bytes(data))  # py-amqp hands a view of a buffer it reuses
        self.size += len(self.chunks[-1])
        if self.size >= WRITE_CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.chunks:
            data = b"".join(self.chunks)
            self.chunks, self.size = [], 0
            self.write(data)

    def close(self) -> None:
        self.chunks, self.size = [], 0
        del self.transport.read_frame
        if self.own:
            self.transport._write = self.write
        else:
            del self.transport._write


class _Confirms:
    """Publisher confirms of one py-amqp channel, awaited together: the channel's publishes stop waiting
    for their own confirm (py-amqp waits for each when the connection asks for confirms), and `wait`
    collects them all. The channel's delivery tags number its messages from 1."""

    def __init__(self, channel: Any) -> None:
        from amqp import spec

        self.channel, self.published, self.upto, self.refused = channel, 0, 0, False
        self.single: set[int] = set()  # tags acknowledged one by one, above `upto`
        self.methods = [spec.Basic.Ack, spec.Basic.Nack]
        channel.confirm_select()
        channel._confirm_selected = True
        publish = channel._basic_publish

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.published += 1
            return publish(*args, **kwargs)

        channel.basic_publish = counted
        channel.events["basic_ack"].add(self._ack)
        channel.events["basic_nack"].add(self._nack)

    def _ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            self.upto = max(self.upto, tag)
        else:
            self.single.add(tag)

    def _nack(self, tag: int, multiple: bool) -> None:
        self.refused = True

    def _confirmed(self) -> int:
        return self.upto + sum(1 for tag in self.single if tag > self.upto)

    def wait(self, timeout_s: float) -> None:
        from amqp.exceptions import MessageNacked

        deadline = time.monotonic() + timeout_s
        while not self.refused and self._confirmed() < self.published:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.published - self._confirmed()} of {self.published} messages "
                                   f"not confirmed by the broker in {timeout_s:.0f} s")
            self.channel.wait(self.methods, timeout=left)
        if self.refused:
            raise MessageNacked("the broker refused a message of the round")
