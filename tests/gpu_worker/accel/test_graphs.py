"""The vocoder's graph runner (`gpu_worker.accel.graphs`) on a CPU: eager where nothing is captured, and
its static-buffer path driven by a stand-in graph that re-runs the captured call on the same buffers,
which is what a CUDA graph's replay does. The audio must be the same bits as the plain module's."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from app.speech import VOCAB_SIZE
from gpu_worker.accel import graph_base
from gpu_worker.accel.graph_base import row_buckets
from gpu_worker.accel.graphs import GraphedHiFT
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.engine.streams import ChunkRow, plan_chunks
from gpu_worker.voices.prompt import install_voice
from tests.support.fakes import FakeSpeaker, host_features, tiny_model
from tests.support.graphs import stand_in_record


@pytest.fixture
def graphed(monkeypatch) -> GraphedHiFT:
    monkeypatch.setattr(GraphedHiFT, "_record", stand_in_record)
    torch.set_num_threads(1)
    hift = GraphedHiFT(tiny_model().hift, max_rows=8, max_graphs=3)
    hift.capturable = True  # as on CUDA
    return hift


def decode(decoder: StreamingDecoder, jobs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Jobs (tokens, seed) over two voices, stepped together; each job's whole audio."""
    voices = [install_voice(host_features(f"{i:064x}", seed=i), speaker=FakeSpeaker(), decoder=decoder)
              for i in range(2)]
    streams = [decoder.open_stream(voices[j % 2], seed) for j, (_, seed) in enumerate(jobs)]
    tokens = [torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed))
              for n, seed in jobs]
    plans = [plan_chunks(t.numel()) for t in tokens]
    audio: list[list[torch.Tensor]] = [[] for _ in jobs]
    for step in range(max(len(p) for p in plans)):
        live = [j for j, p in enumerate(plans) if step < len(p)]
        rows = [ChunkRow(streams[j], tokens[j][plans[j][step].start:plans[j][step].stop], plans[j][step].last)
                for j in live]
        for j, out in zip(live, decoder.step(rows), strict=True):
            audio[j].append(out)
    return [torch.cat(a) for a in audio]


def test_the_decoder_through_captured_graphs_gives_the_same_bits_as_without(graphed: GraphedHiFT) -> None:
    model = tiny_model()
    jobs = [(130, 1), (105, 2), (80, 3)]  # 3 steady rows (bucket 4), then 2, then 1; last chunks apart
    plain = decode(StreamingDecoder(model, device="cpu", dtype=torch.float32, micro_batch_size=8), jobs)
    model.hift = copy.deepcopy(graphed)
    model.hift.inner = tiny_model().hift
    through = decode(StreamingDecoder(model, device="cpu", dtype=torch.float32, micro_batch_size=8), jobs)
    for a, b in zip(plain, through, strict=True):
        assert torch.equal(a, b)
    stats = model.hift.stats()
    assert 1 <= stats["vocoder_cuda_graphs"] <= 3  # the steady shapes seen twice, within max_graphs
    replays = sum(s.graph.replays for s in model.hift._slots.values())
    assert replays >= 2 and all(shape[0] in row_buckets(8) for shape in model.hift._slots)


def test_a_shape_is_captured_on_its_second_sighting_and_padding_rows_change_no_real_row(
        graphed: GraphedHiFT) -> None:
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(3, 80, 12, generator=g)
    tail = torch.randn(3, 1, 480, generator=g)
    noise = graphed.draw_noise([torch.Generator().manual_seed(i) for i in range(3)], 12)
    eager = graphed.inner(mel, tail, noise=noise)
    first = graphed(mel, tail, noise=noise)
    assert graphed.graphs == 0  # seen once: eager
    second = graphed(mel, tail, noise=noise)
    assert graphed.graphs == 1 and list(graphed._slots) == [(4, 12, 480)]  # 3 rows in the bucket of 4
    third = graphed(mel[:2], tail[:2], noise=type(noise)(noise.phase[:2], noise.noise[:2]))  # bucket 2
    for out in (first, second):
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    assert torch.equal(third[0], eager[0][:2])  # the bucket-4 buffers' stale row 3 is not read


