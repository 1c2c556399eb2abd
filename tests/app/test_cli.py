"""The `wavefarm` command: its parser, the worker command lines, the client commands against a real
uvicorn server (a child process, with a bearer token), `--local`, `db upgrade`, and the demo's helpers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import soundfile as sf
from sqlalchemy import inspect

from app import cli
from app.artifacts import ArtifactStore
from app.cli import services as service_commands
from app.db import queries, upgrade
from app.db.models import JobStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.dev import SAMPLES, demo, services
from app.settings import Settings, get_settings
from tests.conftest import REPO, SESSION_TAG, make_test_settings, settings_env

TOKEN = "cli-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cli_settings(tmp_path_factory: pytest.TempPathFactory, redis_session_lock: None) -> Settings:
    """One database and queue pair for the module: the server it starts is shared (startup is slow)."""
    root = tmp_path_factory.mktemp("cli")
    url = f"sqlite:///{root / 'wavefarm.sqlite'}"
    upgrade(url)
    return make_test_settings(database_url=url, artifact_root=root / "artifacts",
                              tag=f"{SESSION_TAG}-{uuid.uuid4().hex[:8]}", api_token=TOKEN)


@pytest.fixture
def cli_env(cli_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This module's settings as WAVEFARM_* variables, in this process (for in-process CLI calls) too."""
    env = settings_env(cli_settings)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def server_url(cli_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`wavefarm serve` in a child process; yields its base URL once /healthz answers."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=REPO,
                                env={**os.environ, **settings_env(cli_settings)}, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def server(server_url: str, cli_env: dict[str, str]) -> str:
    return server_url


def run(*argv: str) -> int:
    return cli.main(list(argv))


def finish_later(settings: Settings, job_id: str, delay: float = 1.0) -> threading.Thread:
    """Play the GPU worker: some progress, then the output file and `succeeded`."""
    def work() -> None:
        time.sleep(delay)
        artifacts = ArtifactStore(settings.artifact_root)
        engine = make_engine(settings.database_url)
        with session_scope(make_sessionmaker(engine)) as s:
            queries.update_progress(session=s, job_id=job_id, frames_done=10)
        time.sleep(0.6)
        relpath = artifacts.output_relpath(job_id, "wav")
        artifacts.write_bytes(relpath, (SAMPLES / "voice_b.wav").read_bytes())
        with session_scope(make_sessionmaker(engine)) as s:
            queries.finish_job(session=s, job_id=job_id, status=JobStatus.SUCCEEDED, output_path=relpath)
        engine.dispose()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


# Parser and service command lines ------------------------------------------------------------------


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
    """`wavefarm bench ARGS` is `python -m gpu_worker.bench ARGS`, options first included."""
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
    assert gpu[:2] == ["-A", "gpu_worker.worker"] and gpu[gpu.index("-Q") + 1] == "gpu-x"
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
    try:
        assert cli.main(command) == 0
    finally:
        get_settings.cache_clear()
    assert started
    engine = make_engine(url)
    assert {"voices", "jobs", "worker_voices"} <= set(inspect(engine).get_table_names())
    engine.dispose()


# Client commands over HTTP ---------------------------------------------------------------------------


def test_submit_wait_downloads_the_audio_over_http(server: str, cli_settings: Settings, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    assert run("voices", "--api", server, "--add", str(SAMPLES / "voice_a.wav")) == 0
    voice_id = json.loads(capsys.readouterr().out)["id"]
    finish_next_job(cli_settings)
    code = run("submit", "--api", server, "--voice", voice_id, "--tokens", str(SAMPLES / "tokens_a.json"),
               "-o", str(out), "--seed", "5")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "succeeded" in printed and out.read_bytes() == (SAMPLES / "voice_b.wav").read_bytes()
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


def test_submit_with_a_reference_file_then_cancel(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_b.wav"),
               "--tokens", str(SAMPLES / "tokens_b.json"), "--format", "flac") == 0
    job_id = capsys.readouterr().out.strip()
    assert run("cancel", "--api", server, job_id) == 0
    assert "cancelled" in capsys.readouterr().out


def test_client_errors_are_messages_not_tracebacks(server: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--api", server, str(uuid.uuid4())) == 2
    assert "NotFound" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 99999]")
    assert run("submit", "--api", server, "--voice", str(SAMPLES / "voice_a.wav"), "--tokens", str(bad)) == 2
    assert "0..6560" in capsys.readouterr().err
    assert run("submit", "--api", server, "--voice", "nope.wav", "--tokens", str(bad)) == 2
    assert "neither a reference audio file nor a voice id" in capsys.readouterr().err
    assert run("jobs", "--api", f"http://127.0.0.1:{free_port()}") == 2
    assert "wavefarm serve" in capsys.readouterr().err


def test_the_server_refuses_a_wrong_token(server: str) -> None:
    assert httpx.get(f"{server}/v1/jobs").status_code == 401
    assert httpx.get(f"{server}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


# Client commands with --local --------------------------------------------------------------------------


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


# Demo helpers ----------------------------------------------------------------------------------------------


def test_demo_defaults_to_tiny_dummy_weights_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("WAVEFARM_MODEL_DIR", raising=False)
    monkeypatch.delenv("WAVEFARM_MODEL_PRESET", raising=False)
    env = demo.demo_environment(tmp_path / "var")
    assert env["WAVEFARM_MODEL_PRESET"] == "tiny"
    assert env["WAVEFARM_DATABASE_URL"] == f"sqlite:///{(tmp_path / 'var').resolve()}/wavefarm.sqlite"
    demo.announce_model(env)
    assert "DUMMY WEIGHTS" in capsys.readouterr().out
    monkeypatch.setenv("WAVEFARM_MODEL_DIR", "/models")
    env = demo.demo_environment(tmp_path / "var")
    assert "WAVEFARM_MODEL_PRESET" not in env and env["WAVEFARM_MODEL_DIR"] == "/models"
    monkeypatch.setenv("WAVEFARM_MODEL_PRESET", "full")
    assert demo.demo_environment(tmp_path / "var")["WAVEFARM_MODEL_PRESET"] == "full"


def test_ensure_redis_starts_and_stops_a_private_server(tmp_path: Path) -> None:
    if services.shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    stop = services.ensure_redis(f"redis://127.0.0.1:{port}/0", tmp_path)
    assert stop is not None and redis.Redis(port=port).ping()
    assert services.ensure_redis(f"redis://127.0.0.1:{port}/3", tmp_path) is None  # reused, not ours
    stop()
    assert not services.port_open("127.0.0.1", port)


def test_ensure_redis_without_a_binary_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setattr(services.shutil, "which", lambda _: None)
    with pytest.raises(services.ServiceError, match="apt-get install redis-server"):
        services.ensure_redis(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    with pytest.raises(services.ServiceError, match="WAVEFARM_BROKER_URL"):
        services.ensure_redis("redis://redis.invalid:6379/0", tmp_path)


def test_stop_process_ends_the_whole_process_group(tmp_path: Path) -> None:
    proc = services.start_process([sys.executable, "-c", "import subprocess, time; "
                                   "subprocess.Popen(['sleep', '60']); time.sleep(60)"],
                                  env=os.environ, log_path=tmp_path / "p.log")
    time.sleep(0.5)
    services.stop_process(proc, timeout=5)
    assert proc.returncode is not None
    listing = subprocess.run(["ps", "-o", "stat=", "-g", str(proc.pid)], capture_output=True, text=True)
    assert all(state.startswith("Z") for state in listing.stdout.split())  # dead (zombies wait for init)


@pytest.mark.integration
@pytest.mark.timeout(330)
def test_demo_renders_the_samples_and_stops_everything_it_started(tmp_path: Path) -> None:
    """The one-command run, on a private Redis port so the demo starts (and must stop) its own."""
    if services.shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAVEFARM_")}
    env.update({"WAVEFARM_BROKER_URL": f"redis://127.0.0.1:{port}/0",
                "WAVEFARM_RESULT_BACKEND": f"redis://127.0.0.1:{port}/1",
                "WAVEFARM_FEATURE_STORE_URL": f"redis://127.0.0.1:{port}/2", "OMP_NUM_THREADS": "1"})
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "app.cli", "demo", "--var", str(tmp_path / "var")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DUMMY WEIGHTS" in done.stdout and "tiny" in done.stdout
    assert done.stdout.count(" succeeded voice ") == 4
    assert "voice preparations on the CPU worker: {'prepared': 2}" in done.stdout
    outputs = list((tmp_path / "var" / "artifacts" / "outputs").glob("*.wav"))
    assert len(outputs) == 4 and all(sf.info(str(p)).samplerate == 24000 for p in outputs)
    assert not services.port_open("127.0.0.1", port), "the demo's Redis is still running"
    assert elapsed < 300


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_flower_takes_its_basic_auth_from_the_environment(cli_settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, **settings_env(cli_settings), "FLOWER_BASIC_AUTH": "admin:pw"}
    proc = services.start_cli(["flower", "--port", str(port)], env=env, log_path=tmp_path / "flower.log")
    try:
        url = f"http://127.0.0.1:{port}/"
        assert services.wait_until(lambda: services.port_open("127.0.0.1", port), timeout=60), \
            services.log_tail(tmp_path / "flower.log")
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, auth=("admin", "wrong"), timeout=10).status_code == 401
        assert httpx.get(url, auth=("admin", "pw"), timeout=10).status_code == 200
    finally:
        services.stop_process(proc)


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_interrupted_demo_stops_its_processes_and_cancels_its_jobs(tmp_path: Path) -> None:
    if services.shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAVEFARM_")}
    env.update({"WAVEFARM_BROKER_URL": f"redis://127.0.0.1:{port}/0", "PYTHONUNBUFFERED": "1",
                "WAVEFARM_RESULT_BACKEND": f"redis://127.0.0.1:{port}/1",
                "WAVEFARM_FEATURE_STORE_URL": f"redis://127.0.0.1:{port}/2"})
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "demo", "--var", str(tmp_path / "var"),
                             "--jobs-per-voice", "20"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("submitted "):
            break
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(60) == 130, out
    assert "interrupted" in out and "unfinished sample jobs" in out
    pids = [int(m) for m in re.findall(r"started app\.cli \S+ \(pid (\d+)\)", out)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not services.port_open("127.0.0.1", port)
