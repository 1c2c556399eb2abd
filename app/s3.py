"""The S3 tokenizer v2 on the CPU side: 16 kHz speech -> speech tokens (25 per second).

    S3Quantizer.load(path, device=...)(logmel128 [128, T16]) -> tokens [1, ceil(T16 / 4)] int64
    StandInTokenizer()(logmel128)                            -> the same shape, from quantised log-mel
    tokenizer.batch([logmel128 [128, T_i], ...])             -> [[ceil(T_i / 4)] int64, ...]: many
                                                                segments in one forward, each one's
                                                                tokens those it gets alone
    tokenizer_for(model_dir)                                 -> one of them, built once per process
    speech_tokens(wave16k, tokenizer)                        -> list[int] for a synth job

Used by the book pipeline (`tasks.books`, token sources `audio` and `text`): tokens are made on a CPU
worker and become ordinary synth-job input. The GPU worker's device half imports `S3Quantizer` from
here too (`gpu_worker.voices.speaker`), so `tasks` and `gpu_worker` never import each other.

Dummy mode (no model folder) has no tokenizer ONNX: `StandInTokenizer` makes deterministic tokens
from quantised log-mel frames (4 frames of 10 ms -> one token, 25 per second) and logs loudly that
they are stand-ins. They carry the speech's length and rhythm, nothing of its content.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from app.errors import BadAudio, ModelLoadError
from app.speech import S3_SAMPLE_RATE, TOKEN_RATE, TOKENIZER_ONNX

log = logging.getLogger(__name__)

S3_MELS = 128
FRAMES_PER_TOKEN = 4  # 100 log-mel frames per second -> 25 tokens per second


def _require_file(path: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing")
    return path


def _check_logmel(logmel128: Tensor) -> None:
    if logmel128.dim() != 2 or logmel128.size(0) != S3_MELS or logmel128.size(1) == 0:
        raise ValueError(f"S3 log-mel must be [128, T > 0], got {tuple(logmel128.shape)}")


class Tokenizer(Protocol):
    def __call__(self, logmel128: Tensor) -> Tensor: ...

    def batch(self, logmels: Sequence[Tensor]) -> list[Tensor]: ...


def _token_count(frames: int) -> int:
    return -(-frames // FRAMES_PER_TOKEN)


class S3Quantizer:
    """S3 tokenizer v2 on a device: a [128, T] log-mel -> prompt tokens (25 per second)."""

    def __init__(self, module: torch.nn.Module):
        self.module: Any = module.eval()  # s3tokenizer's S3TokenizerV2

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> S3Quantizer:
        """Converts the ONNX file with s3tokenizer, as `s3tokenizer.load_model(path)` does for v2 files;
        the class is chosen here rather than from the path's spelling (load_model picks v3 for any path
        containing "v3")."""
        from s3tokenizer.model_v2 import S3TokenizerV2

        file = _require_file(Path(path))
        try:
            with torch.device(device):
                module = S3TokenizerV2("speech_tokenizer_v2_25hz")
            module.init_from_onnx(str(file))
        except Exception as exc:  # protobuf, key or shape errors from the converter: one answer
            raise ModelLoadError(f"{file}: not a readable S3 tokenizer v2 ONNX file ({exc})") from exc
        return cls(module.requires_grad_(False))

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @torch.inference_mode()
    def __call__(self, logmel128: Tensor) -> Tensor:
        # logmel128: [128, T16] -> [1, ceil(T16 / 4)] int64 ids in 0..6560
        _check_logmel(logmel128)
        mel = logmel128.to(self.device, torch.float32)[None]
        length = torch.tensor([mel.size(2)], device=self.device, dtype=torch.int32)
        codes, _ = self.module.quantize(mel, length)
        # One utterance: its code length is ceil(T / 4), known here, so it is never read back from the
        # device (a host sync in every install).
        return codes[:, : _token_count(mel.size(2))].long()

    @torch.inference_mode()
    def batch(self, logmels: Sequence[Tensor]) -> list[Tensor]:
        """Many segments in one forward: padded to the longest, each with its length, so the encoder's
        masks (attention, convolutions, FSMN memory) keep padding out of every segment's tokens."""
        # logmels: [128, T_i] each -> [ceil(T_i / 4)] int64 each, on the tokenizer's device
        if not logmels:
            return []
        for logmel in logmels:
            _check_logmel(logmel)
        frames = [m.size(1) for m in logmels]
        mel = torch.zeros(len(logmels), S3_MELS, max(frames), device=self.device)
        for row, logmel in enumerate(logmels):
            mel[row, :, : frames[row]] = logmel.to(self.device, torch.float32)
        lengths = torch.tensor(frames, device=self.device, dtype=torch.int32)
        codes, _ = self.module.quantize(mel, lengths)
        return [codes[row, : _token_count(n)].long() for row, n in enumerate(frames)]


