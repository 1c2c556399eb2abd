"""The encoder over lanes (`gpu_worker.model.encoder_lanes`): the static-shape pass against the
per-stream one (`Flow.encode_chunks` + the reference's `trim_cache`), past the trims, with rows that
join late, ride along, end on a short last chunk, and padding that never changes a real row.

Both run the same layers on keys laid out differently (right-aligned in fixed buffers, against left-
padded to the batch's longest), so they agree to float rounding: TOL = 1e-5 as the flow's other batch
tests. What the lanes hold after every chunk must be what the reference keeps, frame for frame.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model.encoder_lanes import EncoderShape
from gpu_worker.model.flow import FlowCache, trim_cache
from gpu_worker.model.lanes import Lanes, LaneShape
from tests.gpu_worker.model.ref_oracle import make_prompt, random_tokens, seeded_noise, split_chunks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TOL = 1e-5
PROMPT_TOKENS, TAIL, NEW = 15, 10, 5  # prompt 30 frames >= tail, as 300 >= 100 in production
MAX_NEW = 2 * (NEW + 3)


@pytest.fixture(scope="module")
def voices(tiny_flow):
    noise = seeded_noise(tiny_flow.args, seed=1)
    with torch.inference_mode():
        return [tiny_flow.setup(p.setup_tokens, p.mel, p.spk, noise)[1]
                for p in (make_prompt(PROMPT_TOKENS, seed=seed) for seed in (3, 4))]


def _lanes(flow) -> Lanes:
    a = flow.args
    shape = LaneShape(a.n_timesteps, a.dit.depth, a.dit.num_heads, a.dit.head_dim, a.dit.hidden_size,
                      2 * PROMPT_TOKENS, TAIL, MAX_NEW)
    return Lanes(shape, device=torch.device("cpu"), dtype=torch.float32,
                 encoder=EncoderShape.of(a.encoder, 2 * PROMPT_TOKENS, TAIL))


class Stream:
    def __init__(self, lanes: Lanes, voice: FlowCache) -> None:
        self.lane = lanes.acquire(voice=0)
        lanes.start(self.lane, conv=lanes.conv[:, :, 0], noise=lanes.noise[0], spk=lanes.spk[0],
                    conformer=(voice.conformer_cnn, voice.conformer_att))
        self.cache = FlowCache(conformer_cnn=voice.conformer_cnn, conformer_att=voice.conformer_att)
        self.worst = 0.0


def _step(flow, lanes: Lanes, rows: list[tuple[Stream, torch.Tensor, bool]], pad_rows: int = 0,
          pad_frames: int = 0) -> list[torch.Tensor]:
    """One encoder pass over the lanes (padded to `pad_rows` lanes, `pad_frames` frames), checked row by
    row against each stream encoded alone, then committed and advanced; each row's mu [n, 80]."""
    new = [2 * (t.size(1) if last else t.size(1) - 3) for _, t, last in rows]
    width = max(max(s.lane.index for s, _, _ in rows) + 1, pad_rows)
    frames = max(*new, pad_frames)
    lanes.plan({s.lane.index: n for (s, _, _), n in zip(rows, new, strict=True)}, frames, width)
    plan = lanes.encoder_plan({s.lane.index: (t[0], last) for s, t, last in rows}, frames, width)
    mu, encoded = flow.encode_lanes(plan, lanes.encoder)
    assert mu.shape == (width, frames, 80)
    out = []
    for (stream, tokens, last), n in zip(rows, new, strict=True):
        want, (cache,) = flow.encode_chunks([tokens], [stream.cache], [last])
        got = mu[stream.lane.index, :n]
        out.append(got)
        stream.worst = max(stream.worst, (got - want[0]).abs().max().item())
        assert mu[stream.lane.index, n:].eq(0).all()
        stream.cache = trim_cache(cache, 2 * PROMPT_TOKENS, TAIL)
    lanes.encoder.commit(*encoded)
    for (stream, _, _), n in zip(rows, new, strict=True):
        lanes.advance(stream.lane, n)
        _assert_holds_what_the_reference_keeps(lanes, stream)
    return out


