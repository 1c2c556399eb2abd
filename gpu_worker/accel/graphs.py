"""CUDA graphs around the model: the pieces both runners share, and the vocoder's runner.

    row_buckets(max_rows), record(run, pool),     shared by `GraphedHiFT` and `flow_graphs.GraphedFlow`
    capture_stream(), eager_reason, call_stats
    GraphedHiFT(hift)                             `hift(mel, cache_source, noise=...)`, graphed

A decode step vocodes each group of rows of one shape with one HiFT call: dozens of small convolutions
whose launches, not their arithmetic, bound it on a GPU. `GraphedHiFT` keys a call by its shape (rows
rounded up to a bucket, mel frames, source-tail samples; HiFT's rows are independent, so a padding row
never changes a real one). On CUDA a shape is captured as a CUDA graph the second time it is seen (a
one-off shape, such as a job's last chunk, stays eager) and replayed from then on: the inputs are copied
into the graph's static buffers, the graph runs, its outputs are copied out. `capture(shapes)` captures
the steady ones when the worker starts. On a CPU, and for shapes past `max_graphs`, the module runs
eagerly. The tests drive the static-buffer path on a CPU with a stand-in graph that re-runs the
captured call on the same buffers (`_record`), and compare bit for bit.

Randomness is an input (`SourceNoise`, drawn by the decoder from each stream's generator), so a replay
computes what the eager call computes. `stats()`: graphs held, capture seconds, graph pool bytes, and the
decoder's calls: replayed, eager on a shape's first sighting, and misses (eager where a graph should
have run: a failed capture, `max_graphs` reached, no CUDA), which the GPU check fails on. Every capture
of the process (the flow's too) warms up and records on one stream per device (`capture_stream`).

Degrade, never die (`gpu_worker.fallbacks`): each capture is probed at once (the graph replayed on random
inputs against the eager call on the same inputs, `replay_matches`); a capture that raises or a replay
that differs leaves that shape eager for good, logged once and counted in
`wavefarm_graph_fallbacks_total{part="vocoder",reason}`, and the call goes on eagerly.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from gpu_worker import fallbacks
from gpu_worker.model.config import CHUNK_TOKENS, HIFT_MEL_CACHE, HIFT_SOURCE_CACHE, MEL_PER_TOKEN
from gpu_worker.model.hift import HiFTGenerator, SourceNoise

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # rows (a bucket), mel frames, source-tail samples
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
STEADY_FRAMES = HIFT_MEL_CACHE + CHUNK_TOKENS * MEL_PER_TOKEN  # 58: a continuing chunk with its cached mel


def graph_hift(hift: HiFTGenerator, max_rows: int) -> GraphedHiFT:
    """`hift` wrapped, with a steady chunk's shape (8 cached + 50 new frames, a full source tail)
    captured at every row bucket up to `max_rows` (the worker's micro-batch)."""
    graphed = GraphedHiFT(hift, max_rows=max_rows)
    graphed.capture([(rows, STEADY_FRAMES, HIFT_SOURCE_CACHE) for rows in graphed.buckets])
    log.info("vocoder: %d CUDA graphs captured in %.1f s (%.0f MiB)", graphed.graphs, graphed.capture_s,
             graphed.graph_bytes / 2**20)
    return graphed


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts graphs are made for: powers of two up to `max_rows`, and `max_rows` itself."""
    return tuple(sorted({b for b in BUCKETS if b < max_rows} | {max_rows}))


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding n (n itself past the largest: that shape runs eagerly)."""
    return next((b for b in buckets if b >= n), n)


_CAPTURE_STREAMS: dict[int, Any] = {}  # device index -> the stream every capture on it uses


def capture_stream() -> Any:
    """The one stream this process warms graphs up and captures them on, per device. A stream that runs a
    matrix product gets a cuBLAS workspace of its own, so a new stream per capture held one per capture;
    warming up on the capture stream itself also makes that workspace before the capture, not in it."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


def record(run: Any, pool: Any) -> tuple[Any, Any]:
    """`run` warmed up on the capture stream (as capture requires; the warm-up runs are real calls), then
    captured there into `pool` (a `torch.cuda.graph_pool_handle()`): -> (the graph, the outputs it writes
    on every replay). Capture only records: replay the graph for its first outputs."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs


# Why a decoder call ran eagerly: `first_sight` (a shape is captured the second time it is seen: by design),
# `fallback` (its capture failed or its replay differed: counted in gpu_worker.fallbacks too),
# `over_limit` (max_graphs held already), `not_capturable` (not on CUDA). The last three are misses: on
# CUDA a bucket that should have run as a graph did not (the GPU check fails on them).
CALLS = ("replay", "first_sight", "fallback", "over_limit", "not_capturable")
MISSES = ("fallback", "over_limit", "not_capturable")


def eager_reason(capturable: bool, seen: int, failed: bool) -> str:
    if not capturable:
        return "not_capturable"
    if failed:
        return "fallback"
    return "first_sight" if seen < 2 else "over_limit"


def call_stats(part: str, calls: Counter[str]) -> dict[str, float]:
    """A runner's calls as stats: replays, eager first sightings and misses (`CALLS`)."""
    return {f"{part}_graph_replays": calls["replay"], f"{part}_eager_first_sight": calls["first_sight"],
            f"{part}_graph_misses": sum(calls[k] for k in MISSES)}


def replay_matches(graphed: Sequence[Tensor], eager: Sequence[Tensor]) -> str | None:
    """None if a replay's outputs are the eager call's within rounding (float32: 1e-4, half types: 3e-2,
    of the larger of 1 and the eager output's magnitude), else what differs."""
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        if a.shape != b.shape:
            return f"output {i}: shape {tuple(a.shape)} against {tuple(b.shape)}"
        if a.numel() == 0 or not a.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        x, y = a.float(), b.float()
        finite = torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), finite):
            return f"output {i}: non-finite values where eager has none (or the reverse)"
        scale = max(1.0, float(y[finite].abs().max()) if bool(finite.any()) else 1.0)
        diff = float(torch.where(finite, (x - y).abs(), torch.zeros_like(x)).max())
        if diff > (1e-4 if b.dtype == torch.float32 else 3e-2) * scale:
            return f"output {i}: max |replay - eager| = {diff:.3g} (scale {scale:.3g})"
    return None


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


