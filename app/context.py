"""The clients a producer process holds: database sessions, the feature store, the artifact root, the
broker and the Celery sender that queues tasks. The API builds one per app, the CLI's `--local` commands
one per command; none of the clients connects before its first use.

Celery is imported only when no sender is given, and then by `app.celery_config`, so a process that
passes its own sender (a test, a script) never builds a Celery app.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.broker import Broker, open_broker
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from app.store import FeatureStore
from app.wire import TaskSender


@dataclass
class Context:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    broker: Broker  # for health and queue depths (Redis or RabbitMQ); tasks go through `sender`
    store: FeatureStore
    artifacts: ArtifactStore
    sender: TaskSender
    owns_sender: bool = False  # built here (a Celery app with its own connection pool): closed here

    @classmethod
    def build(cls, settings: Settings, sender: TaskSender | None = None) -> Self:
        owns_sender = sender is None
        if sender is None:
            from app.celery_config import make_celery  # the producer side only: same queues and options

            sender = make_celery(settings)
        engine = make_engine(settings.database_url)
        broker = open_broker(settings.broker_url, timeout_s=5)
        return cls(settings=settings, engine=engine, sessions=make_sessionmaker(engine), broker=broker,
                   store=FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s),
                   artifacts=ArtifactStore(settings.artifact_root), sender=sender, owns_sender=owns_sender)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work: committed when the block ends, rolled back if it raises."""
        with session_scope(self.sessions) as session:
            yield session

    def close(self) -> None:
        self.broker.close()
        self.store.close()
        self.engine.dispose()
        close = getattr(self.sender, "close", None)
        if self.owns_sender and close is not None:
            close()
