"""What every route needs: the per-app context (`app.context.Context` and the app's metrics registry) and
the auth check.

The context is built once in `create_app` and hung on `app.state`; routes get it through `Ctx` and open
one short session per request with `ctx.session()`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import anyio.to_thread
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry

from app.context import Context
from app.settings import Settings
from app.submission.routing import LiveWorkers
from app.voices.service import StoredFeatures

T = TypeVar("T")


@dataclass
class ApiContext(Context):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)  # this app's /metrics
    # Every submission is routed: the live workers' rows read at most once a second in this process.
    live_workers: LiveWorkers | None = field(default_factory=LiveWorkers)
    # Every submission of a ready voice asks whether its features are stored: a find trusted for a second.
    stored_features: StoredFeatures | None = field(default_factory=StoredFeatures)
    _submitters: anyio.CapacityLimiter | None = field(default=None, init=False, repr=False)  # on first use

    async def submitting(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` in the thread pool, at most `settings.submit_threads` of them at once in this
        process. A submission is a millisecond or two of Python work around a few database and broker
        round trips; with 16 of them at once in as many threads, the threads' handing the GIL to each
        other cost a third more CPU per submission (docs/SCALING.md, "Submissions in a few threads")."""
        if self._submitters is None:
            self._submitters = anyio.CapacityLimiter(submit_threads(self.settings))
        return await anyio.to_thread.run_sync(work, *args, limiter=self._submitters)


def submit_threads(settings: Settings) -> int:
    """`settings.submit_threads`, or when unset: 8 on PostgreSQL; 2 on SQLite, which takes one writer at a
    time (more threads only wait on its lock: a thread that finds it taken sleeps and tries again)."""
    if settings.submit_threads is not None:
        return settings.submit_threads
    return 2 if settings.database_url.startswith("sqlite") else 8


async def context(request: Request) -> ApiContext:
    """`async`, as `authorize` is, though neither awaits anything: FastAPI runs a plain `def` dependency
    in its thread pool, a hand-off there and back on every request (two a request with both)."""
    return _of(request)


def _of(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ApiContext, Depends(context)]

_bearer = HTTPBearer(auto_error=False, description="settings.api_token, when one is set")


async def authorize(request: Request,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Refuse the request unless it carries the configured bearer token (no token set: open API)."""
    expected = _of(request).settings.api_token
    if expected is None or not expected.get_secret_value():  # empty, as compose passes "unset"
        return
    given = credentials.credentials if credentials is not None else ""
    # compare_digest: the time taken does not reveal how much of the token matched.
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise HTTPException(401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
