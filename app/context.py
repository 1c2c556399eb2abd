"""The one bundle of clients every wavefarm process holds, handed to the services as `ctx`.

    settings   the deployment's settings (`app.settings`)
    engine, sessions   the database (one short session per unit of work: `ctx.session()`)
    store      the feature store (Redis): features, cancel flags, counters
    artifacts  the artifact root (uploads, tokens, outputs)
    sender     what queues tasks (`app.broker.wire.TaskSender`: a Celery app, or built here a
               `app.broker.publisher.Publisher` over one: no result subscription, no task-sent event)
    broker     health and queue depths (Redis or RabbitMQ); tasks go through `sender`

The API builds one per app (`app.api.deps.ApiContext` adds its metrics registry), the CLI's `--local`
commands one per command, a CPU worker one per process (`tasks.voice.resources`, with the tasks' Celery
app as its sender) and a GPU worker one per process (`gpu_worker.worker.runtime.Runtime` adds the engine loop,
its bookkeeping and its heartbeat). Services take `ctx=` and the session they work in; lower layers
(`app.lifecycle`, `app.submission.routing`, `app.db.queries`) take only the clients they use. None of the
clients connects before its first use.

Celery is imported only when no sender is given, and then by `app.broker.celery_config`, so a process that
passes its own sender (a test, a script, a worker) never builds a second Celery app.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.broker.queues import Broker, open_broker
from app.broker.wire import TaskSender
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore

if TYPE_CHECKING:  # routing reads the database through the queries; the context needs only the type
    from app.submission.routing import LiveWorkers
    from app.voices.service import StoredFeatures


@dataclass(kw_only=True)
class Context:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: FeatureStore
    artifacts: ArtifactStore
    sender: TaskSender
    broker: Broker
    live_workers: LiveWorkers | None = None  # routing's cache of the live workers (the API keeps one)
    stored_features: StoredFeatures | None = None  # voices recently found prepared (the API keeps one)
    owns_sender: bool = False  # built here (a Celery app with its own connection pool): closed here

    @classmethod
    def build(cls, settings: Settings, sender: TaskSender | None = None, **extra: Any) -> Self:
        """Every client from `settings`; `extra` fills a subclass's own fields."""
        owns_sender = sender is None
        if sender is None:
            # the producer side only: same queues and options; messages without result subscriptions
            from app.broker.celery_config import make_celery
            from app.broker.publisher import Publisher

            sender = Publisher(make_celery(settings))
        engine = make_engine(settings.database_url)
        return cls(settings=settings, engine=engine, sessions=make_sessionmaker(engine),
                   store=FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s),
                   artifacts=ArtifactStore(settings.artifact_root), sender=sender,
                   broker=open_broker(settings.broker_url, timeout_s=5), owns_sender=owns_sender, **extra)

    def clients(self) -> dict[str, Any]:
        """This context's own fields, to build a subclass around clients already open."""
        return {f.name: getattr(self, f.name) for f in fields(Context)}

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
