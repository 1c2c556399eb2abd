"""A streamed speech answer saved to a file opens in the usual readers with its length: the FLAC's
header carries the job's length (exactly that many samples follow), and the WAV's "unknown" sizes
(0xFFFFFFFF) read to the end in soundfile and PyAV (and ffprobe where it is installed)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf

from app.api.speech_codec import Encoder
from app.api.speech_tempo import encoder

RATE = 24000


def tone(samples: int) -> bytes:
    t = np.arange(samples) / RATE
    return (np.sin(2 * np.pi * 330 * t) * 9000).astype("<i2").tobytes()


def stream(enc: Encoder, pcm: bytes, chunk: int = 4800) -> bytes:
    out = b"".join(enc.feed(pcm[i:i + chunk]) for i in range(0, len(pcm), chunk))
    return out + enc.finish()


def pyav_length(data: bytes) -> tuple[float | None, int]:
    """(the container's duration in s, or None; the samples decoded)."""
    with av.open(io.BytesIO(data)) as container:
        duration = None if container.duration is None else container.duration / av.time_base
        return duration, sum(f.samples for f in container.decode(audio=0))


@pytest.mark.parametrize("fed", [36_000, 30_000, 40_000])  # the job's length, short of it, beyond it
def test_a_streamed_flac_says_the_jobs_length_and_holds_exactly_that(fed: int, tmp_path: Path) -> None:
    data = stream(Encoder("flac", total_samples=36_000), tone(fed))
    saved = tmp_path / "speech.flac"
    saved.write_bytes(data)
    assert sf.info(str(saved)).frames == 36_000
    samples, rate = sf.read(str(saved), dtype="int16")
    assert (len(samples), rate) == (36_000, RATE)
    kept = min(fed, 36_000)
    assert np.array_equal(samples[:kept], np.frombuffer(tone(fed), "<i2")[:kept])
    assert not samples[kept:].any()  # a job that wrote less is padded with silence
    duration, decoded = pyav_length(data)
    assert decoded == 36_000 and duration is not None and abs(duration - 1.5) < 0.01


def test_a_stretched_flac_says_its_stretched_length() -> None:
    data = stream(encoder("flac", 2.0, 48_000), tone(48_000))
    info = sf.info(io.BytesIO(data))
    assert info.frames == 24_000
    assert len(sf.read(io.BytesIO(data))[0]) == 24_000


def test_a_streamed_wav_of_unknown_length_reads_to_its_end(tmp_path: Path) -> None:
    data = stream(Encoder("wav"), tone(36_000))
    assert data[4:8] == b"\xff\xff\xff\xff"
    saved = tmp_path / "speech.wav"
    saved.write_bytes(data)
    samples, rate = sf.read(str(saved), dtype="int16")
    assert (len(samples), rate) == (36_000, RATE)
    assert pyav_length(data)[1] == 36_000
    if shutil.which("ffprobe"):
        probed = subprocess.run(["ffprobe", "-v", "error", "-show_format", "-of", "json", str(saved)],
                                capture_output=True, text=True, check=True)
        assert abs(float(json.loads(probed.stdout)["format"]["duration"]) - 1.5) < 0.01
