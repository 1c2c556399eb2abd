"""Prometheus metrics of the API process.

`/metrics` is served from a registry owned by one app instance (several apps in one process, as in
the tests, never collide). State metrics are read at scrape time, not kept in this process:
  wavefarm_queue_depth{queue}          messages waiting in the broker (Redis: its lists, all priorities;
                                       RabbitMQ: the queue's ready messages; neither counts delivered ones):
                                       cpu, gpu and each GPU worker's own queue
  wavefarm_prep_path_total{path}       how GPU workers installed job voices (feature-store counters)
  wavefarm_voice_prepare_total{outcome} CPU-side preparations (feature-store counters)
  wavefarm_jobs{status}                jobs in the database by status
  wavefarm_jobs_routed{route}          jobs in the database by where their latest `synth` went and why
                                       (`app.submission.routing.ROUTES`: affinity, placed, spilled, and the
                                       fallbacks)
  wavefarm_gpu_workers_live            GPU workers whose heartbeat in the database is recent
  wavefarm_books{status}               books in the database by status (every status, 0 included)
  wavefarm_book_chapters{state}        chapters of the books not ended yet: assembled, pending
  wavefarm_quality_checks_total{check, verdict}  the book quality gate's checks on CPU workers
                                       (feature-store counters; app.quality.report's CHECKS x VERDICTS)
  wavefarm_sweep_found_total{kind}     what maintenance sweeps found and put back (`app.reconcile.sweep`)
  wavefarm_feature_store_used_bytes    memory the feature-store Redis uses, and its maxmemory limit in
  wavefarm_feature_store_max_bytes     wavefarm_feature_store_max_bytes (0: unlimited)
  wavefarm_source_up{source}           1 when that source answered this scrape
plus request counts and latencies of the API itself, labelled only from closed sets (`request_labels`):
the method when it is one of `METHODS` (any other token a client sends: `other`), the route's template
(`<unmatched>` for a path no route has), the status code when it is one HTTP defines or 499 (a client
that went away; else `other`). No metric is labelled by anything else a client sends (a model, a
format, a voice). The GPU worker
exports its engine's metrics from its own process (`gpu_worker.worker.metrics`, under the same `wavefarm_`
prefix).

Several API processes (`wavefarm serve --processes N`): the state metrics are read from the shared
sources, so any process answers them alike; the request metrics are counted in each process, so they use
prometheus_client's multiprocess mode: with PROMETHEUS_MULTIPROC_DIR set (in the environment before
prometheus_client is imported), each process writes its counts to files there and every `/metrics`
answer sums all of them. `serve` sets the variable for N > 1 and empties the folder of an earlier run's
files (`prepare_multiprocess_dir`; a folder it made itself is removed when it stops); with one process it
is left unset and nothing is written to disk.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.broker.queues import Broker
from app.quality.report import CHECKS, VERDICTS
from app.storage import keys
from app.storage.feature_store import FeatureStore

log = logging.getLogger(__name__)

QUEUE_DEPTH = "wavefarm_queue_depth"
PREP_PATH = "wavefarm_prep_path"
VOICE_PREPARE = "wavefarm_voice_prepare"
JOBS = "wavefarm_jobs"
JOBS_ROUTED = "wavefarm_jobs_routed"
GPU_WORKERS_LIVE = "wavefarm_gpu_workers_live"
BOOKS = "wavefarm_books"
BOOK_CHAPTERS = "wavefarm_book_chapters"
SWEEP_FOUND = "wavefarm_sweep_found"
QUALITY_CHECKS = "wavefarm_quality_checks"
STORE_USED = "wavefarm_feature_store_used_bytes"
STORE_MAX = "wavefarm_feature_store_max_bytes"
SOURCE_UP = "wavefarm_source_up"
HTTP_REQUESTS = "wavefarm_http_requests"
HTTP_SECONDS = "wavefarm_http_request_seconds"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable
# The request methods counted under their own name (RFC 9110's, and PATCH): the parser accepts any token,
# and every label value is a series kept for the life of the process (and a file's worth of rows in
# multiprocess mode), so whatever else a client sends is counted as one value.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
# The codes HTTP defines (Python's own list), and 499: what this API answers a client that went away
# (`app.api.main`, the speech route), as nginx counts it.
CLIENT_CLOSED = 499
STATUSES = frozenset({*(int(code) for code in HTTPStatus), CLIENT_CLOSED})
OTHER = "other"
UNMATCHED = "<unmatched>"


def broker_queue_depth(broker: Broker, queue: str) -> int:
    """Messages waiting in a queue, every priority (`app.broker.queues`)."""
    return broker.queue_depth(queue)


@dataclass
class DbCounts:
    """What the database says at one scrape (read in one session)."""

    jobs: dict[str, int] = field(default_factory=dict)  # by status
    routes: dict[str, int] = field(default_factory=dict)  # by route of the latest synth
    gpu_workers_live: int = 0
    books: dict[str, int] = field(default_factory=dict)  # by status
    chapters: dict[str, int] = field(default_factory=dict)  # of live books: assembled, pending


class StateCollector(Collector):
    """Reads queue depths, feature-store counters and memory, and database counts at every scrape."""

    def __init__(self, *, broker: Broker, store: FeatureStore,
                 queues: list[str] | Callable[[], list[str]], db_counts: Callable[[], DbCounts],
                 sweep_kinds: tuple[str, ...] = ()) -> None:
        self.broker, self.store, self.queues, self.db_counts = broker, store, queues, db_counts
        self.sweep_kinds = sweep_kinds

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(SOURCE_UP, "1 when the source answered this scrape", labels=["source"])
        for source, read in (("broker", self._queues), ("feature_store", self._store),
                             ("database", self._database)):
            try:
                yield from list(read())  # whole or nothing: a source failing half-way yields no family
                up.add_metric([source], 1)
            except Exception:  # a scrape reports a down source; it never fails as a whole
                log.warning("metrics: %s unavailable", source, exc_info=True)
                up.add_metric([source], 0)
        yield up

    def _queues(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(QUEUE_DEPTH, "messages waiting in the broker", labels=["queue"])
        queues = self.queues() if callable(self.queues) else self.queues
        for queue, n in self.broker.queue_depths(list(queues)).items():
            depth.add_metric([queue], n)
        yield depth

    def _store(self) -> Iterator[Metric]:
        for name, group, label, doc, known in (
                (PREP_PATH, keys.COUNTER_PREP_PATH, "path", "jobs by how their voice was installed", ()),
                (VOICE_PREPARE, keys.COUNTER_PREPARE, "outcome", "voice preparations on CPU workers", ()),
                (SWEEP_FOUND, keys.COUNTER_SWEEP, "kind", "what maintenance sweeps found and put back",
                 self.sweep_kinds)):
            family = CounterMetricFamily(name, doc, labels=[label])
            counts = {**dict.fromkeys(known, 0), **self.store.counters(group)}
            for value, count in sorted(counts.items()):
                family.add_metric([value], count)
            yield family
        yield self._quality()
        used, limit = self.store.memory()
        yield GaugeMetricFamily(STORE_USED, "memory the feature-store Redis uses", value=used)
        yield GaugeMetricFamily(STORE_MAX, "the feature-store Redis's maxmemory (0: unlimited)", value=limit)

    def _quality(self) -> Metric:
        """Every check and verdict, 0 included; a field outside that closed set is not exported."""
        family = CounterMetricFamily(QUALITY_CHECKS, "the book quality gate's checks on CPU workers",
                                     labels=["check", "verdict"])
        counts = self.store.counters(keys.COUNTER_QUALITY)
        for check in CHECKS:
            for verdict in VERDICTS:
                family.add_metric([check, verdict], counts.get(f"{check}:{verdict}", 0))
        return family

    def _database(self) -> Iterator[Metric]:
        counts = self.db_counts()
        for name, label, doc, values in (
                (JOBS, "status", "jobs in the database by status", counts.jobs),
                (JOBS_ROUTED, "route", "jobs in the database by the route of their latest synth",
                 counts.routes),
                (BOOKS, "status", "books in the database by status", counts.books),
                (BOOK_CHAPTERS, "state", "chapters of the books not ended yet", counts.chapters)):
            family = GaugeMetricFamily(name, doc, labels=[label])
            for value, count in sorted(values.items()):
                family.add_metric([value], count)
            yield family
        yield GaugeMetricFamily(GPU_WORKERS_LIVE, "GPU workers whose heartbeat is recent",
                                value=counts.gpu_workers_live)


def http_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    """The API's own request metrics, registered once per app (the middleware stack may be rebuilt). In
    multiprocess mode they are written to the shared folder and `registry` reads every process's files."""
    own: CollectorRegistry | None = registry
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(registry)  # registers itself: the sum over the folder's files
        own = None  # registered, this process's metrics would be reported beside the sum
    return (Counter(HTTP_REQUESTS, "HTTP requests", ["method", "route", "status"], registry=own),
            Histogram(HTTP_SECONDS, "HTTP request latency", ["method", "route"], registry=own))


