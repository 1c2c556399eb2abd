"""The streaming decoder on the tiny preset (CPU, fp32): lengths, reproducibility, batch invariance, and
parity of a whole stream (flow + cache trimming + HiFT tail and cross-fade) with the reference driver."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.speech import VOCAB_SIZE
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.engine.streams import Chunk, ChunkRow, plan_chunks
from gpu_worker.model.config import (
    HIFT_SOURCE_CACHE,
    LOOKAHEAD_TOKENS,
    SAMPLES_PER_MEL,
    SILENCE_TOKEN,
)
from gpu_worker.model.hift import draw_source_noise
from gpu_worker.voices.prompt import VoicePrompt, fit_prompt_mel, install_voice
from tests.support.fakes import ARGS, FakeSpeaker, host_features, tiny_model

BATCH_TOL = 1e-4  # float reduction order may change with the batch; the noise and masks do not
PARITY_TOL = 1e-4









def voice(decoder: StreamingDecoder, index: int, seed: int | None = None) -> VoicePrompt:
    return install_voice(host_features(f"{index:064x}", seed=index), speaker=FakeSpeaker(), decoder=decoder,
                         seed=seed)


def tokens_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share between threads; on a busy machine they thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def decoder() -> StreamingDecoder:
    return StreamingDecoder(tiny_model(), device="cpu", dtype=torch.float32, micro_batch_size=8)


@pytest.fixture(scope="module")
def voices(decoder: StreamingDecoder) -> list[VoicePrompt]:
    return [voice(decoder, i) for i in range(3)]


# -- chunking and lengths ---------------------------------------------------------------------------
def chunk_samples(chunks: list[Chunk]) -> list[int]:
    """Samples each chunk emits: the vocoder holds 3840 samples back for the cross-fade until the last."""
    out, held = [], 0
    for chunk in chunks:
        produced = chunk.mel_frames * SAMPLES_PER_MEL + held
        held = 0 if chunk.last else HIFT_SOURCE_CACHE
        out.append(produced - held)
    return out


def test_chunk_plan_feeds_25_new_plus_3_lookahead_tokens() -> None:
    assert [tuple(c) for c in plan_chunks(90)] == [(0, 28, False), (25, 53, False), (50, 78, False),
                                                   (75, 90, True)]
    assert [tuple(c) for c in plan_chunks(28)] == [(0, 28, False), (25, 28, True)]
    assert [tuple(c) for c in plan_chunks(27)] == [(0, 27, True)]
    for n in range(1, 200):
        chunks = plan_chunks(n)
        assert sum(c.mel_frames for c in chunks) == 2 * n
        assert sum(chunk_samples(chunks)) == 960 * n


@pytest.mark.parametrize("n_tokens", [1, 27, 28, 53, 90])
def test_a_stream_of_n_tokens_yields_exactly_960_samples_per_token(decoder, voices, n_tokens) -> None:
    stream = decoder.open_stream(voices[0], seed=1)
    tokens = tokens_of(n_tokens, seed=n_tokens)
    chunks = plan_chunks(n_tokens)
    lengths = [decoder.step([ChunkRow(stream, tokens[c.start:c.stop], c.last)])[0].numel() for c in chunks]
    assert lengths == chunk_samples(chunks)
    assert sum(lengths) == 960 * n_tokens


def test_same_seed_same_audio_and_another_seed_other_audio(decoder, voices) -> None:
    tokens = tokens_of(60, seed=3)
    a = decoder.decode_offline(voices[1], tokens, seed=7)
    b = decoder.decode_offline(voices[1], tokens, seed=7)
    c = decoder.decode_offline(voices[1], tokens, seed=8)
    assert torch.equal(a, b)
    assert a.abs().max() > 0 and not torch.allclose(a, c)


def test_streams_never_write_into_the_shared_voice(decoder, voices) -> None:
    before = [t.clone() for t in voices[2].tensors()]
    decoder.decode_offline(voices[2], tokens_of(80, seed=4), seed=1)
    assert all(torch.equal(x, y) for x, y in zip(before, voices[2].tensors(), strict=True))


def test_step_refuses_two_rows_of_one_stream_and_a_finished_stream(decoder, voices) -> None:
    stream = decoder.open_stream(voices[0], seed=1)
    tokens = tokens_of(10, seed=1)
    with pytest.raises(ValueError):
        decoder.step([ChunkRow(stream, tokens, True), ChunkRow(stream, tokens, True)])
    decoder.step([ChunkRow(stream, tokens, True)])
    with pytest.raises(ValueError):
        decoder.step([ChunkRow(stream, tokens, True)])


def test_a_failed_step_changes_no_stream_and_a_retry_gives_the_same_audio(decoder, voices,
                                                                          monkeypatch) -> None:
    tokens = tokens_of(60, seed=9)
    expected = decoder.decode_offline(voices[0], tokens, seed=3)
    stream = decoder.open_stream(voices[0], seed=3)
    chunks = plan_chunks(60)
    rows = [ChunkRow(stream, tokens[c.start:c.stop], c.last) for c in chunks]
    parts = decoder.step(rows[:1])

    def broken(*args, **kwargs):
        raise RuntimeError("device error")

    monkeypatch.setattr(decoder.model.hift, "forward", broken)
    with pytest.raises(RuntimeError):
        decoder.step(rows[1:2])
    monkeypatch.undo()
    assert stream.chunks_done == 1
    parts += decoder.step(rows[1:2]) + decoder.step(rows[2:])
    assert torch.equal(torch.cat(parts), expected)
    with pytest.raises(ValueError):
        decoder.step([ChunkRow(decoder.open_stream(voices[0], i), tokens[:28], False) for i in range(9)])


# -- batch invariance -------------------------------------------------------------------------------
def _together(decoder, jobs) -> tuple[list[torch.Tensor], list[list[tuple[int, bool]]]]:
    """Decode every job in shared steps; job j joins at step start_j. Returns audio and each step's rows."""
    streams = [decoder.open_stream(v, seed) for v, _, seed, _ in jobs]
    plans = [plan_chunks(t.numel()) for _, t, _, _ in jobs]
    parts: list[list[torch.Tensor]] = [[] for _ in jobs]
    shapes = []
    step = 0
    while any(len(p) < len(plan) for p, plan in zip(parts, plans, strict=True)):
        live = [j for j, job in enumerate(jobs) if job[3] <= step and len(parts[j]) < len(plans[j])]
        rows = []
        for j in live:
            c = plans[j][len(parts[j])]
            rows.append(ChunkRow(streams[j], jobs[j][1][c.start:c.stop], c.last))
        for j, audio in zip(live, decoder.step(rows), strict=True):
            parts[j].append(audio)
        shapes.append([(len(parts[j]) - 1, rows[i].last) for i, j in enumerate(live)])
        step += 1
    return [torch.cat(p) for p in parts], shapes