def _assert_holds_what_the_reference_keeps(lanes: Lanes, stream: Stream) -> None:
    enc, i, att = lanes.encoder, stream.lane.index, stream.cache.conformer_att
    n1, (held1, held2) = enc.shape.first_layers, stream.lane.encoded
    assert (held1, held2) == (att.size(3) // 2, att.size(3))
    torch.testing.assert_close(enc.first[:, i, :, enc.shape.first_width - held1:], att[:n1, 0, :, :held1],
                               rtol=0, atol=TOL)
    torch.testing.assert_close(enc.second[:, i, :, enc.shape.second_width - held2:], att[n1:, 0],
                               rtol=0, atol=TOL)
    torch.testing.assert_close(enc.cnn[i], stream.cache.conformer_cnn[0], rtol=0, atol=TOL)


@torch.inference_mode()
def test_encoder_lanes_equal_the_per_stream_encoder_through_the_trims(tiny_flow, voices):
    """Three streams of two voices, twelve chunks: one joins two steps late (its lane absent, then
    present), one ends early on a short last chunk (its lane given back, the highest moved into it),
    stream 0 rides along every third step. Every row's mu and every lane's buffers follow the
    per-stream encoder and the reference's trim, through the first stage's freeze at K1 frames and the
    second stage's sliding window."""
    lanes = _lanes(tiny_flow)
    chunks = [split_chunks(random_tokens(n, seed=20 + i), new=NEW) for i, n in enumerate((62, 23, 71))]
    streams = [Stream(lanes, voices[0]), Stream(lanes, voices[1])]
    done = [0, 0, 0]
    for k in range(40):
        if k == 2:
            streams.append(Stream(lanes, voices[0]))
        rows = [(s, *chunks[i][done[i]]) for i, s in enumerate(streams)
                if done[i] < len(chunks[i]) and not (i == 0 and k % 3 == 1)]  # stream 0 skips a step
        if done == [len(c) for c in chunks]:
            break
        if not rows:
            continue
        _step(tiny_flow, lanes, rows)
        for s, _, last in rows:
            i = streams.index(s)
            done[i] += 1
            if last:
                lanes.release(s.lane)
    assert streams[2].lane.index < 2  # it was moved down when a lower lane was given back
    worst = max(s.worst for s in streams)
    print(f"encoder lanes vs per-stream: max |diff| = {worst:.3g}")
    assert worst < TOL


@torch.inference_mode()
def test_padding_lanes_and_frames_never_change_a_real_row_of_the_encoder(tiny_flow, voices):
    """A graph bucket pads the pass with free lanes and frames past the longest chunk: every real row's mu
    stays within float rounding by shape of the unpadded pass (measured 1.2e-6 at most, by CPU) and of the
    stream encoded alone, and the free lanes stay finite."""
    def run(pad_rows: int, pad_frames: int) -> tuple[list[torch.Tensor], float]:
        lanes = _lanes(tiny_flow)
        streams = [Stream(lanes, voices[i % 2]) for i in range(2)]
        chunks = [split_chunks(random_tokens(40 + 6 * i, seed=50 + i), new=NEW) for i in range(2)]
        mus = []
        for k in range(6):
            rows = [(s, *c[k]) for s, c in zip(streams, chunks, strict=True) if k < len(c)]
            mus += _step(tiny_flow, lanes, rows, pad_rows, pad_frames)
        assert torch.isfinite(lanes.encoder.first).all() and torch.isfinite(lanes.encoder.second).all()
        return mus, max(s.worst for s in streams)

    exact, alone = run(0, 0)
    padded, alone_padded = run(4, MAX_NEW)
    worst = max((a - b).abs().max().item() for a, b in zip(exact, padded, strict=True))
    print(f"encoder, padded to 4 lanes and {MAX_NEW} frames vs unpadded: max |diff| = {worst:.3g}")
    assert worst < 1e-5 and max(alone, alone_padded) < TOL  # 1e-6 held on Zen 5; 1.2e-6 on Zen 3/4


def test_the_encoder_layout_needs_the_references_tiling():
    from gpu_worker.model.config import EncoderArgs

    with pytest.raises(ValueError, match="upsampling of 2"):
        EncoderShape.of(EncoderArgs(up_stride=3), 300, 100)
    assert EncoderShape.of(EncoderArgs(), 300, 100).first_width == 200
