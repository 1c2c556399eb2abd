"""A real wavefarm service for benchmark scripts: API server, CPU worker and GPU worker as subprocesses.

    settings = bench_settings(root, preset="tiny", slots=4, threads=1, redis_dbs=(5, 6, 7), queue="bench")
    flush_redis(settings)                      # the benchmark's own Redis databases, emptied
    with running_stack(settings, root / "logs", port=8765):
        ...                                    # HTTP on 127.0.0.1:8765; every process stopped at the end

Dummy weights (no model folder), SQLite under `root` unless a database URL is given, the local Redis.
Processes are started with `wavefarm serve | cpu-worker | gpu-worker` (`app.dev.services.start_cli`), so they
read their settings from WAVEFARM_* variables exactly as a deployment does, and are stopped by process
group. Used by scripts/bench_service.py, scripts/bench_book.py and scripts/bench_book_pipeline.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app.dev import services  # noqa: E402
from app.settings import Settings  # noqa: E402

READY_TIMEOUT_S = 180.0  # model build and schema upgrade on a loaded 2-core machine


def bench_settings(root: Path, *, preset: str, slots: int, threads: int, redis_dbs: tuple[int, int, int],
                   queue: str, database_url: str | None = None, **extra: Any) -> Settings:
    """Settings of a benchmark's service: broker, results and features on `redis_dbs` of the local Redis,
    queues `<queue>-cpu` / `<queue>-gpu`, dummy weights of `preset`, `slots` GPU-worker slots (and
    micro-batch size), `threads` engine CPU threads (0: torch's default); `extra` overrides the rest.
    WAVEFARM_BENCH_REDIS (default redis://127.0.0.1:6379) names another Redis server, so that runs on a
    shared machine do not flush each other's databases."""
    base = os.environ.get("WAVEFARM_BENCH_REDIS", "redis://127.0.0.1:6379").rstrip("/")
    broker, results, features = (f"{base}/{db}" for db in redis_dbs)
    values: dict[str, Any] = {
        "database_url": database_url or f"sqlite:///{root / 'bench.sqlite'}",
        "artifact_root": root / "artifacts", "broker_url": broker, "result_backend": results,
        "feature_store_url": features, "queue_cpu": f"{queue}-cpu", "queue_gpu": f"{queue}-gpu",
        "model_preset": preset, "micro_batch_size": slots, "worker_slots": slots, "prep_wait_ms": 60_000,
        "progress_interval_s": 1.0, "torch_threads": threads}
    return Settings(**{**values, **extra})


def env_of(settings: Settings) -> dict[str, str]:
    """This process's environment plus the WAVEFARM_* variables that rebuild `settings` in a child."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"WAVEFARM_{name.upper()}"] = str(value.get_secret_value() if hasattr(value, "get_secret_value")
                                              else value)
    return env


@contextmanager
def served(argv: list[str], settings: Settings, log: Path, port: int, *, what: str,
           wait_s: float = 120) -> Iterator[subprocess.Popen]:
    """`argv` in a process group of its own with `settings`' environment, its output in `log`, until it
    listens on `port`; stopped (SIGTERM, then SIGKILL after 30 s) when the block ends."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env_of(settings), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        if not services.wait_until(lambda: services.port_open("127.0.0.1", port), wait_s):
            raise RuntimeError(f"{what} did not come up:\n{services.log_tail(log)}")
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def flush_redis(settings: Settings) -> None:
    """Empty the benchmark's Redis databases (broker, results, features) on the server their URLs name
    (WAVEFARM_BENCH_REDIS included): every run starts bare."""
    for url in dict.fromkeys((settings.broker_url, settings.result_backend, settings.feature_store_url)):
        subprocess.run(["redis-cli", "-u", url, "flushdb"], check=False, capture_output=True)


def _ping(settings: Settings, nodes: list[str]) -> bool:
    from app.broker.celery_config import make_celery

    app = make_celery(settings)
    try:
        replies = app.control.ping(destination=nodes, timeout=1.0) or []
    finally:
        app.close()
    answered = {name for reply in replies for name in reply}
    return set(nodes) <= answered


@contextmanager
def running_stack(settings: Settings, logs: Path, port: int, *, cpu_concurrency: int | None = None,
                  wait_for_workers: bool = True) -> Iterator[dict[str, Path]]:
    """API on 127.0.0.1:`port`, a CPU worker and a GPU worker; yields their log paths. With
    `wait_for_workers`, returns only once both workers answer a Celery ping (the GPU worker builds its
    model before it answers), so nothing measured afterwards includes their start-up."""
    env = env_of(settings)
    logs.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    nodes = {"cpu": f"bench-cpu-{os.getpid()}@{host}", "gpu": f"bench-gpu-{os.getpid()}@{host}"}
    paths = {"api": logs / "api.log", "cpu": logs / "cpu.log", "gpu": logs / "gpu.log"}
    cpu_args = ["cpu-worker", "--hostname", nodes["cpu"]]
    if cpu_concurrency:
        cpu_args += ["--concurrency", str(cpu_concurrency)]
    procs = [services.start_cli(["serve", "--port", str(port)], env=env, log_path=paths["api"]),
             services.start_cli(cpu_args, env=env, log_path=paths["cpu"]),
             services.start_cli(["gpu-worker", "--hostname", nodes["gpu"]], env=env, log_path=paths["gpu"])]
    try:
        if not services.wait_until(lambda: services.port_open("127.0.0.1", port), READY_TIMEOUT_S):
            raise RuntimeError(f"the API did not come up:\n{services.log_tail(paths['api'])}")
        if wait_for_workers:
            def ready() -> bool:
                for proc, name in zip(procs[1:], ("cpu", "gpu"), strict=True):
                    if proc.poll() is not None:
                        raise RuntimeError(f"the {name} worker exited:\n{services.log_tail(paths[name])}")
                return _ping(settings, list(nodes.values()))

            if not services.wait_until(ready, READY_TIMEOUT_S, interval=0.5):
                raise RuntimeError(f"workers not ready in {READY_TIMEOUT_S:.0f} s:\n"
                                   f"{services.log_tail(paths['cpu'])}\n{services.log_tail(paths['gpu'])}")
        yield paths
    finally:
        for proc in procs:
            services.stop_process(proc)
