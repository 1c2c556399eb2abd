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
                                       (`app.routing.ROUTES`: affinity, placed, spilled, and the fallbacks)
  wavefarm_source_up{source}           1 when that source answered this scrape
plus request counts and latencies of the API itself. The GPU worker exports its engine's metrics from
its own process (`gpu_worker.metrics`, under the same `wavefarm_` prefix).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import keys
from app.broker import Broker, as_broker
from app.store import FeatureStore

log = logging.getLogger(__name__)

QUEUE_DEPTH = "wavefarm_queue_depth"
PREP_PATH = "wavefarm_prep_path"
VOICE_PREPARE = "wavefarm_voice_prepare"
JOBS = "wavefarm_jobs"
JOBS_ROUTED = "wavefarm_jobs_routed"
SOURCE_UP = "wavefarm_source_up"
HTTP_REQUESTS = "wavefarm_http_requests"
HTTP_SECONDS = "wavefarm_http_request_seconds"


def broker_queue_depth(broker: Broker | redis.Redis, queue: str) -> int:
    """Messages waiting in a queue (`app.broker`: Redis's per-priority lists, or a passive declare)."""
    return as_broker(broker).queue_depth(queue)


class StateCollector(Collector):
    """Reads queue depths, feature-store counters and job counts at every scrape."""

    def __init__(self, *, broker: Broker | redis.Redis, store: FeatureStore,
                 queues: list[str] | Callable[[], list[str]], job_counts: Callable[[], dict[str, int]],
                 job_routes: Callable[[], dict[str, int]] = dict) -> None:
        self.broker, self.store, self.queues, self.job_counts = broker, store, queues, job_counts
        self.job_routes = job_routes

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(SOURCE_UP, "1 when the source answered this scrape", labels=["source"])
        for source, read in (("broker", self._queues), ("feature_store", self._counters),
                             ("database", self._jobs)):
            try:
                yield from read()
                up.add_metric([source], 1)
            except Exception:  # a scrape reports a down source; it never fails as a whole
                log.warning("metrics: %s unavailable", source, exc_info=True)
                up.add_metric([source], 0)
        yield up

    def _queues(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(QUEUE_DEPTH, "messages waiting in the broker", labels=["queue"])
        for queue in self.queues() if callable(self.queues) else self.queues:
            depth.add_metric([queue], broker_queue_depth(self.broker, queue))
        yield depth

    def _counters(self) -> Iterator[Metric]:
        for name, group, label, doc in (
                (PREP_PATH, keys.COUNTER_PREP_PATH, "path", "jobs by how their voice was installed"),
                (VOICE_PREPARE, keys.COUNTER_PREPARE, "outcome", "voice preparations on CPU workers")):
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, count in sorted(self.store.counters(group).items()):
                family.add_metric([value], count)
            yield family

    def _jobs(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(JOBS, "jobs in the database by status", labels=["status"])
        for status, count in sorted(self.job_counts().items()):
            family.add_metric([status], count)
        yield family
        routed = GaugeMetricFamily(JOBS_ROUTED, "jobs in the database by the route of their latest synth",
                                   labels=["route"])
        for route, count in sorted(self.job_routes().items()):
            routed.add_metric([route], count)
        yield routed


def http_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    """The API's own request metrics, registered once per app (the middleware stack may be rebuilt)."""
    return (Counter(HTTP_REQUESTS, "HTTP requests", ["method", "route", "status"], registry=registry),
            Histogram(HTTP_SECONDS, "HTTP request latency", ["method", "route"], registry=registry))


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
            route = getattr(scope.get("route"), "path", "<unmatched>")
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.seconds.labels(scope["method"], route).observe(time.perf_counter() - start)
