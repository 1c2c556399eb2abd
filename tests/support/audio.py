"""Small audio files for tests: a sine reference voice as WAV bytes."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


def wav_bytes(seconds: float = 2.0, freq: float = 220.0, sr: int = 16000, amp: float = 0.3) -> bytes:
    """A mono sine of `freq` Hz as a float WAV file (`amp` 0: silence)."""
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()
