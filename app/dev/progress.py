"""`wavefarm demo`'s view of its jobs: progress while they run (tqdm bars on a terminal, a summary line
now and then otherwise), then a report of each job, how its voice was prepared, and where the audio is.
Reads the database and the feature store's counters; starts and stops nothing (`app.dev.demo` does).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from app.dev import services
from app.speech import TOKEN_RATE
from app.storage.keys import COUNTER_PREP_PATH, COUNTER_PREPARE

FINAL = ("succeeded", "failed", "cancelled")
POLL_S = 0.5


def say(message: str = "") -> None:
    print(message, flush=True)


def follow(settings: Any, job_ids: list[str], timeout_s: float,
            check: Callable[[], None]) -> list[dict[str, Any]]:
    """Poll the jobs until all are final: tqdm bars on a terminal, a status line now and then otherwise."""
    from app.db.session import make_engine, make_sessionmaker

    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    show = _Bars(job_ids) if sys.stdout.isatty() else _Lines()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            jobs = _read_jobs(sessions, job_ids)
            show.update(jobs)
            if all(job["status"] in FINAL for job in jobs):
                return jobs
            check()
            if time.monotonic() > deadline:
                raise services.ServiceError(f"jobs not finished after {timeout_s:g} s:\n{_summary(jobs)}")
            time.sleep(POLL_S)
    finally:
        show.close()
        engine.dispose()


def _read_jobs(sessions: Any, job_ids: list[str]) -> list[dict[str, Any]]:
    from app.api.schemas import JobOut
    from app.db import queries
    from app.db.session import session_scope

    with session_scope(sessions) as s:
        return [JobOut.of(queries.require_job(session=s, job_id=j)).model_dump(mode="json") for j in job_ids]


def _summary(jobs: list[dict[str, Any]]) -> str:
    return "  ".join(f"{j['id'][:8]} {j['status']} {j['progress']['frames_done']}/"
                     f"{j['progress']['frames_total']}" for j in jobs)


class _Bars:
    def __init__(self, job_ids: list[str]) -> None:
        from tqdm import tqdm

        self.bars = [tqdm(total=1, desc=job_id[:8], unit="frame", position=i, leave=True)
                     for i, job_id in enumerate(job_ids)]

    def update(self, jobs: list[dict[str, Any]]) -> None:
        for bar, job in zip(self.bars, jobs, strict=True):
            bar.total = max(job["progress"]["frames_total"], 1)
            bar.n = job["progress"]["frames_done"]
            bar.set_postfix_str(f"{job['status']} {job['prep_path'] or ''}".strip())

    def close(self) -> None:
        for bar in self.bars:
            bar.close()


class _Lines:
    """Not a terminal (CI, a log file): one summary line when something changed, at most every 5 s."""

    def __init__(self) -> None:
        self.last, self.at = "", 0.0

    def update(self, jobs: list[dict[str, Any]]) -> None:
        line = _summary(jobs)
        final = all(job["status"] in FINAL for job in jobs)
        if line != self.last and (final or time.monotonic() - self.at >= 5.0):
            say(f"progress: {line}")
            self.last, self.at = line, time.monotonic()

    def close(self) -> None:
        pass


def report(settings: Any, jobs: list[dict[str, Any]], before: dict[str, dict[str, int]]) -> None:
    from app.db import queries
    from app.db.session import make_engine, make_sessionmaker, session_scope
    from app.storage.artifacts import ArtifactStore
    from app.storage.feature_store import FeatureStore

    artifacts = ArtifactStore(settings.artifact_root)
    engine = make_engine(settings.database_url)
    say("\njobs:")
    with session_scope(make_sessionmaker(engine)) as s:
        for job in jobs:
            row = queries.require_job(session=s, job_id=job["id"])
            where = artifacts.path(row.output_path) if row.output_path else row.error
            run_ms = job["timings"]["run_ms"]
            rendered = f"{job['n_tokens'] / TOKEN_RATE:.1f} s of audio in " + (
                f"{run_ms / 1000:.1f} s" if run_ms is not None else "-")
            say(f"  {job['id']}  {job['status']:<9} voice {job['voice_id'][:10]}  "
                f"prep {job['prep_path'] or '-':<17} {rendered}, "
                f"first audio after {job['timings']['first_audio_ms']} ms  -> {where}")
    engine.dispose()
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    try:
        for group, title in ((COUNTER_PREP_PATH, "how each job's voice reached the GPU worker"),
                             (COUNTER_PREPARE, "voice preparations on the CPU worker")):
            now = store.counters(group)
            delta = {k: v - before[group].get(k, 0) for k, v in sorted(now.items())
                     if v != before[group].get(k, 0)}
            say(f"{title}: {delta or 'none'}")
    finally:
        store.close()
    say(f"audio files are under {artifacts.root / 'outputs'}")
