"""The service commands (`app.cli.services`): every command parses, `bench` hands on its arguments, the
workers' command lines follow the settings, `db upgrade`, and services upgrade the schema on start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect

from app import cli
from app.cli import services as service_commands
from app.db.session import make_engine
from app.settings import Settings, get_settings
from tests.conftest import REPO


def test_every_command_parses() -> None:
    parser = cli.build_parser()
    for argv in (["serve", "--host", "0.0.0.0", "--port", "9000"], ["cpu-worker", "--concurrency", "2"],
                 ["gpu-worker"], ["flower", "--port", "5556"], ["status", "x"], ["cancel", "x"],
                 ["voices", "--add", "f.wav"], ["jobs", "--status", "queued"], ["db", "upgrade"], ["demo"],
                 ["submit", "--voice", "v", "--tokens", "t.json", "-o", "o.wav", "--seed", "1", "--format",
                  "flac", "--wait", "--local"]):
        assert callable(parser.parse_args(argv).handler), argv
    with pytest.raises(SystemExit):
        parser.parse_args(["no-such-command"])


def test_bench_hands_every_argument_to_the_benchmark(tmp_path: Path) -> None:
    """`wavefarm bench ARGS` is `python -m bench.engine ARGS`, options first included."""
    cmd = [sys.executable, "-m", "app.cli", "bench"]
    shown = subprocess.run([*cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--concurrency" in shown.stdout and "--dtype" in shown.stdout
    rendered = subprocess.run([*cmd, "--render", str(REPO / "docs/bench/full_cpu_fp32.json")], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert "reference" in rendered.stdout and "preset full" in rendered.stdout
    refused = subprocess.run([*cmd, "--dtype", "fp8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "fp8" in refused.stderr


def test_worker_command_lines_follow_the_settings() -> None:
    settings = Settings(queue_cpu="cpu-x", queue_gpu="gpu-x", worker_slots=12)
    gpu = service_commands.worker_argv("gpu", settings)
    assert gpu[:2] == ["-A", "gpu_worker.worker.process"] and gpu[gpu.index("-Q") + 1] == "gpu-x"
    assert gpu[gpu.index("-P") + 1] == "threads" and gpu[gpu.index("-c") + 1] == "12"
    cpu = service_commands.worker_argv("cpu", settings, concurrency=3)
    assert cpu[:2] == ["-A", "tasks.celery_app"] and cpu[cpu.index("-Q") + 1] == "cpu-x"
    assert cpu[cpu.index("-c") + 1] == "3" and "threads" not in cpu
    flower = service_commands.flower_argv(address="0.0.0.0", port=5555)
    assert "flower" in flower and not any("auth" in a for a in flower)


def test_db_upgrade_creates_the_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    env = {**os.environ, "WAVEFARM_DATABASE_URL": url}
    done = subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
    engine = make_engine(url)
    assert {"voices", "jobs", "worker_voices"} <= set(inspect(engine).get_table_names())
    engine.dispose()


@pytest.mark.parametrize("command", [["serve"], ["cpu-worker"], ["gpu-worker"]])
def test_services_bring_the_schema_up_to_date_on_start(command: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("WAVEFARM_DATABASE_URL", url)
    get_settings.cache_clear()
    started: list[str] = []
    monkeypatch.setattr(service_commands, "_exec", lambda module, argv: started.append(module) or 0)
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append("uvicorn"))
    if command == ["serve"]:  # a port nothing listens on (serve checks it first; 8000 may be a user's)
        command = [*command, "--host", "127.0.0.1", "--port", str(_free_port())]
    try:
        assert cli.main(command) == 0
    finally:
        get_settings.cache_clear()
    assert started
    engine = make_engine(url)
    assert {"voices", "jobs", "worker_voices"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serve_runs_several_processes_on_postgresql_with_their_metrics_in_one_folder(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WAVEFARM_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # restored (unset) after the test
    monkeypatch.setattr(service_commands, "_upgrade_schema", lambda: None)
    get_settings.cache_clear()
    runs: list[dict] = []
    import uvicorn

    def run(*_: object, **options: object) -> None:  # the folder, as the processes would inherit it
        folder = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        runs.append({**options, "folder": folder, "empty_dir": folder.is_dir() and not any(folder.iterdir())})

    monkeypatch.setattr(uvicorn, "run", run)
    try:
        assert cli.main(["serve", "--port", str(_free_port()), "--processes", "3"]) == 0
    finally:
        get_settings.cache_clear()
    (started,) = runs
    assert started["workers"] == 3 and started["factory"] is True and started["empty_dir"]
    assert not started["folder"].exists()  # a folder serve made is removed when it stops
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ  # and no later app in this process looks for it


def test_serve_refuses_several_processes_on_sqlite_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WAVEFARM_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    get_settings.cache_clear()
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("started on SQLite"))
    try:
        assert cli.main(["serve", "--port", str(_free_port()), "--processes", "2"]) == 2
        assert service_commands.serve_refusal(get_settings().database_url, 1) is None
    finally:
        get_settings.cache_clear()
    assert "several API processes need PostgreSQL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--processes", "0"])


def test_flower_says_what_its_start_waits_for_and_hides_the_brokers_password(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(service_commands, "_exec", lambda module, argv: execs.append((module, argv)) or 0)
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "user:pass")
    monkeypatch.setenv("WAVEFARM_BROKER_URL", "redis://:s3cret@10.0.0.5:6379/0")
    get_settings.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="wavefarm"):
            assert cli.main(["flower", "--port", "5557"]) == 0
    finally:
        get_settings.cache_clear()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "starting Flower on http://127.0.0.1:5557" in said and "torch among them" in said, said
    assert "redis://:***@10.0.0.5:6379/0" in said and "s3cret" not in said
    assert execs and execs[0][0] == "celery"
