"""`context_for`: the services' `app.context.Context` around clients a test already holds (its sessions, its
feature store, its producer), for tests whose settings are not the `ctx` fixture's (a worker's database,
a module-wide stack)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from app.broker.queues import open_broker
from app.broker.wire import TaskSender
from app.context import Context
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore


def context_for(settings: Settings, sender: TaskSender, *, sessions: sessionmaker[Session],
                store: FeatureStore,
                artifacts: ArtifactStore | None = None) -> Context:
    """Nothing here connects before its first use; the caller closes what it gave (the broker client is
    only asked for queue depths, which the services do not ask)."""
    return Context(settings=settings, engine=sessions.kw["bind"], sessions=sessions, store=store,
                   artifacts=artifacts or ArtifactStore(settings.artifact_root), sender=sender,
                   broker=open_broker(settings.broker_url))
