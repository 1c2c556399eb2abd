"""A text longer than a job's limit (WAVEFARM_MAX_TEXT_JOB_S, 600 s of estimated speech) is refused at
submission, by the API and so the CLI, with the way to render it as a book; nothing is queued."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.dev import SAMPLES
from tests.app.cli.helpers import TOKEN, run

SENTENCE = "The lighthouse keeper walked along the cliff and counted the boats below. "


def test_a_long_text_is_refused_with_the_book_command(server: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    story = tmp_path / "story.txt"
    story.write_text(SENTENCE * 270, encoding="utf-8")  # 20 KB: about 23 minutes of speech
    assert run("jobs", "--api", server) == 0
    before = capsys.readouterr().out
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--text", f"@{story}") == 2
    err = capsys.readouterr().err
    assert "over the job limit of 15000 (600 s)" in err and "wavefarm book render FILE.txt" in err, err
    assert run("jobs", "--api", server) == 0
    assert capsys.readouterr().out == before
    answer = httpx.post(f"{server}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"},
                        json={"voice_id": "0" * 64, "text": SENTENCE * 1400})  # over 100,000 characters
    assert answer.status_code in (413, 422), answer.text
    assert "wavefarm book render" in answer.text and "POST /v1/books" in answer.text


def test_the_help_says_the_limit_and_the_book_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run("submit", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "WAVEFARM_MAX_TEXT_JOB_S" in out and "wavefarm book render FILE.txt" in out
