"""The floor of a submission: the least an app can do for `POST /v1/jobs`, as a yardstick for wavefarm's.

`scripts/bench_api.py --floor ROUNDS` serves this app beside wavefarm's API on the same database and broker
and sends both the same submissions, interleaved (wavefarm, floor, wavefarm, floor, ...), counting each
process's CPU per request. Absolute rates on a shared machine move with the neighbours; the ratio of the
two CPU costs, measured a few seconds apart under the same load, is the figure.

What the floor does for one submission, and nothing else: FastAPI parses and validates a pydantic body,
the handler runs in the thread pool (a plain `def`, as wavefarm's submission does), one SQLAlchemy Core
INSERT (a compiled statement cached by SQLAlchemy, the row as parameters) into a table with a unique
index on the idempotency key, a commit, and one kombu publish of a small JSON message through kombu's
producer pool (publisher confirms on RabbitMQ, as wavefarm's broker options ask). Not product code.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, MetaData, String, Table, insert

FLOOR_TABLE = "floor_jobs"
WARM_UP_PER_CLIENT = 10  # submissions per concurrent client before each measured round
FLOOR_QUEUE_SUFFIX = "-floor"  # beside the benchmark's own queues, deleted with them

metadata = MetaData()
floor_jobs = Table(
    FLOOR_TABLE, metadata,
    Column("id", String(36), primary_key=True),
    Column("voice_id", String(64), nullable=False),
    Column("tokens", JSON, nullable=False),
    Column("seed", BigInteger, nullable=False),
    Column("priority", BigInteger, nullable=False),
    Column("idempotency_key", String(128)),
    Column("submitted_at", DateTime(timezone=True), nullable=False),
    Index("ix_floor_jobs_idempotency_key", "idempotency_key", unique=True),
)


class FloorRequest(BaseModel):
    voice_id: str = Field(min_length=1, max_length=64)
    tokens: list[int] = Field(min_length=1, max_length=4096)
    seed: int = Field(default=0, ge=0)
    priority: int = Field(default=0, ge=0, le=9)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=128)


def make_floor_app(database_url: str, broker_url: str, queue: str) -> FastAPI:
    """The floor app on `database_url` (its table created if missing), publishing to `queue`."""
    from kombu import Connection, Queue
    from kombu.pools import producers

    from app.db.session import make_engine

    engine = make_engine(database_url)
    metadata.create_all(engine)
    amqp = broker_url.startswith(("amqp://", "pyamqp://"))
    connection = Connection(broker_url, transport_options={"confirm_publish": True} if amqp else {})
    target = Queue(queue, routing_key=queue)
    statement = insert(floor_jobs)
    app = FastAPI()

    @app.post("/v1/jobs", status_code=202)
    def submit(body: FloorRequest) -> dict[str, Any]:
        row = {"id": str(uuid.uuid4()), **body.model_dump(), "submitted_at": datetime.now(UTC)}
        with engine.begin() as conn:
            conn.execute(statement, row)
        with producers[connection].acquire(block=True) as producer:
            producer.publish({"job": row["id"]}, exchange="", routing_key=queue, declare=[target],
                             serializer="json", priority=9 - body.priority, retry=False)
        return {"id": row["id"], "status": "queued", "voice_id": row["voice_id"],
                "n_tokens": len(row["tokens"]), "seed": row["seed"], "priority": row["priority"]}

    @app.on_event("shutdown")
    def close() -> None:
        connection.release()
        engine.dispose()

    return app


def serve_floor(port: int) -> None:
    """The floor app on loopback, configured from the environment `wavefarm serve` reads."""
    import uvicorn

    from app.settings import get_settings

    settings = get_settings()
    app = make_floor_app(settings.database_url, settings.broker_url, floor_queue(settings.queue_cpu))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **server_options())


def server_options() -> dict[str, str]:
    """uvicorn's options for a benchmark's servers. HTTP parser and event loop: uvicorn takes httptools
    and uvloop where they are installed; WAVEFARM_BENCH_HTTP=h11 keeps to the pure-Python pair (h11,
    asyncio), to measure what the others bring on one installation. Keep-alive: while one app of an
    interleaved pair is measured, the other's connections wait; uvicorn's 5 s default closed them, and a
    request sent as one closed ended the run (httpx.ReadError)."""
    chosen = {"http": "h11", "loop": "asyncio"} if os.environ.get("WAVEFARM_BENCH_HTTP") == "h11" else {}
    return {"timeout_keep_alive": 600, **chosen}


def floor_queue(cpu_queue: str) -> str:
    return f"{cpu_queue}{FLOOR_QUEUE_SUFFIX}"


def ratio_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: each round's wavefarm / floor CPU per request, and the range over the rounds."""
    summary = []
    for c in sorted({r["concurrency"] for r in rows}):
        rounds = sorted({r["round"] for r in rows if r["concurrency"] == c})
        ratios, rates = [], []
        for n in rounds:
            pair = {r["app"]: r for r in rows if r["concurrency"] == c and r["round"] == n}
            ours, floor = pair["wavefarm"]["cpu_ms_per_request"], pair["floor"]["cpu_ms_per_request"]
            if floor > 0:
                ratios.append(round(ours / floor, 2))
            rates.append((pair["wavefarm"]["per_s"], pair["floor"]["per_s"]))
        summary.append({"concurrency": c, "cpu_ratio_per_round": ratios,
                        "cpu_ratio_min": min(ratios, default=None),
                        "cpu_ratio_max": max(ratios, default=None),
                        "per_s_wavefarm_floor_per_round": rates})
    return summary


