"""The developer tooling (`app.dev`): the demo's defaults, its local processes (a private Redis, process
groups), the whole demo run and its interruption, and Flower's basic auth."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import httpx
import pytest
import redis
import soundfile as sf

from app.dev import demo, services
from app.settings import Settings
from tests.conftest import REPO, settings_env
from tests.support.net import free_port


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


def test_a_ctrl_c_dropped_inside_a_weakref_callback_still_stops_the_demo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI failure of 2026-12-02: SIGINT landed while a weakref callback ran, Python printed
    "Exception ignored ... KeyboardInterrupt" and the demo ran to the end with exit code 0."""
    dropped: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_value))
    interrupt = demo._Interrupt()
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        class Thing:
            pass

        def callback(_ref: object) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # the handler runs between these bytecodes, inside the callback
                pass

        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing  # no KeyboardInterrupt here: the callback's is reported and dropped
        assert ref() is None and len(dropped) == 1 and isinstance(dropped[0], KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()  # the demo's next poll
    finally:
        signal.signal(signal.SIGINT, previous)


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
