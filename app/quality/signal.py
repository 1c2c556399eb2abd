"""The checks on the samples alone: no model, microseconds a second of audio.

    finite    every sample is a number (a NaN or Inf from the vocoder spoils the whole file)
    silence   the clip is not digital silence: its level, and the share of 20 ms frames below -60 dBFS
    clipping  the share of samples at full scale
    length    the duration against what the text predicts (a reader says about 15 characters a second)
"""

from __future__ import annotations

import numpy as np

from app.quality.report import Check

FRAME_S = 0.02
QUIET_DBFS = -60.0  # a frame below this is silence to the ear
FULL_SCALE = 0.999


def finite(wave: np.ndarray) -> Check:
    bad = int(np.count_nonzero(~np.isfinite(wave)))
    if bad:
        return Check("finite", "fail", score=bad / max(wave.size, 1), threshold="0 non-finite samples",
                     reason=f"{bad} samples are NaN or Inf")
    return Check("finite", "pass", score=0.0, threshold="0 non-finite samples")


def _dbfs(power: np.ndarray | float) -> np.ndarray:
    return 10.0 * np.log10(np.maximum(power, 1e-20))


def silence(wave: np.ndarray, rate: int, *, min_dbfs: float, max_quiet_share: float) -> Check:
    """Fails a clip whose level is below `min_dbfs`, or that is mostly frames under -60 dBFS."""
    level = float(_dbfs(float(np.mean(np.square(wave, dtype=np.float64)))))
    frame = max(1, int(FRAME_S * rate))
    n = wave.size // frame
    frames = wave[: n * frame].reshape(n, frame) if n else wave.reshape(1, -1)
    quiet = float(np.mean(_dbfs(np.mean(np.square(frames, dtype=np.float64), axis=1)) < QUIET_DBFS))
    bound = f"level >= {min_dbfs:g} dBFS, quiet frames <= {max_quiet_share:.0%}"
    if level < min_dbfs:
        return Check("silence", "fail", score=level, threshold=bound,
                     reason=f"the clip's level is {level:.1f} dBFS: silence")
    if quiet > max_quiet_share:
        return Check("silence", "fail", score=level, threshold=bound,
                     reason=f"{quiet:.0%} of the clip is below {QUIET_DBFS:g} dBFS")
    return Check("silence", "pass", score=level, threshold=bound)


def clipping(wave: np.ndarray, *, max_share: float) -> Check:
    share = float(np.mean(np.abs(wave) >= FULL_SCALE)) if wave.size else 0.0
    bound = f"<= {max_share:.2%} of samples at full scale"
    if share > max_share:
        return Check("clipping", "fail", score=share, threshold=bound,
                     reason=f"{share:.2%} of the samples are at full scale")
    return Check("clipping", "pass", score=share, threshold=bound)


def length(seconds: float, expected_s: float | None, *, low: float, high: float) -> Check:
    """The clip's duration over the expected one, held to [low, high]."""
    bound = f"{low:g}..{high:g} x the expected length"
    if not expected_s or expected_s <= 0:
        return Check("length", "skipped", threshold=bound, reason="no text or token count to predict it")
    ratio = seconds / expected_s
    if not low <= ratio <= high:
        side = "short" if ratio < low else "long"
        return Check("length", "fail", score=ratio, threshold=bound,
                     reason=f"{seconds:.2f} s is too {side} for its text (about {expected_s:.1f} s expected)")
    return Check("length", "pass", score=ratio, threshold=bound)
