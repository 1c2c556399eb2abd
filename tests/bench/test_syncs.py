"""Host syncs (`bench.engine.syncs`): the counter sees every kind, and a decoder step has none."""

from __future__ import annotations

import pytest
import torch

from bench.engine.syncs import count_syncs
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.accel.flow_graphs import GraphedFlow
from gpu_worker.engine.streams import ChunkRow


def test_the_counter_sees_scalar_reads_data_dependent_shapes_and_nothing_else() -> None:
    x = torch.arange(6.0)

    def work() -> float:
        y = (x * 2 + 1).softmax(0)  # device work: no sync
        picked = y[y > 0.1]  # a boolean index: the output's size depends on the data
        return float(y.sum()) + int(bool(picked.numel() > 0)) + len(torch.nonzero(x).tolist())

    _, count = count_syncs(work)
    assert count.by_op == {"_local_scalar_dense": 1, "index": 1, "nonzero": 1}
    assert count.total == 3 and count.copies_to_host == 0  # a CPU run has no device to copy from
    _, quiet = count_syncs(lambda: (x @ x, x[1:4], x[torch.tensor([0, 2])]))
    assert quiet.total == 0  # integer indexing, slicing and products need no host read


@pytest.mark.parametrize("graph_buckets", [False, True])
def test_a_mixed_decoder_step_needs_no_host_sync(graph_buckets: bool) -> None:
    """First, continuing and last chunks of streams of three voices at different cache lengths in one step:
    every shape comes from Python-side bookkeeping, never from reading a tensor back; the same through the
    graph runner's bucket shapes (what a CUDA worker with graphs runs)."""
    setup = BenchSetup.build(preset="tiny", device="cpu", dtype="fp32", speaker="standin", micro_batch_size=4)
    try:
        dec = setup.decoder
        if graph_buckets:
            dec.model.flow = GraphedFlow(dec.model.flow, max_rows=4)  # type: ignore[assignment]
        with torch.inference_mode():
            old = [dec.open_stream(setup.install(v), seed=v) for v in (0, 1)]
            for k in range(3):
                dec.step([ChunkRow(s, chunk_tokens(28, seed=10 * k + i), False) for i, s in enumerate(old)])
            new = dec.open_stream(setup.install(2), seed=7)  # a third voice
            rows = [ChunkRow(old[0], chunk_tokens(28, seed=90), False),
                    ChunkRow(old[1], chunk_tokens(11, seed=91), True),  # a last chunk of 11 tokens
                    ChunkRow(new, chunk_tokens(28, seed=92), False)]  # a first chunk
            audio, count = count_syncs(lambda: dec.step(rows))
    finally:
        setup.close()
    assert [a.numel() > 0 for a in audio] == [True, True, True]
    assert count.total == 0, count.by_op


def test_the_counter_sees_scalar_reads_under_inference_mode_too() -> None:
    """The decoder runs under `torch.inference_mode()`, where a scalar read reaches a dispatch mode as
    `aten.item` rather than `_local_scalar_dense`: it must count as well."""
    with torch.inference_mode():
        x = torch.arange(6.0)
        _, count = count_syncs(lambda: int(x[1]) + float(x.sum()))
    assert count.total == 2, count.by_op
