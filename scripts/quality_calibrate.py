"""Measure the quality gate's scores on real recordings and on broken audio, and its CPU cost.

    python scripts/quality_calibrate.py [--json docs/bench/quality_calibration.json]

Recordings (Debian packages, as the tests use them): pocketsphinx-testdata's five LibriVox clips
(one reader, with transcripts) and alsa-utils' channel-test voice (another speaker). Each LibriVox
clip is checked against another clip of its reader; noise, silence and a cut-off clip are made from
them. CPU time is the process's (`time.process_time`), one thread, models warmed first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.quality import listeners  # noqa: E402
from app.quality.gate import check_audio  # noqa: E402
from tests.app.quality.conftest import ALSA, LIBRIVOX, read16k  # noqa: E402

RATE = 16000


def cases() -> list[tuple[str, np.ndarray, str, np.ndarray]]:
    import re

    clips = []
    for line in (LIBRIVOX / "transcription").read_text().splitlines():
        m = re.match(r"<s> (.*) </s> \((.*)\)", line.strip())
        if m:
            clips.append((m[2][-4:], read16k(LIBRIVOX / f"{m[2]}.wav"), m[1]))
    out = [(f"librivox {n}", w, t, clips[(i + 1) % len(clips)][1]) for i, (n, w, t) in enumerate(clips)]
    other = read16k(ALSA / "Front_Center.wav")
    name, wave, text = clips[0]
    rng = np.random.default_rng(0)
    out += [(f"librivox {name} against another speaker", wave, text, other),
            ("white noise", (rng.standard_normal(wave.size) * 0.1).astype(np.float32), text, clips[1][1]),
            ("silence", np.zeros_like(wave), text, clips[1][1]),
            (f"librivox {name}, first 0.8 s", wave[: int(0.8 * RATE)], text, clips[1][1])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows, cost = [], {"quality": 0.0, "voice": 0.0, "words": 0.0, "seconds": 0.0}
    warm = cases()[0]
    check_audio(warm[1], RATE, text=warm[2], reference=warm[3], reference_rate=RATE)
    for name, wave, text, ref in cases():
        report = check_audio(wave, RATE, text=text, reference=ref, reference_rate=RATE)
        rows.append({"clip": name, "seconds": round(wave.size / RATE, 2), "pass": report.passed,
                     **{c.name: None if c.score is None else round(c.score, 3) for c in report.checks}})
        print(f"{name:42s} {'pass' if report.passed else 'FAIL'}  " + "  ".join(
            f"{c.name}={c.score:.2f}" for c in report.checks if c.score is not None))
        if name.startswith("librivox") and "another" not in name and "0.8" not in name:
            for check in ("quality", "voice", "words"):
                t0 = time.process_time()
                if check == "quality":
                    listeners.quality(wave, min_mos=0)
                elif check == "voice":
                    listeners.embedding(wave)
                else:
                    listeners.transcribe(wave)
                cost[check] += time.process_time() - t0
            cost["seconds"] += wave.size / RATE
    per_s = {k: round(v / cost["seconds"], 4) for k, v in cost.items() if k != "seconds"}
    per_s["total"] = round(sum(per_s.values()), 4)
    print(f"CPU seconds per second of audio (one thread, {cost['seconds']:.1f} s of speech): {per_s}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows,
                                         "cpu_s_per_audio_s": per_s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
