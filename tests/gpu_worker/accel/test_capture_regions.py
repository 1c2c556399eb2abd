"""What a CUDA graph captures reads nothing back to the host (issue 41, finding 2): a host read inside a
capture makes CUDA refuse the capture, and the part stays eager for the life of the worker. Checked on a
CPU with `bench.engine.capture_guard`, which runs the region on the meta device (shapes, no data)
under a mode that refuses reads (and copies of host tensors made in the region): the vocoder's call as
`GraphedHiFT` captures it, and the decode step's flow as `GraphedFlow` captures it, at bucket shapes. And
the inverse STFT the vocoder now runs is `torch.istft`'s arithmetic without its read-back."""

from __future__ import annotations

import pytest
import torch

from bench.engine.capture_guard import HostRead, without_data
from bench.engine.decode import steady_rows, warm_streams
from bench.engine.workload import BenchSetup
from gpu_worker.accel.flow_graphs import GraphedFlow
from gpu_worker.model.hift import SourceNoise, inverse_stft
from tests.support.fakes import tiny_model

ISTFT = (16, 4)  # n_fft, hop: the released HiFT's


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: bool(t.sum() > 0),
                                  lambda t: torch.nonzero(t), lambda t: t[t > 0], lambda t: t.tolist(),
                                  lambda t: torch.equal(t, t), lambda t: t + torch.ones(6).to(t.device)],
                         ids=["item", "bool", "nonzero", "boolean-index", "tolist", "equal", "host-copy"])
@pytest.mark.parametrize("inference", [False, True])
def test_the_guard_refuses_every_kind_of_host_read(read, inference: bool) -> None:
    with torch.inference_mode(inference), pytest.raises(HostRead):
        without_data(read, torch.randn(6))


def test_the_guard_sees_the_read_hidden_inside_torch_istft_and_passes_device_work() -> None:
    n_fft, hop = ISTFT
    spec = torch.randn(2, n_fft // 2 + 1, 20, dtype=torch.complex64)
    window = torch.hann_window(n_fft)
    with pytest.raises(HostRead):  # its window-envelope check, inside ATen's C++ body
        without_data(lambda s, w: torch.istft(s, n_fft, hop, n_fft, window=w), spec, window)
    out = without_data(inverse_stft, spec, n_fft, hop, window)
    assert out.device.type == "meta" and out.shape == (2, 19 * hop)
    picked = without_data(lambda t: (t @ t.T).softmax(0)[:, torch.tensor([0, 2])], torch.randn(3, 3))
    assert picked.shape == (3, 2)  # products, softmax and integer indexing need no value


def test_the_vocoder_call_a_graph_captures_reads_nothing_back() -> None:
    """`GraphedHiFT` captures `hift(mel, tail, noise=...)` at a steady chunk's shape (8 cached + 50 new
    frames, a full source tail): with torch.istft in it, every capture failed on CUDA."""
    hift = tiny_model().hift.eval()
    rows, frames = 3, 58
    n = frames * hift.upsample_scale
    h = hift.m_source.n_harmonics
    with torch.inference_mode():
        speech, source = without_data(hift, torch.zeros(rows, 80, frames), torch.zeros(rows, 1, 3840),
                                      noise=SourceNoise(torch.zeros(rows, h), torch.zeros(rows, h, n)))
    assert speech.shape == (rows, n) and source.shape == (rows, 1, n)


def test_the_decode_step_a_graph_captures_reads_nothing_back() -> None:
    """`GraphedFlow` captures `flow.step_lanes(tokens, plan, lanes, window)` at a bucket's shape: three
    warm streams in the bucket of 4, their real plans and lanes, the encoder's chunk and the solve."""
    setup = BenchSetup.build(preset="tiny", device="cpu", dtype="fp32", speaker="standin", micro_batch_size=4)
    seen: list[tuple] = []
    try:
        flow = setup.decoder.model.flow
        setup.decoder.model.flow = GraphedFlow(flow, max_rows=4)  # type: ignore[assignment]
        original = flow.step_lanes

        def spy(*args):
            seen.append(args)
            return original(*args)

        flow.step_lanes = spy  # type: ignore[method-assign]
        with torch.inference_mode():
            streams = warm_streams(setup, 3)
            setup.decoder.step(steady_rows(streams, 50))
            del flow.step_lanes
            tokens, plan, lanes, window = seen[-1]
            assert plan.size(0) == 4  # the bucket's rows, a padding lane riding along
            mel, conv, encoded = without_data(flow.step_lanes, tokens, plan, lanes, window)
    finally:
        setup.close()
    assert mel.device.type == "meta" and mel.size(0) == 4 and len(encoded) == 3


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_the_vocoder_inverse_stft_is_torch_istft_within_1e_6(scale: float) -> None:
    n_fft, hop = ISTFT
    g = torch.Generator().manual_seed(int(scale))
    x = torch.randn(3, n_fft + 2, 58 * 120 + 1, generator=g) * scale  # a steady chunk's frames
    half = n_fft // 2 + 1
    magnitude, phase = torch.exp(x[:, :half]).clamp(max=1e2), torch.sin(x[:, half:])
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float()
    ours, theirs = inverse_stft(spec, n_fft, hop, window), torch.istft(spec, n_fft, hop, n_fft, window=window)
    assert ours.shape == theirs.shape
    assert float((ours - theirs).abs().max()) <= 1e-6 * max(1.0, float(theirs.abs().max()))
    envelope = torch.stack([window.roll(k * hop) for k in range(n_fft // hop)]).square().sum(0)
    assert float(envelope.min()) > 0.5  # the overlap-add the skipped check guards is never near zero