async def measure_interleaved(procs: dict[str, Any], ports: dict[str, int], voice: str,
                              args: Any) -> list[dict[str, Any]]:
    """`args.floor` rounds at each concurrency: the same submissions to wavefarm, then to the floor, each
    app's CPU per request from its own process (`procs`: name -> Popen, `ports`: name -> port)."""
    import random

    import httpx

    from scripts.bench_api import cpu_seconds, quantile, run_scenario

    rng = random.Random(0)
    tokens = [rng.randrange(6561) for _ in range(100)]
    seeds = iter(range(10**9))

    def submit(_: int) -> tuple[str, str, Any]:
        return "POST", "/v1/jobs", {"voice_id": voice, "tokens": tokens, "seed": next(seeds)}

    rows = []
    most = max(args.concurrency)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    clients = {name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits)
               for name, port in ports.items()}
    try:
        for c in args.concurrency:
            for n in range(args.floor):
                for name in ("wavefarm", "floor"):
                    # warm-up at the round's concurrency: its connections, pools and caches in place
                    await run_scenario(clients[name], submit, c, WARM_UP_PER_CLIENT * c)
                    before = cpu_seconds(procs[name].pid)
                    wall, lat, busy = await run_scenario(clients[name], submit, c, args.requests)
                    cpu = cpu_seconds(procs[name].pid) - before
                    rows.append({"app": name, "round": n + 1, "concurrency": c, "requests": args.requests,
                                 "busy_503": busy, "per_s": round(len(lat) / wall, 1),
                                 "p50_ms": round(1000 * quantile(lat, 0.5), 2),
                                 "p99_ms": round(1000 * quantile(lat, 0.99), 2),
                                 "cpu_ms_per_request": round(1000 * cpu / args.requests, 2)})
                    r = rows[-1]
                    print(f"  C={c:<3} round {n + 1} {name:<9} {r['per_s']:>8}/s  p50 {r['p50_ms']:>8} ms  "
                          f"cpu {r['cpu_ms_per_request']:>7} ms" + (f"  busy(503) {busy}" if busy else ""),
                          flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return rows


@contextmanager
def floor_process(settings: Any, log: Path, port: int) -> Iterator[subprocess.Popen]:
    """This app on `port` in a process of its own, on the API's database and broker (`settings`)."""
    from scripts.service_stack import served

    argv = [sys.executable, str(Path(__file__).resolve()), str(port)]
    with served(argv, settings, log, port, what="the floor app") as proc:
        yield proc


def run_floor(name: str, args: Any, root: Path, port: int) -> dict[str, Any]:
    """`bench_api.py --floor`: wavefarm's submissions against this app's, interleaved, on backend `name`."""
    import httpx

    from scripts.bench_api import PORT, api_process, backend, store_voice

    print(f"{name} (against the floor):", flush=True)
    with backend(name, root / name) as settings:
        with api_process(settings, root / f"{name}-api.log", None, counted=False) as api, \
                floor_process(settings, root / f"{name}-floor.log", port) as floor, \
                httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
            voice = store_voice(client, settings if args.voice == "ready" else None)
            rows = asyncio.run(measure_interleaved({"wavefarm": api, "floor": floor},
                                                   {"wavefarm": PORT, "floor": port}, voice, args))
    summary = ratio_summary(rows)
    for s in summary:
        print(f"  C={s['concurrency']}: wavefarm / floor CPU per submission {s['cpu_ratio_per_round']}")
    return {"backend": name, "database": settings.database_url.split(":", 1)[0],
            "broker": settings.broker_url.split(":", 1)[0], "floor_rows": rows, "floor_summary": summary}


if __name__ == "__main__":  # pragma: no cover - started by bench_api.py --floor
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    serve_floor(int(sys.argv[1]))
