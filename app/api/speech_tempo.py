"""A speech request's `speed` (OpenAI's 0.25 to 4.0): the rendered 16-bit PCM is time-stretched, pitch
kept, chunk by chunk as it streams, by FFmpeg's `atempo` filter (WSOLA) through PyAV, which the encoders
already use (`app.api.speech_codec`): no new library, and it takes audio as it comes.

`atempo` takes 0.5 to 100 per instance, so a slower speed runs two at the square root each. The model is
not asked to speak faster: the voice's own pace, rendered, is stretched afterwards.
"""

from __future__ import annotations

import math
from typing import Any

import av
import av.filter
import numpy as np

from app.api.speech_codec import Encoder
from app.speech import SAMPLE_RATE

MIN_SPEED, MAX_SPEED = 0.25, 4.0
_ATEMPO_MIN = 0.5


def _factors(speed: float) -> list[float]:
    return [math.sqrt(speed)] * 2 if speed < _ATEMPO_MIN else [speed]


class Tempo:
    """feed(pcm bytes) -> stretched pcm bytes ready now; finish() -> the rest. Whole s16 samples."""

    def __init__(self, speed: float, sample_rate: int = SAMPLE_RATE) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed {speed} is outside {MIN_SPEED} to {MAX_SPEED}")
        self.sample_rate = sample_rate
        self.pts = 0
        self.graph = av.filter.Graph()
        chain: list[Any] = [self.graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono")]
        chain += [self.graph.add("atempo", f"{factor:.6f}") for factor in _factors(speed)]
        # atempo may hand out another sample format: back to what the encoders are fed
        chain.append(self.graph.add(
            "aformat", f"sample_fmts=s16:channel_layouts=mono:sample_rates={sample_rate}"))
        chain.append(self.graph.add("abuffersink"))
        for left, right in zip(chain, chain[1:], strict=False):
            left.link_to(right)
        self.graph.configure()
        self.finished = False

    def feed(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, dtype="<i2").reshape(1, -1), format="s16",
                                           layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self.pts
        self.pts += frame.samples
        self.graph.push(frame)
        return self._pull()

    def finish(self) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> bytes:
        out: list[bytes] = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.BlockingIOError, av.EOFError):  # nothing more for now / ever
                return b"".join(out)
            out.append(frame.to_ndarray().astype("<i2", copy=False).tobytes())


class TempoEncoder(Encoder):
    """An `Encoder` that stretches what it is fed to `speed` first; the same feed/finish."""

    def __init__(self, fmt: str, speed: float, sample_rate: int = SAMPLE_RATE,
                 total_samples: int | None = None) -> None:
        super().__init__(fmt, sample_rate, total_samples)
        self.tempo = Tempo(speed, sample_rate)

    def feed(self, pcm: bytes) -> bytes:
        return super().feed(self.tempo.feed(pcm))

    def finish(self) -> bytes:
        return super().feed(self.tempo.finish()) + super().finish()


def encoder(fmt: str, speed: float, job_samples: int | None) -> Encoder:
    """The encoder for a speech request: stretched only when the speed is not the voice's own;
    `job_samples`, the job's length when known, is the stretched length the header may say."""
    if speed == 1.0:
        return Encoder(fmt, total_samples=job_samples)
    return TempoEncoder(fmt, speed, total_samples=round(job_samples / speed) if job_samples else None)
