"""`submit -o FILE`: the file's extension chooses its container (a job's own WAV or FLAC, else MP3, Opus
or AAC in M4A encoded from the job's audio), and an extension nothing here writes is refused before any
job is submitted."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
import soundfile as sf

from app.cli.audio_out import output_plan
from app.dev import SAMPLES
from app.errors import BadInput
from app.settings import Settings
from tests.app.cli.helpers import run
from tests.app.cli.test_jobs import finish_next_job


@pytest.mark.parametrize("name, container", [("out.mp3", "mp3"), ("out.opus", "ogg"), ("OUT.M4A", "mp4")])
def test_the_output_extension_chooses_the_container(server: str, cli_settings: Settings, tmp_path: Path,
                                                     name: str, container: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / name
    finish_next_job(cli_settings)  # the job's audio: voice_b.wav
    code = run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--tokens",
               str(SAMPLES / "tokens_a.json"), "-o", str(out))
    assert code == 0, capsys.readouterr()
    with av.open(str(out)) as opened:
        assert container in opened.format.name.split(","), opened.format.name
        assert opened.duration is not None  # a length in the container, as players show it
        seconds = opened.duration / av.time_base
    expected = sf.info(str(SAMPLES / "voice_b.wav")).duration
    assert abs(seconds - expected) < 0.1, (seconds, expected)


def test_an_extension_it_cannot_write_is_refused_before_submitting(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("jobs", "--api", server) == 0
    before = capsys.readouterr().out
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--tokens",
               str(SAMPLES / "tokens_a.json"), "-o", str(tmp_path / "out.aiff")) == 2
    err = capsys.readouterr().err
    assert "cannot write a .aiff" in err and ".mp3" in err and ".m4a" in err, err
    assert run("jobs", "--api", server) == 0
    assert capsys.readouterr().out == before  # no job, no voice upload's job either
    assert not (tmp_path / "out.aiff").exists()


def test_a_flac_file_is_the_jobs_own_flac_and_a_contradicting_format_is_refused() -> None:
    assert output_plan(Path("a.FLAC"), None) == "flac"
    assert output_plan(Path("a.wav"), None) == "wav"
    assert output_plan(Path("a.mp3"), "flac") == "flac"  # encoded from the job's FLAC
    with pytest.raises(BadInput, match="contradicts"):
        output_plan(Path("a.wav"), "flac")
