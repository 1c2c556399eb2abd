"""The vocoder's graph runner (`gpu_worker.accel.graphs`) on a CPU: eager where nothing is captured, and
its static-buffer path driven by a stand-in graph that re-runs the captured call on the same buffers,
which is what a CUDA graph's replay does. The audio must be the same bits as the plain module's."""

from __future__ import annotations

import copy

import pytest
import torch

from app.speech import VOCAB_SIZE
from gpu_worker.accel.graphs import GraphedHiFT, row_buckets
from gpu_worker.decoder import StreamingDecoder
from gpu_worker.prompt import install_voice
from gpu_worker.streams import ChunkRow, plan_chunks
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
    assert cpu.stats() == {"vocoder_cuda_graphs": 0, "vocoder_graph_capture_s": 0.0, "vocoder_graph_bytes": 0}


def test_row_buckets_are_powers_of_two_up_to_the_micro_batch() -> None:
    assert row_buckets(8) == (1, 2, 4, 8)
    assert row_buckets(12) == (1, 2, 4, 8, 12)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
