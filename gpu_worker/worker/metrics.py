"""The GPU worker's Prometheus metrics, registered by the runtime in the registry it is given (the
process's default registry in a worker, which `wavefarm gpu-worker --metrics-port` serves; a fresh one
in tests that build several runtimes in one process).

    wavefarm_worker_steps_total                 batched decode steps
    wavefarm_worker_frames_total                mel frames decoded (50 per second of audio)
    wavefarm_worker_voice_installs_total{event} voices installed and evicted
    wavefarm_worker_live_jobs                   jobs in the engine
    wavefarm_worker_voice_bytes                 device bytes of installed voices
    wavefarm_worker_rows_per_step               histogram: rows decoded together in one step
    wavefarm_worker_first_audio_seconds         histogram: from a job's admission to its first audio
    wavefarm_worker_cuda_graphs{part}           CUDA graphs held, part = flow (the decode solve,
                                                `accel.flow_graphs`) or vocoder (`accel.graphs`)
    wavefarm_worker_graph_capture_seconds{part} seconds spent capturing them
    wavefarm_worker_graph_bytes{part}           device memory their capture took
    wavefarm_graph_fallbacks_total{part,reason} CUDA graph buckets left eager (`gpu_worker.fallbacks`)
    wavefarm_worker_fallbacks_total{part,reason} other fallbacks taken: attention, speaker, dtype
The counters and gauges are read from the engine's snapshot at scrape time; the histograms are observed
by the engine loop. The API's own metrics are `app.api.metrics`'s, under the same `wavefarm_` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_worker import fallbacks

STEPS = "wavefarm_worker_steps"
FRAMES = "wavefarm_worker_frames"
INSTALLS = "wavefarm_worker_voice_installs"
LIVE_JOBS = "wavefarm_worker_live_jobs"
VOICE_BYTES = "wavefarm_worker_voice_bytes"
ROWS_PER_STEP = "wavefarm_worker_rows_per_step"
FIRST_AUDIO_SECONDS = "wavefarm_worker_first_audio_seconds"
CUDA_GRAPHS = "wavefarm_worker_cuda_graphs"
GRAPH_CAPTURE_SECONDS = "wavefarm_worker_graph_capture_seconds"
GRAPH_BYTES = "wavefarm_worker_graph_bytes"
GRAPH_FALLBACKS = "wavefarm_graph_fallbacks"
WORKER_FALLBACKS = "wavefarm_worker_fallbacks"
GRAPH_PARTS = ("flow", "vocoder")  # what the graph runners wrap: the decode solve, HiFT


class _EngineCollector(Collector):
    """The engine's counters, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        yield CounterMetricFamily(STEPS, "batched decode steps", value=snap.get("batches", 0))
        yield CounterMetricFamily(FRAMES, "mel frames decoded (50 per second of audio)",
                                  value=snap.get("mel_frames", 0))
        installs = CounterMetricFamily(INSTALLS, "voices installed and evicted", labels=["event"])
        installs.add_metric(["installed"], snap.get("installs", 0))
        installs.add_metric(["evicted"], snap.get("evictions", 0))
        yield installs
        yield GaugeMetricFamily(LIVE_JOBS, "jobs in the engine", value=snap["live_jobs"])
        yield GaugeMetricFamily(VOICE_BYTES, "device bytes of installed voices", value=snap["voice_bytes"])
        graphs = GaugeMetricFamily(CUDA_GRAPHS, "CUDA graphs held", labels=["part"])
        capture = CounterMetricFamily(GRAPH_CAPTURE_SECONDS, "seconds spent capturing CUDA graphs",
                                      labels=["part"])
        memory = GaugeMetricFamily(GRAPH_BYTES, "device memory the CUDA graphs' capture took",
                                   labels=["part"])
        for part in GRAPH_PARTS:
            graphs.add_metric([part], snap.get(f"{part}_cuda_graphs", 0))
            capture.add_metric([part], snap.get(f"{part}_graph_capture_s", 0.0))
            memory.add_metric([part], snap.get(f"{part}_graph_bytes", 0))
        yield from (graphs, capture, memory)
        yield from fallback_metrics()


def fallback_metrics() -> Iterator[Metric]:
    """The process's fallbacks (`gpu_worker.fallbacks`), by part and reason."""
    for name, kind, text in ((GRAPH_FALLBACKS, "graph", "CUDA graph buckets that run eagerly instead"),
                             (WORKER_FALLBACKS, "worker", "plain paths taken where an accelerated failed")):
        family = CounterMetricFamily(name, text, labels=["part", "reason"])
        for (part, reason), n in sorted(fallbacks.counts(kind).items()):
            family.add_metric([part, reason], n)
        yield family


class WorkerMetrics:
    """One runtime's metrics in `registry`: the engine's counters (from `snapshot`) and the histograms."""

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = registry
        self.rows_per_step = Histogram(ROWS_PER_STEP, "rows decoded together in one engine step",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        self.first_audio = Histogram(FIRST_AUDIO_SECONDS, "from a job's admission to its first audio",
                                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=registry)
        registry.register(_EngineCollector(snapshot))
