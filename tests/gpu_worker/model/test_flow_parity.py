"""Flow against the reference flow (stepaudio2-minicpmo, test-only oracle): same weights, same noise, fp32.

Every comparison asserts a max abs difference below TOL = 1e-5 (the target was 1e-4). Measured on a
2-core CPU: encoder 0 (bit for bit), one DiT evaluation 1.2e-6, CFM solve 1e-6, offline inference 1e-6
(full size 1.9e-6), setup caches 1.7e-6, streaming mels and caches 2.2e-6 (full size 5e-6). The
differences come from the order of float sums: the timestep embedding and adaLN run once per step on
one row, where the reference runs them per row.
"""

from __future__ import annotations

import pytest
import torch

from bench.engine.flows import LaneFlow
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.flow import Flow, FlowCache, trim_cache
from tests.gpu_worker.model.ref_oracle import (
    CACHE_KEYS,
    make_prompt,
    random_tokens,
    reference_on_meta,
    reference_setup,
    reference_stream,
    split_chunks,
)

pytest.importorskip("stepaudio2.cosyvoice2.flow.flow")
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TOL = 1e-5
CACHE_FIELDS = ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att")


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item()


def assert_caches_close(ours: FlowCache, ref: dict) -> None:
    for field, key in zip(CACHE_FIELDS, CACHE_KEYS, strict=True):
        got = ours.reference_estimator_att() if field == "estimator_att" else getattr(ours, field)
        assert max_diff(got, ref[key]) < TOL, key


