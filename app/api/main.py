"""The FastAPI app factory: `create_app(settings)`, and the error mapping every route relies on.

Errors: BadInput -> 422, NotFound -> 404 (Gone -> 410) and Conflict -> 409, with the reason; request
validation -> 422; an unreachable database or Redis -> 503; no database connection free within the
pool's timeout -> 503 Busy with Retry-After; a speech stream cut after its audio started is passed to
the server, which closes the connection; anything else is a bug: logged with a traceback, 500 without
details. Every error body has the `Problem` shape ({"error", "reason"}).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import kombu.exceptions
import redis
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app import audio
from app.api.deps import ApiContext
from app.api.docs import install_docs
from app.api.limits import BodyLimit
from app.api.metrics import DbCounts, HttpMetrics, StateCollector, http_metrics
from app.api.routes_books import router as books_router
from app.api.routes_jobs import router as jobs_router
from app.api.routes_openai import router as openai_router
from app.api.routes_ops import router as ops_router
from app.api.routes_voices import router as voices_router
from app.api.schemas import problem
from app.api.speech_stream import StreamCut
from app.api.web import router as web_router
from app.books.reading.source import DEFAULT_LIMITS
from app.broker.wire import TaskSender
from app.db import queries
from app.db.models import JobStatus, utcnow
from app.errors import BadInput, Conflict, Gone, NotFound
from app.reconcile.dead_workers import WORKER_GONE_S
from app.reconcile.report import SWEEP_FINDINGS
from app.settings import Settings, get_settings
from app.submission import routing

log = logging.getLogger(__name__)

# The broker (kombu), Redis or the database not answering: not the client's fault, not a bug either.
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, OperationalError, kombu.exceptions.OperationalError)


def build_context(settings: Settings, sender: TaskSender | None = None) -> ApiContext:
    """Clients for everything the API talks to (none connects before first use), and its metrics."""
    ctx = ApiContext.build(settings, sender)
    ctx.registry.register(StateCollector(
        broker=ctx.broker, store=ctx.store, queues=lambda: _queues(ctx), db_counts=lambda: _db_counts(ctx),
        sweep_kinds=SWEEP_FINDINGS))
    return ctx


def _queues(ctx: ApiContext) -> list[str]:
    """cpu, gpu, and the own queue of every GPU worker the database knows (`app.submission.routing`)."""
    try:
        with ctx.session() as s:
            workers = queries.list_worker_names(session=s)
    except OperationalError:  # the database is down (its own metric says so): the two shared queues
        workers = []
    return [ctx.settings.queue_cpu, ctx.settings.queue_gpu,
            *(routing.worker_queue(ctx.settings, name) for name in workers)]


def _db_counts(ctx: ApiContext) -> DbCounts:
    every_status = dict.fromkeys((s.value for s in JobStatus), 0)  # a status with no job reads 0
    beat_after = utcnow() - timedelta(seconds=WORKER_GONE_S)
    with ctx.session() as s:
        return DbCounts(jobs={**every_status, **queries.count_jobs_by_status(session=s)},
                        routes=queries.count_jobs_by_route(session=s),
                        gpu_workers_live=len(queries.live_workers(session=s, beat_after=beat_after)),
                        books=queries.count_books_by_status(session=s),
                        chapters=queries.count_live_book_chapters(session=s))


def create_app(settings: Settings, *, sender: TaskSender | None = None) -> FastAPI:
    """The API. `sender` replaces the Celery producer (tests that need no broker round trip)."""
    ctx = build_context(settings, sender)
    if settings.api_token is None or not settings.api_token.get_secret_value():
        log.warning("WAVEFARM_API_TOKEN is not set: the API accepts every request")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.close()

    app = FastAPI(title="wavefarm", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Offline speech synthesis: speech tokens in, audio in a reference voice out.")
    app.state.ctx = ctx
    # Largest acceptable body: a reference, a token file at the token limit, and form overhead.
    job_body = settings.max_reference_bytes + 8 * settings.max_tokens + 2**20
    book_body = settings.max_reference_bytes + DEFAULT_LIMITS.max_epub_bytes + 2**20  # an EPUB and a voice
    app.add_middleware(BodyLimit, max_bytes=job_body,
                       per_prefix={"/v1/books": book_body, "/v1/jobs/batch": settings.max_batch_bytes})
    app.add_middleware(HttpMetrics, metrics=http_metrics(ctx.registry))
    for router in (voices_router, jobs_router, books_router, openai_router, ops_router, web_router):
        app.include_router(router)
    install_docs(app)  # Swagger UI from the package, not a CDN
    _install_error_handlers(app)
    return app


def app_from_environment() -> FastAPI:
    """`uvicorn --factory app.api.main:app_from_environment` (what `wavefarm serve` runs)."""
    return settled(create_app(get_settings()))


def settled(app: FastAPI) -> FastAPI:
    """`app`, in a process that will serve it until it exits: what a reference upload would import later
    (torch and torchaudio, for the resampler: `app.audio.load_resampler`) imported now, then everything
    alive frozen out of the garbage collector's walks (`gc.freeze`). Those objects (the modules, the
    app, its routes and models: about 300,000) live as long as the process; left to the collector, a
    full collection walked them all, about 200 ms every few thousand submissions, and every young one
    was slowed as well (docs/SCALING.md). Imported now, the first upload does not wait for torch either.
    Only for a serving process: a test process would keep every cycle alive at the time forever."""
    audio.load_resampler()
    gc.collect()
    gc.freeze()
    return app


# Refusals the services raise: (status, the Problem's error name; None: the class's own name).
REFUSALS: tuple[tuple[type[Exception], int, str | None], ...] = (
    (BadInput, 422, None), (Gone, 410, "Gone"), (NotFound, 404, "NotFound"), (Conflict, 409, "Conflict"))
HTTP_NAMES = {401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict", 410: "Gone",
              413: "TooLarge", 415: "UnsupportedMediaType"}


def _respond(status: int, error: str, reason: str, **extra: Any) -> JSONResponse:
    return JSONResponse(status_code=status, content={**problem(error, reason), **extra})


def _refusal(status: int, name: str | None) -> Any:
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return _respond(status, name or type(exc).__name__, str(exc))

    return handler


def _install_error_handlers(app: FastAPI) -> None:
    for kind, status, name in REFUSALS:  # FastAPI picks the most specific class: Gone before NotFound
        app.add_exception_handler(kind, _refusal(status, name))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Without the offending input: it may be bytes that are not text, or NaN, or huge; loc says where.
        errors = jsonable_encoder([{k: v for k, v in e.items() if k in ("type", "loc", "msg")}
                                   for e in exc.errors()])
        reason = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors)
        return _respond(422, "ValidationError", reason or "invalid request", detail=errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, headers=exc.headers,
                            content=problem(HTTP_NAMES.get(exc.status_code, "HTTPError"), str(exc.detail)))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s: dependency unavailable: %s", request.method, request.url.path, exc)
        return _respond(503, "Unavailable", f"a backing service is unavailable ({type(exc).__name__})")

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, unavailable)

    @app.exception_handler(PoolTimeout)
    async def busy(request: Request, exc: PoolTimeout) -> JSONResponse:
        # More requests at once than database connections, for the pool's whole timeout: overload, not
        # a bug; the client may come back (measured: 64 concurrent book listings, scripts/bench_api.py).
        log.warning("%s %s: no database connection free: %s", request.method, request.url.path, exc)
        response = _respond(503, "Busy", "every database connection is in use; retry shortly")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        # The client left while its body was being read: nobody to answer, and no bug (an overloaded
        # server's slow reads make it common). 499 is what the access log and the metrics count.
        log.info("%s %s: the client disconnected before its request was read", request.method,
                 request.url.path)
        return _respond(499, "ClientClosedRequest", "the client disconnected")

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StreamCut):  # no bug: logged with its job where it happened; on to the server,
            raise exc  # which closes the connection (the response has started: no status can follow)
        log.exception("%s %s: unhandled error", request.method, request.url.path)
        return _respond(500, "InternalError", "internal error; the server log has the details")