def test_a_stream_decodes_the_same_in_a_mixed_batch_as_alone(decoder, voices) -> None:
    lengths = [30, 60, 20, 80, 45, 28, 53, 70]
    starts = [0, 0, 1, 1, 2, 3, 3, 4]
    jobs = [(voices[i % 3], tokens_of(n, seed=100 + i), 100 + i, start)
            for i, (n, start) in enumerate(zip(lengths, starts, strict=True))]
    together, shapes = _together(decoder, jobs)
    mixed = [s for s in shapes if any(c == 0 for c, _ in s) and any(c > 0 for c, _ in s)]
    assert mixed and any(any(last for _, last in s) and len(s) > 2 for s in shapes)
    worst = 0.0
    for (v, tokens, seed, _), audio in zip(jobs, together, strict=True):
        alone = decoder.decode_offline(v, tokens, seed)
        assert audio.shape == alone.shape == (960 * tokens.numel(),)
        worst = max(worst, (audio - alone).abs().max().item())
    print(f"batch invariance: max |together - alone| = {worst:.3g}")
    assert worst <= BATCH_TOL


# -- lanes ------------------------------------------------------------------------------------------
def test_finished_and_closed_streams_give_their_lanes_back_and_the_others_move_down(decoder, voices) -> None:
    """Lanes stay dense: the stream in the highest lane moves into a freed one and decodes on unchanged."""
    jobs = [(voices[i % 3], tokens_of(n, seed=300 + i), 300 + i, 0) for i, n in enumerate([90, 30, 120])]
    streams = [decoder.open_stream(v, seed) for v, _, seed, _ in jobs]
    plans = [plan_chunks(t.numel()) for _, t, _, _ in jobs]
    parts: list[list[torch.Tensor]] = [[] for _ in jobs]
    lanes_seen = []
    for step in range(max(len(p) for p in plans)):
        live = [j for j in range(3) if step < len(plans[j])]
        chunks = [plans[j][step] for j in live]
        rows = [ChunkRow(streams[j], jobs[j][1][c.start:c.stop], c.last)
                for j, c in zip(live, chunks, strict=True)]
        for j, audio in zip(live, decoder.step(rows), strict=True):
            parts[j].append(audio)
        lanes_seen.append((decoder.lanes.n_open, [None if s.lane is None else s.lane.index for s in streams]))
    assert lanes_seen[0] == (3, [0, 1, 2])
    assert lanes_seen[1] == (2, [0, None, 1])  # job 1 finished: job 2 moved from lane 2 into lane 1
    assert lanes_seen[-1] == (0, [None, None, None])
    for (v, tokens, seed, _), got in zip(jobs, parts, strict=True):
        alone = decoder.decode_offline(v, tokens, seed)
        assert (torch.cat(got) - alone).abs().max() <= BATCH_TOL
    stream = decoder.open_stream(voices[0], seed=1)
    decoder.step([ChunkRow(stream, tokens_of(28, seed=1), False)])
    decoder.close_stream(stream)  # an aborted job's
    assert decoder.lanes.n_open == 0 and stream.lane is None
    with pytest.raises(ValueError, match="closed"):
        decoder.step([ChunkRow(stream, tokens_of(28, seed=2), False)])


