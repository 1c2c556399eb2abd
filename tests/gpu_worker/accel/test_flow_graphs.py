"""The decode step's graph runner (`gpu_worker.accel.flow_graphs`: the encoder and the solve) on a CPU:
its buckets' shapes run eagerly where nothing is captured, and its static-buffer path is driven by a
stand-in graph that re-runs the captured call on the same buffers (what a CUDA graph's replay does):
the audio must be the same bits as the same shapes run eagerly, and within float rounding of the
decoder's exact shapes."""

from __future__ import annotations

import pytest
import torch

from app.speech import PROMPT_FRAMES, VOCAB_SIZE
from gpu_worker.accel.flow_graphs import FRAME_BUCKETS, GraphedFlow
from gpu_worker.accel.graph_base import row_buckets
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.engine.streams import ChunkRow, plan_chunks
from gpu_worker.voices.prompt import install_voice
from tests.support.fakes import FakeSpeaker, host_features, tiny_model
from tests.support.graphs import stand_in_record

JOBS = [(200, 1), (130, 2), (105, 3), (60, 4), (45, 5)]  # 5 rows (bucket 8), lasts apart, one to 300+ frames


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def decoder_with(flow) -> StreamingDecoder:
    model = tiny_model()
    if flow is not None:
        model.flow = flow(model.flow)
    return StreamingDecoder(model, device="cpu", dtype=torch.float32, micro_batch_size=8)


def decode(decoder: StreamingDecoder, jobs=JOBS) -> list[torch.Tensor]:
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


def capturing(flow) -> GraphedFlow:
    graphed = GraphedFlow(flow, max_rows=8, max_graphs=6)
    graphed.capturable = True  # as on CUDA
    return graphed


def test_the_decoder_through_captured_solve_graphs_gives_the_bits_of_its_buckets_run_eagerly(monkeypatch):
    monkeypatch.setattr(GraphedFlow, "_record", stand_in_record)
    exact = decode(decoder_with(None))
    buckets = decode(decoder_with(lambda f: GraphedFlow(f, max_rows=8)))  # a CPU: eager, bucket shapes
    decoder = decoder_with(capturing)
    graphed = decode(decoder)
    flow = decoder.model.flow
    assert all(torch.equal(a, b) for a, b in zip(buckets, graphed, strict=True))
    worst = max((a - b).abs().max().item() for a, b in zip(exact, graphed, strict=True))
    print(f"graph buckets vs exact shapes: max |diff| = {worst:.3g}")
    assert worst < 1e-4  # the decoder tests' batch tolerance: rounding by shape only
    assert all(a.numel() == 960 * n for a, (n, _) in zip(graphed, JOBS, strict=True))
    assert 1 <= flow.graphs <= 6 and sum(s.graph.replays for s in flow._slots.values()) >= 2
    assert all(b in row_buckets(8) and t in FRAME_BUCKETS for b, t, _ in flow._slots)
    assert {w for _, _, w in flow._slots} <= {100, PROMPT_FRAMES}
    stats = decoder.stats()
    assert stats["flow_cuda_graphs"] == flow.graphs and stats["flow_graph_capture_s"] > 0


def test_capture_at_start_covers_every_row_bucket_and_growing_lanes_drops_the_graphs(monkeypatch):
    monkeypatch.setattr(GraphedFlow, "_record", stand_in_record)
    decoder = decoder_with(capturing)
    lanes = decoder.reserve(PROMPT_FRAMES, 4)
    flow = decoder.model.flow
    flow.capture(lanes)
    assert sorted(flow._slots) == [(b, FRAME_BUCKETS[0], 100) for b in (1, 2, 4)]  # the lanes hold 4
    decode(decoder, JOBS[:4])  # 4 streams: the reserved lanes, no growth
    assert lanes.version == flow._version and flow.graphs >= 3
    decode(decoder, JOBS)  # 5 streams: the lanes grow, the graphs of the old tensors go
    assert lanes.capacity >= 5 and flow._version == lanes.version
    assert all(slot.graph.replays >= 0 for slot in flow._slots.values())


def test_a_cpu_captures_nothing_and_runs_the_flow_itself():
    cpu = GraphedFlow(tiny_model().flow, max_rows=8)
    assert not cpu.capturable and cpu.bucket(3, 50) == (4, 50) and cpu.bucket(5, 51) == (8, 56)
    assert cpu.bucket(9, 50) == (9, 50)  # past the largest bucket: its own shape, eager
    assert cpu.stats() == {"flow_cuda_graphs": 0, "flow_graph_capture_s": 0.0, "flow_graph_bytes": 0,
                           "flow_graph_replays": 0, "flow_eager_first_sight": 0, "flow_graph_misses": 0}
    assert cpu.args is cpu.inner.args  # everything but the decode solve is the flow's own