@pytest.mark.parametrize("preset", ["full", "tiny"])
def test_state_dict_keys_and_shapes_equal_reference(preset):
    args = ModelArgs.preset(preset).flow
    with torch.device("meta"):
        ours = Flow(args)
    want = {k: tuple(v.shape) for k, v in reference_on_meta(args).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert preset != "full" or len(got) == 605
    assert not list(ours.buffers())  # noise, caches and positional tables are not module state


@torch.inference_mode()
def test_encoder_whole_utterance_matches_reference(tiny_pair):
    x = torch.randn(1, 37, tiny_pair.args.encoder.input_size, generator=torch.Generator().manual_seed(5))
    want, _ = tiny_pair.ref.encoder(x, torch.tensor([37]))
    assert max_diff(tiny_pair.ours.encoder(x), want) < TOL


@torch.inference_mode()
def test_encoder_chunks_with_caches_match_reference(tiny_pair):
    x = torch.randn(1, 60, tiny_pair.args.encoder.input_size, generator=torch.Generator().manual_seed(6))
    ref_cnn = ref_att = cnn = att = None
    for chunk, last in [(x[:, :23], False), (x[:, 20:48], False), (x[:, 45:], True)]:
        want, ref_cnn, ref_att = tiny_pair.ref.encoder.forward_chunk(chunk, last, ref_cnn, ref_att)
        got, cnn, att = tiny_pair.ours.encoder.forward_chunk(chunk, cnn, att, last)
        assert max(max_diff(got, want), max_diff(cnn, ref_cnn), max_diff(att, ref_att)) < TOL


def _dit_inputs(args, frames: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(2, 80, frames, generator=gen) for _ in range(3))
    spk = torch.randn(2, 80, generator=gen)
    packed = torch.cat([x, mu, spk[:, :, None].expand(-1, -1, frames), cond], dim=1).transpose(1, 2)
    return (x, mu, spk, cond), packed


@torch.inference_mode()
def test_dit_velocity_matches_reference_without_cache(tiny_pair):
    a = tiny_pair.args.dit
    (x, mu, spk, cond), packed = _dit_inputs(tiny_pair.args, 33, seed=7)
    t = torch.tensor([0.37])
    want = tiny_pair.ref.decoder.estimator(x, torch.ones(2, 1, 33), mu, t.repeat(2), spk, cond)
    conv = torch.zeros(a.depth, 2, 2 * a.hidden_size, 2)
    kv = torch.zeros(a.depth, 2, a.num_heads, 33, 2 * a.head_dim)
    got, _ = tiny_pair.ours.decoder.estimator(packed, t, conv, kv)
    assert max_diff(got.transpose(1, 2), want) < TOL


@torch.inference_mode()
def test_dit_velocity_and_caches_match_reference_with_cache(tiny_pair):
    a, gen = tiny_pair.args.dit, torch.Generator().manual_seed(8)
    (x, mu, spk, cond), packed = _dit_inputs(tiny_pair.args, 21, seed=9)
    conv_cache = torch.randn(a.depth, 2, 2 * a.hidden_size, 2, generator=gen)
    att_cache = torch.randn(a.depth, 2, a.num_heads, 40, 2 * a.head_dim, generator=gen)
    t = torch.tensor([0.61])
    want, want_conv, want_att = tiny_pair.ref.decoder.estimator.forward_chunk(
        x, mu, t.repeat(2), spk, cond, conv_cache, att_cache)
    kv = torch.cat([torch.zeros(a.depth, 2, a.num_heads, 21, 2 * a.head_dim), att_cache], dim=3)
    got, got_conv = tiny_pair.ours.decoder.estimator(packed, t, conv_cache, kv)
    assert max_diff(got.transpose(1, 2), want) < TOL
    assert max(max_diff(got_conv, want_conv), max_diff(kv, want_att)) < TOL


@torch.inference_mode()
def test_cfm_solve_matches_reference_with_the_same_noise(tiny_pair):
    a, n, steps = tiny_pair.args.dit, 45, tiny_pair.args.n_timesteps
    gen = torch.Generator().manual_seed(10)
    mu, cond = torch.randn(1, 80, n, generator=gen), torch.randn(1, 80, n, generator=gen)
    spk = torch.randn(1, 80, generator=gen)
    want = tiny_pair.ref.decoder(mu, torch.ones(1, 1, n), spk, cond, n_timesteps=steps)
    conv = torch.zeros(a.depth, 2, 2 * a.hidden_size, 2)
    kv = torch.zeros(a.depth, 2, a.num_heads, n, 2 * a.head_dim)
    noise = tiny_pair.noise[:, :, :n].transpose(1, 2)
    got, _ = tiny_pair.ours.decoder.solve(noise, mu.transpose(1, 2), spk, cond.transpose(1, 2),
                                          [conv] * steps, [kv] * steps)
    assert max_diff(got.transpose(1, 2), want) < TOL


@torch.inference_mode()
def _check_inference(pair, n_prompt: int, n_tokens: int) -> None:
    prompt, tokens = make_prompt(n_prompt, seed=11), random_tokens(n_tokens, seed=12)
    want = pair.ref.inference(tokens, torch.tensor([n_tokens]), prompt.tokens, torch.tensor([n_prompt]),
                              prompt.mel, torch.tensor([prompt.n_frames]), prompt.spk, pair.args.n_timesteps)
    got = pair.ours.inference(tokens, prompt.tokens, prompt.mel, prompt.spk, pair.noise)
    assert max_diff(got, want) < TOL


def test_offline_inference_matches_reference(tiny_pair):
    _check_inference(tiny_pair, n_prompt=12, n_tokens=41)


def test_setup_caches_match_reference(tiny_pair):
    prompt = make_prompt(15, seed=13)
    want = reference_setup(tiny_pair.ref, prompt.setup_tokens, prompt.mel, prompt.spk)
    with torch.inference_mode():
        spk, cache = tiny_pair.ours.setup(prompt.setup_tokens, prompt.mel, prompt.spk, tiny_pair.noise)
    assert_caches_close(cache, want)
    assert cache.estimator_att.size(4) == cache.conformer_att.size(3) == prompt.n_frames


def _check_streaming(pair, prompt, tokens, chunk_new: int, tail: int) -> list[int]:
    """Setup + every chunk of `tokens`, both sides trimming after each chunk; returns cache lengths."""
    chunks = split_chunks(tokens, new=chunk_new)
    ref_cache = reference_setup(pair.ref, prompt.setup_tokens, prompt.mel, prompt.spk)
    want_mels, want_caches = reference_stream(pair.ref, ref_cache, chunks, prompt.spk, prompt.n_frames, tail)
    lengths = []
    with torch.inference_mode():
        spk, cache = pair.ours.setup(prompt.setup_tokens, prompt.mel, prompt.spk, pair.noise)
        for (chunk, last), want_mel, want_cache in zip(chunks, want_mels, want_caches, strict=True):
            lengths.append(cache.offset)
            mel, n_frames, (cache,) = pair.ours.stream_chunks([chunk], spk, [cache], [last], [pair.noise])
            cache = trim_cache(cache, prompt.n_frames, tail)
            assert n_frames == [want_mel.size(2)]
            assert max_diff(mel, want_mel) < TOL
            assert_caches_close(cache, want_cache)
    return lengths


def test_streaming_matches_reference_through_cache_trimming(tiny_pair):
    prompt = make_prompt(10, seed=14)
    lengths = _check_streaming(tiny_pair, prompt, random_tokens(160, seed=15), chunk_new=25, tail=100)
    assert lengths == [20, 70, 120, 120, 120, 120, 120]  # trimmed to prompt (20) + tail (100) from chunk 3 on


@pytest.mark.parametrize(("prompt_tokens", "n_tokens", "chunk_new", "tail"), [
    (30, 130, 10, 20),  # prompt 60 frames >= tail: the production regime (300 >= 100)
    (10, 330, 25, 100),  # prompt 20 frames < tail: generated frames in the kept tail too
])
def test_streaming_matches_reference_over_a_dozen_trimmed_chunks(tiny_pair, prompt_tokens, n_tokens,
                                                                  chunk_new, tail):
    prompt = make_prompt(prompt_tokens, seed=18)
    lengths = _check_streaming(tiny_pair, prompt, random_tokens(n_tokens, seed=19), chunk_new, tail)
    assert len(lengths) >= 13 and lengths[-1] == prompt.n_frames + tail


def _check_streaming_lanes(pair, prompt, tokens, chunk_new: int, tail: int) -> int:
    """As `_check_streaming`, through `Flow.step_lanes` (the decoder's encoder pass and solve over the
    lanes); returns the chunk count."""
    chunks = split_chunks(tokens, new=chunk_new)
    ref_cache = reference_setup(pair.ref, prompt.setup_tokens, prompt.mel, prompt.spk)
    want_mels, _ = reference_stream(pair.ref, ref_cache, chunks, prompt.spk, prompt.n_frames, tail)
    with torch.inference_mode():
        voice = pair.ours.setup(prompt.setup_tokens, prompt.mel, prompt.spk, pair.noise)
        driver = LaneFlow(pair.ours, [voice], tail=tail, max_new=2 * (chunk_new + 3))
        stream = driver.open(0, pair.noise)
        worst = 0.0
        for (chunk, last), want_mel in zip(chunks, want_mels, strict=True):
            (mel,) = driver.solve([(stream, chunk, last)])
            worst = max(worst, max_diff(mel, want_mel))
    print(f"lanes (encoder and solve) vs the reference, {len(chunks)} chunks: max |diff| = {worst:.3g}")
    assert worst < TOL
    return len(chunks)


def test_streaming_through_lanes_matches_reference_over_a_dozen_trimmed_chunks(tiny_pair):
    prompt = make_prompt(30, seed=18)  # 60 frames >= tail 20
    assert _check_streaming_lanes(tiny_pair, prompt, random_tokens(130, seed=19), 10, 20) >= 13


def test_full_size_streaming_through_lanes_matches_reference(full_pair):
    prompt = make_prompt(8, seed=16)  # 16 frames; chunks of 5 + 3 tokens, tail 10: trimmed after chunk 2,
    # and chunk 4 reads a head cut inside chunk 2 (its first 6 frames, beside chunk 3's 10)
    assert _check_streaming_lanes(full_pair, prompt, random_tokens(23, seed=17), 5, 10) == 4


def test_trim_cache_keeps_prompt_frames_and_last_tail_frames():
    conformer = torch.arange(40.0)[None, None, None, :, None].expand(2, 1, 1, 40, 4)
    estimator = torch.arange(50.0)[None, None, None, None, :, None].expand(3, 2, 2, 1, 50, 4)
    cache = trim_cache(FlowCache(None, conformer, None, estimator), prompt_len=8, tail=10)
    assert cache.conformer_att[0, 0, 0, :, 0].tolist() == [*range(8), *range(30, 40)]
    assert cache.estimator_att[0, 0, 0, 0, :, 0].tolist() == [*range(8), *range(40, 50)]
    short = FlowCache(None, conformer[:, :, :, :18], None, estimator[..., :18, :])
    kept = trim_cache(short, prompt_len=8, tail=10)
    assert kept.conformer_att is short.conformer_att and kept.estimator_att is short.estimator_att


def test_full_size_streaming_matches_reference(full_pair):
    prompt = make_prompt(4, seed=16)  # 8 frames; chunks of 5 + 3 tokens, tail 10: trimmed before chunk 3
    lengths = _check_streaming(full_pair, prompt, random_tokens(18, seed=17), chunk_new=5, tail=10)
    assert lengths == [8, 18, 18]


def test_full_size_offline_inference_matches_reference(full_pair):
    _check_inference(full_pair, n_prompt=4, n_tokens=9)
