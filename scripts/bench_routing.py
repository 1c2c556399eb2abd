"""The routing decision at scale: what one `app.submission.routing.route_voice` costs with many workers and
installs.

    python scripts/bench_routing.py [--backends postgres,sqlite] [--workers 64] [--voices 100000]
                                    [--done-jobs 100000] [--decisions 600] [--json docs/bench/routing.json]

Per backend, a throwaway database (PostgreSQL: `wavefarm_bench_routing_<pid>` on 127.0.0.1:5432, dropped
at the end; SQLite: a file in a temporary folder) brought to the head migration, then synthetic rows:
- `--workers` live GPU workers (beating now) and `--workers // 8` gone ones (silent for an hour);
- `--voices` installs (`worker_voices`) on the live workers, voice i on worker i mod workers, with
  `last_used` spread over a day and one in ten pinned; 1% of the voices on gone workers only, and as many
  voices installed nowhere;
- live jobs: each live worker has 0-3 claimed jobs and 0-4 queued on its own queue; and `--done-jobs`
  finished jobs (succeeded, cancelled, failed) routed to and run by the workers, as history accumulates.
Then `--decisions` decisions of each kind, each in a session of its own as `send_routed` makes one:
    held       a voice a live worker has installed        (route: affinity, or spilled)
    not_held   a voice installed nowhere                  (route: placed)
    gone       a voice installed only on gone workers     (route: placed)
Printed and saved per kind: p50/p99/mean ms per decision, this process's CPU ms per decision (what the
API process spends), SQL statements per decision and the routes taken; plus each statement's mean time
(which query dominates; on PostgreSQL also each statement's own execution time, EXPLAIN ANALYZE), and
a floor: the same number of `SELECT 1` round trips through the same session,
timed the same way (what three statements cost on this machine whatever they ask). Nothing else runs
against this database; the machine may be shared, so the tail is pessimistic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sqlalchemy import Engine, event, insert, text, update  # noqa: E402

from app.db import upgrade  # noqa: E402
from app.db.models import Job, JobStatus, Voice, Worker, WorkerVoice, utcnow  # noqa: E402
from app.db.session import make_engine, make_sessionmaker  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.submission import routing  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
KINDS = ("held", "not_held", "gone")
FLOOR = "floor_3_select_1"
CHUNK = 5000


@contextmanager
def database(name: str, root: Path) -> Iterator[str]:
    """A fresh database at the head migration; its SQLAlchemy URL. Dropped (PostgreSQL) on the way out."""
    if name == "sqlite":
        url = f"sqlite:///{root / 'routing.db'}"
        upgrade(url)
        yield url
        return
    import psycopg

    db = f"wavefarm_bench_routing_{os.getpid()}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def _insert(engine: Engine, model: Any, rows: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        for i in range(0, len(rows), CHUNK):
            conn.execute(insert(model), rows[i:i + CHUNK])


def seed(engine: Engine, *, workers: int, voices: int, done_jobs: int, seed: int = 0) -> dict[str, list[str]]:
    """The synthetic rows of the module docstring; the voice ids of each kind."""
    rng = random.Random(seed)
    now = utcnow()
    live = [f"gpu{i:03d}@bench" for i in range(workers)]
    gone = [f"gpu{i:03d}@gone" for i in range(max(1, workers // 8))]
    n_gone, n_free = max(1, voices // 100), max(1, voices // 100)
    held_ids = [f"v{i:07d}" for i in range(voices)]
    gone_ids = [f"g{i:07d}" for i in range(n_gone)]
    free_ids = [f"f{i:07d}" for i in range(n_free)]
    _insert(engine, Voice, [{"id": v, "status": "ready"} for v in held_ids + gone_ids + free_ids])
    _insert(engine, Worker, [{"name": w, "started_at": now - timedelta(hours=2), "heartbeat_at": now,
                              "slots": 8} for w in live])
    _insert(engine, Worker, [{"name": w, "started_at": now - timedelta(hours=3),
                              "heartbeat_at": now - timedelta(hours=1), "slots": 8} for w in gone])

    def install(worker: str, voice: str) -> dict[str, Any]:
        return {"worker_id": worker, "voice_id": voice, "nbytes": 1 << 20,
                "installed_at": now - timedelta(seconds=rng.uniform(3600, 86_400)),
                "last_used": now - timedelta(seconds=rng.uniform(0, 86_400)),
                "pinned": rng.randint(1, 3) if rng.random() < 0.1 else 0}

    installs = ([install(live[i % workers], v) for i, v in enumerate(held_ids)]
                + [install(gone[i % len(gone)], v) for i, v in enumerate(gone_ids)])
    _insert(engine, WorkerVoice, installs)
    latest: dict[str, Any] = {}
    for row in installs:  # what record_install keeps on the worker's row, install by install
        latest[row["worker_id"]] = max(latest.get(row["worker_id"], row["installed_at"]), row["installed_at"])
    with engine.begin() as conn:
        for name, at in latest.items():
            conn.execute(update(Worker).where(Worker.name == name).values(last_install_at=at))

    def job(status: str, worker: str | None, routed_to: str | None) -> dict[str, Any]:
        started = now - timedelta(seconds=rng.uniform(0, 3600))
        return {"voice_id": rng.choice(held_ids), "status": status, "n_tokens": 100, "seed": 0,
                "worker": worker, "routed_to": routed_to, "route": "affinity", "started_at": started,
                "submitted_at": started, "updated_at": started}

    jobs = [job(JobStatus.RUNNING, w, w) for w in live for _ in range(rng.randint(0, 3))]
    jobs += [job(JobStatus.QUEUED, None, w) for w in live for _ in range(rng.randint(0, 4))]
    finished = (JobStatus.SUCCEEDED,) * 18 + (JobStatus.FAILED, JobStatus.CANCELLED)
    for _ in range(done_jobs):
        w = rng.choice(live + gone)
        jobs.append(job(rng.choice(finished), w, w))
    _insert(engine, Job, jobs)
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")  # what autovacuum would have done by now
    return {"held": held_ids, "not_held": free_ids, "gone": gone_ids}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(engine: Engine, settings: Settings, ids: dict[str, list[str]], decisions: int) -> dict[str, Any]:
    """Time `decisions` routing decisions of each kind (interleaved), counting and timing statements."""
    session_of = make_sessionmaker(engine)
    statements: dict[str, list[float]] = defaultdict(list)
    count, started = [0], [0.0]

    def before(_c: Any, _cur: Any, _stmt: str, *_: Any) -> None:
        started[0] = time.perf_counter()

    def after(_c: Any, _cur: Any, stmt: str, *_: Any) -> None:
        count[0] += 1
        statements[" ".join(stmt.split())[:160]].append(time.perf_counter() - started[0])

    rng = random.Random(1)
    beaten = [0.0]

    def beat() -> None:  # the live workers beat (every 10 s in a deployment); not timed
        if time.perf_counter() - beaten[0] > 5.0:
            with engine.begin() as conn:
                conn.execute(update(Worker).where(Worker.name.like("%@bench")).values(heartbeat_at=utcnow()))
            beaten[0] = time.perf_counter()

    plan = [kind for kind in (*KINDS, FLOOR) for _ in range(decisions)]
    rng.shuffle(plan)
    for kind in KINDS[:1] * 20:  # warm the pool and the database's caches
        beat()
        with session_of() as s:
            routing.route_voice(session=s, settings=settings, voice_id=rng.choice(ids[kind]))
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    times: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)  # this process's: the API's share of a decision
    counts: dict[str, list[int]] = defaultdict(list)
    routes: dict[str, Counter[str]] = defaultdict(Counter)
    try:
        for kind in plan:
            beat()
            voice = rng.choice(ids.get(kind, ids["held"]))
            with session_of() as s:
                s.connection()  # checked out and begun, as in a submission's session: not timed
                before_count, t0, c0 = count[0], time.perf_counter(), time.process_time()
                if kind == FLOOR:
                    route = routing.shared(settings, "-")
                    for _ in range(3):
                        s.execute(text("SELECT 1")).all()
                else:
                    route = routing.route_voice(session=s, settings=settings, voice_id=voice)
                times[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.process_time() - c0)
            counts[kind].append(count[0] - before_count)
            routes[kind][route.reason] += 1
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    kinds = {kind: {"decisions": len(times[kind]),
                    "p50_ms": round(1000 * quantile(times[kind], 0.5), 3),
                    "p99_ms": round(1000 * quantile(times[kind], 0.99), 3),
                    "mean_ms": round(1000 * sum(times[kind]) / len(times[kind]), 3),
                    "client_cpu_ms": round(1000 * sum(cpu[kind]) / len(cpu[kind]), 3),
                    "statements": round(sum(counts[kind]) / len(counts[kind]), 2),
                    "routes": dict(routes[kind])} for kind in (*KINDS, FLOOR)}
    per_statement = sorted(({"statement": text, "calls": len(t), "mean_ms": round(1000 * sum(t) / len(t), 3)}
                            for text, t in statements.items()), key=lambda r: -r["mean_ms"])
    return {"kinds": kinds, "statements": per_statement}


def server_ms(engine: Engine, settings: Settings, voice: str) -> list[dict[str, Any]]:
    """PostgreSQL's own execution time of each statement of one decision (EXPLAIN ANALYZE, median of 5),
    without the round trips and the client: what the database spends per decision."""
    seen: list[tuple[str, Any]] = []

    def keep(_c: Any, _cur: Any, stmt: str, params: Any, *_: Any) -> None:
        seen.append((stmt, params))

    session_of = make_sessionmaker(engine)
    event.listen(engine, "before_cursor_execute", keep)
    try:
        with session_of() as s:
            routing.route_voice(session=s, settings=settings, voice_id=voice)
    finally:
        event.remove(engine, "before_cursor_execute", keep)
    rows = []
    with engine.connect() as conn:
        for stmt, params in seen:
            runs = sorted(float(conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + stmt, params)
                                .scalar_one()[0]["Execution Time"]) for _ in range(5))
            rows.append({"statement": " ".join(stmt.split())[:160], "execution_ms": round(runs[2], 3)})
    return rows


def run_backend(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    with database(name, root) as url:
        engine = make_engine(url)
        try:
            t0 = time.perf_counter()
            ids = seed(engine, workers=args.workers, voices=args.voices, done_jobs=args.done_jobs)
            seeded = time.perf_counter() - t0
            settings = Settings(database_url=url, voice_affinity="on")
            result = measure(engine, settings, ids, args.decisions)
            if name == "postgres":
                result["server"] = {kind: server_ms(engine, settings, ids[kind][-1]) for kind in KINDS}
        finally:
            engine.dispose()
    print(f"{name}: seeded in {seeded:.1f} s")
    for kind, r in result["kinds"].items():
        print(f"  {kind:<16} p50 {r['p50_ms']:>8} ms  p99 {r['p99_ms']:>8} ms  mean {r['mean_ms']:>8} ms  "
              f"cpu {r['client_cpu_ms']:>7} ms  statements {r['statements']:>5}  routes {r['routes']}")
    for r in result["statements"][:8]:
        print(f"    {r['mean_ms']:>8} ms x{r['calls']:<6} {r['statement'][:110]}")
    for kind, rows in result.get("server", {}).items():
        print(f"  {kind}: PostgreSQL's execution {sum(r['execution_ms'] for r in rows):.3f} ms "
              f"({', '.join(str(r['execution_ms']) for r in rows)})")
    return {"backend": name, "workers": args.workers, "gone_workers": max(1, args.workers // 8),
            "voices_installed": args.voices, "done_jobs": args.done_jobs, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="postgres,sqlite")
    parser.add_argument("--workers", type=int, default=64, help="live GPU workers (and 1/8 as many gone)")
    parser.add_argument("--voices", type=int, default=100_000, help="installs on the live workers")
    parser.add_argument("--done-jobs", type=int, default=100_000, help="finished jobs in the history")
    parser.add_argument("--decisions", type=int, default=600, help="per kind (held, not held, gone)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wavefarm-bench-routing-"))
    results = [run_backend(name, args, root) for name in args.backends.split(",")]
    if args.json:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip()
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        report = {"command": " ".join(["python", "scripts/bench_routing.py", *(argv or sys.argv[1:])]),
                  "git": revision, "cpu": cpu, "cores": os.cpu_count(), "load_before": os.getloadavg(),
                  "target_ms": 2.0, "backends": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
