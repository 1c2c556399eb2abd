"""What a newcomer hit with the command line: WAVEFARM_API_URL instead of --api everywhere, a job's short
id taken where its id is, ./run keeping the caller's folder, ./run --help listing the commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from app.dev import SAMPLES
from app.settings import get_settings
from tests.app.cli.helpers import run
from tests.conftest import REPO
from tests.support.audio import wav_bytes
from tests.support.net import free_port


def test_the_api_address_comes_from_wavefarm_api_url(server: str, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WAVEFARM_API_URL", server)
    get_settings.cache_clear()
    assert run("voices", "--add", str(SAMPLES / "voice_a.wav")) == 0
    voice_id = json.loads(capsys.readouterr().out)["id"]
    assert run("voices") == 0 and voice_id in capsys.readouterr().out
    monkeypatch.setenv("WAVEFARM_API_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    get_settings.cache_clear()
    assert run("voices") == 2
    assert run("voices", "--api", server) == 0  # --api still wins
    get_settings.cache_clear()


def test_status_and_cancel_take_the_short_id_the_cli_prints(server: str, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--tokens",
               str(SAMPLES / "tokens_a.json")) == 0
    job_id = capsys.readouterr().out.splitlines()[0]
    assert run("status", "--api", server, job_id[:8]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == job_id
    assert run("cancel", "--api", server, job_id[:8]) == 0
    assert capsys.readouterr().out.strip() == f"job {job_id}: cancelled"


def test_serve_on_a_busy_port_says_who_holds_it_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert run("serve", "--port", str(port)) == 2
    told = capsys.readouterr()
    assert f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in told.err
    assert f"--port {port + 1}" in told.err and "Application startup" not in told.out + told.err
    with socket.socket() as held:  # the GPU worker's metrics port, the same way
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert run("gpu-worker", "--metrics-port", str(port)) == 2
    assert f"--metrics-port {port + 1}" in capsys.readouterr().err


def _run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAVEFARM_")}
    return subprocess.run([str(REPO / "run"), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)


def test_run_keeps_the_callers_folder_for_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "only_here.json").write_text("[1, 2, 3]")
    done = _run_script("submit", "--api", f"http://127.0.0.1:{free_port()}", "--voice", "Ada",
                       "--tokens", "only_here.json", cwd=tmp_path)
    assert done.returncode == 2
    assert "cannot read the tokens file" not in done.stderr  # read from the caller's folder
    assert "wavefarm serve" in done.stderr  # it got as far as the (absent) API


def test_run_help_lists_the_commands(tmp_path: Path) -> None:
    done = _run_script("--help", cwd=tmp_path)
    assert done.returncode == 0
    for command in ("serve", "gpu-worker", "submit", "status", "voices", "book", "model"):
        assert f"\n    {command} " in done.stdout, command


def test_a_short_references_padding_note_is_said_when_stored_not_on_every_submit(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = tmp_path / "short.wav"
    short.write_bytes(wav_bytes(seconds=1.5))
    tokens = str(SAMPLES / "tokens_a.json")
    assert run("submit", "--api", server, "--voice", str(short), "--tokens", tokens) == 0
    first = capsys.readouterr().err
    assert first.count("padded with silence") == 1
    for _ in range(2):
        assert run("submit", "--api", server, "--voice", str(short), "--tokens", tokens) == 0
        assert "padded with silence" not in capsys.readouterr().err
