"""The vocoder in CUDA graphs: `GraphedHiFT` wraps a `HiFTGenerator` with its call signature.

    GraphedHiFT(hift)             `hift(mel, cache_source, noise=...)`, graphed
    graph_hift(hift, max_rows)    wrapped, with the steady shapes captured (the worker's start)

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
have run: a failed capture, `max_graphs` reached, no CUDA), which the GPU check fails on. The counting,
the fallbacks, the capture stream and the pool are the runner base's (`accel.graph_base`), shared with
the flow's runner (`accel.flow_graphs`).

Degrade, never die (`gpu_worker.fallbacks`): each capture is probed at once (the graph replayed on random
inputs against the eager call on the same inputs, `replay_matches`); a capture that raises or a replay
that differs leaves that shape eager for good, logged once and counted in
`wavefarm_graph_fallbacks_total{part="vocoder",reason}`, and the call goes on eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpu_worker.accel.graph_base import GraphRunner, bucket_of, replay_matches, row_buckets
from gpu_worker.model.config import CHUNK_TOKENS, HIFT_MEL_CACHE, HIFT_SOURCE_CACHE, MEL_PER_TOKEN
from gpu_worker.model.hift import HiFTGenerator, SourceNoise

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # rows (a bucket), mel frames, source-tail samples
STEADY_FRAMES = HIFT_MEL_CACHE + CHUNK_TOKENS * MEL_PER_TOKEN  # 58: a continuing chunk with its cached mel


def graph_hift(hift: HiFTGenerator, max_rows: int) -> GraphedHiFT:
    """`hift` wrapped, with a steady chunk's shape (8 cached + 50 new frames, a full source tail)
    captured at every row bucket up to `max_rows` (the worker's micro-batch)."""
    graphed = GraphedHiFT(hift, max_rows=max_rows)
    graphed.capture([(rows, STEADY_FRAMES, HIFT_SOURCE_CACHE) for rows in graphed.buckets])
    log.info("vocoder: %d CUDA graphs captured in %.1f s (%.0f MiB)", graphed.graphs, graphed.capture_s,
             graphed.graph_bytes / 2**20)
    return graphed


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


class GraphedHiFT(GraphRunner[HiFTGenerator, Shape, _Slot]):
    """`hift(mel, cache_source, noise=...)` through static buffers, replayed as CUDA graphs on CUDA.
    Anything else of the module's (upsample_scale, m_source, conv_pre, ...) reads through."""

    def __init__(self, hift: HiFTGenerator, *, max_rows: int = 64, max_graphs: int = 32) -> None:
        super().__init__(hift, part="vocoder", key_name="shape", max_graphs=max_graphs,
                         capturable=hift.conv_pre.weight.device.type == "cuda")
        self.buckets = row_buckets(max_rows)

    def forward(self, mel: Tensor, cache_source: Tensor | None = None, *, noise: SourceNoise | None = None,
                generators: Sequence[torch.Generator] | None = None) -> tuple[Tensor, Tensor]:
        if noise is None or cache_source is None:  # not the decoder's call: as the module runs it
            return self.inner(mel, cache_source, noise=noise, generators=generators)
        rows = mel.size(0)
        shape = (bucket_of(rows, self.buckets), mel.size(2), cache_source.size(2))
        slot = self._slot_for(shape, lambda: self._capture_shape(shape))
        if slot is None:
            return self.inner(mel, cache_source, noise=noise)
        slot.load(mel, cache_source, noise)  # rows past `rows` keep what they held: rows are independent
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
                self._capture_shape(shape)

    # -- buffers and capture ------------------------------------------------------------------------
    def _capture_shape(self, shape: Shape) -> _Slot | None:
        """`shape` captured and probed -> its slot; None (it runs eagerly from now on) if either fails."""
        return self._try_capture(shape, lambda: self._capture(self._slot(shape)), self._probe)

    def _slot(self, shape: Shape) -> _Slot:
        """`shape`'s static buffers (zeros), filed under it."""
        rows, frames, tail = shape
        weight = self.inner.conv_pre.weight
        n = frames * self.inner.upsample_scale
        h = self.inner.m_source.n_harmonics
        device = weight.device
        slot = _Slot(torch.zeros(rows, 80, frames, device=device, dtype=weight.dtype),
                     torch.zeros(rows, 1, tail, device=device),
                     torch.zeros(rows, h, device=device), torch.zeros(rows, h, n, device=device))
        self._slots[shape] = slot
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

    def _capture(self, slot: _Slot) -> _Slot:
        (slot.graph, (slot.speech, slot.source)), took = self._timed(lambda: self._record(
            lambda: self.inner(slot.mel, slot.tail, noise=SourceNoise(slot.phase, slot.noise))))
        log.info("vocoder graph captured for %d rows x %d frames (tail %d) in %.2f s", slot.mel.size(0),
                 slot.mel.size(2), slot.tail.size(2), took)
        return slot
