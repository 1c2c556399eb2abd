"""What the broker holds, as far as wavefarm asks: is it there, and how many messages wait in a queue
(the metrics, the health check, the GPU worker's look at the cpu queue).

Both transports answer through kombu's public channel API (a passive `queue_declare`, which counts every
priority level of a queue on Redis and the ready messages on RabbitMQ), on a short-lived connection per
question, so it is safe from any thread. Nothing here reads or moves messages: a message is only a
doorbell (`app.lifecycle`), so no part of wavefarm needs to know where one is.
"""

from __future__ import annotations

import contextlib
from typing import Protocol
from urllib.parse import urlsplit

import redis
from kombu import Connection
from kombu.exceptions import ChannelError

from app.broker.wire import PRIORITY_STEPS

AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def is_amqp(url: str) -> bool:
    """The broker URL names RabbitMQ (AMQP 0-9-1) rather than Redis."""
    return urlsplit(url).scheme in AMQP_SCHEMES


class Broker(Protocol):
    """The broker as wavefarm inspects it (tasks are sent through Celery, never through this)."""

    def ping(self) -> object: ...

    def queue_depth(self, queue: str) -> int: ...

    def queue_depths(self, queues: list[str]) -> dict[str, int]: ...

    def purge(self, queue: str) -> int: ...

    def close(self) -> None: ...


class KombuBroker:
    """Redis or RabbitMQ, asked through kombu (module docstring)."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        # Redis: a PING on a pooled client (thread-safe, 0.04 ms) rather than a kombu connection (1 ms):
        # /healthz asks on every call.
        self._redis = None if is_amqp(url) else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _connect(self) -> Connection:
        # Redis: the same priority steps as the Celery apps (`app.broker.celery_config`), or the count misses
        # some
        options = {} if is_amqp(self.url) else {"socket_timeout": self.timeout_s,
                                                "priority_steps": list(PRIORITY_STEPS)}
        conn = Connection(self.url, connect_timeout=self.timeout_s, transport_options=options)
        conn.ensure_connection(max_retries=1, timeout=self.timeout_s)
        return conn

    def ping(self) -> object:
        if self._redis is not None:
            return self._redis.ping()
        with self._connect() as conn:
            conn.default_channel  # noqa: B018 - opening a channel is the round trip
            return True

    def queue_depth(self, queue: str) -> int:
        """Messages waiting in a queue (every priority); a queue nobody declared yet holds none."""
        return self.queue_depths([queue])[queue]

    def queue_depths(self, queues: list[str]) -> dict[str, int]:
        """`queue_depth` of each queue, over one connection."""
        depths = {}
        with self._connect() as conn:
            for queue in queues:
                channel = conn.channel()
                try:
                    depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
                except ChannelError:  # NOT_FOUND: not declared yet (RabbitMQ closes the channel)
                    depths[queue] = 0
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
        return depths

    def purge(self, queue: str) -> int:
        """Drop every message waiting in a queue (a test's lost broker, an operator's reset); -> how many."""
        with self._connect() as conn:
            with contextlib.suppress(ChannelError):
                return int(conn.channel().queue_purge(queue=queue) or 0)
            return 0

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


def open_broker(url: str, timeout_s: float = 5.0) -> KombuBroker:
    """The broker behind a Celery broker URL; nothing connects before the first question."""
    return KombuBroker(url, timeout_s)
