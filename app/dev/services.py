"""Start and stop the local processes of an embedded run: a Redis server and Celery workers.

Used by `wavefarm demo`. Everything started here is tracked by process id and stopped by that id
(a Redis we did not start is left alone); workers run in their own process group so a Ctrl-C in the
terminal reaches us first and we stop them in order. Nothing here knows about jobs or models.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}


class ServiceError(RuntimeError):
    """A local service could not be started; the message says what to do."""


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def ensure_redis(url: str, workdir: Path) -> Callable[[], None] | None:
    """Make sure the Redis at `url` answers; start a throwaway local one if nothing listens.

    Returns a function that stops the Redis we started, or None when one was already running."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if port_open(host, port):
        log.info("using the Redis already listening on %s:%d", host, port)
        return None
    if host not in LOCAL_HOSTS:
        raise ServiceError(f"nothing answers at {host}:{port} ({url}); start that Redis or point "
                           "WAVEFARM_BROKER_URL at a reachable one")
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError(
            f"no Redis listens on {host}:{port} and redis-server is not installed. Get one with\n"
            "  apt-get install redis-server        (Debian/Ubuntu)\n"
            "  brew install redis                  (macOS)\n"
            "  docker run -d -p 6379:6379 redis:7  (anywhere with Docker)\n"
            "then run the demo again.")
    workdir.mkdir(parents=True, exist_ok=True)
    pidfile = workdir / f"redis-{port}.pid"
    pidfile.unlink(missing_ok=True)
    subprocess.run([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--pidfile", str(pidfile), "--dir", str(workdir),
                    "--logfile", str(workdir / f"redis-{port}.log")], check=True)
    if not wait_until(lambda: port_open(host, port) and pidfile.exists(), timeout=10):
        raise ServiceError(f"redis-server did not come up on port {port}; see {workdir}/redis-{port}.log")
    pid = int(pidfile.read_text().strip())
    log.info("started redis-server (pid %d) on port %d", pid, port)

    def stop() -> None:
        _signal_pid(pid, signal.SIGTERM)
        if not wait_until(lambda: not port_open(host, port), timeout=10):
            _signal_pid(pid, signal.SIGKILL)
        log.info("stopped redis-server (pid %d)", pid)

    return stop


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_process(argv: list[str], *, env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group, output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    log.info("started %s (pid %d), log %s", " ".join(argv[2:4]), proc.pid, log_path)
    return proc


def start_cli(args: list[str], *, env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Run `wavefarm <args>` as a child process (same interpreter, no installed script needed)."""
    return start_process([sys.executable, "-m", "app.cli", *args], env=env, log_path=log_path)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM the child's process group (a Celery worker and its pool), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # the group we created with start_new_session, led by proc.pid
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop on signal %d", proc.pid, sig)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
