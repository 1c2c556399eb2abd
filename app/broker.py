"""What the broker holds, for each transport: queue depths (the metrics, the health check), which tasks
of a queue have a message (the maintenance sweep), and putting a dead consumer's message back.

kombu's Redis transport (`redis://`) keeps one list per priority step (`app.wire.priority_lists`) and
the messages delivered but not yet acknowledged in the hash `unacked` (delivery tag -> [message,
exchange, routing key]), their delivery times in the sorted set `unacked_index`. All of it can be read,
so the sweep knows whether a job still has a message, and a message a dead worker held can be put back
at once, the way kombu's own restore does it after the visibility timeout.

RabbitMQ (`amqp://`) tells the number of ready messages in a queue (a passive declare) but not which
tasks they are, and it puts a consumer's unacknowledged messages back in their queue itself the moment
that consumer's connection closes. `task_ids` is therefore None there; `app.maintenance` says what the
sweep does instead.

`move_queue` empties a gone GPU worker's own queue into the shared one (`app.routing`), on either broker.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Protocol
from urllib.parse import urlsplit

import redis
from kombu import Connection, Producer
from kombu.exceptions import ChannelError

from app.wire import UNACKED_INDEX_KEY, UNACKED_KEY, priority_lists

log = logging.getLogger(__name__)

AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def is_amqp(url: str) -> bool:
    """The broker URL names RabbitMQ (AMQP 0-9-1) rather than Redis."""
    return urlsplit(url).scheme in AMQP_SCHEMES


class Broker(Protocol):
    """The broker as wavefarm inspects it (tasks are sent through Celery, never through this)."""

    redelivers_dead_consumers: bool  # a dead consumer's unacknowledged messages return by themselves

    def ping(self) -> object: ...
    def queue_depth(self, queue: str) -> int: ...
    def task_ids(self, queue: str) -> set[str] | None: ...
    def move_queue(self, src: str, dst: str) -> list[str]: ...
    def close(self) -> None: ...


class RedisBroker:
    """kombu's Redis transport, read and repaired through its keys (module docstring)."""

    redelivers_dead_consumers = False

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 5.0) -> RedisBroker:
        return cls(redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s))

    def ping(self) -> object:
        return self.client.ping()

    def queue_depth(self, queue: str) -> int:
        """Messages waiting in a queue: the sum over its per-priority lists."""
        pipe = self.client.pipeline(transaction=False)
        for key in priority_lists(queue):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())

    def waiting_ids(self, queue: str) -> set[str]:
        """Task ids waiting in the queue's lists (every priority)."""
        ids: set[str] = set()
        for key in priority_lists(queue):
            for raw in self.client.lrange(key, 0, -1):
                ids.update(_task_id(_loads(raw)))
        return ids

    def unacked(self, queue: str, *, prefix: str | None = None) -> dict[str, str]:
        """Task id -> delivery tag of the queue's delivered, unacknowledged messages (and of every queue
        whose name starts with `prefix`, when given: the GPU workers' own queues)."""
        found: dict[str, str] = {}
        for tag, raw in self.client.hgetall(UNACKED_KEY).items():
            entry = _loads(raw)
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], str)):
                continue
            if entry[2] == queue or (prefix is not None and entry[2].startswith(prefix)):
                for task_id in _task_id(entry[0]):
                    found[task_id] = tag.decode() if isinstance(tag, bytes) else str(tag)
        return found

    def task_ids(self, queue: str) -> set[str] | None:
        """Task ids with a message for `queue`: waiting (every priority) or delivered and unacked."""
        return self.waiting_ids(queue) | set(self.unacked(queue))

    def restore(self, tag: str, queue: str) -> bool:
        """Put an unacknowledged message back at the head of its queue (its consumer is dead): what kombu
        does once the visibility timeout passed. Atomic (WATCH on the hash): of two restorers, and of a
        restorer and a late ack, exactly one removes the entry; True if this call put it back."""
        restored = False

        def move(pipe: Any) -> None:
            nonlocal restored
            raw = pipe.hget(UNACKED_KEY, tag)
            pipe.multi()
            pipe.zrem(UNACKED_INDEX_KEY, tag)
            pipe.hdel(UNACKED_KEY, tag)
            restored = False
            if raw:
                message = json.loads(raw)[0]
                _mark_redelivered(message)
                _retarget(message, queue)
                pipe.rpush(_list_for(queue, message), json.dumps(message))
                restored = True

        self.client.transaction(move, UNACKED_KEY)
        return restored

    def move_queue(self, src: str, dst: str) -> list[str]:
        """Every message waiting in `src` (a gone worker's own queue) moved to the head of `dst`, oldest
        first, each at its priority; -> their task ids. Each move is atomic (WATCH on the list): a message
        is in one of the two queues, never in neither."""
        moved: list[str] = []
        for src_list in priority_lists(src):
            while True:
                taken: list[bytes] = []

                def move(pipe: Any, key: str = src_list, out: list[bytes] = taken) -> None:
                    out[:] = self._move_newest(pipe, key, dst)

                self.client.transaction(move, src_list)
                if not taken:
                    break
                moved.extend(_task_id(_loads(taken[0])))
        return moved

    @staticmethod
    def _move_newest(pipe: Any, src_list: str, dst: str) -> list[bytes]:
        """kombu pushes on the left and serves from the right: taking the newest first and pushing each on
        the right keeps the moved messages' order, served before what `dst` already holds. -> [the raw
        message moved], or [] when the list is empty."""
        raw = pipe.lindex(src_list, 0)
        if raw is None:
            return []
        message = _loads(raw)
        pipe.multi()
        pipe.lpop(src_list)
        if isinstance(message, dict):
            _retarget(message, dst)
            pipe.rpush(_list_for(dst, message), json.dumps(message))
        return [raw]  # a message that is not kombu's JSON is dropped: nothing could deliver it

    def close(self) -> None:
        self.client.close()


