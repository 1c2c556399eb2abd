"""Service commands: serve, cpu-worker, gpu-worker, flower, bench, db upgrade, maintenance, demo.

Each builds the real server's command line and replaces this process with it (`os.execv`), so signals
reach the server directly; a GPU worker with a metrics port runs Celery in this process instead, to keep
the exporter alive beside it. Services bring the database schema up to date before they start.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from app.cli.common import print_json, settings

log = logging.getLogger("wavefarm")

CELERY_CPU_APP = "tasks.celery_app"
CELERY_GPU_APP = "gpu_worker.worker.process"


def add_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the HTTP API (uvicorn)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--processes", type=_positive, default=1,
                       help="API processes on the one port (uvicorn's --workers); more than one needs "
                            "PostgreSQL (default: 1)")
    serve.set_defaults(handler=cmd_serve)
    for name, what in (("cpu-worker", "voice preparation and maintenance tasks (celery -Q cpu)"),
                       ("gpu-worker", "the synthesis worker (celery -Q gpu, thread pool of worker_slots)")):
        worker = sub.add_parser(name, help=what)
        worker.add_argument("--loglevel", default="info")
        worker.add_argument("--hostname", help="celery node name (default: <kind>@%%h)")
        if name == "cpu-worker":
            worker.add_argument("--concurrency", type=int, help="processes (default: one per core)")
        else:
            worker.add_argument("--metrics-port", type=int,
                                help="serve Prometheus metrics (engine, installs) on this port")
        worker.set_defaults(handler=cmd_worker, kind=name.split("-")[0])
    flower = sub.add_parser("flower", help="Celery's monitoring UI (basic auth from FLOWER_BASIC_AUTH)")
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--port", type=int, default=5555)
    flower.set_defaults(handler=cmd_flower)
    bench = sub.add_parser("bench", add_help=False,
                           help="the engine benchmark (python -m bench.engine; `wavefarm bench --help`)")
    bench.set_defaults(handler=cmd_bench, bench_args=[])
    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="apply the Alembic migrations (idempotent)").set_defaults(
        handler=cmd_db_upgrade)
    maint = sub.add_parser("maintenance", help="one sweep: orphan files, jobs without a broker message, "
                           "abandoned voices, lost book.chapter messages (what the maintenance.sweep task "
                           "does)")
    maint.add_argument("--grace-s", type=float, help="remove orphan files older than this "
                       "(default: WAVEFARM_ORPHAN_GRACE_S)")
    maint.set_defaults(handler=cmd_maintenance)
    demo = sub.add_parser("demo", help="one-command embedded run: local Redis, SQLite, workers, samples")
    demo.add_argument("--jobs-per-voice", type=int, default=2, help="sample jobs per sample voice")
    demo.add_argument("--var", type=Path, default=Path("var"), help="folder for the database, files, logs")
    demo.add_argument("--timeout", type=float, default=270.0, help="seconds to wait for the jobs")
    demo.set_defaults(handler=cmd_demo)


def _upgrade_schema() -> None:
    """Services bring the database schema up to date on start (concurrent starts upgrade once)."""
    from app.db import upgrade

    upgrade(settings().database_url)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def serve_refusal(database_url: str, processes: int) -> str | None:
    """Why `serve` will not start `processes` API processes on this database, or None."""
    if processes > 1 and database_url.startswith("sqlite"):
        return (f"--processes {processes}: several API processes need PostgreSQL (WAVEFARM_DATABASE_URL); "
                "SQLite takes one writer at a time, so the processes would queue on its lock and time "
                "out. Run one process on SQLite.")
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.cli.ports import check_port_free

    refusal = serve_refusal(settings().database_url, args.processes)
    if refusal:
        print(f"wavefarm serve: {refusal}", file=sys.stderr)
        return 2
    check_port_free(args.host, args.port)  # before anything starts: say who holds it
    _upgrade_schema()  # once, here, before the processes start
    made = None
    if args.processes > 1:
        from app.api.metrics import MULTIPROC_ENV, prepare_multiprocess_dir

        given = os.environ.get(MULTIPROC_ENV)
        folder = prepare_multiprocess_dir(os.environ)  # inherited by the processes uvicorn spawns
        made = None if given else folder
        log.info("serve: %d processes; request metrics shared in %s", args.processes, folder)
    try:
        uvicorn.run("app.api.main:app_from_environment", factory=True, host=args.host, port=args.port,
                    log_level=args.log_level, workers=args.processes)
    finally:
        if made is not None:  # a folder of our own: its counts mean nothing to the next start
            shutil.rmtree(made, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # nor to an app built later in this process
    return 0


def worker_argv(kind: str, settings: Any, *, loglevel: str = "info", hostname: str | None = None,
                concurrency: int | None = None) -> list[str]:
    """The celery command line of a CPU or GPU worker."""
    if kind == "gpu":
        # Threads: every slot is a synth task waiting on the one engine thread that owns the device.
        argv = ["-A", CELERY_GPU_APP, "worker", "-Q", settings.queue_gpu, "-P", "threads",
                "-c", str(settings.worker_slots)]
    else:
        argv = ["-A", CELERY_CPU_APP, "worker", "-Q", settings.queue_cpu]
        if concurrency:
            argv += ["-c", str(concurrency)]
    return argv + ["-n", hostname or f"{kind}@%h", "--loglevel", loglevel]


def flower_argv(*, address: str, port: int) -> list[str]:
    # Basic auth is read by Flower from FLOWER_BASIC_AUTH itself: credentials stay out of argv (ps).
    return ["-A", CELERY_CPU_APP, "flower", f"--address={address}", f"--port={port}"]


def _exec(module: str, argv: list[str]) -> int:
    log.info("exec: %s %s", module, " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 0  # not reached


def cmd_worker(args: argparse.Namespace) -> int:
    port = getattr(args, "metrics_port", None)
    if port is not None:
        from app.cli.ports import check_port_free

        check_port_free("0.0.0.0", port, option="--metrics-port")  # where start_http_server listens
    _upgrade_schema()
    argv = worker_argv(args.kind, settings(), loglevel=args.loglevel, hostname=args.hostname,
                       concurrency=getattr(args, "concurrency", None))
    if port is None:
        return _exec("celery", argv)
    # The GPU worker's pool is threads: one process, so an exporter started here serves the
    # metrics its engine registers in prometheus_client's default registry.
    from prometheus_client import start_http_server

    start_http_server(port)
    log.info("worker metrics on :%d/metrics", port)
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *argv]
    celery_main()  # exits
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    if not os.environ.get("FLOWER_BASIC_AUTH"):
        log.warning("FLOWER_BASIC_AUTH is not set: Flower runs WITHOUT authentication")
    # Flower answers only once it has imported the CPU worker's task modules (torch among them) and
    # reached the broker: seconds of silence on a loaded machine, said here so it is not taken for a hang.
    log.info("starting Flower on http://%s:%d: it answers once it has loaded the CPU worker's tasks "
             "(torch among them) and reached the broker at %s; its \"Visit me\" line says it is up",
             args.address, args.port, _redacted(settings().broker_url))
    return _exec("celery", flower_argv(address=args.address, port=args.port))


def _redacted(url: str) -> str:
    """The URL with its password, if any, as ***: for a log line."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def cmd_bench(args: argparse.Namespace) -> int:
    # Its own process and parser: the benchmark belongs to the GPU side, which app never imports.
    return _exec("bench.engine", list(args.bench_args))


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy import make_url

    from app.db import upgrade

    url = settings().database_url
    upgrade(url)
    print(f"database at {make_url(url).render_as_string(hide_password=True)} is up to date")
    return 0


def cmd_maintenance(args: argparse.Namespace) -> int:
    from app.reconcile.sweep import run_sweep

    report = run_sweep(settings(), grace_s=args.grace_s)
    print_json(report.as_dict())
    return 1 if report.errors else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from app.dev.demo import run_demo

    return run_demo(var=args.var, jobs_per_voice=args.jobs_per_voice, timeout_s=args.timeout)
