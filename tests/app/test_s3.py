"""The CPU side of the S3 tokenizer: the stand-in's tokens, alone and in a batch."""

from __future__ import annotations

import pytest
import s3tokenizer
import torch

from app.s3 import StandInTokenizer


def _mel(samples: int, seed: int) -> torch.Tensor:
    # A tone per seed over faint noise: the stand-in's bands tell the segments apart
    t = torch.arange(samples) / 16000
    noise = 0.01 * torch.randn(samples, generator=torch.Generator().manual_seed(seed))
    wave = 0.3 * torch.sin(2 * torch.pi * 300 * (seed + 1) ** 2 * t) + noise
    return s3tokenizer.log_mel_spectrogram(wave, n_mels=128)


def test_stand_in_batch_gives_each_segment_the_tokens_it_gets_alone():
    tokenizer = StandInTokenizer()
    mels = [_mel(n, seed) for seed, n in enumerate((16000, 4960, 27200))]
    batched = tokenizer.batch(mels)
    assert [t.numel() for t in batched] == [-(-m.size(1) // 4) for m in mels]
    assert all(torch.equal(b, tokenizer(m)[0]) for b, m in zip(batched, mels, strict=True))
    assert not torch.equal(batched[0][: batched[1].numel()], batched[1])  # segments are not mixed up


def test_stand_in_batch_refuses_a_wrong_log_mel():
    with pytest.raises(ValueError, match="log-mel"):
        StandInTokenizer().batch([_mel(8000, 0), torch.zeros(80, 10)])
