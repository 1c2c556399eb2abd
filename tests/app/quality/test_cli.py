"""`wavefarm quality check`: a JSON report, exit 0 on pass, 1 on fail, 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from app.cli import main
from tests.app.quality.conftest import LIBRIVOX


def test_check_passes_a_real_clip_and_fails_noise(librivox, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    clip = LIBRIVOX / "sense_and_sensibility_01_austen_64kb-0920.wav"
    ref = LIBRIVOX / "sense_and_sensibility_01_austen_64kb-0870.wav"
    text = librivox["0920"][1]
    assert main(["quality", "check", str(clip), "--voice", str(ref), "--text", text, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pass"] is True and report["reasons"] == []
    assert report["checks"]["voice"]["verdict"] == "pass" and report["checks"]["voice"]["score"] > 0.6
    assert report["checks"]["quality"]["threshold"].startswith(">= 1.6")

    noise = tmp_path / "noise.wav"
    sf.write(noise, np.random.default_rng(1).standard_normal(48000).astype(np.float32) * 0.1, 16000)
    assert main(["quality", "check", str(noise), "--voice", str(ref), "--text", text, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["pass"] is False and any(r.startswith("quality:") for r in report["reasons"])


def test_bad_input_exits_2_with_a_reason(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF not really a wave file")
    assert main(["quality", "check", str(junk)]) == 2
    assert "not a readable audio file" in capsys.readouterr().err
    assert main(["quality", "check", str(tmp_path / "missing.wav")]) == 2