def test_a_stream_dropped_before_its_end_gives_its_lane_back_at_the_next_step(decoder, voices) -> None:
    dropped = decoder.open_stream(voices[1], seed=5)
    decoder.step([ChunkRow(dropped, tokens_of(28, seed=5), False)])
    assert decoder.lanes.n_open == 1
    del dropped
    kept = decoder.open_stream(voices[1], seed=6)
    decoder.step([ChunkRow(kept, tokens_of(28, seed=6), False)])
    assert decoder.lanes.n_open == 1 and kept.lane.index == 0
    decoder.close_stream(kept)


def test_a_voice_is_copied_into_one_slot_for_all_its_streams_and_kept_for_the_next(voices) -> None:
    decoder = StreamingDecoder(tiny_model(), device="cpu", dtype=torch.float32, micro_batch_size=8)
    copies: list[int] = []

    def stream(v: int, seed: int):
        s = decoder.open_stream(voices[v], seed)
        decoder.step([ChunkRow(s, tokens_of(28, seed=seed), False)])
        return s

    a, b = stream(0, 1), stream(0, 2)
    lanes = decoder.lanes
    original = lanes.put_voice
    lanes.put_voice = lambda index, frames: (copies.append(index), original(index, frames))[1]
    c = stream(0, 3)
    assert copies == [] and a.lane.voice == b.lane.voice == c.lane.voice  # one slot, copied once
    d = stream(1, 4)
    slot_a, slot_d = a.lane.voice, d.lane.voice
    assert copies == [slot_d] and slot_d != slot_a
    for s in (a, b, c, d):
        decoder.close_stream(s)
    e = stream(1, 5)  # the voice's frames are still in their slot: no copy
    assert copies == [slot_d] and e.lane.voice == slot_d
    stream(2, 6)  # a new voice takes the free slot, no new one
    assert copies == [slot_d, slot_a] and lanes.voice_slots == 2


# -- parity with the reference driver ---------------------------------------------------------------
def _reference_hift(args, state):
    pytest.importorskip("stepaudio2.flashcosyvoice.modules.hifigan")
    from bench.engine.reference import reference_hift

    ref = reference_hift(args.hift)
    ref.load_state_dict(state, strict=True)
    return ref.eval()


