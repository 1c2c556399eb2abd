"""A text job's guide-voice speech, from the CPU worker that speaks it to the GPU worker that tokenizes it.

    GuideSpeech(segments)                 each segment's 16 kHz speech, its pause included, as int16 PCM
    GuideSpeech.from_waves(waves)         from the guide voice's float32 speech (exact: espeak-ng's PCM
                                          is int16 to begin with)
    speech.token_counts()                 each segment's token count, known before any tokenizer runs
    speech.logmels()                      each segment's S3 128-bin log-mel: the tokenizer's input
    speech.encode() / GuideSpeech.decode  safetensors bytes for the feature store (never pickle); decode
                                          checks the frame and its bounds before reading anything

A segment's tokens are those the S3 tokenizer gives its speech alone (`app.s3`), so a job's tokens do not
depend on where, or beside which other segments, they were made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.s3 import FRAMES_PER_TOKEN, S3_MELS
from app.speech import S3_SAMPLE_RATE, TOKEN_RATE
from app.storage.feature_store import check_safetensors

HOP = 160  # samples per S3 log-mel frame (100 per second at 16 kHz)
MIN_SAMPLES = S3_SAMPLE_RATE // TOKEN_RATE * 2  # the shortest speech the tokenizer is given (2 tokens)
SAMPLES_PER_TOKEN = S3_SAMPLE_RATE // TOKEN_RATE
MAX_SEGMENTS = 10_000


def token_count(samples: int) -> int:
    """Tokens the S3 tokenizer makes of `samples` of 16 kHz speech: one per 4 log-mel frames, rounded up
    (the log-mel has samples // 160 frames)."""
    return -(-(samples // HOP) // FRAMES_PER_TOKEN)


@dataclass(frozen=True)
class GuideSpeech:
    segments: list[np.ndarray]  # [T_i] int16 at 16 kHz each, T_i >= MIN_SAMPLES

    @classmethod
    def from_waves(cls, waves: list[np.ndarray]) -> GuideSpeech:
        """[T_i] float32 speech in [-1, 1) each -> int16; ValueError for a segment too short to tokenize."""
        segments = [np.round(np.clip(w, -1.0, 32767 / 32768) * 32768).astype(np.int16) for w in waves]
        return cls(_checked(segments))

    def token_counts(self) -> list[int]:
        return [token_count(s.size) for s in self.segments]

    def logmels(self) -> list[torch.Tensor]:
        import s3tokenizer

        return [s3tokenizer.log_mel_spectrogram(torch.from_numpy(s.astype(np.float32) / 32768.0),
                                                n_mels=S3_MELS) for s in self.segments]

    def encode(self) -> bytes:
        lengths = torch.tensor([s.size for s in self.segments], dtype=torch.int64)
        pcm = torch.from_numpy(np.concatenate(self.segments))
        return st_save({"pcm": pcm, "lengths": lengths}, metadata={"rate": str(S3_SAMPLE_RATE)})

    @classmethod
    def decode(cls, data: bytes, *, max_tokens: int) -> GuideSpeech:
        """ValueError unless `data` is guide speech of at most `max_tokens` tokens (plus one per segment
        for rounding): a stored entry is trusted no further than its frame and its bounds."""
        check_safetensors(data)
        try:
            tensors = st_load(bytes(data))
        except Exception as exc:  # safetensors raises its own error types for a bad body
            raise ValueError(f"not guide speech: {exc}") from exc
        pcm, lengths = tensors.get("pcm"), tensors.get("lengths")
        if pcm is None or lengths is None or pcm.dtype != torch.int16 or lengths.dtype != torch.int64 \
                or pcm.dim() != 1 or lengths.dim() != 1 or not 0 < lengths.numel() <= MAX_SEGMENTS:
            raise ValueError("not guide speech: expected int16 'pcm' [T] and int64 'lengths' [n]")
        sizes = [int(n) for n in lengths.tolist()]
        if min(sizes) < MIN_SAMPLES or sum(sizes) != pcm.numel():
            raise ValueError("not guide speech: segment lengths do not add up to its speech")
        if sum(token_count(n) for n in sizes) > max_tokens + len(sizes):
            raise ValueError(f"guide speech over the limit of {max_tokens} tokens")
        return cls(_checked([s.numpy() for s in torch.split(pcm, sizes)]))


def _checked(segments: list[np.ndarray]) -> list[np.ndarray]:
    if not 0 < len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"guide speech of {len(segments)} segments (1 to {MAX_SEGMENTS})")
    for segment in segments:
        if segment.ndim != 1 or segment.size < MIN_SAMPLES:
            raise ValueError(f"speech of {segment.size} samples is too short to tokenize")
    return segments
