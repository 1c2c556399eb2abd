"""The flow's decode step in CUDA graphs: `GraphedFlow` wraps a `Flow` with its call signature.

A decode step's flow is the encoder's chunk (ten conformer layers) and the estimator over 10 Euler
steps with classifier-free guidance (16 blocks of a few dozen kernels each): some five thousand
launches that bound the step on a GPU, not its arithmetic. Over the decoder's lanes (`model/lanes.py`,
`model/encoder_lanes.py`) the whole of it has static shapes and reads every state tensor at a fixed
address, so it is captured whole, once per shape, and replayed:

    bucket(rows, frames) -> the shape a step runs as: rows up to a power of two (`graphs.row_buckets`,
        capped by `max_rows`; the decoder pads with lanes that ride along), new frames up to 50 (a first
        or continuing chunk) or 56 (a step with a last chunk of up to 28 tokens)
    step_lanes(tokens_plan, plan, lanes, window)  `Flow.step_lanes`, graphed: the plans copied into a
        shape's static buffers, its graph replayed; the outputs are the graph's buffers (read them
        before the next call)
    capture(lanes)   the steady shapes (continuing chunks, the voice's last 100 frames) at every row
        bucket, as the worker starts; any other shape is captured the second time it is seen, up to
        `max_graphs`. A capture runs the step twice first (warm-up) on the real inputs: the step writes
        only frame slots no frame that counts holds, and its encoder buffers and conv caches are
        outputs the decoder commits later, so that is harmless
Lanes that grow (more streams than reserved) move their tensors: every graph is dropped and captured
again (`Lanes.version`). On a CPU, and for shapes past `max_graphs`, it runs the flow eagerly.
Everything else (setup solves, `solve_lanes` alone) is the inner flow's, eager. The tests drive the
static-buffer path on a CPU with a stand-in graph (`_record`) and compare bit for bit.

Degrade, never die (`gpu_worker.fallbacks`): each capture is probed at once (a replay against the eager
step on the same plans, `graphs.replay_matches`); a capture that raises or a replay that differs leaves
that bucket eager for good (until the lanes move), logged once and counted in
`wavefarm_graph_fallbacks_total{part="flow",reason}`, and the step goes on eagerly.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from gpu_worker import fallbacks
from gpu_worker.accel.graphs import (
    allocated,
    bucket_of,
    call_stats,
    eager_reason,
    record,
    replay_matches,
    row_buckets,
)
from gpu_worker.model.config import CHUNK_TOKENS, MEL_PER_TOKEN
from gpu_worker.model.flow import CHUNK_FRAMES, Flow
from gpu_worker.model.lanes import Lanes

log = logging.getLogger(__name__)

FRAME_BUCKETS = (MEL_PER_TOKEN * CHUNK_TOKENS, CHUNK_FRAMES)  # 50: a first or continuing chunk; 56
Key = tuple[int, int, int]  # rows, new frames, voice window


Outputs = tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]  # mel, conv caches, encoder buffers


@dataclass
class _Slot:
    tokens: Tensor  # [B, 4 + T_in] int64
    plan: Tensor  # [B, 3 + T + CAP] int64
    out: tuple[Tensor, ...] = ()  # mel, conv, first, second, cnn: the graph's output buffers
    graph: Any = None


class GraphedFlow(nn.Module):
    """`flow.step_lanes(...)` through static buffers, replayed as CUDA graphs on CUDA."""

    def __init__(self, flow: Flow, *, max_rows: int = 64, max_graphs: int = 48) -> None:
        super().__init__()
        self.inner = flow
        self.rows = row_buckets(max_rows)
        self.max_graphs = max_graphs
        self.capturable = next(flow.parameters()).device.type == "cuda"
        self._slots: dict[Key, _Slot] = {}
        self._seen: Counter[Key] = Counter()
        self._eager: set[Key] = set()  # buckets whose capture failed or whose replay differed
        self._version = -1
        self._pool: Any = None
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.calls: Counter[str] = Counter()  # replayed, or eager and why (`graphs.CALLS`)

    def __getattr__(self, name: str) -> Any:  # args, setup_batch, solve_lanes, ...: the flow's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    @property
    def graphs(self) -> int:
        return sum(slot.graph is not None for slot in self._slots.values())

    def stats(self) -> dict[str, float]:
        return {"flow_cuda_graphs": self.graphs, "flow_graph_capture_s": self.capture_s,
                "flow_graph_bytes": self.graph_bytes, **call_stats("flow", self.calls)}

    def bucket(self, rows: int, frames: int) -> tuple[int, int]:
        return bucket_of(rows, self.rows), bucket_of(frames, FRAME_BUCKETS)

    def step_lanes(self, tokens_plan: Tensor, plan: Tensor, lanes: Lanes, window: int) -> Outputs:
        if lanes.version != self._version:  # new tensors: graphs of the old ones would read freed memory
            self._slots.clear()
            self._eager.clear()
            self._version = lanes.version
        key = (plan.size(0), plan.size(1) - 3 - lanes.shape.capacity, window)
        self._seen[key] += 1
        slot = self._slots.get(key)
        if (slot is None and self.capturable and self._seen[key] >= 2 and self.graphs < self.max_graphs
                and key not in self._eager):
            slot = self._try_capture(key, tokens_plan, plan, lanes)
        if slot is None:
            self.calls[eager_reason(self.capturable, self._seen[key], key in self._eager)] += 1
            return self.inner.step_lanes(tokens_plan, plan, lanes, window)
        self.calls["replay"] += 1
        slot.tokens.copy_(tokens_plan, non_blocking=True)
        slot.plan.copy_(plan, non_blocking=True)
        slot.graph.replay()
        mel, conv, *encoded = slot.out
        return mel, conv, (encoded[0], encoded[1], encoded[2])

    @torch.inference_mode()
    def capture(self, lanes: Lanes) -> None:
        """The steady shapes (continuing chunks that see the voice's last `tail` frames) at every row
        bucket the lanes hold, captured now: the worker's start."""
        if not self.capturable:
            return
        self._version = lanes.version
        frames, window = FRAME_BUCKETS[0], lanes.shape.tail
        for rows in self.rows:
            key = (rows, frames, window)
            if (self.graphs >= self.max_graphs or rows > lanes.capacity or key in self._slots
                    or key in self._eager):
                continue
            plan = lanes.plan({}, frames, rows)  # every lane rides along: nothing moves
            tokens = lanes.encoder_plan({}, frames, rows).to(lanes.device)
            self._try_capture(key, tokens, plan.to(lanes.device),
                          lanes)

    def _try_capture(self, key: Key, tokens_plan: Tensor, plan: Tensor, lanes: Lanes) -> _Slot | None:
        """`key` captured and probed -> its slot; None (the bucket runs eagerly) if either fails."""
        try:
            slot = self._capture(key, tokens_plan, plan, lanes)
            graphed = tuple(t.clone() for t in self._replay(slot))
            problem = replay_matches(graphed, self._eager_run(slot, lanes, key[2]))
        except Exception as exc:  # capture raises assorted errors; an eager step beats a dead worker
            self._slots.pop(key, None)
            self._eager.add(key)
            fallbacks.record("graph", "flow", "capture_error", f"bucket {key}: {type(exc).__name__}: {exc}")
            return None
        if problem is not None:
            self._slots.pop(key, None)
            self._eager.add(key)
            fallbacks.record("graph", "flow", "replay_mismatch", f"bucket {key}: {problem}")
            return None
        return slot

    @staticmethod
    def _replay(slot: _Slot) -> tuple[Tensor, ...]:
        slot.graph.replay()
        return slot.out

    def _eager_run(self, slot: _Slot, lanes: Lanes, window: int) -> tuple[Tensor, ...]:
        mel, conv, encoded = self.inner.step_lanes(slot.tokens, slot.plan, lanes, window)
        return mel, conv, *encoded

    def _capture(self, key: Key, tokens_plan: Tensor, plan: Tensor, lanes: Lanes) -> _Slot:
        start, before = time.perf_counter(), allocated()
        slot = _Slot(tokens_plan.clone(), plan.clone())
        window = key[2]

        def run() -> tuple[Tensor, ...]:
            mel, conv, encoded = self.inner.step_lanes(slot.tokens, slot.plan, lanes, window)
            return mel, conv, *encoded

        slot.graph, slot.out = self._record(run)
        self._slots[key] = slot
        took = time.perf_counter() - start
        self.capture_s += took
        self.graph_bytes += max(0, allocated() - before)
        log.info("flow step graph captured for %d lanes x %d frames (voice window %d) in %.2f s", *key, took)
        return slot

    def _record(self, run: Any) -> tuple[Any, tuple[Tensor, ...]]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record(run, self._pool)


def graph_flow(flow: Flow, lanes: Lanes, max_rows: int) -> GraphedFlow:
    """`flow` wrapped, with the steady shapes captured for every row bucket up to `max_rows`."""
    graphed = GraphedFlow(flow, max_rows=max_rows)
    graphed.capture(lanes)
    log.info("flow: %d CUDA graphs captured in %.1f s (%.0f MiB)", graphed.graphs, graphed.capture_s,
             graphed.graph_bytes / 2**20)
    return graphed
