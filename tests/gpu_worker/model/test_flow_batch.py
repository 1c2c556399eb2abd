"""Batch invariance of the masked streaming solve: a row's mel and caches do not depend on its batch.

Eight streams of three voices start at staggered steps, so batches mix first, continuing and last
chunks, different voices, noise buffers, estimator and conformer cache lengths (trimmed ones included)
and chunk sizes; the encoder, too, runs once over all rows (left-padded caches, right-padded chunks).
Decoded together (one `stream_chunks` call per step) they must equal each stream decoded alone
(one call per chunk, batch of one) up to float rounding: TOL = 1e-5, measured about 1.5e-6 on the CPU.

Not bit for bit: with stock CPU kernels a row's result depends on the shapes around it (a Linear
512 -> 2048 on 100 rows vs the same rows inside 896 differs by 2e-7; SDPA changes with the total key
length even when the extra keys are masked). A mask or padding bug shows up as differences of 1e-2
and more, far above TOL, and the differences do not grow from chunk to chunk.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from gpu_worker.model.flow import Flow, FlowCache, trim_cache
from tests.gpu_worker.model.ref_oracle import Prompt, make_prompt, random_tokens, seeded_noise, split_chunks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TOL = 1e-5

PROMPT_TOKENS = (8, 11, 14)  # one voice each
STREAMS = [  # (voice, tokens, first step): all 8 live at step 3, where 1 ends and 6, 7 begin
    (0, 160, 0), (1, 95, 0), (2, 130, 1), (0, 110, 1), (1, 150, 2), (2, 72, 2), (0, 90, 3), (1, 40, 3),
]


@dataclass
class Voice:
    prompt: Prompt
    spk: torch.Tensor  # [1, 80]
    cache: FlowCache


@dataclass
class Stream:
    voice: Voice
    chunks: list[tuple[torch.Tensor, bool]]
    start: int
    noise: torch.Tensor
    cache: FlowCache
    mels: list[torch.Tensor] = field(default_factory=list)

    def active(self, step: int) -> bool:
        return self.start <= step and len(self.mels) < len(self.chunks)


@pytest.fixture(scope="module")
def voices(tiny_flow) -> list[Voice]:
    out = []
    for i, n in enumerate(PROMPT_TOKENS):
        prompt = make_prompt(n, seed=20 + i)
        with torch.inference_mode():
            spk, cache = tiny_flow.setup(prompt.setup_tokens, prompt.mel, prompt.spk,
                                         seeded_noise(tiny_flow.args, seed=30 + i))
        out.append(Voice(prompt, spk, cache))
    return out


def _streams(flow: Flow, voices: list[Voice]) -> list[Stream]:
    return [Stream(voices[v], split_chunks(random_tokens(n, seed=40 + i)), start,
                   seeded_noise(flow.args, seed=50 + i), voices[v].cache)
            for i, (v, n, start) in enumerate(STREAMS)]


@torch.inference_mode()
def _step(flow: Flow, streams: list[Stream]) -> None:
    """One batched chunk for each of `streams`; appends each row's mel and keeps its trimmed cache."""
    chunks = [s.chunks[len(s.mels)] for s in streams]
    mel, n_frames, caches = flow.stream_chunks(
        [tokens for tokens, _ in chunks], torch.cat([s.voice.spk for s in streams]),
        [s.cache for s in streams], [last for _, last in chunks], [s.noise for s in streams])
    for i, stream in enumerate(streams):
        stream.mels.append(mel[i : i + 1, :, : n_frames[i]])
        stream.cache = trim_cache(caches[i], stream.voice.prompt.n_frames)


def _decode_together(flow: Flow, streams: list[Stream]) -> list[int]:
    batch_sizes, step = [], 0
    while any(s.start > step or s.active(step) for s in streams):
        rows = [s for s in streams if s.active(step)]
        if rows:
            _step(flow, rows)
            batch_sizes.append(len(rows))
        step += 1
    return batch_sizes


def tensors(cache: FlowCache) -> list[torch.Tensor]:
    """A reference-layout cache's four tensors, in field order."""
    return [cache.conformer_cnn, cache.conformer_att, cache.estimator_cnn, cache.estimator_att]


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item()