def prepare_multiprocess_dir(environ: MutableMapping[str, str]) -> Path:
    """The folder several API processes share their request metrics in: PROMETHEUS_MULTIPROC_DIR when
    set (emptied of an earlier run's `.db` files: counts of processes gone would be summed as if live),
    else a new temporary folder, set in `environ` for the processes to inherit."""
    given = environ.get(MULTIPROC_ENV)
    if not given:
        folder = Path(tempfile.mkdtemp(prefix="wavefarm-api-metrics-"))
        environ[MULTIPROC_ENV] = str(folder)
        return folder
    folder = Path(given)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    return folder


def request_labels(scope: Scope, status: int) -> tuple[str, str, str]:
    """(method, route, status) of a request, each from a closed set: the route is a template of the
    app's own routes, never the raw path."""
    method = scope["method"] if scope["method"] in METHODS else OTHER
    route = getattr(scope.get("route"), "path", None)
    return (method, route if isinstance(route, str) else UNMATCHED,
            str(status) if status in STATUSES else OTHER)


class HttpMetrics:
    """ASGI middleware: request counts and latencies by route template (never by raw path)."""

    def __init__(self, app: ASGIApp, metrics: tuple[Counter, Histogram]) -> None:
        self.app = app
        self.requests, self.seconds = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            method, route, code = request_labels(scope, status)
            self.requests.labels(method, route, code).inc()
            self.seconds.labels(method, route).observe(time.perf_counter() - start)
