"""Regenerate the bundled demo samples (run by hand; the outputs are committed).

`python -m app.dev.samples.generate` writes two reference voices and two token files next to this
file. The voices are espeak-ng speech when the binary exists (voice-like enough for the speaker
models), else a harmonic synthetic voice; the tokens are random S3 ids in 0..6560, seeded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from app.audio import resample
from app.speech import VOCAB_SIZE

HERE = Path(__file__).resolve().parent
# (file, espeak voice, pitch, text, sample rate, seconds)
VOICES = [
    ("voice_a.wav", "en-us", 45, "Hello there. This is the first sample voice of the wavefarm demo, "
     "speaking slowly and clearly.", 16000, 5.0),
    ("voice_b.wav", "en-gb+f3", 70, "Good evening. I am the second voice, a little higher, reading a "
     "short sentence for the demo.", 24000, 3.5),
]
TOKENS = [("tokens_a.json", 75, 1), ("tokens_b.json", 60, 2)]


def espeak(voice: str, pitch: int, text: str) -> tuple[np.ndarray, int] | None:
    if shutil.which("espeak-ng") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "say.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-p", str(pitch), "-s", "145", "-w", str(out), text],
                       check=True)
        pcm, sr = sf.read(out, dtype="float32")
    return pcm, sr


def harmonic_voice(seconds: float, f0: float, sample_rate: int, seed: int) -> np.ndarray:
    """A vowel-like buzz with a wandering pitch and syllable-rate amplitude, for hosts without espeak."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t) + 0.02 * rng.standard_normal(t.size).cumsum() / 300)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4.0 * t)) ** 2
    return (0.2 * wave * envelope).astype(np.float32)


def main() -> None:
    for i, (name, voice, pitch, text, sr, seconds) in enumerate(VOICES):
        said = espeak(voice, pitch, text)
        if said is None:
            pcm = harmonic_voice(seconds, 110.0 + 90.0 * i, sr, seed=i)
        else:
            pcm = resample(said[0], said[1], sr).numpy()[: int(seconds * sr)]
        sf.write(HERE / name, pcm, sr, subtype="PCM_16")
    for name, n, seed in TOKENS:
        ids = np.random.default_rng(seed).integers(0, VOCAB_SIZE, size=n).tolist()
        (HERE / name).write_text(json.dumps(ids) + "\n")


if __name__ == "__main__":
    main()
