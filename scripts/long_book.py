"""A long book holds up: a synthetic 300-chapter, 5,000-segment book (speech tokens, tiny preset, dummy
weights, the CPU) planned, rendered, both workers SIGKILLed part-way and started again, resumed and
assembled; printed: wall time of each phase, peak RSS of each process, database rows and size.

    python scripts/long_book.py --json docs/bench/long_book.json

One CPU worker and one GPU worker as separate processes (`scripts/cluster.py`), a fresh SQLite database,
artifact root and Redis databases 5, 6, 7 (flushed). The book is submitted in this process (the
service's `submit_book`, as the API does); its chapters are assembled by the CPU worker and the M4B at the
end. Peak RSS is sampled every 0.5 s over every process of each worker's process group (Celery's parent
and its pool); the submitting process's own peak comes from getrusage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cluster import Cluster, reference  # noqa: E402
from service_stack import bench_settings, flush_redis  # noqa: E402

from app.books.files import output_dir  # noqa: E402
from app.books.reading.source import BookLimits  # noqa: E402
from app.books.service import BookOptions, BookRequest, Submission, submit_book  # noqa: E402
from app.books.status import book_status  # noqa: E402
from app.broker.celery_config import make_celery  # noqa: E402
from app.context import Context  # noqa: E402
from app.db import upgrade  # noqa: E402
from app.db.session import make_engine, make_sessionmaker  # noqa: E402
from app.speech import VOCAB_SIZE  # noqa: E402
from app.storage.artifacts import ArtifactStore  # noqa: E402
from app.storage.feature_store import FeatureStore  # noqa: E402

REDIS_DBS = (5, 6, 7)
TABLES = ("jobs", "segments", "book_segments", "book_chapters", "books", "voices", "install_events")


def manifest(chapters: int, segments: int, tokens: int) -> bytes:
    """`segments` spread over `chapters`, each segment `tokens` distinct speech tokens."""
    per = [segments // chapters + (1 if c < segments % chapters else 0) for c in range(chapters)]
    n = 0
    out = []
    for c, count in enumerate(per):
        items = []
        for _ in range(count):
            items.append({"tokens": [(n * 7919 + i * 31 + 11) % VOCAB_SIZE for i in range(tokens)]})
            n += 1
        out.append({"title": f"Chapter {c + 1}", "segments": items})
    return json.dumps({"title": "A Long Book", "author": "Synthetic", "chapters": out}).encode()


class RssSampler(threading.Thread):
    """Peak RSS (MiB) over each named process group, sampled every 0.5 s."""

    def __init__(self, groups: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.groups, self.peak = dict(groups), dict.fromkeys(groups, 0.0)
        self.stopped = threading.Event()

    def watch(self, name: str, pgid: int) -> None:
        self.groups[name] = pgid
        self.peak.setdefault(name, 0.0)

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            totals: dict[int, float] = {}
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    pgid = os.getpgid(int(entry))
                    with open(f"/proc/{entry}/status") as status:
                        rss = next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
                except (OSError, ProcessLookupError, StopIteration):
                    continue
                totals[pgid] = totals.get(pgid, 0.0) + rss / 1024
            for name, pgid in self.groups.items():
                self.peak[name] = max(self.peak[name], totals.get(pgid, 0.0))


def progress(sessions: Any, artifacts: ArtifactStore, book_id: str) -> Any:
    with sessions() as session:
        return book_status(session=session, artifacts=artifacts, book_id=book_id)


def stuck(sessions: Any, book_id: str) -> list[dict[str, Any]]:
    """The book's segments without audio and what their jobs are doing (for a stall's report)."""
    from app.db import queries

    out = []
    with sessions() as session:
        for s in queries.book_segment_states(session=session, book_id=book_id):
            if s.done:
                continue
            job = queries.get_job(session=session, job_id=s.job_id) if s.job_id else None
            out.append({"key": s.key[:12], "job": s.job_id, "status": s.job_status, "error": s.error,
                        "attempts": job.attempts if job else None, "worker": job.worker if job else None,
                        "routed_to": job.routed_to if job else None,
                        "updated": str(job.updated_at) if job else None})
    return out


def wait(sessions: Any, artifacts: ArtifactStore, book_id: str, until: Any, timeout_s: float,
         cluster: Cluster) -> Any:
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        view = progress(sessions, artifacts, book_id)
        if until(view):
            return view
        if view.book.status in ("failed", "cancelled"):
            raise RuntimeError(f"book {view.book.status}: {view.book.error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"book still {view.book.status} at {view.segments_done}/"
                               f"{view.segments_total}; not done: {stuck(sessions, book_id)}\n"
                               f"{cluster.tails(8)}")
        if view.segments_done // 500 != last:
            last = view.segments_done // 500
            print(f"  {view.book.status}: {view.segments_done}/{view.segments_total} segments", flush=True)
        time.sleep(1.0)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    settings = bench_settings(work, preset="tiny", slots=args.slots, threads=1, redis_dbs=REDIS_DBS,
                              queue="long", prep_wait_ms=2000)
    flush_redis(settings)
    artifacts = ArtifactStore(settings.artifact_root)
    artifacts.ensure_layout()
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    cluster = Cluster(settings, work / "logs")
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    app = make_celery(settings)
    ctx = Context.build(settings, sender=app)
    phases: dict[str, float] = {}
    try:
        for name, kind in (("g1", "gpu"), ("c1", "cpu")):
            cluster.start(kind, name)
        cluster.wait_ready()
        sampler = RssSampler(dict(cluster.pids()))
        sampler.start()
        data = manifest(args.chapters, args.segments, args.tokens)
        t0 = time.monotonic()
        with sessions() as session:
            request = BookRequest(submission=Submission(options=BookOptions(), filename="long.json"),
                                  reference_bytes=reference(0))
            book_id = submit_book(ctx=ctx, session=session, data=data, request=request, limits=BookLimits())
        phases["submit_and_plan_s"] = time.monotonic() - t0
        kill_at = int(args.kill_at * args.segments)
        wait(sessions, artifacts, book_id, lambda v: v.segments_done >= kill_at, args.timeout, cluster)
        phases["render_until_kill_s"] = time.monotonic() - t0
        done_at_kill = progress(sessions, artifacts, book_id).segments_done
        for name in ("g1", "c1"):
            cluster.kill(name)
        print(f"  killed both workers at {done_at_kill} segments", flush=True)
        t_restart = time.monotonic()
        for name, kind in (("g2", "gpu"), ("c2", "cpu")):
            cluster.start(kind, name)
        cluster.wait_ready(["g2", "c2"])
        for name, pid in cluster.pids().items():
            sampler.watch(name, pid)
        final = wait(sessions, artifacts, book_id, lambda v: v.book.status == "succeeded", args.timeout,
                     cluster)
        phases["resume_to_done_s"] = time.monotonic() - t_restart
        phases["total_s"] = time.monotonic() - t0
        sampler.stopped.set()
        sampler.join()
        with engine.connect() as connection:
            from sqlalchemy import text

            rows = {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in TABLES}  # noqa: S608
            attempts = connection.execute(text("SELECT sum(attempts), count(*) FROM jobs")).one()
        db_path = Path(settings.database_url.removeprefix("sqlite:///"))
        out = output_dir(artifacts, book_id)
        return {
            "chapters": len(final.chapters), "segments": final.segments_total,
            "tokens_per_segment": args.tokens,
            "audio_s": round(final.audio_seconds, 1), "status": final.book.status,
            "segments_done_at_kill": done_at_kill,
            "rendered_twice": int(attempts[0] or 0) - int(attempts[1] or 0),
            "phases_s": {k: round(v, 1) for k, v in phases.items()},
            "peak_rss_mib": {**{k: round(v) for k, v in sampler.peak.items()},
                             "submitter": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)},
            "database_rows": rows,
            "database_mib": round(db_path.stat().st_size / 2**20, 1),
            "m4b_mib": round((out / "book.m4b").stat().st_size / 2**20, 1),
            "chapter_files": len(list(out.glob("chapter-*.flac"))),
        }
    finally:
        ctx.close()
        app.close()
        store.close()
        cluster.stop_all()
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", type=int, default=300)
    parser.add_argument("--segments", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=10, help="speech tokens per segment (25 a second)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of segments done at the kill")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wf-long-book-") as tmp:
        result = run(args, Path(tmp))
    report = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "python": platform.python_version(), "command": " ".join(["python", *sys.argv]), **result}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