@dataclass
class _Slot:
    """A shape's static buffers, and its graph once captured."""

    mel: Tensor  # [B, 80, T]
    tail: Tensor  # [B, 1, Nc]
    phase: Tensor  # [B, H]
    noise: Tensor  # [B, H, T * 480]
    speech: Tensor | None = None  # the outputs the graph writes
    source: Tensor | None = None
    graph: Any = None  # torch.cuda.CUDAGraph (replay())

    def load(self, mel: Tensor, tail: Tensor, noise: SourceNoise) -> None:
        rows = mel.size(0)
        self.mel[:rows].copy_(mel)
        self.tail[:rows].copy_(tail)
        self.phase[:rows].copy_(noise.phase)
        self.noise[:rows].copy_(noise.noise)


class GraphedHiFT(nn.Module):
    """`hift(mel, cache_source, noise=...)` through static buffers, replayed as CUDA graphs on CUDA."""

    def __init__(self, hift: HiFTGenerator, *, max_rows: int = 64, max_graphs: int = 32) -> None:
        super().__init__()
        self.inner = hift
        self.buckets = row_buckets(max_rows)
        self.max_graphs = max_graphs
        self.capturable = hift.conv_pre.weight.device.type == "cuda"
        self._slots: dict[Shape, _Slot] = {}
        self._seen: Counter[Shape] = Counter()
        self._eager: set[Shape] = set()  # shapes whose capture failed or whose replay differed
        self._pool: Any = None
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.calls: Counter[str] = Counter()  # the decoder's calls: replayed, or eager and why (CALLS)

    def __getattr__(self, name: str) -> Any:  # upsample_scale, m_source, conv_pre, ...: the module's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    @property
    def graphs(self) -> int:
        return sum(slot.graph is not None for slot in self._slots.values())

    def stats(self) -> dict[str, float]:
        return {"vocoder_cuda_graphs": self.graphs, "vocoder_graph_capture_s": self.capture_s,
                "vocoder_graph_bytes": self.graph_bytes, **call_stats("vocoder", self.calls)}

    def forward(self, mel: Tensor, cache_source: Tensor | None = None, *, noise: SourceNoise | None = None,
                generators: Sequence[torch.Generator] | None = None) -> tuple[Tensor, Tensor]:
        if noise is None or cache_source is None:  # not the decoder's call: as the module runs it
            return self.inner(mel, cache_source, noise=noise, generators=generators)
        rows = mel.size(0)
        shape = (self._bucket(rows), mel.size(2), cache_source.size(2))
        self._seen[shape] += 1
        slot = self._slots.get(shape)
        if (slot is None and self.capturable and self._seen[shape] >= 2 and self.graphs < self.max_graphs
                and shape not in self._eager):
            slot = self._try_capture(shape)
        if slot is None:
            self.calls[eager_reason(self.capturable, self._seen[shape], shape in self._eager)] += 1
            return self.inner(mel, cache_source, noise=noise)
        slot.load(mel, cache_source, noise)  # rows past `rows` keep what they held: rows are independent
        self.calls["replay"] += 1
        slot.graph.replay()
        assert slot.speech is not None and slot.source is not None
        return slot.speech[:rows].clone(), slot.source[:rows].clone()

    def capture(self, shapes: Iterable[Shape]) -> None:
        """Capture these shapes now (the worker's start: the steady chunk at every row count it may run)."""
        if not self.capturable:
            return
        for shape in shapes:
            if self.graphs >= self.max_graphs:
                break
            if shape not in self._slots and shape not in self._eager:
                self._try_capture(shape)

    # -- buffers and capture ------------------------------------------------------------------------
    def _bucket(self, rows: int) -> int:
        return bucket_of(rows, self.buckets)

    def _slot(self, shape: Shape, mel: Tensor, tail: Tensor, noise: SourceNoise) -> _Slot:
        slot = self._slots.get(shape)
        if slot is None:
            slot = _Slot(torch.zeros_like(mel), torch.zeros_like(tail), torch.zeros_like(noise.phase),
                         torch.zeros_like(noise.noise))
            self._slots[shape] = slot
        return slot

    def _example(self, shape: Shape) -> tuple[Tensor, Tensor, SourceNoise]:
        rows, frames, tail = shape
        weight = self.inner.conv_pre.weight
        n = frames * self.inner.upsample_scale
        h = self.inner.m_source.n_harmonics
        return (torch.zeros(rows, 80, frames, device=weight.device, dtype=weight.dtype),
                torch.zeros(rows, 1, tail, device=weight.device),
                SourceNoise(torch.zeros(rows, h, device=weight.device),
                            torch.zeros(rows, h, n, device=weight.device)))

    def _try_capture(self, shape: Shape) -> _Slot | None:
        """`shape` captured and probed -> its slot; None (it runs eagerly from now on) if either fails."""
        try:
            slot = self._slot(shape, *self._example(shape))
            self._capture(slot)
            problem = self._probe(slot)
        except Exception as exc:  # capture raises assorted errors; an eager vocoder beats a dead worker
            self._slots.pop(shape, None)
            self._eager.add(shape)
            fallbacks.record("graph", "vocoder", "capture_error",
                             f"shape {shape}: {type(exc).__name__}: {exc}")
            return None
        if problem is not None:
            self._slots.pop(shape, None)
            self._eager.add(shape)
            fallbacks.record("graph", "vocoder", "replay_mismatch", f"shape {shape}: {problem}")
            return None
        return slot

    def _probe(self, slot: _Slot) -> str | None:
        """The graph replayed on random inputs against the eager call on the same inputs."""
        g = torch.Generator(device="cpu").manual_seed(1234)
        for buffer in (slot.mel, slot.tail, slot.phase, slot.noise):
            buffer.copy_(torch.randn(buffer.shape, generator=g).to(buffer.device, buffer.dtype))
        slot.graph.replay()
        assert slot.speech is not None and slot.source is not None
        replayed = (slot.speech.clone(), slot.source.clone())
        eager = self.inner(slot.mel, slot.tail, noise=SourceNoise(slot.phase, slot.noise))
        return replay_matches(replayed, eager)

    def _capture(self, slot: _Slot) -> None:
        start, before = time.perf_counter(), allocated()
        slot.graph, (slot.speech, slot.source) = self._record(
            lambda: self.inner(slot.mel, slot.tail, noise=SourceNoise(slot.phase, slot.noise)))
        took = time.perf_counter() - start
        self.capture_s += took
        self.graph_bytes += max(0, allocated() - before)
        log.info("vocoder graph captured for %d rows x %d frames (tail %d) in %.2f s", slot.mel.size(0),
                 slot.mel.size(2), slot.tail.size(2), took)

    def _record(self, run: Any) -> tuple[Any, tuple[Tensor, Tensor]]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record(run, self._pool)
