"""The client commands (`app.cli.jobs`) against a real uvicorn server with a bearer token, and with
`--local` against the services in process."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from app.db import queries
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.dev import SAMPLES
from app.settings import Settings
from tests.app.cli.helpers import TOKEN, finish_later, run
from tests.support.audio import wav_bytes
from tests.support.net import free_port


def test_submit_wait_downloads_the_audio_over_http(server: str, cli_settings: Settings, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)  # what a user's terminal shows: no line per HTTP request (every poll)
    out = tmp_path / "out.wav"
    assert run("voices", "--api", server, "--add", str(SAMPLES / "voice_a.wav")) == 0
    voice_id = json.loads(capsys.readouterr().out)["id"]
    finish_next_job(cli_settings)
    code = run("submit", "--api", server, "--voice", voice_id, "--tokens", str(SAMPLES / "tokens_a.json"),
               "-o", str(out), "--seed", "5")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "succeeded" in printed and out.read_bytes() == (SAMPLES / "voice_b.wav").read_bytes()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("httpx")] == []
    job_id = printed.splitlines()[0]
    assert run("status", "--api", server, job_id) == 0
    assert json.loads(capsys.readouterr().out)["seed"] == 5
    assert run("jobs", "--api", server, "--voice-id", voice_id) == 0
    assert job_id in capsys.readouterr().out
    assert run("voices", "--api", server) == 0
    assert voice_id in capsys.readouterr().out


def finish_next_job(settings: Settings) -> None:
    """In a thread: wait for a job that is not in the database yet, then finish it like a worker."""
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        known = {job.id for job in queries.list_jobs(session=s, limit=1000)}

    def wait_and_finish() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with session_scope(make_sessionmaker(engine)) as s:
                new = [job.id for job in queries.list_jobs(session=s, limit=1000) if job.id not in known]
            if new:
                finish_later(settings, new[0], delay=0.2).join()
                break
            time.sleep(0.2)
        engine.dispose()

    threading.Thread(target=wait_and_finish, daemon=True).start()


def test_submit_with_a_long_reference_says_what_part_of_it_is_the_voice(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = tmp_path / "long.wav"
    reference.write_bytes(wav_bytes(6.78, freq=210.0, sr=24000))
    assert run("submit", "--api", server, "--voice", str(reference),
               "--tokens", str(SAMPLES / "tokens_a.json")) == 0
    err = capsys.readouterr().err
    assert "wavefarm: note: the reference is 6.78 s long; its first 6 s are the voice" in err


def test_submit_with_a_reference_file_then_cancel(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_b.wav"),
               "--tokens", str(SAMPLES / "tokens_b.json"), "--format", "flac") == 0
    job_id = capsys.readouterr().out.strip()
    assert run("cancel", "--api", server, job_id) == 0
    assert "cancelled" in capsys.readouterr().out


def test_submit_text_from_the_command_line_or_a_file_sends_a_text_job(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--text", "Good morning.",
               "--language", "en-GB") == 0
    first = capsys.readouterr().out.strip()
    story = tmp_path / "story.txt"
    story.write_text("It was 3:30 pm.\n\nThe wind blew N.N.E.", encoding="utf-8")
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--text", f"@{story}") == 0
    second = capsys.readouterr().out.strip()
    for job_id, text, language in ((first, "Good morning.", "en-GB"), (second, story.read_text(), "en")):
        assert run("status", "--api", server, job_id) == 0
        job = json.loads(capsys.readouterr().out)
        assert (job["kind"], job["text"], job["language"]) == ("text", text, language)
    assert run("submit", "--api", server, "--voice", "0" * 64, "--tokens", "t.json", "--language", "de") == 2
    assert "--language goes with --text" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --tokens and --text are one or the other
        run("submit", "--api", server, "--voice", "0" * 64, "--tokens", "t.json", "--text", "Hi.")
    assert "not allowed with argument" in capsys.readouterr().err


def test_client_errors_are_messages_not_tracebacks(server: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--api", server, str(uuid.uuid4())) == 2
    assert "NotFound" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 99999]")
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--tokens", str(bad)) == 2
    assert "0..6560" in capsys.readouterr().err
    assert run("submit", "--api", server, "--voice", "nope.wav", "--tokens", str(bad)) == 2
    assert "neither a reference audio file nor a voice id or name" in capsys.readouterr().err
    assert run("jobs", "--api", f"http://127.0.0.1:{free_port()}") == 2
    assert "wavefarm serve" in capsys.readouterr().err


def test_the_server_refuses_a_wrong_token(server: str) -> None:
    assert httpx.get(f"{server}/v1/jobs").status_code == 401
    assert httpx.get(f"{server}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_local_submit_and_wait_without_the_api(cli_env: dict[str, str], cli_settings: Settings,
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "local.wav"
    finish_next_job(cli_settings)
    assert run("submit", "--local", "--voice", str(SAMPLES / "voice_a.wav"), "--tokens",
               str(SAMPLES / "tokens_a.json"), "-o", str(out)) == 0
    assert sf.info(str(out)).frames > 0
    capsys.readouterr()
    assert run("voices", "--local") == 0
    assert "uses" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["submit", "--voice", "0" * 64, "--tokens", "{missing}/tokens.json"], "cannot read the tokens file"),
    (["voices", "--add", "{missing}/voice.wav"], "cannot read the reference audio file"),
    (["submit", "--voice", "0" * 64, "--tokens", "{missing}"], "tokens file '{missing}': Is a directory"),
    (["book", "render", "{missing}/novel.epub", "--voice", "0" * 64], "cannot read the book file"),
])
def test_a_file_that_cannot_be_read_is_one_line_and_a_non_zero_exit(
        tmp_path: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(missing=tmp_path) for a in argv] + ["--api", "http://127.0.0.1:1"]
    says = says.format(missing=tmp_path)
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wavefarm: BadInput: ") and says in err, err
    assert "Traceback" not in err


def test_an_unknown_job_status_is_refused_with_the_valid_ones(cli_env: dict[str, str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert run("jobs", "--local", "--status", "evil") == 2
    err = capsys.readouterr().err
    assert "--status 'evil' is not one of queued, " in err and "cancelled" in err, err


def test_voices_add_with_a_name_lists_it_and_submit_takes_the_name(server: str, cli_settings: Settings,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert run("voices", "--api", server, "--add", str(SAMPLES / "voice_a.wav"), "--name", "Ada") == 0
    added = json.loads(capsys.readouterr().out)
    assert added["name"] == "Ada"
    assert run("voices", "--api", server) == 0
    assert f"{added['id']}  Ada" in capsys.readouterr().out
    finish_next_job(cli_settings)
    assert run("submit", "--api", server, "--voice", "Ada", "--tokens", str(SAMPLES / "tokens_a.json"),
               "-o", str(tmp_path / "out.wav")) == 0
    job_id = capsys.readouterr().out.splitlines()[0]
    assert run("status", "--api", server, job_id) == 0
    assert json.loads(capsys.readouterr().out)["voice_id"] == added["id"]
    assert run("voices", "--api", server, "--voice", added["id"][:8], "--name", "Grace") == 0
    assert json.loads(capsys.readouterr().out)["name"] == "Grace"
    assert run("submit", "--api", server, "--voice", "Ada", "--tokens", str(SAMPLES / "tokens_a.json")) == 2
    assert "no voice 'Ada'" in capsys.readouterr().err


def test_jobs_pages_with_after_and_all(server: str, cli_settings: Settings,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert run("voices", "--api", server, "--add", str(SAMPLES / "voice_a.wav")) == 0
    voice_id = json.loads(capsys.readouterr().out)["id"]
    created = [str(uuid.uuid4()) for _ in range(5)]
    with session_scope(make_sessionmaker(make_engine(cli_settings.database_url))) as s:
        for job_id in created:
            queries.create_job(session=s, new=queries.NewJob(
                id=job_id, voice_id=voice_id, tokens=[1, 2], n_tokens=2, seed=1, output_format="wav"))
    with session_scope(make_sessionmaker(make_engine(cli_settings.database_url))) as s:
        # every job of this voice: the sample voice's earlier tests in this module may have left some
        newest_first = [j.id for j in queries.list_jobs(session=s, voice_id=voice_id, limit=1000)]

    def ids(out: str) -> list[str]:
        return [line.split()[0] for line in out.splitlines()]

    assert run("jobs", "--api", server, "--voice-id", voice_id, "--limit", "2") == 0
    first = capsys.readouterr()
    assert ids(first.out) == newest_first[:2]
    cursor = first.err.split("--after ")[1].split()[0]
    assert run("jobs", "--api", server, "--voice-id", voice_id, "--limit", "2", "--after", cursor) == 0
    assert ids(capsys.readouterr().out) == newest_first[2:4]
    assert run("jobs", "--api", server, "--voice-id", voice_id, "--limit", "2", "--all") == 0
    every = capsys.readouterr()
    assert ids(every.out) == newest_first and set(created) <= set(newest_first) and "--after" not in every.err
    assert run("jobs", "--api", server, "--after", "not-a-cursor") == 2
    assert "after: not a cursor" in capsys.readouterr().err


def test_submit_batch_from_a_folder_prints_each_result_and_a_summary_and_resubmits_nothing(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "segments"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([1, 2, 3]))
    (folder / "b.json").write_text(json.dumps({"tokens": [4, 5, 99999]}))
    (folder / "c.json").write_text("[6, 7")
    argv = ["submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--batch", str(folder),
            "--idempotency-key", f"run-{uuid.uuid4().hex[:8]}", "--priority", "4"]
    assert run(*argv) == 1  # some were refused
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["a.json", "b.json", "c.json"]
    assert "refused  422 BadTokens" in lines[1] and "refused  - BadInput: tokens are not JSON" in lines[2]
    job_id = lines[0].split()[1]
    assert lines[-1] == "1 accepted (0 existed already), 2 refused"
    assert run(*argv) == 1
    again = capsys.readouterr().out.splitlines()
    assert again[0] == f"a.json  {job_id}  queued  (existed)"
    assert run("status", "--api", server, job_id) == 0
    assert json.loads(capsys.readouterr().out)["priority"] == 4


def test_local_submit_batch_of_json_lines_naming_their_voices(
        cli_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("voices", "--local", "--add", str(SAMPLES / "voice_a.wav")) == 0
    voice_id = json.loads(capsys.readouterr().out)["id"]
    lines = [{"voice_id": voice_id, "tokens": [1, 2], "seed": 5}, {"voice_id": "0" * 64, "tokens": [1]},
             {"voice_id": voice_id, "text": "Hello there."}]
    batch = tmp_path / "jobs.jsonl"
    batch.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert run("submit", "--local", "--batch", str(batch)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("1  refused  404 NotFound")
    assert out[-1] == "2 accepted (0 existed already), 1 refused"
    assert run("status", "--local", out[0].split()[1]) == 0
    assert json.loads(capsys.readouterr().out)["seed"] == 5
