"""The service layer alone: how many requests the API answers, at what latency, CPU and SQL cost.

    python scripts/bench_api.py [--backends sqlite,postgres] [--concurrency 1,8,32,64] [--requests 400]
                                [--book-segments 33000] [--books 200] [--json OUT]
                                [--batch 1000 --batch-requests 10 --scenarios batch] [--null-broker]

Per backend, one API process (`uvicorn` with the app `wavefarm serve` runs) on loopback, no workers:
- `sqlite`: the embedded default (a SQLite file, the local Redis as broker on databases 5-7);
- `postgres`: a fresh PostgreSQL database on 127.0.0.1:5432 (dropped at the end) and RabbitMQ as broker.
Seeded through the API (a stored voice) and the data layer (one book of `--book-segments` segments and
`--books` books of 100, as `add_book_plan` writes a read book), then, at each concurrency, `--requests`
requests of each scenario from an asyncio client in this process (keep-alive connections):
    submit        POST /v1/jobs (100 speech tokens, a stored voice)
    job_status    GET /v1/jobs/{id}          list_jobs   GET /v1/jobs?limit=50
    book_status   GET /v1/books/{id} of the big book     list_books  GET /v1/books?limit=200
    batch         POST /v1/jobs/batch of `--batch` jobs (100 tokens each, one stored voice),
                  `--batch-requests` requests; its row counts jobs: jobs/s, API CPU and SQL statements per job
Printed per row: requests/s answered, p50/p99 latency, how many were answered 503 Busy (overload), the
API process's CPU ms per request (from /proc) and SQL statements per request (counted by a SQLAlchemy
event in the API process). The client shares the machine's cores with the server: on 2 cores it takes
part of the CPU the server could have had, so the rates are a floor. `--profile` also writes a cProfile
of 200 submissions at concurrency 1 (the request thread's own time) and prints its top functions; with
`--batch`, of `--batch-requests` batches instead.

The submitted voice is prepared before the run (`--voice ready`, the default: a voice in use, its features
in the store) or left pending (`--voice pending`: no CPU worker runs, so each submission also makes the
preparation claim's Redis `SET NX`). The API is served as `wavefarm serve` serves it (`app.api.main.settled`).

`--floor ROUNDS` measures only submissions, against the least possible app doing the same
(`scripts/bench_floor.py`), served beside the API on the same database and broker: at each concurrency,
ROUNDS rounds of `--requests` submissions to wavefarm, then to the floor (A, B, A, B, ...), and per round
the ratio of their CPU per request (`floor_summary` in the JSON).

`--processes N` (N > 1, PostgreSQL only: `wavefarm serve --processes` refuses SQLite) serves the API
from N uvicorn processes on the one port, as `wavefarm serve --processes N` does (the request metrics in
prometheus_client's multiprocess mode); CPU is then the whole process tree's and statements are summed
over the processes (each writes its count to a file of its own), and after the run one scrape of
/metrics must count every request the client sent (`metrics_requests_counted` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app import lifecycle  # noqa: E402
from app.dev import SAMPLES  # noqa: E402
from app.settings import Settings  # noqa: E402
from scripts.bench_api_processes import metrics_check, processes_refusal, serve_processes  # noqa: E402
from scripts.bench_floor import floor_queue, run_floor, server_options  # noqa: E402
from scripts.service_stack import bench_settings, flush_redis, served  # noqa: E402


def _free_port() -> int:
    """A port nothing listens on now: a fixed one was taken by another run of this script on a shared
    machine, whose API then answered this run's requests (and wrote to its own database)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


PORT = _free_port()
FLOOR_PORT = _free_port()
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
RABBIT = "amqp://guest:guest@127.0.0.1:5672//"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SCENARIOS = ("submit", "job_status", "list_jobs", "book_status", "list_books", "batch")


# -- the API process --------------------------------------------------------------------------------------

class NullSender:
    """--null-broker: messages are dropped here, so a run shows what the service costs without the broker."""

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        pass


