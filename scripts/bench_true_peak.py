"""A chapter's true peak: the meter's (`app.books.writing.meter`, oversampling only what could raise the
peak) against the whole signal oversampled block by block (what it did before), interleaved, one thread.

    python scripts/bench_true_peak.py [--minutes 10] [--rounds 3]

Two signals at 24 kHz: speech (the guide voice, espeak-ng, reading a paragraph over and over, resampled
to 24 kHz, with 0.4 s pauses) and noise (what the decoder's random weights make). Prints CPU ms per
second of audio for each, and checks both give the same number.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.audio import resample  # noqa: E402
from app.books.writing.meter import _PEAK_BLOCK, _PEAK_CONTEXT, TRUE_PEAK_RATE, _PeakTracker  # noqa: E402

RATE = 24_000
TEXT = ("The old lighthouse keeper climbed the stairs every evening at dusk. He had done it for forty "
        "years, through storms and calm nights alike, and he never once let the lamp go dark.")


def whole(wave: np.ndarray) -> float:
    """Every block oversampled with its context: the tracker before it skipped anything."""
    from scipy.signal import resample_poly

    factor = math.ceil(TRUE_PEAK_RATE / RATE)
    peak = float(np.abs(wave).max())
    for start in range(0, len(wave), _PEAK_BLOCK):
        lo, hi = max(0, start - _PEAK_CONTEXT), min(len(wave), start + _PEAK_BLOCK + _PEAK_CONTEXT)
        up = resample_poly(wave[lo:hi], factor, 1)
        end = min(hi, start + _PEAK_BLOCK)
        peak = max(peak, float(np.abs(up[(start - lo) * factor:(end - lo) * factor]).max()))
    return peak


def screened(wave: np.ndarray) -> float:
    tracker = _PeakTracker(RATE)
    for start in range(0, len(wave), 48_000):  # fed in 2 s pieces, as a chapter's segments are
        tracker.add(wave[start:start + 48_000])
    tracker.result()
    return tracker.peak


def signals(minutes: float) -> dict[str, np.ndarray]:
    from app.text.guide_voice import speak

    n = int(minutes * 60 * RATE)
    said = resample(speak(TEXT), 16_000, RATE).numpy().astype(np.float64)
    spoken = np.concatenate([said, np.zeros(int(0.4 * RATE))])
    speech = np.tile(spoken, n // len(spoken) + 1)[:n] * 0.9 / np.abs(said).max()
    noise = 0.25 * np.random.default_rng(0).standard_normal(n)
    return {"speech": speech, "noise": noise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    waves = signals(args.minutes)
    print(f"{args.minutes:g} min at {RATE} Hz; CPU ms per second of audio, {args.rounds} rounds interleaved")
    for name, wave in waves.items():
        seconds = len(wave) / RATE
        times: dict[str, list[float]] = {"whole": [], "screened": []}
        values = {}
        for _ in range(args.rounds):
            for how, fn in (("whole", whole), ("screened", screened)):
                started = time.process_time()
                values[how] = fn(wave)
                times[how].append((time.process_time() - started) * 1000 / seconds)
        assert values["whole"] == values["screened"], values
        print(f"{name:7s} whole {min(times['whole']):.3f}-{max(times['whole']):.3f}  "
              f"screened {min(times['screened']):.3f}-{max(times['screened']):.3f}  "
              f"peak {20 * math.log10(values['whole']):.3f} dBTP (equal)")


if __name__ == "__main__":
    main()
