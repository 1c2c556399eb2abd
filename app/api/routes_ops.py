"""Operations: /healthz (database, broker and feature store reachable; the default lexicon readable when
one is configured) and /metrics (Prometheus text)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from app.api.deps import ApiContext, Ctx
from app.api.schemas import Health
from app.books.planning.lexicon import load_lexicon
from app.db import queries
from app.db.models import utcnow
from app.reconcile.dead_workers import WORKER_GONE_S

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])


def _check(ctx: ApiContext) -> dict[str, str]:
    checks: dict[str, str] = {}
    probes: dict[str, Callable[[], object]] = {
        "database": lambda: _select_one(ctx),
        "broker": ctx.broker.ping,
        "feature_store": ctx.store.client.ping,
    }
    if ctx.settings.lexicon is not None:  # every book goes through it: one that cannot be read refuses all
        probes["lexicon"] = lambda: _lexicon(ctx.settings.lexicon)
    for name, probe in probes.items():
        try:
            probe()
            checks[name] = "ok"
        except Exception as exc:  # a health check reports any failure; it never raises
            # The answer names the component and the kind; the message (hosts, ports, a database URL,
            # a driver's internals) goes to the log, not to whoever can reach /healthz.
            log.warning("healthz: %s failed: %s: %s", name, type(exc).__name__, exc)
            checks[name] = type(exc).__name__
    return checks


def _lexicon(path: Path | None) -> None:
    """Read and check the default lexicon, once per version of the file (healthz is polled often)."""
    assert path is not None
    stat = path.stat()
    _read_lexicon(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _read_lexicon(path: str, _mtime_ns: int, _size: int) -> None:
    load_lexicon(Path(path))


def _select_one(ctx: ApiContext) -> None:
    with ctx.session() as s:
        s.execute(text("SELECT 1"))


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(response: Response, ctx: Ctx) -> Health:
    """200 when the database, the broker and the feature store all answer (and the default lexicon, when
    one is configured, can be read); 503 says which did not, and the kind of failure (an exception's class
    name); the details are in the server's log."""
    checks = _check(ctx)
    healthy = all(v == "ok" for v in checks.values())
    if not healthy:
        response.status_code = 503
    return Health(status="ok" if healthy else "degraded", checks=checks,
                  dummy_weights_workers=_dummy_workers(ctx) if checks.get("database") == "ok" else None)


def _dummy_workers(ctx: ApiContext) -> int | None:
    """Live GPU workers (a heartbeat within WORKER_GONE_S) that run dummy weights, as they registered."""
    try:
        with ctx.session() as s:
            return queries.live_workers_on_dummy_weights(
                session=s, beat_after=utcnow() - timedelta(seconds=WORKER_GONE_S))
    except Exception as exc:  # noqa: BLE001 - a health probe answers; the log says why
        log.warning("healthz: dummy-weights count failed: %s: %s", type(exc).__name__, exc)
        return None


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def metrics(ctx: Ctx) -> Response:
    """Queue depths, preparation-path counters, job counts by status, and the API's request metrics."""
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)
