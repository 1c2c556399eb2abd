"""A chapter's loudness: measured (ITU-R BS.1770-4), normalised to a target, and its joins made quiet.

    measure(wave, rate)          -> Loudness: integrated loudness (LUFS, gated, BS.1770-4 with pyloudnorm's
                                    filters) and true peak (dBTP: the peak of the signal oversampled to at
                                    least 192 kHz, as BS.1770-4 Annex 2 asks, so peaks between samples
                                    count); `app.books.writing.meter` measures a signal fed in pieces
    gain_for, after_gain         the one gain to a target under the ceiling, and the figures it gives
    normalise(wave, rate, lufs)  -> (wave with one gain applied, Loudness after it): the gain that reaches
                                    `lufs`, lowered where the true peak would pass TRUE_PEAK_CEILING_DBTP
    fade_edges(wave, rate)       -> the wave with a short raised-cosine fade in and out, so a segment that
                                    starts or ends away from zero does not click where it meets the next

The default target is -20 LUFS integrated, true peak at most -1 dBTP. It lies inside the range
audiobook makers work to (about -18 to -23; ACX asks an RMS level of -18 to -23 dB with peaks under
-3 dBFS) and leaves 19 dB between the loudness and the peak ceiling: speech whose peaks stand up to
that far above its loudness needs no gain taken back, and no limiter or compressor is run here (one
gain per chapter, nothing that changes the voice). A chapter with hotter peaks gets less gain and ends
quieter than the target; its measured figures say so (chapters.json, the book's status).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.books.writing.meter import StreamMeter

DEFAULT_TARGET_LUFS = -20.0
TRUE_PEAK_CEILING_DBTP = -1.0
FADE_MS = 5.0  # at each segment edge: long enough to remove a step, far shorter than a phoneme
_BLOCK = 1 << 18  # samples fed to the meter at a time


@dataclass(frozen=True)
class Loudness:
    integrated_lufs: float  # -inf for silence or audio shorter than one 400 ms gating block
    true_peak_dbtp: float  # -inf for silence
    gain_db: float = 0.0  # the gain normalise() applied (0 when it did not)

    def as_dict(self, digits: int | None = 2) -> dict[str, float | None]:
        """JSON-ready: -inf is None; rounded to `digits` (None: exact, as the sidecars keep it)."""
        def finite(x: float) -> float | None:
            return None if not math.isfinite(x) else x if digits is None else round(x, digits)
        return {"integrated_lufs": finite(self.integrated_lufs),
                "true_peak_dbtp": finite(self.true_peak_dbtp),
                "gain_db": finite(self.gain_db)}


def measure(wave: np.ndarray, rate: int) -> Loudness:
    """A whole signal's loudness and true peak (`app.books.writing.meter`; a chapter is measured as it is
    assembled, in pieces)."""
    meter = StreamMeter(rate)
    for start in range(0, len(wave), _BLOCK):
        meter.add(wave[start:start + _BLOCK])
    return Loudness(meter.integrated(), meter.true_peak())


def integrated_loudness(wave: np.ndarray, rate: int) -> float:
    return measure(wave, rate).integrated_lufs


def true_peak(wave: np.ndarray, rate: int) -> float:
    """The largest absolute value of `wave` oversampled to >= 192 kHz, in dB (dBTP); -inf for silence."""
    return measure(wave, rate).true_peak_dbtp


def gain_for(before: Loudness, target_lufs: float, ceiling_dbtp: float = TRUE_PEAK_CEILING_DBTP) -> float:
    """The one gain (dB) that reaches `target_lufs`, lowered so the true peak stays under the ceiling."""
    return min(target_lufs - before.integrated_lufs, ceiling_dbtp - before.true_peak_dbtp)


def after_gain(before: Loudness, gain_db: float) -> Loudness:
    """One gain moves both figures by exactly `gain_db` (BS.1770 is linear in amplitude): no second
    pass over the signal (the true peak's is the costly one, at 8x the samples)."""
    return Loudness(before.integrated_lufs + gain_db, before.true_peak_dbtp + gain_db, gain_db)


def normalise(wave: np.ndarray, rate: int, target_lufs: float,
              ceiling_dbtp: float = TRUE_PEAK_CEILING_DBTP) -> tuple[np.ndarray, Loudness]:
    """One gain to `target_lufs`, lowered so the true peak stays at or under `ceiling_dbtp`.

    Silence, or audio too short to gate (under 400 ms), is returned unchanged with its figures."""
    before = measure(wave, rate)
    if not math.isfinite(before.integrated_lufs):
        return wave, before
    gain_db = gain_for(before, target_lufs, ceiling_dbtp)
    return (wave * 10.0 ** (gain_db / 20.0)).astype(np.float32), after_gain(before, gain_db)


def fade_edges(wave: np.ndarray, rate: int, ms: float = FADE_MS) -> np.ndarray:
    """A copy of `wave` with a raised-cosine fade of `ms` in at the start and out at the end (shortened
    to a quarter of the wave for very short ones)."""
    n = min(round(ms * rate / 1000), len(wave) // 4)
    if n < 2:
        return wave
    ramp = (0.5 - 0.5 * np.cos(np.linspace(0.0, math.pi, n, dtype=np.float64))).astype(np.float32)
    out = wave.astype(np.float32, copy=True)
    out[:n] *= ramp
    out[-n:] *= ramp[::-1]
    return out
