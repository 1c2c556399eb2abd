"""Start and stop the local processes of an embedded run: a Redis server and Celery workers; and claim
the Redis databases it uses.

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import redis

from app.storage.keys import DEMO_LEASE_KEY, DEMO_OWNER_KEY

log = logging.getLogger(__name__)

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}
# The demo's Redis databases when you set none of these: the defaults' (0, 1, 2), else this other set on
# the same Redis. The tests' databases are 6-14 (tests/conftest.py), so neither set meets a test run's.
REDIS_VARS = ("WAVEFARM_BROKER_URL", "WAVEFARM_RESULT_BACKEND", "WAVEFARM_FEATURE_STORE_URL")
OTHER_DBS = (3, 4, 5)
LEASE_S = 60  # a claim's lease: longer than the demo takes to start its workers (which then hold connections)


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
    # redis-server creates its pid file before it writes the number: wait for the number, not the file
    if not wait_until(lambda: port_open(host, port) and _read_pid(pidfile) is not None, timeout=10):
        raise ServiceError(f"redis-server did not come up on port {port}; see {workdir}/redis-{port}.log")
    pid = _read_pid(pidfile)
    assert pid is not None
    log.info("started redis-server (pid %d) on port %d", pid, port)

    def stop() -> None:
        _signal_pid(pid, signal.SIGTERM)
        if not wait_until(lambda: not port_open(host, port), timeout=10):
            _signal_pid(pid, signal.SIGKILL)
        log.info("stopped redis-server (pid %d)", pid)

    return stop


def choose_redis(env: Mapping[str, str], *, owner: str, defaults: list[str]) -> tuple[dict[str, str], str]:
    """The Redis URLs (REDIS_VARS) the demo's processes use, and the line that says which: those you set,
    as they are; else the `defaults`' databases unless another stack uses one of them
    (`claim_redis_databases`), then OTHER_DBS on the same Redis, loudly: two stacks on one broker database
    take each other's tasks."""
    if any(name in env for name in REDIS_VARS):
        return {}, f"redis: as you set it: {', '.join(env.get(n, '(default)') for n in REDIS_VARS)}"
    own = tuple(db_of(url) for url in defaults)
    dbs, passed_over = claim_redis_databases(defaults[0], [own, OTHER_DBS], owner=owner)
    urls = {name: with_db(url, db) for name, url, db in zip(REDIS_VARS, defaults, dbs, strict=True)}
    listed = f"databases {', '.join(map(str, dbs))} (broker, results, feature store) at {_where(defaults[0])}"
    if passed_over:
        return urls, f"!!! REDIS: another stack uses {passed_over[0]}; this demo uses {listed} instead !!!"
    return urls, f"redis: {listed}"


def with_db(url: str, db: int) -> str:
    """`url` (redis://...) naming database `db` instead of its own."""
    return urlunparse(urlparse(url)._replace(path=f"/{db}"))


def db_of(url: str) -> int:
    return int(urlparse(url).path.lstrip("/") or 0)


def claim_redis_databases(url: str, sets: Sequence[tuple[int, ...]], *,
                          owner: str) -> tuple[tuple[int, ...], list[str]]:
    """The first of `sets` (database numbers) on the Redis at `url` that no other stack uses, claimed for
    `owner`; and, for each set passed over before it, why. ServiceError when every set is in use.

    A database is in use when another client is connected to it (a running stack: Celery workers wait on
    their queues, the API keeps connections), when another demo's lease on it is fresh (that demo is
    starting), or when it holds keys that no demo's marker explains (another stack's queue bindings,
    queued tasks, results, features: live, or stopped with tasks our workers would take). Otherwise it is
    free: empty, this demo's leftovers, or a stopped demo's. The lease is taken with SET NX, so two demos
    starting at once cannot both win a database."""
    passed_over: list[str] = []
    for dbs in sets:
        why = _claim(url, dbs, owner)
        if why is None:
            return dbs, passed_over
        passed_over.append(why)
    raise ServiceError(f"every set of Redis databases the demo may use is in use at {_where(url)}: "
                       f"{'; '.join(passed_over)}. Set WAVEFARM_BROKER_URL, WAVEFARM_RESULT_BACKEND and "
                       "WAVEFARM_FEATURE_STORE_URL to free databases (or another Redis) and run it again")


def _where(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 6379}"


def _claim(url: str, dbs: tuple[int, ...], owner: str) -> str | None:
    """Claim databases `dbs` for `owner`; None when done, else why not (no lease of ours is left)."""
    clients = {db: redis.Redis.from_url(with_db(url, db)) for db in dbs}
    try:
        busy = _busy(clients, owner)
        if not busy:
            leased = [db for db, client in clients.items()
                      if client.set(DEMO_LEASE_KEY, owner, nx=True, ex=LEASE_S)]
            busy = _busy(clients, owner)  # another demo took a lease meanwhile
            for db in leased if busy else []:  # a race lost: our fresh leases go, theirs stay
                clients[db].delete(DEMO_LEASE_KEY)
        if busy:  # the first reason: the line stays readable
            more = f" (and {len(busy) - 1} more)" if len(busy) > 1 else ""
            return f"databases {', '.join(map(str, dbs))}: {busy[0]}{more}"
        for client in clients.values():
            client.set(DEMO_OWNER_KEY, owner)
        return None
    finally:
        for client in clients.values():
            client.close()


def _busy(clients: dict[int, redis.Redis], owner: str) -> list[str]:
    connected = _others_connected(clients)
    return [f"db {db} {why}" for db, client in clients.items()
            if (why := _in_use(client, owner, connected.get(db, 0)))]


def _others_connected(clients: dict[int, redis.Redis]) -> dict[int, int]:
    """Clients connected to each database, ours left out; none known where CLIENT LIST is not allowed."""
    ours = {client.client_id() for client in clients.values()}
    try:
        listed = next(iter(clients.values())).client_list()
    except redis.ResponseError:  # an ACL without CLIENT LIST: the keys alone tell
        return {}
    counts: dict[int, int] = {}
    for entry in listed:
        if int(entry["id"]) not in ours:
            counts[int(entry["db"])] = counts.get(int(entry["db"]), 0) + 1
    return counts


def _text(raw: object) -> str | None:
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def _in_use(client: redis.Redis, owner: str, connected: int) -> str | None:
    """Why another stack uses this database, or None when it is free for `owner`."""
    lease = _text(client.get(DEMO_LEASE_KEY))
    if lease is not None and lease != owner:
        return f"is being claimed by the demo at {lease}"
    if connected:
        return f"has {connected} clients connected (a running stack)"
    if client.get(DEMO_OWNER_KEY) is not None:
        return None  # this demo's leftovers, or a demo's that has stopped
    keys = client.dbsize() - (lease == owner)  # our own lease, just taken, is not another stack's
    return f"holds {keys} keys of another stack" if keys else None


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


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
