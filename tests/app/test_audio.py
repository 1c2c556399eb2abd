"""Reference audio: decoding limits, normalisation, identity, atomic output files."""

import io
import zipfile

import numpy as np
import pytest
import soundfile as sf

from app.audio import (
    PROMPT_SAMPLES,
    AudioLimits,
    decode_audio,
    load_reference,
    normalise_reference,
    write_audio,
)
from app.errors import BadAudio


def encode(pcm: np.ndarray, sr: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def speechy(seconds: float, sr: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    mono = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    mono = mono + 0.01 * rng.standard_normal(mono.shape)
    return np.stack([mono] * channels, axis=1).astype(np.float32) if channels > 1 else mono.astype(np.float32)


def test_same_voice_in_wav_and_flac_has_one_identity():
    pcm = speechy(3.0, 16000)
    a_pcm, a_id = load_reference(encode(pcm, 16000, "WAV", "FLOAT"))
    b_pcm, b_id = load_reference(encode(pcm, 16000, "FLAC", "PCM_24"))
    assert a_pcm.shape == (PROMPT_SAMPLES,) and a_pcm.dtype == np.float32
    assert np.abs(a_pcm - b_pcm).max() < 1e-5  # FLAC is 24-bit
    assert a_id != b_id or np.array_equal(a_pcm, b_pcm)
    again, again_id = load_reference(encode(pcm, 16000, "WAV", "FLOAT"))
    assert again_id == a_id and np.array_equal(again, a_pcm)


def test_long_reference_is_truncated_to_six_seconds_and_short_one_zero_padded(caplog):
    long_pcm, _ = normalise_reference(speechy(9.0, 24000), 24000)
    assert long_pcm.shape == (PROMPT_SAMPLES,)
    assert "using its first 6.0 s" in caplog.text
    short_pcm, _ = normalise_reference(speechy(2.0, 24000), 24000)
    assert short_pcm.shape == (PROMPT_SAMPLES,)
    assert np.all(short_pcm[2 * 24000:] == 0) and np.abs(short_pcm[:24000]).max() > 0.1


def test_stereo_is_downmixed_and_48k_resampled():
    stereo = speechy(2.0, 48000, channels=2)
    stereo[:, 1] *= 0.0
    pcm, _ = load_reference(encode(stereo, 48000))
    mono, _ = load_reference(encode(stereo.mean(axis=1), 48000))
    assert np.abs(pcm - mono).max() < 1e-4


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (encode(np.zeros(1, np.float32), 16000), "long; at least"),
        (encode(np.zeros(16000, np.float32), 16000), "silent"),
        (encode(speechy(1.0, 16000, channels=9), 16000), "9 channels"),
        (encode(speechy(1.0, 192000), 192000), "192000 Hz"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 40, "not a readable audio file"),
        (b"this is not audio at all, just text pretending to be a .wav", "not a readable audio file"),
    ],
    ids=["empty", "one-sample", "all-zeros", "nine-channels", "192k", "lying-header", "text"],
)
def test_bad_references_are_refused_with_the_reason(data, reason):
    with pytest.raises(BadAudio, match=reason):
        load_reference(data)


def test_non_finite_samples_are_refused():
    pcm = speechy(1.0, 16000)
    pcm[100] = np.nan
    with pytest.raises(BadAudio, match="NaN"):
        normalise_reference(pcm, 16000)
    pcm[100] = np.inf
    with pytest.raises(BadAudio, match="NaN or infinite"):
        normalise_reference(pcm, 16000)


def test_truncated_file_is_refused_or_shorter():
    data = encode(speechy(2.0, 16000), 16000, "FLAC")
    with pytest.raises(BadAudio):
        decode_audio(data[: len(data) // 50])


def test_duration_and_size_limits_hold_without_decoding_everything():
    data = encode(speechy(3.0, 8000), 8000, "FLAC")
    with pytest.raises(BadAudio, match="longer than the 2 s limit"):
        decode_audio(data, AudioLimits(max_seconds=2.0))
    with pytest.raises(BadAudio, match="bytes; the limit"):
        decode_audio(data, AudioLimits(max_bytes=100))


def test_zip_archive_with_wav_extension_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.wav", b"\x00" * 10_000_000)
    with pytest.raises(BadAudio, match="not a readable audio file"):
        load_reference(buf.getvalue())


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_write_audio_is_atomic_and_readable(tmp_path, fmt):
    wave = speechy(0.5, 24000)
    out = tmp_path / "sub" / f"job.{fmt}"
    write_audio(out, wave, fmt)
    back, sr = sf.read(out, dtype="float32")
    assert sr == 24000 and back.shape == wave.shape
    assert np.abs(back - wave).max() < 1e-4
    assert [p.name for p in out.parent.iterdir()] == [out.name]


@pytest.mark.parametrize("peak", [1e18, 32767.0, 3e38])
def test_a_float_reference_over_full_scale_is_scaled_down_and_prepares_finite_features(peak, caplog):
    """A float WAV peaking at 1e18 made NaN features and a `ready` voice that decoded to garbage."""
    from app.voices.features import host_half

    quiet = speechy(2.0, 16000, channels=2)
    loud = (quiet.astype(np.float64) * (peak / float(np.abs(quiet).max()))).astype(np.float32)
    pcm, voice_id = load_reference(encode(loud, 16000, "WAV", "FLOAT"))
    at_full_scale, _ = load_reference(encode(quiet / np.abs(quiet).max(), 16000, "WAV", "FLOAT"))
    assert np.abs(pcm - at_full_scale).max() < 1e-5 and 0.9 < np.abs(pcm).max() < 1.1
    host = host_half(pcm, voice_id)  # raises unless every feature is finite
    assert host.voice_id == voice_id
    assert "scaled down to full scale" in caplog.text


def test_a_reference_at_or_under_full_scale_keeps_its_level_and_its_id():
    pcm = speechy(2.0, 24000)
    kept, voice_id = normalise_reference(pcm, 24000)
    assert np.array_equal(kept[: pcm.shape[0]], pcm) and np.abs(kept).max() < 1.0
    assert normalise_reference(pcm * 2, 24000)[1] != voice_id  # scaled to full scale: another level


@pytest.mark.parametrize("data", [b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 40, b"not audio at all"])
def test_an_unreadable_file_is_refused_in_libsndfile_words_without_a_python_object(data):
    with pytest.raises(BadAudio) as info:
        decode_audio(data)
    message = str(info.value)
    assert "object at 0x" not in message and "<_io" not in message, message
    assert message.startswith("not a readable audio file (WAV, FLAC, OGG or MP3): ") and len(message) > 52


@pytest.mark.parametrize(("orig_sr", "new_sr"),
                         [(22050, 16000), (48000, 24000), (8000, 24000), (16000, 22050)])
def test_resampling_with_the_kernel_built_once_gives_torchaudios_numbers_bit_for_bit(orig_sr, new_sr):
    """The guide voice (22,050 Hz) and every reference are resampled through a cached kernel: the same
    samples as `torchaudio.functional.resample`, for a mono and a batched signal, call after call."""
    import torch
    import torchaudio.functional as AF

    from app.audio import resample

    rng = np.random.default_rng(orig_sr + new_sr)
    for shape in ((orig_sr // 3,), (2, orig_sr // 5)):
        pcm = rng.standard_normal(shape).astype(np.float32)
        for _ in range(2):  # the first call builds the kernel, the second uses it
            expected = AF.resample(torch.from_numpy(pcm), orig_sr, new_sr)
            assert torch.equal(resample(pcm, orig_sr, new_sr), expected)
