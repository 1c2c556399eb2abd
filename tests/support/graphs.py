"""A CUDA graph's contract on a CPU, for the graph runners' tests (`gpu_worker.accel`): `replay()`
recomputes the captured call into the same output tensors, which is what a CUDA graph's replay does."""

from __future__ import annotations

from typing import Any


class ReplayGraph:
    def __init__(self, run: Any, outputs: Any) -> None:
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.run(), strict=True):
            out.copy_(new)
        self.replays += 1


def stand_in_record(self: Any, run: Any) -> tuple[ReplayGraph, Any]:
    """In place of a runner's `_record`: the call once (its outputs), and a graph that re-runs it."""
    outputs = run()
    return ReplayGraph(run, outputs), outputs
