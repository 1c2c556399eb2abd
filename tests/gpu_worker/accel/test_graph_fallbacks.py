"""A CUDA graph that fails to capture, or whose replay differs from the eager call on the startup probe,
leaves its bucket eager (`gpu_worker.fallbacks`): the audio is what the plain module gives, the failure
is logged once and counted in wavefarm_graph_fallbacks_total{part,reason}, and no capture is tried again
for that bucket. Driven on a CPU with stand-in graphs (`tests.support.graphs`), the failures injected."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from app.speech import PROMPT_FRAMES
from gpu_worker import fallbacks
from gpu_worker.accel.flow_graphs import GraphedFlow
from gpu_worker.accel.graph_base import replay_matches
from gpu_worker.accel.graphs import GraphedHiFT
from gpu_worker.worker.metrics import WorkerMetrics
from tests.gpu_worker.accel.test_flow_graphs import decode, decoder_with
from tests.support.fakes import tiny_model
from tests.support.graphs import ReplayGraph, stand_in_record

JOBS = [(130, 1), (105, 2), (80, 3)]


@pytest.fixture(autouse=True)
def one_thread_and_clean_counts():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fallbacks.reset()
    yield
    fallbacks.reset()
    torch.set_num_threads(threads)


class Calls:
    n = 0


def failing_record(self, run):
    Calls.n += 1
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class DriftingGraph(ReplayGraph):
    """A replay that computes something else (as a capture that read a moved tensor would)."""

    def replay(self) -> None:
        super().replay()
        self.outputs[0].add_(0.5)


def drifting_record(self, run):
    outputs = run()
    return DriftingGraph(run, outputs), outputs


def graphed_flow(flow):
    graphed = GraphedFlow(flow, max_rows=8, max_graphs=6)
    graphed.capturable = True  # as on CUDA
    return graphed


def metric_lines() -> str:
    registry = CollectorRegistry()
    WorkerMetrics(registry, lambda: {"live_jobs": 0, "voice_bytes": 0})
    return generate_latest(registry).decode()


@pytest.mark.parametrize(("record", "reason"), [(failing_record, "capture_error"),
                                                (drifting_record, "replay_mismatch")])
def test_a_flow_bucket_whose_graph_fails_runs_eagerly_with_the_eager_audio(monkeypatch, record, reason):
    plain = decode(decoder_with(lambda f: GraphedFlow(f, max_rows=8)), JOBS)  # bucket shapes, eager
    monkeypatch.setattr(GraphedFlow, "_record", record)
    Calls.n = 0
    decoder = decoder_with(graphed_flow)
    lanes = decoder.reserve(PROMPT_FRAMES, 4)
    decoder.model.flow.capture(lanes)  # the worker's start: every row bucket tried once
    graphed = decode(decoder, JOBS)
    flow = decoder.model.flow
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed, strict=True))
    assert flow.graphs == 0 and len(flow._eager) >= 3
    counted = fallbacks.counts("graph")
    assert set(counted) == {("flow", reason)} and counted[("flow", reason)] == len(flow._eager)
    if record is failing_record:
        assert Calls.n == len(flow._eager)  # one try per bucket, never again
    assert f'wavefarm_graph_fallbacks_total{{part="flow",reason="{reason}"}} {len(flow._eager)}.0' in \
        metric_lines()


def test_a_vocoder_shape_whose_capture_fails_runs_eagerly_and_others_keep_their_graphs(monkeypatch):
    from tests.gpu_worker.accel.test_graphs import decode as decode_hift

    plain = decode_hift(decoder_with(None), JOBS)

    def first_fails(self, run):
        if not self._eager:  # the first capture tried
            raise RuntimeError("capture failed")
        return stand_in_record(self, run)

    monkeypatch.setattr(GraphedHiFT, "_record", first_fails)
    hift = GraphedHiFT(tiny_model().hift, max_rows=8, max_graphs=4)
    hift.capturable = True
    decoder = decoder_with(None)
    hift.inner = decoder.model.hift
    decoder.model.hift = hift
    through = decode_hift(decoder, JOBS)
    for a, b in zip(plain, through, strict=True):
        assert torch.equal(a, b)
    assert len(hift._eager) == 1 and hift.graphs >= 1  # the first shape eager, later ones graphed
    assert fallbacks.counts("graph") == {("vocoder", "capture_error"): 1}


def test_replay_matches_allows_rounding_and_names_what_differs():
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    assert replay_matches([x + 1e-6], [x]) is None
    assert "max |replay - eager|" in replay_matches([x + 1e-2], [x])
    assert replay_matches([x.bfloat16() + 0.01], [x.bfloat16()]) is None
    assert "non-finite" in replay_matches([torch.full_like(x, float("nan"))], [x])
    assert "shape" in replay_matches([x[:2]], [x])