def test_no_more_graphs_than_allowed_and_nothing_captured_where_capture_is_impossible(
        graphed: GraphedHiFT) -> None:
    g = torch.Generator().manual_seed(1)
    for frames in (10, 11, 12, 13, 14):
        mel = torch.randn(1, 80, frames, generator=g)
        noise = graphed.draw_noise([torch.Generator().manual_seed(frames)], frames)
        for _ in range(2):
            out = graphed(mel, torch.zeros(1, 1, 0), noise=noise)
        assert torch.equal(out[0], graphed.inner(mel, torch.zeros(1, 1, 0), noise=noise)[0])
    assert graphed.graphs == graphed.max_graphs == 3
    cpu = GraphedHiFT(tiny_model().hift)
    assert not cpu.capturable
    cpu.capture([(1, 58, 3840), (2, 58, 3840)])
    assert cpu.stats() == {"vocoder_cuda_graphs": 0, "vocoder_graph_capture_s": 0.0, "vocoder_graph_bytes": 0,
                           "vocoder_graph_replays": 0, "vocoder_eager_first_sight": 0,
                           "vocoder_graph_misses": 0}
    mel = torch.zeros(1, 80, 10)
    noise = cpu.draw_noise([torch.Generator().manual_seed(0)], 10)
    for _ in range(2):
        cpu(mel, torch.zeros(1, 1, 0), noise=noise)
    assert cpu.stats()["vocoder_graph_misses"] == 2  # eager where no graph can be: a miss (not on CUDA)


def test_row_buckets_are_powers_of_two_up_to_the_micro_batch() -> None:
    assert row_buckets(8) == (1, 2, 4, 8)
    assert row_buckets(12) == (1, 2, 4, 8, 12)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


class FakeCuda:
    """torch.cuda's stream and graph calls as `graph_base.record` makes them, recorded (no GPU here)."""

    def __init__(self) -> None:
        self.streams: list[object] = []
        self.captured_on: list[object] = []
        self.current: object = "main stream"

    def Stream(self):  # noqa: N802 - torch.cuda's name
        stream = type("Stream", (), {"wait_stream": lambda s, other: None})()
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        yield
        self.current = previous

    def current_stream(self):
        return type("Current", (), {"wait_stream": lambda s, other: None})()

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        self.captured_on.append(stream)
        with self.stream(stream):  # torch.cuda.graph makes the stream it captures on the current one
            yield


def test_every_capture_warms_up_and_records_on_one_stream_per_device(monkeypatch) -> None:
    """Issue 41, finding 7: a new side stream per capture held a cuBLAS workspace per capture."""
    fake = FakeCuda()
    for name in ("Stream", "stream", "current_stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(graph_base, "_CAPTURE_STREAMS", {})
    warmed_on: list[object] = []
    for _ in range(3):
        graph_base.record(lambda: warmed_on.append(fake.current) or (torch.zeros(1),), pool=None)
    assert len(fake.streams) == 1
    assert fake.captured_on == fake.streams * 3 and set(map(id, warmed_on)) == {id(fake.streams[0])}


def test_the_runner_counts_replays_first_sightings_and_misses(graphed: GraphedHiFT, monkeypatch) -> None:
    g = torch.Generator().manual_seed(2)
    for frames in (10, 11, 12, 13, 14):  # max_graphs 3: the fourth and fifth shapes miss their graph
        mel = torch.randn(1, 80, frames, generator=g)
        noise = graphed.draw_noise([torch.Generator().manual_seed(frames)], frames)
        for _ in range(3):
            graphed(mel, torch.zeros(1, 1, 0), noise=noise)
    stats = graphed.stats()
    assert stats["vocoder_eager_first_sight"] == 5 and stats["vocoder_graph_replays"] == 3 * 2
    assert stats["vocoder_graph_misses"] == 2 * 2  # seen again, no graph: what the GPU check fails on
