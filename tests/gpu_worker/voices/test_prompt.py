"""The device half of prompt preparation on the tiny preset, with the real S3 tokenizer and CAM++
wrappers on stand-in ONNX files: split across the feature store, it equals the unsplit preparation."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from app.audio import load_reference, resample
from app.dev import SAMPLES
from app.errors import EngineFailure
from app.speech import CAMPPLUS_ONNX, TOKENIZER_ONNX, VOCAB_SIZE
from app.voices.features import PromptHostFeatures, host_half, prompt_mel, s3_log_mel, speaker_fbank
from gpu_worker.checkpoint.write import write_campplus_onnx, write_s3_tokenizer_onnx
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.model.config import SILENCE_TOKEN
from gpu_worker.voices.prompt import (
    StandInSpeaker,
    VoicePrompt,
    fit_prompt_mel,
    install_voice,
    install_voices,
    seeded_noise,
    voice_seed,
)
from gpu_worker.voices.speaker import SpeakerFrontend
from tests.support.fakes import tiny_model

REFERENCE = (SAMPLES / "voice_a.wav").read_bytes()


@pytest.fixture(scope="module")
def speaker(tmp_path_factory) -> Iterator[SpeakerFrontend]:
    folder: Path = tmp_path_factory.mktemp("speaker")
    write_campplus_onnx(folder / CAMPPLUS_ONNX, seed=1)
    write_s3_tokenizer_onnx(folder / TOKENIZER_ONNX, seed=1, dtype=np.float16)  # half the 0.5 GB
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield SpeakerFrontend.from_folder(folder)
    torch.set_num_threads(threads)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def decoder() -> StreamingDecoder:
    return StreamingDecoder(tiny_model(), device="cpu", dtype=torch.float32, micro_batch_size=4)


def unsplit_prepare(pcm24k: np.ndarray, voice_id: str, speaker, decoder) -> VoicePrompt:
    """Features and device half in one go, no store in between (what Token2wav.set_stream_cache does)."""
    wave24 = torch.from_numpy(pcm24k)
    wave16 = resample(wave24, 24000, 16000)
    tokens, embedding = speaker.quantize_and_embed(s3_log_mel(wave16), speaker_fbank(wave16))
    mel = prompt_mel(wave24)[None]  # [1, 300, 80]
    mel = fit_prompt_mel(mel, 2 * tokens.size(1))
    with torch.inference_mode():
        spk, cache = decoder.model.flow.setup(
            torch.cat([tokens, torch.full((1, 3), SILENCE_TOKEN)], dim=1), mel, embedding,
            seeded_noise(voice_seed(voice_id), decoder.device, decoder.dtype)[0])
    return VoicePrompt(voice_id=voice_id, spk=spk, prompt_len=mel.size(1),
                       conformer_cnn_cache=cache.conformer_cnn, conformer_att_cache=cache.conformer_att,
                       estimator_cnn_cache=cache.estimator_cnn, estimator_att_cache=cache.estimator_att)


def assert_same_prompt(a: VoicePrompt, b: VoicePrompt) -> None:
    assert a.voice_id == b.voice_id and a.prompt_len == b.prompt_len
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


def test_device_half_of_stored_host_half_equals_the_unsplit_preparation_bit_for_bit(speaker, decoder) -> None:
    pcm, voice_id = load_reference(REFERENCE)
    stored = host_half(pcm, voice_id).to_bytes()  # what the CPU worker puts in the feature store
    split = install_voice(PromptHostFeatures.from_bytes(stored), speaker=speaker, decoder=decoder)
    assert_same_prompt(split, unsplit_prepare(pcm, voice_id, speaker, decoder))
    tokens = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1))
    unsplit = unsplit_prepare(pcm, voice_id, speaker, decoder)
    audio = decoder.decode_offline(split, tokens, seed=5)
    assert torch.equal(audio, decoder.decode_offline(unsplit, tokens, seed=5))


def test_a_six_second_prompt_gives_the_documented_cache_shapes(speaker, decoder) -> None:
    pcm, voice_id = load_reference(REFERENCE)
    prompt = install_voice(host_half(pcm, voice_id), speaker=speaker, decoder=decoder)
    enc, dit, steps = decoder.model.args.flow.encoder, decoder.model.args.flow.dit, 10
    heads, d_k = enc.attention_heads, enc.output_size // enc.attention_heads
    assert prompt.prompt_len == 300 and prompt.spk.shape == (1, 80)
    assert prompt.conformer_cnn_cache.shape == (1, enc.output_size, 6)
    assert prompt.conformer_att_cache.shape == (enc.num_blocks + enc.num_up_blocks, 1, heads, 300, 2 * d_k)
    assert prompt.estimator_cnn_cache.shape == (steps, dit.depth, 2, 2 * dit.hidden_size, 2)
    assert prompt.estimator_att_cache.shape == (steps, dit.depth, 2, dit.num_heads, 300, 2 * dit.head_dim)
    assert prompt.nbytes() == sum(t.numel() * 4 for t in prompt.tensors())


def test_install_is_reproducible_and_seeded_by_the_voice() -> None:
    decoder = StreamingDecoder(tiny_model(), device="cpu", dtype=torch.float32, micro_batch_size=1)
    gen = torch.Generator().manual_seed(0)
    feats = {"logmel128": torch.randn(128, 600, generator=gen),
             "fbank80": torch.randn(598, 80, generator=gen), "mel80": torch.randn(300, 80, generator=gen)}
    speaker = StandInSpeaker()
    a = install_voice(PromptHostFeatures(voice_id="a" * 64, **feats), speaker=speaker, decoder=decoder)
    b = install_voice(PromptHostFeatures(voice_id="a" * 64, **feats), speaker=speaker, decoder=decoder)
    c = install_voice(PromptHostFeatures(voice_id="b" * 64, **feats), speaker=speaker, decoder=decoder)
    assert_same_prompt(a, b)
    assert not torch.equal(a.estimator_att_cache, c.estimator_att_cache)  # other voice, other setup noise


def test_prompt_mel_is_replicate_padded_or_cropped_to_twice_the_prompt_tokens() -> None:
    mel = torch.arange(3 * 2, dtype=torch.float32).reshape(1, 3, 2)
    padded = fit_prompt_mel(mel, 5)
    assert padded.shape == (1, 5, 2) and torch.equal(padded[0, 3:], mel[0, 2:].expand(2, 2))
    assert torch.equal(fit_prompt_mel(mel, 2), mel[:, :2])
    assert torch.equal(fit_prompt_mel(mel, 3), mel)


@torch.inference_mode()
def test_voices_installed_in_one_batched_setup_solve_match_their_installs_alone(decoder) -> None:
    speaker = StandInSpeaker()
    hosts = [host_half(*load_reference((SAMPLES / name).read_bytes()))
             for name in ("voice_a.wav", "voice_b.wav")]
    together = install_voices(hosts, speaker=speaker, decoder=decoder)
    for host, got in zip(hosts, together, strict=True):
        alone = install_voice(host, speaker=speaker, decoder=decoder)
        assert got.voice_id == host.voice_id and got.prompt_len == alone.prompt_len
        for a, b in zip(got.tensors(), alone.tensors(), strict=True):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-5  # float rounding, not bit for bit
    assert not torch.equal(together[0].estimator_att_cache, together[1].estimator_att_cache)
    (one,) = install_voices(hosts[:1], speaker=speaker, decoder=decoder)  # one voice: the single path
    assert_same_prompt(one, install_voice(hosts[0], speaker=speaker, decoder=decoder))


def test_an_install_with_the_real_speaker_models_needs_no_host_sync(speaker, decoder) -> None:
    """S3 quantize, CAM++ and the setup solve: every shape is known on the host, nothing is read back."""
    from bench.engine.syncs import count_syncs

    pcm, voice_id = load_reference(REFERENCE)
    host = host_half(pcm, voice_id)
    prompt, count = count_syncs(lambda: install_voice(host, speaker=speaker, decoder=decoder))
    assert prompt.prompt_len == 300 and count.total == 0, count.by_op


def _features(voice_id: str, mel_scale: float = 1.0) -> PromptHostFeatures:
    gen = torch.Generator().manual_seed(0)
    return PromptHostFeatures(voice_id=voice_id, logmel128=torch.randn(128, 600, generator=gen),
                              fbank80=torch.randn(598, 80, generator=gen),
                              mel80=torch.randn(300, 80, generator=gen) * mel_scale)


def test_host_features_with_a_nan_are_refused_before_the_setup_solve(decoder) -> None:
    host = _features("c" * 64)
    host.fbank80[5, 5] = float("nan")
    solves = []
    setup_batch = decoder.model.flow.setup_batch
    decoder.model.flow.setup_batch = lambda *a: solves.append(1) or setup_batch(*a)
    try:
        with pytest.raises(EngineFailure, match=r"voice c{64}: host features fbank80 hold NaN or infinite"):
            install_voice(host, speaker=StandInSpeaker(), decoder=decoder)
    finally:
        del decoder.model.flow.setup_batch
    assert solves == []


def test_a_setup_solve_that_overflows_is_refused_and_fails_its_batch(decoder) -> None:
    """Finite features far out of range (a mel of 1e30) overflow the solve: the prompt is garbage."""
    loud = _features("d" * 64, mel_scale=1e30)
    with pytest.raises(EngineFailure, match=r"voice d{64}: installed prompt tensors .*hold NaN or infinite"):
        install_voice(loud, speaker=StandInSpeaker(), decoder=decoder)
    with pytest.raises(EngineFailure, match=r"voice d{64}"):  # the resolver then installs one by one
        install_voices([_features("e" * 64), loud], speaker=StandInSpeaker(), decoder=decoder)
    assert install_voice(_features("e" * 64), speaker=StandInSpeaker(), decoder=decoder).prompt_len == 300
