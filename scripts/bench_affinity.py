"""Voice affinity on and off, measured on one machine: two GPU workers and one CPU worker (tiny preset,
dummy weights, CPU), 60 jobs over 12 voices arriving in a mixed order, one every `--gap-s` seconds.

    python scripts/bench_affinity.py --rounds 1 --json docs/bench/affinity.json

Each run starts from nothing (a fresh SQLite database, artifact root and Redis databases; workers started
anew) so both modes begin with no voice installed; the modes alternate (on, off, on, off, ...). Printed
per run: installs (rows of `install_events`), installs per 100 jobs, the distinct (voice, worker) pairs
those installs covered, and the first-audio latency of the jobs (first audio written - submitted):
mean, p95 and max. The Redis databases used (2, 3, 4 of the local server) are flushed.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cluster import Cluster, reference  # noqa: E402
from service_stack import bench_settings, flush_redis  # noqa: E402

from app.broker.celery_config import make_celery  # noqa: E402
from app.context import Context  # noqa: E402
from app.db import queries, upgrade  # noqa: E402
from app.db.models import DONE_JOB_STATUSES, utcnow  # noqa: E402
from app.db.session import make_engine, make_sessionmaker  # noqa: E402
from app.speech import VOCAB_SIZE  # noqa: E402
from app.storage.artifacts import ArtifactStore  # noqa: E402
from app.storage.feature_store import FeatureStore  # noqa: E402
from app.submission.jobs import submit_job  # noqa: E402
from app.submission.request import JobRequest  # noqa: E402
from app.submission.routing import LIVE_BEAT_S  # noqa: E402

REDIS_DBS = (2, 3, 4)


def plan(jobs: int, voices: int, seed: int) -> list[tuple[int, list[int], int]]:
    rng = random.Random(seed)
    order = [i % voices for i in range(jobs)]
    rng.shuffle(order)
    return [(v, [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(20, 40))], rng.randrange(1 << 30))
            for v in order]


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _job_record(voice: int, row: Any, t0: Any) -> dict[str, Any]:
    """What one job went through: where it was routed and ran, how its voice was ready, its first audio."""
    return {"voice": voice, "route": row.route, "ran_on": (row.worker or "").split("@")[0],
            "prep_path": row.prep_path, "submitted_s": round((row.submitted_at - t0).total_seconds(), 3),
            "first_audio_s": round((row.first_audio_at - row.submitted_at).total_seconds(), 3)
            if row.first_audio_at else None}


def run_once(mode: str, jobs: list[tuple[int, list[int], int]], gap_s: float, work: Path) -> dict[str, Any]:
    settings = bench_settings(work, preset="tiny", slots=4, threads=1, redis_dbs=REDIS_DBS, queue="aff",
                              voice_affinity=mode, prep_wait_ms=2000, progress_interval_s=0.5)
    flush_redis(settings)
    ArtifactStore(settings.artifact_root).ensure_layout()
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    cluster = Cluster(settings, work / "logs")
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    app = make_celery(settings)
    ctx = Context.build(settings, sender=app)
    try:
        for name, kind in (("g1", "gpu"), ("g2", "gpu"), ("c1", "cpu")):
            cluster.start(kind, name)
        cluster.wait_ready()
        deadline = time.monotonic() + 60
        while True:  # both heartbeats recorded: affinity sees two workers from the first job
            with sessions() as session:
                live = queries.live_workers(session=session,
                                            beat_after=utcnow() - timedelta(seconds=LIVE_BEAT_S))
            if len(live) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ids = []
        started = last = time.monotonic()
        for voice, tokens, seed in jobs:
            # at least gap_s between arrivals: a slow submission (the first is) never makes a burst
            time.sleep(max(0.0, last + gap_s - time.monotonic()) if ids else 0.0)
            last = time.monotonic()
            with sessions() as session:
                ids.append(submit_job(ctx=ctx, session=session, request=JobRequest(
                    tokens=tokens, reference_bytes=reference(voice), seed=seed)))
        while True:
            with sessions() as session:
                rows = [queries.require_job(session=session, job_id=j) for j in ids]
            if all(r.status in DONE_JOB_STATUSES for r in rows):
                break
            if time.monotonic() - started > 900:
                raise RuntimeError(f"{mode}: jobs not done in 900 s\n{cluster.tails()}")
            time.sleep(0.5)
        with sessions() as session:
            events = queries.list_install_events(session=session)
        latency = [(r.first_audio_at - r.submitted_at).total_seconds() for r in rows if r.first_audio_at]
        return {
            "mode": mode, "jobs": len(ids), "succeeded": sum(r.status == "succeeded" for r in rows),
            "installs": len(events), "installs_per_100_jobs": round(100 * len(events) / len(ids), 1),
            "voice_worker_pairs": len({(e.voice_id, e.worker_id) for e in events}),
            "first_audio_s": {"mean": round(statistics.fmean(latency), 3), "p95": round(p95(latency), 3),
                              "max": round(max(latency), 3)},
            "routes": dict(sorted(Counter(r.route or "" for r in rows).items())),
            "per_job": [_job_record(voice, r, rows[0].submitted_at) for (voice, _, _), r in zip(jobs, rows,
                                                                                              strict=True)],
            "wall_s": round(time.monotonic() - started, 1),
        }
    finally:
        ctx.close()
        app.close()
        store.close()
        cluster.stop_all()
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--voices", type=int, default=12)
    parser.add_argument("--gap-s", type=float, default=0.5, help="seconds between arrivals")
    parser.add_argument("--rounds", type=int, default=1, help="on/off pairs, alternating")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    jobs = plan(args.jobs, args.voices, args.seed)
    runs = []
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            with tempfile.TemporaryDirectory(prefix=f"wf-aff-{mode}-") as tmp:
                result = run_once(mode, jobs, args.gap_s, Path(tmp))
            print(json.dumps(result), flush=True)
            runs.append(result)
    report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "jobs": args.jobs, "voices": args.voices, "gap_s": args.gap_s, "runs": runs}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