def _reference_vocode(monkeypatch, ref, mel, cache_source, noise):
    """The reference HiFT with its global-RNG draws replaced by `noise` (our stream's draws)."""
    layers = pytest.importorskip("stepaudio2.flashcosyvoice.modules.hifigan_components.layers")
    draws = iter([noise.noise.transpose(1, 2)])
    monkeypatch.setattr(layers.torch, "rand", lambda *shape, **kw: noise.phase.clone())
    monkeypatch.setattr(layers.torch, "randn_like",
                        lambda x: next(draws, None) if x.shape[-1] > 1 else torch.zeros_like(x))
    try:
        with torch.inference_mode():
            return ref(mel, cache_source)
    finally:
        monkeypatch.undo()


def _reference_audio(monkeypatch, model, host, tokens, seed) -> list[torch.Tensor]:
    """Token2wav's streaming math with the reference modules: setup, chunks, trimming, HiFT tail, fade."""
    oracle = pytest.importorskip("tests.gpu_worker.model.ref_oracle")
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(1, 80, 30000, generator=gen)  # the stream's noise; its HiFT draws follow
    flow = oracle.reference_flow(ARGS.flow, model.flow.state_dict(), buffer)
    prompt_tokens, spk_raw = FakeSpeaker().quantize_and_embed(host.logmel128, host.fbank80)
    prompt_mel = fit_prompt_mel(host.mel80[None], 2 * prompt_tokens.size(1))
    silence = torch.full((1, LOOKAHEAD_TOKENS), SILENCE_TOKEN, dtype=torch.int64)
    cache = oracle.reference_setup(flow, torch.cat([prompt_tokens, silence], 1), prompt_mel, spk_raw)
    chunks = [(tokens[c.start:c.stop][None], c.last) for c in plan_chunks(tokens.numel())]
    mels, _ = oracle.reference_stream(flow, cache, chunks, spk_raw, prompt_len=prompt_mel.size(1))
    hift = _reference_hift(ARGS, model.hift.state_dict())
    window = torch.from_numpy(np.hamming(7680))
    tail_mel, tail_source, tail_speech = torch.zeros(1, 80, 0), torch.zeros(1, 1, 0), torch.zeros(1, 0)
    out = []
    for (_, last), chunk_mel in zip(chunks, mels, strict=True):
        mel = torch.cat([tail_mel, chunk_mel], dim=2)
        noise = draw_source_noise([gen], mel.size(2) * 480, ARGS.hift.nb_harmonics + 1)
        speech, source = _reference_vocode(monkeypatch, hift, mel, tail_source, noise)
        if tail_speech.size(1) > 0:
            speech = speech.clone()
            speech[:, :3840] = speech[:, :3840] * window[:3840] + tail_speech[:, -3840:] * window[3840:]
        tail_mel, tail_source, tail_speech = mel[:, :, -8:], source[:, :, -3840:], speech[:, -3840:]
        out.append(speech[0] if last else speech[0, :-3840])
    return out


def test_a_four_chunk_stream_matches_the_reference_driver(decoder, monkeypatch) -> None:
    seed = 4242
    host = host_features(f"{99:064x}", seed=99)
    prompt = install_voice(host, speaker=FakeSpeaker(), decoder=decoder, seed=seed)  # reference: one buffer
    tokens = tokens_of(90, seed=5)
    stream = decoder.open_stream(prompt, seed)
    ours = [decoder.step([ChunkRow(stream, tokens[c.start:c.stop], c.last)])[0] for c in plan_chunks(90)]
    reference = _reference_audio(monkeypatch, decoder.model, host, tokens, seed)
    assert [a.numel() for a in ours] == [r.numel() for r in reference]
    diffs = [(a - r).abs().max().item() for a, r in zip(ours, reference, strict=True)]
    print(f"parity with the reference driver, per chunk max |diff|: {[f'{d:.3g}' for d in diffs]}")
    assert max(diffs) <= PARITY_TOL
    assert torch.cat(reference).abs().max() > 1e-3
