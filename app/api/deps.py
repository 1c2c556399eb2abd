"""What every route needs: the per-app context (settings, sessions, Redis, Celery) and the auth check.

The context is built once in `create_app` and hung on `app.state`; routes get it through `context`
and open one short session per request with `session(ctx)`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.db.session import session_scope
from app.settings import Settings
from app.store import FeatureStore
from app.submit import TaskSender


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    broker: redis.Redis  # only for health and queue depths; tasks go through `sender`
    store: FeatureStore
    artifacts: ArtifactStore
    sender: TaskSender
    registry: CollectorRegistry  # this app's /metrics
    owns_sender: bool = False  # built by us (a Celery app with its own connection pool): we close it

    def close(self) -> None:
        self.broker.close()
        self.store.close()
        self.engine.dispose()
        close = getattr(self.sender, "close", None)
        if self.owns_sender and close is not None:
            close()


def context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ApiContext, Depends(context)]


@contextmanager
def session(ctx: ApiContext) -> Iterator[Session]:
    with session_scope(ctx.sessions) as s:
        yield s


_bearer = HTTPBearer(auto_error=False, description="settings.api_token, when one is set")


def authorize(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Refuse the request unless it carries the configured bearer token (no token set: open API)."""
    expected = context(request).settings.api_token
    if expected is None or not expected.get_secret_value():  # empty, as compose passes "unset"
        return
    given = credentials.credentials if credentials is not None else ""
    # compare_digest: the time taken does not reveal how much of the token matched.
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise HTTPException(401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
