"""`scripts/bench_api.py --processes N`: the API served by N processes, as `wavefarm serve --processes N`
serves it, with what the benchmark needs from each: its SQL statements counted into a file of its own
(summed over the processes at GET /_bench/statements), and a check that /metrics, answered by any
process, counts every process's requests (prometheus_client's multiprocess mode, `app.api.metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

STATEMENTS_DIR = "WAVEFARM_BENCH_STATEMENTS_DIR"  # where each API process writes its statement count


def counted_app() -> Any:
    """The API app of `wavefarm serve` in one of several processes, counting its SQL statements into a
    file of its own (8 bytes, rewritten in place) so /_bench/statements can sum every process's."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from app.api.main import app_from_environment

    folder = Path(os.environ[STATEMENTS_DIR])
    fd = os.open(folder / str(os.getpid()), os.O_RDWR | os.O_CREAT, 0o600)
    count = [0]

    def counted(*_: Any) -> None:
        count[0] += 1
        os.pwrite(fd, count[0].to_bytes(8, "little"), 0)

    event.listen(Engine, "before_cursor_execute", counted)
    app = app_from_environment()

    def statements() -> dict[str, int]:
        return {"statements": sum(int.from_bytes(f.read_bytes()[:8] or b"\0", "little")
                                  for f in folder.iterdir())}

    app.add_api_route("/_bench/statements", statements, methods=["GET"])
    return app


def serve_processes(port: int, processes: int) -> None:
    """What `wavefarm serve --processes N` runs, with `counted_app` as the app."""
    import uvicorn

    from app.api.metrics import prepare_multiprocess_dir
    from app.cli.services import _upgrade_schema

    _upgrade_schema()
    metrics = prepare_multiprocess_dir(os.environ)
    statements = os.environ[STATEMENTS_DIR] = tempfile.mkdtemp(prefix="wavefarm-bench-statements-")
    try:
        uvicorn.run("scripts.bench_api_processes:counted_app", factory=True, host="127.0.0.1", port=port,
                    log_level="warning", workers=processes)
    finally:
        shutil.rmtree(metrics, ignore_errors=True)
        shutil.rmtree(statements, ignore_errors=True)


async def requests_counted(base: str) -> float:
    """Requests the API's /metrics counts in all (summed over processes in multiprocess mode)."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("wavefarm_http_requests_total{"))


async def metrics_check(base: str, n: int) -> dict[str, float]:
    """`n` requests between two scrapes, whichever processes answer them: the second scrape must count
    them all, and the first scrape itself (a per-process counter would count only its own share)."""
    before = await requests_counted(base)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        await asyncio.gather(*(client.get("/healthz") for _ in range(n)))
    return {"sent": n + 1, "counted": await requests_counted(base) - before}


def processes_refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (several processes: PostgreSQL only, as `wavefarm serve`), or None."""
    if args.processes < 1:
        return f"--processes must be at least 1, not {args.processes}"
    if args.processes > 1 and "sqlite" in args.backends.split(","):
        return (f"--processes {args.processes} needs --backends postgres: `wavefarm serve` runs several "
                "API processes on PostgreSQL only")
    if args.processes > 1 and args.profile:
        return "--profile profiles one API process: use it without --processes"
    return None