class StandInTokenizer:
    """Deterministic stand-in tokens for dummy-weight runs: quantised mean log-mel of 4-frame groups."""

    def __init__(self) -> None:
        log.warning("S3 TOKENIZER STAND-IN: no model folder, so speech tokens are made from quantised "
                    "log-mel frames; they follow the speech's timing but carry none of its content")

    @torch.inference_mode()
    def __call__(self, logmel128: Tensor) -> Tensor:
        # logmel128: [128, T16] -> [1, ceil(T16 / 4)] int64 ids in 0..6560
        _check_logmel(logmel128)
        frames = logmel128.size(1)
        n = _token_count(frames)
        tail = logmel128[:, -1:].expand(S3_MELS, n * FRAMES_PER_TOKEN - frames)
        padded = torch.cat([logmel128.float(), tail.float()], dim=1)  # [128, 4n]
        groups = padded.reshape(S3_MELS, n, FRAMES_PER_TOKEN).mean(dim=2)  # [128, n]
        bands = groups.reshape(4, S3_MELS // 4, n).mean(dim=1)  # [4, n]: four bands of 32 mels
        # s3 log-mel lies in about [-1.5, 1.5] (floored at max - 8, then (x + 4) / 4): 9 levels per band
        levels = ((bands + 1.5) * 3).floor().clamp(0, 8).long()  # [4, n] in 0..8
        weights = torch.tensor([1, 9, 81, 729], dtype=torch.long)[:, None]
        return (levels * weights).sum(dim=0)[None]  # [1, n]: 9^4 ids, VOCAB_SIZE

    def batch(self, logmels: Sequence[Tensor]) -> list[Tensor]:
        # The stand-in's arithmetic is a few reductions per segment: no forward to share
        return [self(logmel)[0] for logmel in logmels]


_LOCK = threading.Lock()


@cache
def _tokenizer(model_dir: str | None) -> Tokenizer:
    if model_dir is None:
        return StandInTokenizer()
    return S3Quantizer.load(Path(model_dir) / TOKENIZER_ONNX)


def tokenizer_for(model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer of a model folder (the stand-in without one), built once per process."""
    with _LOCK:
        return _tokenizer(None if model_dir is None else str(model_dir))


def speech_tokens(wave16k: np.ndarray | Tensor, tokenizer: Tokenizer) -> list[int]:
    """[T] float32 mono speech at 16 kHz -> speech token ids (25 per second); BadAudio if too short."""
    import s3tokenizer

    wave = torch.as_tensor(np.asarray(wave16k, dtype=np.float32))
    if wave.dim() != 1 or wave.numel() < S3_SAMPLE_RATE // TOKEN_RATE * 2:
        raise BadAudio(f"speech of {wave.numel()} samples is too short to tokenize")
    logmel = s3tokenizer.log_mel_spectrogram(wave, n_mels=S3_MELS)
    return [int(t) for t in tokenizer(logmel)[0].tolist()]
