"""The book gate's CPU per second of audio without the listeners: reading a segment's WAV and the signal
checks (`app.books.quality.hear(..., listen=False)`), the work a CPU worker adds to each segment of a
book on dummy weights. The listeners' cost is `scripts/quality_calibrate.py`'s (docs/QUALITY.md).

    python scripts/quality_book_cost.py [--clips 20] [--seconds 8]

Prints milliseconds of this process's CPU time per second of audio (a 220 Hz tone with a little noise,
24 kHz 16-bit WAV, the length check fed the matching token count, so every check runs and passes).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from app.books.quality import hear
from app.quality.gate import Thresholds
from app.speech import SAMPLE_RATE, TOKEN_RATE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    t = np.arange(int(args.seconds * SAMPLE_RATE)) / SAMPLE_RATE
    cpu = 0.0
    with tempfile.TemporaryDirectory() as folder:
        for n in range(args.clips):
            path = Path(folder) / f"{n}.wav"
            wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.01 * rng.standard_normal(t.size)
            sf.write(path, wave, SAMPLE_RATE)
            start = time.process_time()
            report = hear(path, n_tokens=int(args.seconds * TOKEN_RATE), text="", language="en",
                          thresholds=Thresholds(), listen=False)
            cpu += time.process_time() - start
            assert report.passed, report.reasons
    audio = args.clips * args.seconds
    print(f"{cpu / audio * 1000:.3f} ms CPU per second of audio ({args.clips} clips, {audio:.0f} s)")


if __name__ == "__main__":
    main()
