"""A text job's guide-voice speech, from the CPU worker that speaks it to the GPU worker that tokenizes it.

    GuideSpeech(segments, rate)           each segment's speech, its pause included, as int16 PCM at the
                                          guide voice's own rate (espeak-ng: 22,050 Hz), as it was spoken
    GuideSpeech.from_waves(waves)         from 16 kHz float32 speech (tests, and speech made elsewhere)
    speech.token_counts()                 each segment's token count, known before any tokenizer runs (from
                                          the length its speech has once resampled to 16 kHz)
    speech.waves16k()                     each segment resampled to 16 kHz float32 (`app.audio.resample`)
    speech.logmels()                      each segment's S3 128-bin log-mel: the tokenizer's input
    speech.encode() / GuideSpeech.decode  safetensors bytes for the feature store (never pickle); decode
                                          checks the frame, the rate and the bounds before reading anything

The speech is stored at the rate it was spoken and resampled to the tokenizer's 16 kHz on the GPU worker
(`logmels`): the resampling cost a CPU worker about a fifth of a segment's speech (issue 44), and a GPU
worker's host does it beside the log-mel it computes anyway. Speech stored at 16 kHz (a `rate` of 16,000,
or an entry written before the rate was stored) is read as it is.

A segment's tokens are those the S3 tokenizer gives its speech alone (`app.s3`), so a job's tokens do not
depend on where, or beside which other segments, they were made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.audio import resample
from app.s3 import FRAMES_PER_TOKEN, S3_MELS
from app.speech import S3_SAMPLE_RATE, TOKEN_RATE
from app.storage.feature_store import check_safetensors

HOP = 160  # samples per S3 log-mel frame (100 per second at 16 kHz)
MIN_SAMPLES = S3_SAMPLE_RATE // TOKEN_RATE * 2  # the shortest speech the tokenizer is given (2 tokens)
SAMPLES_PER_TOKEN = S3_SAMPLE_RATE // TOKEN_RATE
MAX_SEGMENTS = 10_000
# the rates guide speech may be stored at: a closed set, since a rate sizes the resampler's kernel (one
# prime to 16,000 such as 47,999 would make it gigabytes)
RATES = frozenset({8_000, 11_025, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000})


def length_at_16k(samples: int, rate: int) -> int:
    """How many samples `samples` at `rate` become at 16 kHz: `app.audio.resample`'s (torchaudio's) output
    length, ceil(samples * new / old) with both rates divided by their greatest common divisor, computed
    as torchaudio computes it."""
    if rate == S3_SAMPLE_RATE:
        return samples
    common = math.gcd(rate, S3_SAMPLE_RATE)
    return math.ceil(S3_SAMPLE_RATE // common * samples / (rate // common))


def token_count(samples: int) -> int:
    """Tokens the S3 tokenizer makes of `samples` of 16 kHz speech: one per 4 log-mel frames, rounded up
    (the log-mel has samples // 160 frames)."""
    return -(-(samples // HOP) // FRAMES_PER_TOKEN)


@dataclass(frozen=True)
class GuideSpeech:
    segments: list[np.ndarray]  # [T_i] int16 at `rate` each, at least MIN_SAMPLES once at 16 kHz
    rate: int = S3_SAMPLE_RATE

    def __post_init__(self) -> None:
        if self.rate not in RATES:
            raise ValueError(f"guide speech at {self.rate} Hz (one of {sorted(RATES)})")
        _checked(self.segments, self.rate)

    @classmethod
    def from_waves(cls, waves: list[np.ndarray], rate: int = S3_SAMPLE_RATE) -> GuideSpeech:
        """[T_i] float32 speech in [-1, 1) each -> int16; ValueError for a segment too short to tokenize."""
        return cls([np.round(np.clip(w, -1.0, 32767 / 32768) * 32768).astype(np.int16) for w in waves], rate)

    def token_counts(self) -> list[int]:
        return [token_count(length_at_16k(s.size, self.rate)) for s in self.segments]

    def waves16k(self) -> list[torch.Tensor]:
        """Each segment as [T] float32 at 16 kHz, resampled when it was stored at another rate."""
        waves = [torch.from_numpy(s.astype(np.float32) / 32768.0) for s in self.segments]
        if self.rate == S3_SAMPLE_RATE:
            return waves
        return [resample(w, self.rate, S3_SAMPLE_RATE) for w in waves]

    def logmels(self) -> list[torch.Tensor]:
        import s3tokenizer

        return [s3tokenizer.log_mel_spectrogram(w, n_mels=S3_MELS) for w in self.waves16k()]

    def encode(self) -> bytes:
        lengths = torch.tensor([s.size for s in self.segments], dtype=torch.int64)
        pcm = torch.from_numpy(np.concatenate(self.segments))
        return st_save({"pcm": pcm, "lengths": lengths, "rate": torch.tensor([self.rate], dtype=torch.int64)},
                       metadata={"rate": str(self.rate)})

    @classmethod
    def decode(cls, data: bytes, *, max_tokens: int) -> GuideSpeech:
        """ValueError unless `data` is guide speech of at most `max_tokens` tokens (plus one per segment
        for rounding): a stored entry is trusted no further than its frame and its bounds."""
        check_safetensors(data)
        try:
            tensors = st_load(bytes(data))
        except Exception as exc:  # safetensors raises its own error types for a bad body
            raise ValueError(f"not guide speech: {exc}") from exc
        pcm, lengths, rates = tensors.get("pcm"), tensors.get("lengths"), tensors.get("rate")
        if pcm is None or lengths is None or pcm.dtype != torch.int16 or lengths.dtype != torch.int64 \
                or pcm.dim() != 1 or lengths.dim() != 1 or not 0 < lengths.numel() <= MAX_SEGMENTS:
            raise ValueError("not guide speech: expected int16 'pcm' [T] and int64 'lengths' [n]")
        if rates is not None and (rates.dtype != torch.int64 or rates.shape != (1,)):
            raise ValueError("not guide speech: expected its int64 'rate' [1]")
        rate = S3_SAMPLE_RATE if rates is None else int(rates[0])  # entries written before the rate was
        if rate not in RATES:                                      # stored are 16 kHz
            raise ValueError(f"not guide speech: a rate of {rate} Hz (one of {sorted(RATES)})")
        sizes = [int(n) for n in lengths.tolist()]
        if min(sizes) < 1 or sum(sizes) != pcm.numel():
            raise ValueError("not guide speech: segment lengths do not add up to its speech")
        if sum(token_count(length_at_16k(n, rate)) for n in sizes) > max_tokens + len(sizes):
            raise ValueError(f"guide speech over the limit of {max_tokens} tokens")
        return cls([s.numpy() for s in torch.split(pcm, sizes)], rate)


def _checked(segments: list[np.ndarray], rate: int) -> None:
    if not 0 < len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"guide speech of {len(segments)} segments (1 to {MAX_SEGMENTS})")
    for segment in segments:
        if segment.ndim != 1 or segment.dtype != np.int16:
            raise ValueError("guide speech segments are [T] int16")
        if length_at_16k(segment.size, rate) < MIN_SAMPLES:
            raise ValueError(f"speech of {segment.size} samples at {rate} Hz is too short to tokenize")
