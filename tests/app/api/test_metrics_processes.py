"""The API's request metrics with several processes (`wavefarm serve --processes N`): in prometheus_client's
multiprocess mode every process's requests are counted in the folder they share, so whichever process
answers /metrics reports them all; without it each process reports only its own. Each process here is a
real one (the mode is chosen when prometheus_client is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.api.metrics import MULTIPROC_ENV, prepare_multiprocess_dir
from tests.conftest import REPO

# One API process: `n` requests to a path no route has (404, counted as <unmatched>), each with a made-up
# 2 kB method when argv[4] says so, then, with --read, the requests its /metrics reports in all.
PROCESS = """
import sys
from fastapi.testclient import TestClient
from app.api.main import create_app
from app.settings import Settings
client = TestClient(create_app(Settings(database_url=sys.argv[1])))
for i in range(int(sys.argv[2])):
    method = f"X{i:04d}" + "Q" * 2000 if sys.argv[4:] == ["made-up"] else "GET"
    assert client.request(method, "/v1/no-such-route").status_code == 404
if sys.argv[3] == "--read":
    text = client.get("/metrics").text
    print(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("wavefarm_http_requests_total{")))
"""


def _process(tmp_path: Path, n: int, folder: Path | None, read: bool = False, methods: str = "GET") -> str:
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    if folder is not None:
        env[MULTIPROC_ENV] = str(folder)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = [sys.executable, "-c", PROCESS, url, str(n), "--read" if read else "-", methods]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_every_process_reports_the_requests_all_of_them_answered(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    folder = prepare_multiprocess_dir(env)
    try:
        _process(tmp_path, 3, folder)
        _process(tmp_path, 5, folder)
        assert float(_process(tmp_path, 0, folder, read=True)) == 8  # a third process sees both
        assert float(_process(tmp_path, 2, None, read=True)) == 2  # one process alone: its own only
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_a_given_metrics_folder_is_emptied_of_an_earlier_runs_files(tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "counter_123.db").write_bytes(b"old")
    (folder / "notes.txt").write_text("kept")
    env = {MULTIPROC_ENV: str(folder)}
    assert prepare_multiprocess_dir(env) == folder and env[MULTIPROC_ENV] == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_made_up_methods_do_not_grow_the_shared_metrics_folder(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    folder = prepare_multiprocess_dir(env)
    try:
        _process(tmp_path, 1, folder, methods="made-up")
        one = sum(f.stat().st_size for f in folder.iterdir())
        assert float(_process(tmp_path, 40, folder, methods="made-up", read=True)) == 41
        assert sum(f.stat().st_size for f in folder.iterdir()) <= 3 * one  # two processes' files
        assert not any(b"QQQQ" in f.read_bytes() for f in folder.iterdir())
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