class AmqpBroker:
    """RabbitMQ: a short-lived connection per question (thread-safe, as the API's threads need)."""

    redelivers_dead_consumers = True

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url, self.timeout_s = url, timeout_s

    def _connect(self) -> Connection:
        conn = Connection(self.url, connect_timeout=self.timeout_s)
        conn.connect()
        return conn

    def ping(self) -> object:
        with self._connect():
            return True

    def queue_depth(self, queue: str) -> int:
        """Ready messages of a queue (a passive declare; a queue nobody declared yet holds none)."""
        with self._connect() as conn:
            channel = conn.channel()
            try:
                return int(channel.queue_declare(queue=queue, passive=True).message_count)
            except ChannelError:  # 404 NOT_FOUND: not declared yet (it closed the channel)
                return 0

    def task_ids(self, queue: str) -> set[str] | None:
        return None  # RabbitMQ does not list a queue's messages without taking them

    def move_queue(self, src: str, dst: str) -> list[str]:
        """Every message waiting in `src` (a gone worker's own queue) published again to `dst`, with its
        body, headers, properties and priority (already in RabbitMQ's order), and only then acknowledged
        in `src` (a crash in between leaves a copy in each, which the claims make harmless); the emptied
        queue is deleted. -> their task ids."""
        moved: list[str] = []
        with Connection(self.url, connect_timeout=self.timeout_s,
                        transport_options={"confirm_publish": True}) as conn:
            channel = conn.channel()
            producer = Producer(channel)
            while True:
                try:
                    raw = channel.basic_get(queue=src, no_ack=False)
                except ChannelError:  # 404: never declared (or deleted already)
                    return moved
                if raw is None:
                    break
                message = channel.message_to_python(raw)
                props = message.properties
                producer.publish(message.body, exchange="", routing_key=dst, headers=message.headers,
                                 content_type=message.content_type,
                                 content_encoding=message.content_encoding, priority=props.get("priority"),
                                 correlation_id=props.get("correlation_id"), reply_to=props.get("reply_to"),
                                 delivery_mode=2, retry=True)
                message.ack()
                task_id = message.headers.get("id")
                if isinstance(task_id, str):
                    moved.append(task_id)
            with contextlib.suppress(ChannelError):
                channel.queue_delete(queue=src, if_empty=True, if_unused=True)
        return moved

    def close(self) -> None:
        pass


def open_broker(url: str, timeout_s: float = 5.0) -> RedisBroker | AmqpBroker:
    """The broker behind a Celery broker URL; nothing connects before the first question."""
    return AmqpBroker(url, timeout_s) if is_amqp(url) else RedisBroker.from_url(url, timeout_s)


def as_broker(broker: Broker | redis.Redis) -> Broker:
    """A Redis client is kombu's Redis transport (callers and tests that hold one)."""
    return RedisBroker(broker) if isinstance(broker, redis.Redis) else broker


def _loads(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _task_id(message: Any) -> list[str]:
    try:
        task_id = message["headers"]["id"]
    except (KeyError, TypeError):
        return []
    return [task_id] if isinstance(task_id, str) else []


def _mark_redelivered(message: dict[str, Any]) -> None:
    message.get("headers", {})["redelivered"] = True
    delivery = message.get("properties", {}).get("delivery_info")
    if isinstance(delivery, dict):
        delivery["redelivered"] = True


def _retarget(message: dict[str, Any], queue: str) -> None:
    """The message now belongs to `queue` (the default exchange, routed by queue name, as Celery publishes
    them): kombu restores it there after a visibility timeout, and a retry is published there."""
    delivery = message.get("properties", {}).get("delivery_info")
    if isinstance(delivery, dict):
        delivery["exchange"], delivery["routing_key"] = "", queue


def _list_for(queue: str, message: dict[str, Any]) -> str:
    """The priority list a message goes back to (kombu: its `priority` property, 0 if none)."""
    lists = priority_lists(queue)
    try:
        priority = int(message["properties"]["priority"])
    except (KeyError, TypeError, ValueError):
        priority = 0
    return lists[max(0, min(priority, len(lists) - 1))]
