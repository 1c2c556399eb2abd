"""Host features equal the reference feature functions, on the real speech shipped with s3tokenizer."""

from importlib.resources import files

import numpy as np
import pytest
import s3tokenizer
import soundfile as sf
import torch
import torchaudio.compliance.kaldi as kaldi

from app.audio import normalise_reference, resample
from app.errors import BadAudio, FeaturesMissing
from app.voices.features import (
    PromptHostFeatures,
    check_finite,
    host_half,
    prompt_mel,
    s3_log_mel,
    speaker_fbank,
)

RECORDINGS = ["BAC009S0764W0121.wav", "BAC009S0764W0122.wav"]


def real_speech(name: str) -> tuple[np.ndarray, int]:
    path = files("s3tokenizer") / "assets" / name
    pcm, sr = sf.read(str(path), dtype="float32")
    return pcm, sr


@pytest.mark.parametrize("name", RECORDINGS)
def test_prompt_mel_matches_the_reference_mel_function(name):
    from stepaudio2.flashcosyvoice.utils.audio import mel_spectrogram  # librosa filters

    pcm, sr = real_speech(name)
    wave24 = resample(pcm, sr, 24000)
    ours = prompt_mel(wave24)
    ref = mel_spectrogram(wave24[None]).squeeze(0).T
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", RECORDINGS)
def test_log_mel_and_fbank_match_the_reference_functions(name):
    pcm, sr = real_speech(name)
    assert sr == 16000
    wave16 = torch.from_numpy(pcm)
    ref_mel = s3tokenizer.log_mel_spectrogram(wave16)
    ref_fb = kaldi.fbank(wave16[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    ref_fb = ref_fb - ref_fb.mean(dim=0, keepdim=True)
    assert (s3_log_mel(wave16) - ref_mel).abs().max().item() < 1e-5
    assert (speaker_fbank(wave16) - ref_fb).abs().max().item() < 1e-5


def test_six_second_prompt_has_the_fixed_feature_shapes():
    pcm, sr = real_speech(RECORDINGS[0])
    pcm24, voice_id = normalise_reference(pcm, sr)
    feats = host_half(pcm24, voice_id)
    assert feats.logmel128.shape == (128, 600)
    assert feats.mel80.shape == (300, 80)
    assert feats.fbank80.shape[1] == 80 and abs(feats.fbank80.mean(0)).max() < 1e-4


def test_features_round_trip_through_safetensors_bytes_exactly():
    pcm, sr = real_speech(RECORDINGS[1])
    pcm24, voice_id = normalise_reference(pcm, sr)
    feats = host_half(pcm24, voice_id)
    data = feats.to_bytes()
    assert not data.startswith(b"\x80")  # not a pickle
    back = PromptHostFeatures.from_bytes(data)
    assert back.voice_id == voice_id
    for name in ("logmel128", "fbank80", "mel80"):
        assert torch.equal(getattr(back, name), getattr(feats, name))


def test_features_of_another_version_or_garbage_are_missing_not_misread():
    pcm, sr = real_speech(RECORDINGS[0])
    feats = host_half(*normalise_reference(pcm, sr))
    data = feats.to_bytes().replace(b'"feature_version":"1"', b'"feature_version":"0"')
    with pytest.raises(FeaturesMissing, match="version"):
        PromptHostFeatures.from_bytes(data)
    with pytest.raises(FeaturesMissing):
        PromptHostFeatures.from_bytes(b"\x01\x00")


def test_features_with_a_nan_or_an_infinity_are_refused() -> None:
    """A peak of 1e18 that bypasses the reference's normalisation overflows the power spectra to inf."""
    pcm, voice_id = normalise_reference(real_speech(RECORDINGS[0])[0], 16000)
    with pytest.raises(BadAudio, match=r"values of its logmel128 feature are NaN or infinite"):
        host_half(pcm * np.float32(1e18 / np.abs(pcm).max()), voice_id)
    host = host_half(pcm, voice_id)
    mel = host.mel80.clone()
    mel[3, 7] = float("nan")
    with pytest.raises(BadAudio, match=r"1 of the 24000 values of its mel80 feature"):
        check_finite(PromptHostFeatures(voice_id, host.logmel128, host.fbank80, mel))
    assert check_finite(host) is host
