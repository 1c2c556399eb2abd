"""The flow's decode step in CUDA graphs: `GraphedFlow` wraps a `Flow` with its call signature.

A decode step's flow is the encoder's chunk (ten conformer layers) and the estimator over 10 Euler
steps with classifier-free guidance (16 blocks of a few dozen kernels each): some five thousand
launches that bound the step on a GPU, not its arithmetic. Over the decoder's lanes (`model/lanes.py`,
`model/encoder_lanes.py`) the whole of it has static shapes and reads every state tensor at a fixed
address, so it is captured whole, once per shape, and replayed:

    bucket(rows, frames) -> the shape a step runs as: rows up to a power of two (`graph_base.row_buckets`,
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

The counting, the fallbacks, the capture stream and the pool are the runner base's (`accel.graph_base`),
shared with the vocoder's runner (`accel.graphs`).

Degrade, never die (`gpu_worker.fallbacks`): each capture is probed at once (a replay against the eager
step on the same plans, `graph_base.replay_matches`); a capture that raises or a replay that differs leaves
that bucket eager for good (until the lanes move), logged once and counted in
`wavefarm_graph_fallbacks_total{part="flow",reason}`, and the step goes on eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpu_worker.accel.graph_base import GraphRunner, bucket_of, replay_matches, row_buckets
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


class GraphedFlow(GraphRunner[Flow, Key, _Slot]):
    """`flow.step_lanes(...)` through static buffers, replayed as CUDA graphs on CUDA. Anything else of the
    flow's (args, setup_batch, solve_lanes, ...) reads through."""

    def __init__(self, flow: Flow, *, max_rows: int = 64, max_graphs: int = 48) -> None:
        super().__init__(flow, part="flow", key_name="bucket", max_graphs=max_graphs,
                         capturable=next(flow.parameters()).device.type == "cuda")
        self.rows = row_buckets(max_rows)
        self._version = -1

    def bucket(self, rows: int, frames: int) -> tuple[int, int]:
        return bucket_of(rows, self.rows), bucket_of(frames, FRAME_BUCKETS)

    def step_lanes(self, tokens_plan: Tensor, plan: Tensor, lanes: Lanes, window: int) -> Outputs:
        if lanes.version != self._version:  # new tensors: graphs of the old ones would read freed memory
            self._forget()
            self._version = lanes.version
        key = (plan.size(0), plan.size(1) - 3 - lanes.shape.capacity, window)
        slot = self._slot_for(key, lambda: self._capture_key(key, tokens_plan, plan, lanes))
        if slot is None:
            return self.inner.step_lanes(tokens_plan, plan, lanes, window)
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
            self._capture_key(key, tokens, plan.to(lanes.device), lanes)

    def _capture_key(self, key: Key, tokens_plan: Tensor, plan: Tensor, lanes: Lanes) -> _Slot | None:
        """`key` captured and probed (a replay against the eager step on the same plans) -> its slot;
        None (the bucket runs eagerly until the lanes move) if either fails."""
        def probe(slot: _Slot) -> str | None:
            graphed = tuple(t.clone() for t in self._replay(slot))
            return replay_matches(graphed, self._eager_run(slot, lanes, key[2]))

        return self._try_capture(key, lambda: self._capture(key, tokens_plan, plan, lanes), probe)

    @staticmethod
    def _replay(slot: _Slot) -> tuple[Tensor, ...]:
        slot.graph.replay()
        return slot.out

    def _eager_run(self, slot: _Slot, lanes: Lanes, window: int) -> tuple[Tensor, ...]:
        mel, conv, encoded = self.inner.step_lanes(slot.tokens, slot.plan, lanes, window)
        return mel, conv, *encoded

    def _capture(self, key: Key, tokens_plan: Tensor, plan: Tensor, lanes: Lanes) -> _Slot:
        def capture() -> _Slot:
            slot = _Slot(tokens_plan.clone(), plan.clone())
            slot.graph, slot.out = self._record(lambda: self._eager_run(slot, lanes, key[2]))
            self._slots[key] = slot
            return slot

        slot, took = self._timed(capture)
        log.info("flow step graph captured for %d lanes x %d frames (voice window %d) in %.2f s", *key, took)
        return slot


def graph_flow(flow: Flow, lanes: Lanes, max_rows: int) -> GraphedFlow:
    """`flow` wrapped, with the steady shapes captured for every row bucket up to `max_rows`."""
    graphed = GraphedFlow(flow, max_rows=max_rows)
    graphed.capture(lanes)
    log.info("flow: %d CUDA graphs captured in %.1f s (%.0f MiB)", graphed.graphs, graphed.capture_s,
             graphed.graph_bytes / 2**20)
    return graphed
