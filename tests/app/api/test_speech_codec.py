"""The speech endpoint's encoders, chunk by chunk: every format decodes back (PyAV) to the samples fed,
the encoded bytes come out while samples go in (not all at the end), and an unknown format is refused."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from app.api.speech_codec import FORMATS, Encoder, check_format, wav_stream_header
from app.errors import BadInput

RATE = 24000


def tone(seconds: float) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    return (np.sin(2 * np.pi * 330 * t) * 9000).astype("<i2").tobytes()


def encode(fmt: str, pcm: bytes, chunk: int = 4800) -> tuple[bytes, list[int]]:
    encoder, out, sizes = Encoder(fmt), b"", []
    for i in range(0, len(pcm), chunk):
        got = encoder.feed(pcm[i:i + chunk])
        sizes.append(len(got))
        out += got
    return out + encoder.finish(), sizes


def decoded(fmt: str, data: bytes) -> np.ndarray:
    container = av.open(io.BytesIO(data), format={"aac": "aac", "opus": "ogg"}.get(fmt))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
def test_every_format_decodes_back_and_streams_while_fed(fmt: str) -> None:
    pcm = tone(3.0)
    data, sizes = encode(fmt, pcm)
    samples = decoded(fmt, data)
    if fmt in ("wav", "flac"):  # lossless
        assert np.array_equal(samples.astype("<i2"), np.frombuffer(pcm, "<i2"))
    else:
        rate = 48000 if fmt == "opus" else RATE
        assert abs(len(samples) / rate - 3.0) < 0.15, (fmt, len(samples))
    streamed = sum(sizes[: len(sizes) // 2])
    assert streamed > len(data) / 4, (fmt, sizes)  # a good part was out by half-way


def test_pcm_is_the_samples_as_they_are_and_wav_says_its_length_is_unknown() -> None:
    pcm = tone(0.5)
    assert encode("pcm", pcm)[0] == pcm
    wav = encode("wav", pcm)[0]
    assert wav[:44] == wav_stream_header() and wav[44:] == pcm
    assert struct.unpack("<I", wav[40:44])[0] == 0xFFFFFFFF
    Encoder("mp3").finish()  # nothing fed (a job without audio): closes without an error


@pytest.mark.parametrize("fmt", ["ogg", "m4a", "", "WAV", "../x"])
def test_an_unsupported_format_is_refused_with_the_list(fmt: str) -> None:
    with pytest.raises(BadInput, match="mp3, opus, aac"):
        check_format(fmt)
