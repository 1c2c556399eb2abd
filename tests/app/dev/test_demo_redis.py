"""The demo's Redis databases on a Redis another stack shares: the defaults when nothing else uses them
(its own leftovers included), another empty set when something does, said in one line and handed to
every process the demo starts. Each test has a private redis-server on a free port, so databases 0-5 are
the real numbers and no other test run's (6-14, tests/conftest.py) or anyone's demo is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from app.dev import demo, services
from app.storage.keys import DEMO_LEASE_KEY, DEMO_OWNER_KEY
from tests.support.net import free_port

OWNER = "host-a:/home/a/wavefarm/var"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[list[str]]:
    """The URLs of databases 0, 1 and 2 (the demo's defaults) on a Redis of this test's own."""
    if services.shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    stop = services.ensure_redis(f"redis://127.0.0.1:{port}/0", tmp_path / "redis")
    assert stop is not None
    try:
        yield [f"redis://127.0.0.1:{port}/{db}" for db in (0, 1, 2)]
    finally:
        stop()


def _db(url: str, db: int) -> redis.Redis:
    """A client of one database; closed by the caller (`with`), or it counts as a connected stack."""
    return redis.Redis.from_url(services.with_db(url, db))


def _other_stack_in(url: str, db: int) -> None:
    """What a Celery worker of another stack leaves in its broker database: its queue's binding."""
    with _db(url, db) as client:
        client.sadd("_kombu.binding.cpu", "cpu\x06\x16\x06\x16cpu")


def _another_demo_in(url: str, db: int, *, starting: bool) -> None:
    with _db(url, db) as client:
        client.set(DEMO_OWNER_KEY, "host-b:/home/b/wavefarm/var")
        client.set("wf:count:prepare", 2)
        if starting:
            client.set(DEMO_LEASE_KEY, "host-b:/home/b/wavefarm/var", ex=60)


def test_free_default_databases_are_kept_and_so_are_the_demos_own_leftovers(private_redis: list[str]) -> None:
    urls, line = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert urls == dict(zip(services.REDIS_VARS, private_redis, strict=True))
    assert line.startswith("redis: databases 0, 1, 2 ") and "!!!" not in line
    _other_stack_in(private_redis[0], 0)  # now the bindings of this demo's own (stopped) worker
    with _db(private_redis[0], 2) as client:
        client.set("wf:count:prepare", 1)
    again, _ = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert again == urls


def test_a_stopped_demos_databases_are_taken_over(private_redis: list[str]) -> None:
    for db in (0, 1, 2):
        _another_demo_in(private_redis[0], db, starting=False)
    urls, _ = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert urls == dict(zip(services.REDIS_VARS, private_redis, strict=True))
    with _db(private_redis[0], 1) as client:
        assert client.get(DEMO_OWNER_KEY) == OWNER.encode()


def test_a_client_connected_to_a_default_database_means_a_running_stack(private_redis: list[str]) -> None:
    """A worker waiting on its queue: connected, even with no key yet (a fresh stack, or another demo's
    running one, whose marker alone would read as a stopped demo's)."""
    _another_demo_in(private_redis[0], 2, starting=False)
    with _db(private_redis[0], 2) as worker:
        worker.ping()
        urls, line = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert [services.db_of(url) for url in urls.values()] == [3, 4, 5]
    assert "db 2 has 1 clients connected (a running stack)" in line


def test_default_databases_another_stack_uses_are_left_for_empty_ones_said_loudly(
        private_redis: list[str]) -> None:
    _other_stack_in(private_redis[0], 0)
    urls, line = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert [services.db_of(url) for url in urls.values()] == [3, 4, 5]
    assert set(urls.values()).isdisjoint(private_redis)
    for url in urls.values():  # empty but for this demo's claim
        with redis.Redis.from_url(url) as client:
            assert client.dbsize() == 2 and client.get(DEMO_OWNER_KEY) == OWNER.encode()
            assert client.get(DEMO_LEASE_KEY) == OWNER.encode()
    assert line.startswith("!!! REDIS: another stack uses databases 0, 1, 2: db 0 holds 1 keys")
    assert "this demo uses databases 3, 4, 5 (broker, results, feature store)" in line
    assert len(line.splitlines()) == 1


def test_a_starting_demos_lease_makes_a_database_busy_and_a_set_all_busy_is_refused(
        private_redis: list[str]) -> None:
    _another_demo_in(private_redis[0], 1, starting=True)
    urls, line = services.choose_redis({}, owner=OWNER, defaults=private_redis)
    assert [services.db_of(url) for url in urls.values()] == [3, 4, 5]
    assert "db 1 is being claimed by the demo at host-b:/home/b/wavefarm/var" in line
    with pytest.raises(services.ServiceError, match="WAVEFARM_BROKER_URL, WAVEFARM_RESULT_BACKEND and"):
        services.choose_redis({}, owner="host-c:/elsewhere/var", defaults=private_redis)
    with _db(private_redis[0], 0) as client:
        assert client.get(DEMO_LEASE_KEY) is None  # a refused set keeps no half claim


def test_urls_the_user_set_are_used_as_they_are(private_redis: list[str]) -> None:
    _other_stack_in(private_redis[0], 0)
    urls, line = services.choose_redis({"WAVEFARM_BROKER_URL": private_redis[0]}, owner=OWNER,
                                       defaults=private_redis)
    assert urls == {} and line.startswith("redis: as you set it: ")


@pytest.mark.timeout(120)
def test_the_demo_hands_the_databases_it_chose_to_every_process_it_starts(
        private_redis: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The whole start of `run_demo` up to its first job, with the defaults on the private Redis; the
    workers are stand-ins (a sleeping process each) whose environment is recorded."""
    _other_stack_in(private_redis[0], 0)
    monkeypatch.setattr(demo, "default_redis_urls", lambda: private_redis)
    for name in (*services.REDIS_VARS, "WAVEFARM_MODEL_DIR", *demo.demo_environment(tmp_path)):
        monkeypatch.delenv(name, raising=False)  # run_demo sets them in this process: put back after
    started: list[dict[str, str]] = []

    def start_cli(args: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        started.append(dict(env))
        return services.start_process([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                                      log_path=log_path)

    submitting: list[Any] = []

    def no_jobs(settings: Any, *_: Any) -> Any:
        submitting.append(settings)
        raise services.ServiceError("stopped by the test before the sample jobs")

    monkeypatch.setattr(services, "start_cli", start_cli)
    monkeypatch.setattr(demo, "_submit_samples", no_jobs)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    try:
        assert demo.run_demo(var=tmp_path / "var") == 1
        assert dict(os.environ) == environ  # given back: later code in this process keeps its settings
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert "!!! REDIS: another stack uses databases 0, 1, 2" in out and "stopped by the test" in out
    assert len(started) == 2  # the CPU worker and the GPU worker
    for env in started:
        assert [services.db_of(env[name]) for name in services.REDIS_VARS] == [3, 4, 5]
    with _db(private_redis[0], 0) as client:
        assert client.smembers("_kombu.binding.cpu")  # the other stack's data untouched
    assert services.db_of(submitting[0].broker_url) == 3  # the demo's own submissions' too
