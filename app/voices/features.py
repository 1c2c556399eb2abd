"""Host half of prompt preparation: CPU-only features of a normalised reference voice.

Input is the output of `app.audio.normalise_reference` (mono float32, 24 kHz, 6 s). Output is one
`PromptHostFeatures` value that travels through the feature store as safetensors bytes and feeds
the device half on the GPU worker (S3 quantize, CAM++, setup solve). No model, no device here.

Three features, each exactly as the reference pipeline computes it (MODEL.md):
- S3 log-mel (128 bins) of the 16 kHz wave: the `s3tokenizer` package's own function;
- kaldi fbank (80 bins) of the 16 kHz wave, minus its mean over time: torchaudio's kaldi compliance;
- the 24 kHz mel (80 bins) the flow is conditioned on: written here with slaney mel filters
  (computed in float64 as librosa does, so no librosa dependency at run time).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import s3tokenizer
import torch
import torch.nn.functional as F
import torchaudio.compliance.kaldi as kaldi
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.audio import resample
from app.errors import BadAudio, FeaturesMissing
from app.speech import MEL_BINS, S3_SAMPLE_RATE, SAMPLE_RATE, SAMPLES_PER_MEL
from app.storage.keys import FEATURE_VERSION

# 24 kHz mel of the flow's conditioning (MODEL.md "Host half").
MEL_N_FFT = 1920
MEL_HOP = SAMPLES_PER_MEL
MEL_FMAX = 8000.0


@dataclass(frozen=True)
class PromptHostFeatures:
    voice_id: str
    logmel128: torch.Tensor  # [128, T16] S3 log-mel of the 16 kHz prompt
    fbank80: torch.Tensor  # [Tf, 80] kaldi fbank, mean-normalised over time
    mel80: torch.Tensor  # [Tm, 80] 24 kHz log mel

    def to_bytes(self) -> bytes:
        tensors = {name: getattr(self, name).contiguous() for name in ("logmel128", "fbank80", "mel80")}
        meta = {"voice_id": self.voice_id, "feature_version": str(FEATURE_VERSION)}
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> PromptHostFeatures:
        meta = _safetensors_metadata(data)
        if meta.get("feature_version") != str(FEATURE_VERSION):
            raise FeaturesMissing(f"stored features have version {meta.get('feature_version')!r}, "
                                  f"this build reads {FEATURE_VERSION}")
        tensors = st_load(data)
        return cls(voice_id=meta["voice_id"], logmel128=tensors["logmel128"],
                   fbank80=tensors["fbank80"], mel80=tensors["mel80"])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logmel128, self.fbank80, self.mel80))


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then a JSON header.
    if len(data) < 8:
        raise FeaturesMissing("stored features are truncated")
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError as exc:
        raise FeaturesMissing("stored features have an unreadable header") from exc
    return header.get("__metadata__", {})


def host_half(pcm24k: np.ndarray, voice_id: str) -> PromptHostFeatures:
    """Normalised 24 kHz prompt -> its three host features; BadAudio if one is not finite."""
    wave24 = torch.as_tensor(np.asarray(pcm24k, dtype=np.float32))  # [T24]
    wave16 = resample(wave24, SAMPLE_RATE, S3_SAMPLE_RATE)  # [T16]
    return check_finite(PromptHostFeatures(
        voice_id=voice_id,
        logmel128=s3_log_mel(wave16),
        fbank80=speaker_fbank(wave16),
        mel80=prompt_mel(wave24),
    ))


def check_finite(host: PromptHostFeatures) -> PromptHostFeatures:
    """Refuse features holding a NaN or an infinity (BadAudio, naming the feature): they would make a
    voice `ready` whose every job decodes to garbage. `voice.prepare` fails the voice with this reason, an
    inline preparation on the GPU worker fails the job that needed it."""
    for name in ("logmel128", "fbank80", "mel80"):
        values = getattr(host, name)
        bad = int(values.numel() - torch.isfinite(values).sum())
        if bad:
            raise BadAudio(f"voice {host.voice_id}: {bad} of the {values.numel()} values of its {name} "
                           "feature are NaN or infinite; the reference cannot be used")
    return host


def s3_log_mel(wave16k: torch.Tensor) -> torch.Tensor:
    """wave16k: [T] -> [128, T // 160] (Hann 400, hop 160, last frame dropped, floored at max - 8)."""
    return s3tokenizer.log_mel_spectrogram(wave16k, n_mels=128)


def speaker_fbank(wave16k: torch.Tensor) -> torch.Tensor:
    """wave16k: [T] -> [frames, 80]: kaldi fbank, no dither, minus its mean over time."""
    feats = kaldi.fbank(wave16k.unsqueeze(0), num_mel_bins=80, dither=0.0,
                        sample_frequency=S3_SAMPLE_RATE)
    return feats - feats.mean(dim=0, keepdim=True)


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's Auditory Toolbox scale: linear below 1 kHz, logarithmic above.
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    mel = hz / f_sp
    above = hz >= min_log_hz
    mel[above] = min_log_mel + np.log(hz[above] / min_log_hz) / logstep
    return mel


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    hz = mel * f_sp
    above = mel >= min_log_mel
    hz[above] = min_log_hz * np.exp(logstep * (mel[above] - min_log_mel))
    return hz


@lru_cache(maxsize=1)
def _mel_basis() -> torch.Tensor:
    """[80, 961] triangular slaney filters, area-normalised, computed in float64 like librosa's."""
    fft_hz = np.linspace(0.0, SAMPLE_RATE / 2, MEL_N_FFT // 2 + 1)
    edges_mel = np.linspace(_hz_to_slaney_mel(np.array([0.0]))[0],
                            _hz_to_slaney_mel(np.array([MEL_FMAX]))[0], MEL_BINS + 2)
    edges_hz = _slaney_mel_to_hz(edges_mel)
    widths = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


@lru_cache(maxsize=1)
def _hann() -> torch.Tensor:
    return torch.hann_window(MEL_N_FFT)


def prompt_mel(wave24k: torch.Tensor) -> torch.Tensor:
    """wave24k: [T] -> [T // 480, 80] log mel (reflect-pad 720 each side, no centring)."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    padded = F.pad(wave24k[None, None], (pad, pad), mode="reflect")[0]  # [1, T + 1440]
    spec = torch.stft(padded, MEL_N_FFT, hop_length=MEL_HOP, win_length=MEL_N_FFT, window=_hann(),
                      center=False, onesided=True, return_complex=True)  # [1, 961, frames]
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    mel = torch.log(torch.clamp(_mel_basis() @ magnitude, min=1e-5))  # [1, 80, frames]
    return mel[0].T.contiguous()