def test_rows_decoded_together_equal_rows_decoded_alone_within_1e_5(tiny_flow, voices):
    together, alone = _streams(tiny_flow, voices), _streams(tiny_flow, voices)
    batch_sizes = _decode_together(tiny_flow, together)
    for stream in alone:
        while stream.active(stream.start):
            _step(tiny_flow, [stream])
    assert max(batch_sizes) == len(STREAMS)
    for a, b in zip(together, alone, strict=True):
        mel = torch.cat(a.mels, dim=2)
        assert mel.size(2) == 2 * sum(t.size(1) - (0 if last else 3) for t, last in a.chunks)
        assert max_diff(mel, torch.cat(b.mels, dim=2)) < TOL
        assert max_diff(a.cache.reference_estimator_att(), b.cache.reference_estimator_att()) < TOL
        assert max_diff(a.cache.estimator_cnn, b.cache.estimator_cnn) < TOL
        assert max_diff(a.cache.conformer_att, b.cache.conformer_att) < TOL  # one batched encoder pass
        assert max_diff(a.cache.conformer_cnn, b.cache.conformer_cnn) < TOL


def test_streams_trim_their_own_caches_and_leave_the_shared_voice_caches_untouched(tiny_flow, voices):
    before = [[t.clone() for t in tensors(v.cache)] for v in voices]
    streams = _streams(tiny_flow, voices)
    _decode_together(tiny_flow, streams)
    lengths = {s.cache.offset for s in streams}
    assert len(lengths) > 1 and max(lengths) == max(2 * n for n in PROMPT_TOKENS) + 100
    for voice, saved in zip(voices, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(tensors(voice.cache), saved, strict=True))


@torch.inference_mode()
def test_setup_row_in_a_batch_of_chunk_rows_equals_setup_alone(tiny_flow, voices):
    prompt, noise = make_prompt(9, seed=60), seeded_noise(tiny_flow.args, seed=61)
    spk, want = tiny_flow.setup(prompt.setup_tokens, prompt.mel, prompt.spk, noise)
    mu, cache = tiny_flow.encode_chunk(prompt.setup_tokens, FlowCache(), last_chunk=False)
    rows = [(mu, spk, noise, cache, prompt.mel)]  # (mu, spk, noise, cache, cond), setup row first
    for stream in _streams(tiny_flow, voices)[:3]:
        tokens, last = stream.chunks[0]
        chunk_mu, chunk_cache = tiny_flow.encode_chunk(tokens, stream.cache, last)
        rows.append((chunk_mu, stream.voice.spk, stream.noise, chunk_cache, torch.zeros_like(chunk_mu)))
    mus, spks, noises, caches, conds = zip(*rows, strict=True)
    _, got = tiny_flow.solve_chunk_batch(list(mus), torch.cat(spks), list(noises), list(caches), list(conds))
    assert max_diff(got[0].reference_estimator_att(), want.estimator_att) < TOL
    assert max_diff(got[0].estimator_cnn, want.estimator_cnn) < TOL


@torch.inference_mode()
def test_encoder_rows_batched_equal_rows_encoded_alone(tiny_flow, voices):
    prompt = make_prompt(9, seed=62)
    rows = [(prompt.setup_tokens, FlowCache(), False)]  # no caches yet, 12 tokens
    for i, stream in enumerate(_streams(tiny_flow, voices)[:4]):
        tokens, last = stream.chunks[-1] if i % 2 else stream.chunks[0]  # last (short) and first chunks
        rows.append((tokens, stream.cache, last))
    tokens, caches, lasts = (list(x) for x in zip(*rows, strict=True))
    mus, got = tiny_flow.encode_chunks(tokens, caches, lasts)
    for (tok, cache, last), mu, new in zip(rows, mus, got, strict=True):
        want_mu, want = tiny_flow.encode_chunk(tok, cache, last)
        assert max_diff(mu, want_mu) < TOL
        assert max_diff(new.conformer_att, want.conformer_att) < TOL
        assert max_diff(new.conformer_cnn, want.conformer_cnn) < TOL


def test_a_bf16_model_decodes_a_mixed_batch_in_bf16_close_to_fp32(tiny_flow, voices):
    half = copy.deepcopy(tiny_flow).to(torch.bfloat16)
    want, got = _streams(tiny_flow, voices)[:4], _streams(tiny_flow, voices)[:4]
    for stream in got:
        stream.voice = Voice(stream.voice.prompt, stream.voice.spk.bfloat16(),
                             FlowCache(*(t.bfloat16() for t in tensors(stream.voice.cache))))
        stream.cache, stream.noise = stream.voice.cache, stream.noise.bfloat16()
    for streams, flow in ((want, tiny_flow), (got, half)):
        _step(flow, streams)
        _step(flow, streams)
    for a, b in zip(want, got, strict=True):
        assert b.mels[-1].dtype == torch.bfloat16
        assert b.cache.reference_estimator_att().dtype == torch.bfloat16
        assert max_diff(torch.cat(b.mels, dim=2).float(), torch.cat(a.mels, dim=2)) < 0.1  # values ~ +-5
