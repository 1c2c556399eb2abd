"""Real recordings for the quality gate's tests, from Debian packages (.ci/run installs them):
pocketsphinx-testdata's LibriVox clips (one reader of Sense and Sensibility, with transcripts) and
alsa-utils' channel-test voice (another speaker, two words a clip)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import service_missing

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
ALSA = Path("/usr/share/sounds/alsa")


def read16k(path: Path) -> np.ndarray:
    from app.quality.gate import _to_16k

    wave, rate = sf.read(path, dtype="float32", always_2d=True)
    return _to_16k(wave.mean(axis=1), rate)


@pytest.fixture(scope="session")
def librivox() -> dict[str, tuple[np.ndarray, str]]:
    """Clip name -> (16 kHz speech, its transcript)."""
    if not (LIBRIVOX / "transcription").exists():
        service_missing("pocketsphinx-testdata's LibriVox recordings are not installed (apt-get install "
                        "pocketsphinx-testdata)")
    clips = {}
    for line in (LIBRIVOX / "transcription").read_text().splitlines():
        m = re.match(r"<s> (.*) </s> \((.*)\)", line.strip())
        if m:
            clips[m[2][-4:]] = (read16k(LIBRIVOX / f"{m[2]}.wav"), m[1])
    return clips


@pytest.fixture(scope="session")
def other_speaker() -> list[np.ndarray]:
    if not (ALSA / "Front_Center.wav").exists():
        service_missing("alsa-utils' test voice is not installed (apt-get install alsa-utils)")
    return [read16k(p) for p in sorted(ALSA.glob("[FRS]*_*.wav"))]