def serve_counted(port: int, profile: str | None, null_broker: bool = False, counted: bool = True) -> None:
    """The API app of `wavefarm serve`, plus a count of SQL statements at GET /_bench/statements (not
    `counted`: no count, so its listener's work per statement is not measured against the floor's)."""
    import uvicorn
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from app.api.main import create_app, settled
    from app.cli.services import _upgrade_schema
    from app.settings import get_settings

    _upgrade_schema()
    count = [0]
    if counted:
        event.listen(Engine, "before_cursor_execute", lambda *_: count.__setitem__(0, count[0] + 1))
    app = settled(create_app(get_settings(), sender=NullSender() if null_broker else None))  # as served
    app.add_api_route("/_bench/statements", lambda: {"statements": count[0]}, methods=["GET"])
    if profile:
        import cProfile

        profiler = cProfile.Profile()

        def toggle(on: bool) -> dict[str, bool]:
            (profiler.enable if on else profiler.disable)()
            if not on:
                profiler.dump_stats(profile)
            return {"profiling": on}

        app.add_api_route("/_bench/profile/{on}", toggle, methods=["POST"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **server_options())


def cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its descendants (the processes `--processes` starts)."""
    def own(p: int) -> tuple[int, float]:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK  # ppid, utime + stime

    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                table[int(entry.name)] = own(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # ended meanwhile
    tree, grew = {pid}, True
    while grew:  # until no process has a parent in the tree that is not in it itself
        grew = False
        for p, (ppid, _) in table.items():
            if ppid in tree and p not in tree:
                tree.add(p)
                grew = True
    return sum(table[p][1] for p in tree if p in table)


@contextmanager
def api_process(settings: Settings, log: Path, profile: str | None, null_broker: bool = False,
                processes: int = 1, counted: bool = True) -> Iterator[subprocess.Popen]:
    argv = [sys.executable, __file__, "--serve", str(PORT)] + (["--profile-out", profile] if profile else [])
    argv += [] if counted else ["--uncounted"]
    argv += ["--null-broker"] if null_broker else []
    argv += ["--serve-processes", str(processes)] if processes > 1 else []
    with served(argv, settings, log, PORT, what="the API", wait_s=180) as proc:
        yield proc


# -- backends -----------------------------------------------------------------------------------------------

@contextmanager
def backend(name: str, root: Path) -> Iterator[Settings]:
    if name == "sqlite":
        settings = bench_settings(root, preset="tiny", slots=1, threads=1, redis_dbs=(5, 6, 7),
                                  queue=f"benchapi{os.getpid()}")
        flush_redis(settings)
        yield settings
        flush_redis(settings)
        return
    import psycopg

    db = f"wavefarm_benchapi_{os.getpid()}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    settings = bench_settings(root, preset="tiny", slots=1, threads=1, redis_dbs=(5, 6, 7),
                              queue=f"benchapi{os.getpid()}",
                              database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}",
                              broker_url=RABBIT)
    flush_redis(settings)
    try:
        yield settings
    finally:
        _delete_queues(settings)
        flush_redis(settings)
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def _delete_queues(settings: Settings) -> None:
    from app.broker.celery_config import make_celery

    app = make_celery(settings)
    try:
        with app.connection_for_write() as conn:
            for queue in (settings.queue_cpu, settings.queue_gpu, floor_queue(settings.queue_cpu)):
                try:
                    conn.default_channel.queue_delete(queue)
                except Exception as exc:  # noqa: BLE001 - a queue never declared is fine
                    print(f"  (queue {queue}: {exc})")
    finally:
        app.close()


def seed_books(settings: Settings, voice_id: str, big: int, small: int) -> str:
    """One book of `big` segments and `small` books of 100, written as a read book is; the big one's id."""
    from app.db.models import SegmentKind
    from app.db.queries import books as q
    from app.db.session import make_engine, make_sessionmaker

    engine = make_engine(settings.database_url)
    session_of = make_sessionmaker(engine)

    def one(n: int, per_chapter: int) -> str:
        book_id = str(uuid.uuid4())  # ids are UUIDs in their dashed form
        keys = [(uuid.uuid4().hex, SegmentKind.TOKENS.value, voice_id) for _ in range(n)]
        chapters = [q.PlannedChapter(f"chapter {i // per_chapter + 1}", keys[i:i + per_chapter],
                                     4.0 * per_chapter) for i in range(0, n, per_chapter)]
        with session_of.begin() as s:
            q.create_book(session=s, new=q.NewBook(
                id=book_id, voice_id=voice_id, title="bench", author="bench", language="en",
                output_format="wav", m4b=False, target_lufs=None, seed=0, priority=5))
        with session_of.begin() as s:
            lifecycle.add_book_plan(session=s, book_id=book_id, title="bench", author="bench", language="en",
                                    plan_key=f"books/{book_id}/plan.json", chapters=chapters)
        return book_id

    big_id = one(big, 1000)
    for _ in range(small):
        one(100, 25)
    engine.dispose()
    return big_id


# -- load ---------------------------------------------------------------------------------------------------

async def run_scenario(client: httpx.AsyncClient, make: Any, concurrency: int,
                       n: int) -> tuple[float, list[float], int]:
    """`n` requests from `concurrency` tasks; wall seconds, each answered request's latency (s), and how
    many were answered 503 Busy (no database connection free: the API's overload answer)."""
    latencies: list[float] = []
    busy = [0]
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            method, url, body = make(i)
            start = time.perf_counter()
            response = await client.request(method, url, json=body)
            if response.status_code == 503 and response.json().get("error") == "Busy":
                busy[0] += 1
                continue
            latencies.append(time.perf_counter() - start)
            if response.status_code >= 400 or (url.endswith("/batch") and response.json()["refused"]):
                raise RuntimeError(f"{method} {url}: {response.status_code} {response.text[:300]}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, busy[0]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(proc: subprocess.Popen, voice: str, book: str, args: argparse.Namespace) -> list[dict]:
    most = max(args.concurrency)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    rows = []
    job_ids: list[str] = []
    rng = random.Random(0)
    tokens = [rng.randrange(6561) for _ in range(100)]

    def submit(i: int) -> tuple[str, str, Any]:
        return "POST", "/v1/jobs", {"voice_id": voice, "tokens": tokens, "seed": i}

    def batch(i: int) -> tuple[str, str, Any]:
        return "POST", "/v1/jobs/batch", [{"voice_id": voice, "tokens": tokens, "seed": i * args.batch + k}
                                          for k in range(args.batch)]

    makers = {"submit": submit,
              "job_status": lambda i: ("GET", f"/v1/jobs/{job_ids[i % len(job_ids)]}", None),
              "list_jobs": lambda i: ("GET", "/v1/jobs?limit=50", None),
              "book_status": lambda i: ("GET", f"/v1/books/{book}", None),
              "list_books": lambda i: ("GET", "/v1/books?limit=200", None), "batch": batch}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300, limits=limits) as client:
        async def statements() -> int:
            return (await client.get("/_bench/statements")).json()["statements"]

        for c in args.concurrency:
            for name in args.scenarios:
                n = args.requests if name in ("submit", "job_status") else max(20, args.requests // 4)
                n = args.batch_requests if name == "batch" else n
                per = args.batch if name == "batch" else 1  # jobs a request
                await run_scenario(client, makers[name], min(c, 4), min(n, 8 if per == 1 else 1))  # warm-up
                before_sql, before_cpu = await statements(), cpu_seconds(proc.pid)
                wall, lat, busy = await run_scenario(client, makers[name], c, n)
                sql, cpu = await statements() - before_sql - 1, cpu_seconds(proc.pid) - before_cpu
                if name == "submit":
                    listed = (await client.get("/v1/jobs?limit=1000")).json()
                    job_ids = [j["id"] for j in listed]
                rows.append({"concurrency": c, "scenario": name, "requests": n, "jobs_per_request": per,
                             "busy_503": busy, "per_s": round(per * len(lat) / wall, 1),
                             "p50_ms": round(1000 * quantile(lat, 0.5), 2),
                             "p99_ms": round(1000 * quantile(lat, 0.99), 2),
                             "cpu_ms_per_request": round(1000 * cpu / n, 2),
                             "sql_per_request": round(sql / n, 2),
                             "cpu_ms_per_job": round(1000 * cpu / (n * per), 3),
                             "sql_per_job": round(sql / (n * per), 4)})
                r = rows[-1]
                unit = "jobs" if per > 1 else ""
                print(f"  C={c:<3} {name:<12} {r['per_s']:>8}{unit}/s  p50 {r['p50_ms']:>8} ms  "
                      f"p99 {r['p99_ms']:>8} ms  cpu {r['cpu_ms_per_request']:>7} ms  "
                      f"sql {r['sql_per_request']:>6}" + (f"  busy(503) {busy}" if busy else "")
                      + (f"  per job: cpu {r['cpu_ms_per_job']} ms, sql {r['sql_per_job']}"
                         if per > 1 else ""), flush=True)
    return rows


async def profile_submissions(voice: str, out: Path, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
        await client.post("/_bench/profile/true")
        if args.batch:
            for i in range(args.batch_requests):
                body = [{"voice_id": voice, "tokens": list(range(100)), "seed": 10**6 + i * args.batch + k}
                        for k in range(args.batch)]
                (await client.post("/v1/jobs/batch", json=body)).raise_for_status()
        else:
            for i in range(200):
                body = {"voice_id": voice, "tokens": list(range(100)), "seed": i}
                (await client.post("/v1/jobs", json=body)).raise_for_status()
        await client.post("/_bench/profile/false")


def print_profile(path: Path) -> list[str]:
    import io
    import pstats

    stream = io.StringIO()
    pstats.Stats(str(path), stream=stream).sort_stats("cumulative").print_stats(25)
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    print("\n".join(lines))
    return lines


def store_voice(client: httpx.Client, settings: Settings | None = None) -> str:
    """The benchmark's voice, stored through the API. With `settings`, also prepared here, as a CPU worker
    would (`voice.prepare`'s own function): its row ready and its features in the store, the state of a
    voice used again and again (`--voice ready`). Without, it stays pending (no CPU worker runs), so every
    submission also makes the preparation claim's Redis `SET NX` (`--voice pending`)."""
    sample = SAMPLES / "voice_a.wav"
    response = client.post("/v1/voices", files={"file": (sample.name, sample.read_bytes(), "audio/wav")})
    response.raise_for_status()
    voice = str(response.json()["id"])
    if settings is not None:
        from app.context import Context
        from tasks.voice import prepare_voice

        ctx = Context.build(settings)
        try:
            outcome = prepare_voice(voice, ctx)
        finally:
            ctx.close()
        if outcome != "prepared":
            raise SystemExit(f"the benchmark's voice was not prepared: {outcome}")
        if client.get(f"/v1/voices/{voice}").json()["status"] != "ready":
            raise SystemExit("the benchmark's voice is prepared but not ready")
    return voice


def run_backend(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    if args.floor:
        return run_floor(name, args, root, FLOOR_PORT)
    print(f"{name}:", flush=True)
    with backend(name, root / name) as settings:
        profile = str(root / f"{name}.prof") if args.profile else None
        with api_process(settings, root / f"{name}-api.log", profile, args.null_broker,
                         args.processes) as proc, \
                httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
            voice = store_voice(client, settings if args.voice == "ready" else None)
            book = seed_books(settings, voice, args.book_segments, args.books)
            rows = asyncio.run(measure(proc, voice, book, args))
            base = f"http://127.0.0.1:{PORT}"
            counted = asyncio.run(metrics_check(base, 100)) if args.processes > 1 else None
            top = []
            if profile:
                asyncio.run(profile_submissions(voice, Path(profile), args))
                top = print_profile(Path(profile))
    return {"backend": name, "database": settings.database_url.split(":", 1)[0],
            "broker": settings.broker_url.split(":", 1)[0], "rows": rows, "profile_top": top,
            **({"processes": args.processes, "metrics_requests_counted": counted} if counted else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests", type=int, default=400, help="per concurrency (listings: a quarter)")
    parser.add_argument("--book-segments", type=int, default=33_000)
    parser.add_argument("--books", type=int, default=200, help="books of 100 segments beside the big one")
    parser.add_argument("--batch", type=int, default=0, help="jobs a POST /v1/jobs/batch (batch scenario)")
    parser.add_argument("--batch-requests", type=int, default=10, help="batch requests per concurrency")
    parser.add_argument("--scenarios", default=None, help=f"some of {','.join(SCENARIOS)} (default: all; "
                        "batch only with --batch)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--null-broker", action="store_true", help="the API drops its messages (no broker "
                        "round trips): what the service costs without them")
    parser.add_argument("--processes", type=int, default=1,
                        help="API processes (uvicorn workers, as `wavefarm serve --processes`); >1: postgres")
    parser.add_argument("--floor", type=int, default=0, metavar="ROUNDS",
                        help="submissions only, interleaved with the floor app's (scripts/bench_floor.py)")
    parser.add_argument("--voice", choices=("ready", "pending"), default="ready",
                        help="the submitted voice: prepared before the run (the steady state: default), or "
                        "left pending, so each submission also makes the preparation claim's Redis SET NX")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    parser.add_argument("--uncounted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve and args.serve_processes > 1:
        serve_processes(args.serve, args.serve_processes)
        return 0
    if args.serve:
        serve_counted(args.serve, args.profile_out, args.null_broker, counted=not args.uncounted)
        return 0
    refusal = processes_refusal(args)
    if refusal:
        parser.error(refusal)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    every = [s for s in SCENARIOS if s != "batch" or args.batch]
    chosen = args.scenarios.split(",") if args.scenarios else every
    if "batch" in chosen and not args.batch:
        parser.error("the batch scenario needs --batch N")
    args.scenarios = chosen
    root = Path(tempfile.mkdtemp(prefix="wavefarm-bench-api-"))
    results = [run_backend(name, args, root) for name in args.backends.split(",")]
    if args.json:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        report = {"command": " ".join(sys.argv), "http": os.environ.get("WAVEFARM_BENCH_HTTP", "auto"),
                  "httptools_uvloop": [importlib.util.find_spec(m) is not None
                                       for m in ("httptools", "uvloop")],
                  "git": revision.strip(), "voice": args.voice, "cpu": cpu, "cores": os.cpu_count(),
                  "load_before": os.getloadavg(), "backends": results}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
