"""What every route needs: the per-app context (`app.context.Context` and the app's metrics registry) and
the auth check.

The context is built once in `create_app` and hung on `app.state`; routes get it through `Ctx` and open
one short session per request with `ctx.session()`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry

from app.context import Context
from app.submission.routing import LiveWorkers
from app.voices.service import StoredFeatures


@dataclass
class ApiContext(Context):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)  # this app's /metrics
    # Every submission is routed: the live workers' rows read at most once a second in this process.
    live_workers: LiveWorkers | None = field(default_factory=LiveWorkers)
    # Every submission of a ready voice asks whether its features are stored: a find trusted for a second.
    stored_features: StoredFeatures | None = field(default_factory=StoredFeatures)


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
