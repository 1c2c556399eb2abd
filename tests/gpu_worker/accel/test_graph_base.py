"""The runner base both CUDA-graph runners build on (`gpu_worker.accel.graph_base.GraphRunner`), over a
toy module on a CPU with the stand-in graph: the wrapped module's attributes read through, a key is
captured the second time it is seen and replayed after, every eager call is counted with its reason, and
a capture that fails or a replay that differs leaves its key eager for good, counted as a fallback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from gpu_worker import fallbacks
from gpu_worker.accel.graph_base import GraphRunner, replay_matches
from tests.support.graphs import ReplayGraph, stand_in_record


@dataclass
class _Slot:
    x: Tensor
    out: tuple[Tensor, ...] = ()
    graph: Any = None


class GraphedLinear(GraphRunner[nn.Linear, int, _Slot]):
    """`linear(x)` keyed by its rows, as a runner does it."""

    def __init__(self, linear: nn.Linear, max_graphs: int) -> None:
        super().__init__(linear, part="toy", key_name="rows", max_graphs=max_graphs, capturable=True)

    def forward(self, x: Tensor) -> Tensor:
        key = x.size(0)
        slot = self._slot_for(key, lambda: self._try_capture(key, lambda: self._capture(key, x), self._probe))
        if slot is None:
            return self.inner(x)
        slot.x.copy_(x)
        slot.graph.replay()
        return slot.out[0].clone()

    def _capture(self, key: int, x: Tensor) -> _Slot:
        slot = _Slot(x.clone())
        (slot.graph, slot.out), _ = self._timed(lambda: self._record(lambda: (self.inner(slot.x),)))
        self._slots[key] = slot
        return slot

    def _probe(self, slot: _Slot) -> str | None:
        slot.graph.replay()
        return replay_matches(slot.out, (self.inner(slot.x),))


@pytest.fixture(autouse=True)
def clean_counts():
    fallbacks.reset()
    yield
    fallbacks.reset()


def runner(monkeypatch, record=stand_in_record, max_graphs: int = 2) -> GraphedLinear:
    monkeypatch.setattr(GraphedLinear, "_record", record)
    return GraphedLinear(nn.Linear(4, 3).requires_grad_(False), max_graphs)


def test_a_key_is_captured_on_its_second_sighting_and_replayed_with_the_eager_bits(monkeypatch) -> None:
    toy = runner(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 4, generator=g)
        assert torch.equal(toy(x), toy.inner(x))
    for rows in (1, 3):  # a third key past max_graphs 2 stays eager, and is a miss once seen again
        toy(torch.randn(rows, 4, generator=g))
        toy(torch.randn(rows, 4, generator=g))
    assert toy.graphs == 2 and sorted(toy._slots) == [1, 2]
    stats = toy.stats()
    assert stats["toy_cuda_graphs"] == 2 and stats["toy_graph_capture_s"] >= 0
    assert stats["toy_graph_replays"] == 2 + 1 and stats["toy_eager_first_sight"] == 3
    assert stats["toy_graph_misses"] == 1 and toy.calls["over_limit"] == 1


def test_the_wrapped_modules_attributes_read_through(monkeypatch) -> None:
    toy = runner(monkeypatch)
    assert toy.in_features == 4 and toy.weight is toy.inner.weight and toy.max_graphs == 2


def failing(self, run):
    raise RuntimeError("operation not permitted when stream is capturing")


class Drifting(ReplayGraph):
    def replay(self) -> None:
        super().replay()
        self.outputs[0].add_(1.0)


def drifting(self, run):
    outputs = run()
    return Drifting(run, outputs), outputs


@pytest.mark.parametrize(("record", "reason"), [(failing, "capture_error"), (drifting, "replay_mismatch")])
def test_a_failed_capture_leaves_its_key_eager_for_good_and_counts_a_fallback(monkeypatch, record,
                                                                              reason) -> None:
    toy = runner(monkeypatch, record)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        assert torch.equal(toy(x), toy.inner(x))
    assert toy.graphs == 0 and toy._eager == {2}
    assert fallbacks.counts("graph") == {("toy", reason): 1}  # tried once, never again
    assert toy.calls == {"first_sight": 1, "fallback": 3} and toy.stats()["toy_graph_misses"] == 3
    toy._forget()  # what a runner does when the tensors its graphs read move: the key may be tried again
    toy(x)
    assert fallbacks.counts("graph") == {("toy", reason): 2}
