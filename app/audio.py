"""Audio in and out: decode uploads, normalise a reference voice, write outputs atomically.

Everything that touches audio *files* lives here (soundfile: WAV, FLAC, OGG, MP3 where libsndfile
supports it). The feature maths is in `app.voices.features`; this module does no model work.

Refusals raise `BadAudio` with the reason, before any large allocation where possible: the decoder
is told how many frames it may produce, so a lying header or a compression bomb cannot make us
decode an hour of audio.

torch (for torchaudio's resampler) is imported by `resample` when it first runs, not with this module:
the API and the CLI import this module, and a client command must start without loading torch.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import soundfile as sf

from app.errors import BadAudio
from app.speech import PROMPT_SAMPLES, PROMPT_SECONDS, SAMPLE_RATE, OutputFormat

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_CHANNELS = 8
SILENCE_PEAK = 1e-4  # -80 dBFS: a reference quieter than this carries no voice


@dataclass(frozen=True)
class AudioLimits:
    """What a client may send; the service passes values from its settings."""

    max_bytes: int = 50 * 1024 * 1024
    max_seconds: float = 600.0
    min_seconds: float = 0.5
    min_sample_rate: int = 8000
    max_sample_rate: int = 96000


@dataclass(frozen=True)
class Decoded:
    pcm: np.ndarray  # [T, C] float32: in [-1, 1] from integer formats; a float file may exceed it
    sample_rate: int
    format: str  # how it is stored: WAV (plain, extensible or RF64), FLAC, OGG, MP3


def decode_audio(data: bytes, limits: AudioLimits = AudioLimits()) -> Decoded:
    """Decode an uploaded audio file, refusing anything outside `limits`."""
    if not data:
        raise BadAudio("audio file is empty")
    if len(data) > limits.max_bytes:
        raise BadAudio(f"audio file is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sample_rate, channels, fmt = f.samplerate, f.channels, f.format
            _check_header(sample_rate, channels, limits)
            cap = int(limits.max_seconds * sample_rate)
            # Read one frame past the cap: a header may lie about its length.
            pcm = f.read(frames=cap + 1, dtype="float32", always_2d=True)
    except BadAudio:
        raise
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        raise BadAudio(f"not a readable audio file (WAV, FLAC, OGG or MP3): {_reason(exc)}") from exc
    if pcm.shape[0] > cap:
        raise BadAudio(f"audio is longer than the {limits.max_seconds:g} s limit")
    if pcm.shape[0] < limits.min_seconds * sample_rate:
        raise BadAudio(f"audio is {pcm.shape[0] / sample_rate:.3f} s long; at least "
                       f"{limits.min_seconds:g} s is needed")
    return Decoded(pcm=pcm, sample_rate=sample_rate, format=_container(fmt))


# soundfile's containers accepted for a reference, and the kind each is stored as:
# WAVE_FORMAT_EXTENSIBLE (WAVEX, what many editors write) and RF64 are PCM or float in a WAV wrapper
REFERENCE_CONTAINERS = {"WAV": "WAV", "WAVEX": "WAV", "RF64": "WAV", "FLAC": "FLAC", "OGG": "OGG",
                        "MP3": "MP3"}


def _container(fmt: str) -> str:
    kind = REFERENCE_CONTAINERS.get(fmt.upper())
    if kind is None:
        raise BadAudio(f"a {fmt} file: references must be WAV (plain, extensible or RF64), FLAC, OGG or MP3")
    return kind


_OBJECT_REPR_RE = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _reason(exc: Exception) -> str:
    """libsndfile's own words, without the in-memory file's repr ('Error opening <_io.BytesIO object at
    0x7f...>: ') that soundfile puts before them: it tells the client nothing and names our memory."""
    text = str(getattr(exc, "error_string", "") or exc).strip()
    return _OBJECT_REPR_RE.sub("the upload", text) or type(exc).__name__


def _check_header(sample_rate: int, channels: int, limits: AudioLimits) -> None:
    if channels < 1 or channels > MAX_CHANNELS:
        raise BadAudio(f"audio has {channels} channels; at most {MAX_CHANNELS} are accepted")
    if not limits.min_sample_rate <= sample_rate <= limits.max_sample_rate:
        raise BadAudio(f"sample rate {sample_rate} Hz is outside the accepted "
                       f"{limits.min_sample_rate}..{limits.max_sample_rate} Hz")


def resample(pcm: np.ndarray | torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Band-limited resampling (torchaudio's windowed sinc, its defaults); pcm: [..., T]. The same numbers
    as `torchaudio.functional.resample`, with the kernel of each pair of rates built once."""
    import torch

    wave = torch.as_tensor(pcm, dtype=torch.float32)
    if orig_sr == new_sr:
        return wave
    return cast("torch.Tensor", _resampler(int(orig_sr), int(new_sr))(wave))


def load_resampler() -> None:
    """Import what `resample` needs (torch, torchaudio) now, not at its first call."""
    import torchaudio.transforms  # noqa: F401


@functools.lru_cache(maxsize=32)
def _resampler(orig_sr: int, new_sr: int) -> torch.nn.Module:
    """torchaudio's resampler between two rates in float32: its windowed-sinc kernel, which
    `torchaudio.functional.resample` builds again on every call (a fifth of the CPU of a guide-voice
    segment, issue 44), built once. Its forward keeps no state, so threads may share it."""
    import torch
    import torchaudio.transforms as T

    return T.Resample(orig_sr, new_sr, dtype=torch.float32)


def reference_notes(pcm: np.ndarray, sample_rate: int) -> list[str]:
    """What `normalise_reference` changes in this audio, as the client should be told it."""
    pcm = np.asarray(pcm)
    seconds, length = pcm.shape[0] / sample_rate, f"the reference is {pcm.shape[0] / sample_rate:.2f} s long"
    notes = []
    if seconds > PROMPT_SECONDS + 0.5 / SAMPLE_RATE:
        notes.append(f"{length}; its first {PROMPT_SECONDS:g} s are the voice")
    elif seconds < PROMPT_SECONDS - 0.5 / SAMPLE_RATE:
        notes.append(f"{length}; it is padded with silence to {PROMPT_SECONDS:g} s")
    peak = float(np.abs(pcm).max()) if pcm.size and np.isfinite(pcm).all() else 0.0
    if peak > 1.0:
        notes.append(f"the reference peaks at {20 * np.log10(peak):+.1f} dBFS; it is scaled down to full "
                     "scale")
    return notes


def normalise_reference(pcm: np.ndarray, sample_rate: int) -> tuple[np.ndarray, str]:
    """Reference audio -> (mono 24 kHz float32 PCM of exactly 6 s, voice id).

    pcm: [T, C] or [T]. Bound the level, downmix, resample, truncate (with a warning) or zero-pad. The
    voice id is the sha256 of the normalised float32 bytes followed by the sample rate, so the same voice
    uploaded as WAV or FLAC, or at another sample rate that resamples identically, is one voice.

    The level: a reference peaking above full scale (1.0; only a float file can) is scaled down, in
    float64, to peak at exactly 1.0, with a warning; NaN or infinite samples are refused. Normalised,
    not refused: any finite level maps onto full scale without loss, and a loud float file is usually a
    scaling slip (integer sample values written as floats, peaking near 32768) whose voice is intact;
    left as it is, a peak of 1e18 overflows the features' power spectra to inf and NaN. The voice id
    follows the scaled audio (so such a reference is one voice at whatever level it was sent).
    """
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim == 1:
        pcm = pcm[:, None]
    if pcm.ndim != 2 or pcm.shape[0] == 0:
        raise BadAudio("reference audio is empty")
    if pcm.shape[1] > MAX_CHANNELS:
        raise BadAudio(f"reference has {pcm.shape[1]} channels; at most {MAX_CHANNELS} are accepted")
    if not np.isfinite(pcm).all():
        raise BadAudio("reference audio contains NaN or infinite samples")
    peak = float(np.abs(pcm).max())
    if peak > 1.0:  # before the downmix: a mean of channels near float32's maximum would overflow
        log.warning("reference peaks at %.3g (%+.1f dBFS); scaled down to full scale", peak,
                    20 * np.log10(peak))
        pcm = (pcm.astype(np.float64) / peak).astype(np.float32)
    mono = pcm.mean(axis=1)
    if float(np.abs(mono).max()) < SILENCE_PEAK:
        raise BadAudio("reference audio is silent")
    wave = resample(mono, sample_rate, SAMPLE_RATE).numpy()
    if wave.shape[0] > PROMPT_SAMPLES:
        log.warning("reference is %.2f s; using its first %.1f s", wave.shape[0] / SAMPLE_RATE,
                    PROMPT_SECONDS)
        wave = wave[:PROMPT_SAMPLES]
    elif wave.shape[0] < PROMPT_SAMPLES:
        wave = np.pad(wave, (0, PROMPT_SAMPLES - wave.shape[0]))
    wave = np.ascontiguousarray(wave, dtype=np.float32)
    return wave, voice_id_of(wave)


def voice_id_of(pcm24k: np.ndarray) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(pcm24k, dtype="<f4").tobytes())
    digest.update(str(SAMPLE_RATE).encode())
    return digest.hexdigest()


def load_reference(data: bytes, limits: AudioLimits = AudioLimits()) -> tuple[np.ndarray, str]:
    """Uploaded reference file bytes -> (normalised 24 kHz PCM, voice id)."""
    decoded = decode_audio(data, limits)
    return normalise_reference(decoded.pcm, decoded.sample_rate)


# soundfile's container and subtype of each output format
CONTAINERS = {OutputFormat.WAV: ("WAV", "PCM_16"), OutputFormat.FLAC: ("FLAC", "PCM_16")}


def open_output(path: Path, fmt: str, sample_rate: int = SAMPLE_RATE) -> tuple[sf.SoundFile, Path]:
    """Open a temp file beside `path` for incremental writing; `commit_output` renames it in place."""
    if fmt not in CONTAINERS:
        raise BadAudio(f"output format {fmt!r} is not one of {[f.value for f in OutputFormat]}")
    container, subtype = CONTAINERS[OutputFormat(fmt)]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    handle = sf.SoundFile(tmp, mode="w", samplerate=sample_rate, channels=1, format=container,
                          subtype=subtype)
    return handle, Path(tmp)


def commit_output(handle: sf.SoundFile, tmp: Path, path: Path) -> None:
    handle.close()
    os.replace(tmp, path)


def write_audio(path: Path, wave: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> None:
    """Write a whole waveform atomically (temp name, then rename)."""
    handle, tmp = open_output(path, fmt, sample_rate)
    try:
        handle.write(np.asarray(wave, dtype=np.float32))
    except BaseException:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise
    commit_output(handle, tmp, path)
