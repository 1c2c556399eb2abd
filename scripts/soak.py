"""Soak: many jobs through the real stack while jobs are cancelled and workers are killed.

    python scripts/soak.py --jobs 200 --voices 20

Starts its own Redis servers (broker + results, and the feature store, optionally capped as an LRU cache;
temp folder, own ports, no persistence) and a SQLite file, a real CPU worker
(`tasks.celery_app`, solo pool) and a real GPU worker (`gpu_worker.worker`, thread pool, tiny preset,
dummy weights, CPU device) as subprocesses, submits jobs through `app.jobs`, cancels a fraction of them
at random stages (queued, preparing, running, after a random delay), SIGKILLs the GPU worker and the CPU
worker once each mid-run and starts them again (as a supervisor would), then checks:
  completed + cancelled + failed == submitted; orphan files == 0; pins == 0; feature-store keys bounded
  by the number of voices, each with a TTL; worker RSS after warm-up within 10 %.
Prints a JSON report (and writes it with --report). Exit status 0 when every check holds.
It never touches any Redis or database but its own.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import redis
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.artifacts import ArtifactStore  # noqa: E402
from app.celery_config import make_celery  # noqa: E402
from app.db import queries, upgrade  # noqa: E402
from app.db.models import DONE_JOB_STATUSES, JobStatus  # noqa: E402
from app.db.session import make_engine, make_sessionmaker, session_scope  # noqa: E402
from app.jobs import submit_job  # noqa: E402
from app.keys import PREFIX  # noqa: E402
from app.maintenance import run_sweep  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.speech import VOCAB_SIZE  # noqa: E402
from app.store import FeatureStore  # noqa: E402
from app.voices import reclaim_abandoned_voice  # noqa: E402

STAGES = ("queued", "preparing", "running", "delay")


def reference(i: int, seconds: float = 3.0, sr: int = 24000) -> bytes:
    """A distinct, non-silent reference voice per index (tones + seeded noise)."""
    rng = np.random.default_rng(i)
    t = np.arange(int(seconds * sr)) / sr
    wave = 0.2 * np.sin(2 * np.pi * (110 + 17 * i) * t) + 0.05 * rng.standard_normal(t.shape)
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), sr, format="WAV")
    return buf.getvalue()


class Stack:
    """Own Redis, CPU worker and GPU worker processes; everything stopped by pid at the end."""

    def __init__(self, work: Path, port: int, settings: Settings, feature_maxmemory_mb: int = 0) -> None:
        self.work, self.port, self.settings = work, port, settings
        self.feature_maxmemory_mb = feature_maxmemory_mb
        self.redis: list[subprocess.Popen[bytes]] = []
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: Counter[str] = Counter()

    def start_redis(self) -> None:
        """Broker and results on `port`; the feature store on `port + 1`, an LRU cache when capped."""
        cap = (["--maxmemory", f"{self.feature_maxmemory_mb}mb", "--maxmemory-policy", "volatile-lru"]
               if self.feature_maxmemory_mb else [])
        for port, extra in ((self.port, []), (self.port + 1, cap)):
            self.redis.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--dir", str(self.work), *extra], stdout=subprocess.DEVNULL))
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            else:
                raise RuntimeError("own redis-server did not start")

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for name, value in self.settings.model_dump(exclude_none=True).items():
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"WAVEFARM_{name.upper()}"] = str(value)
        return env

    def start(self, kind: str) -> subprocess.Popen[bytes]:
        self.starts[kind] += 1
        name = f"soak-{kind}@%h"  # the same name after a restart, as a supervisor would run it
        if kind == "gpu":
            argv = ["-A", "gpu_worker.worker", "worker", "-Q", self.settings.queue_gpu, "-P", "threads",
                    "-c", str(self.settings.worker_slots)]
        else:
            argv = ["-A", "tasks.celery_app", "worker", "-Q", self.settings.queue_cpu, "-P", "solo"]
        log = open(self.work / f"{kind}{self.starts[kind]}.log", "wb")  # open while the process lives
        proc = subprocess.Popen([sys.executable, "-m", "celery", *argv, "-n", name, "-l", "INFO",
                                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                                cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        self.workers[kind] = proc
        return proc

    def kill(self, kind: str) -> None:
        proc = self.workers[kind]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self.redis:
            proc.terminate()
            proc.wait(10)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(tempfile.mkdtemp(prefix="wavefarm-soak-"))
        redis_url = f"redis://127.0.0.1:{args.redis_port}"
        self.settings = Settings(
            database_url=f"sqlite:///{self.work / 'soak.sqlite'}", broker_url=f"{redis_url}/0",
            result_backend=f"{redis_url}/1", feature_store_url=f"redis://127.0.0.1:{args.redis_port + 1}/0",
            artifact_root=self.work / "artifacts", queue_cpu="soak-cpu", queue_gpu="soak-gpu",
            model_preset="tiny", worker_slots=args.slots, micro_batch_size=args.slots, prep_wait_ms=500,
            voice_cache_capacity=8, feature_ttl_s=900, progress_interval_s=0.2,
            visibility_timeout_s=args.visibility_timeout_s, job_max_attempts=3, stuck_job_after_s=60,
            orphan_grace_s=600)
        upgrade(self.settings.database_url)
        self.sessions = make_sessionmaker(make_engine(self.settings.database_url))
        self.artifacts = ArtifactStore(self.settings.artifact_root)
        self.artifacts.ensure_layout()
        self.stack = Stack(self.work, args.redis_port, self.settings, args.feature_maxmemory_mb)
        self.jobs: list[str] = []
        self.cancel_plan: dict[str, tuple[str, float]] = {}
        self.cancelled_at: Counter[str] = Counter()
        self.rss: dict[str, list[tuple[float, int, float]]] = {"gpu": [], "cpu": []}  # (t, done, MB)
        self.events: list[str] = []
        self.t0 = time.monotonic()

    # -- driving ----------------------------------------------------------------------------------------
    def submit_all(self, store: FeatureStore) -> None:
        refs = [reference(i) for i in range(self.args.voices)]
        sender = make_celery(self.settings)
        try:
            for i in range(self.args.jobs):
                n = self.rng.randint(self.args.min_tokens, self.args.max_tokens)
                with self.sessions() as session:
                    tokens = [self.rng.randrange(VOCAB_SIZE) for _ in range(n)]
                    job_id = submit_job(settings=self.settings, session=session, sender=sender, store=store,
                                        artifacts=self.artifacts, tokens=tokens,
                                        reference_bytes=refs[i % len(refs)], seed=i)
                self.jobs.append(job_id)
                if self.rng.random() < self.args.cancel_fraction:
                    self.cancel_plan[job_id] = (self.rng.choice(STAGES), self.rng.uniform(0, 10))
                time.sleep(self.args.submit_interval_s)
        finally:
            sender.close()

    def cancel(self, store: FeatureStore, job_id: str, stage: str) -> None:
        with session_scope(self.sessions) as session:
            if queries.cancel_job(session=session, job_id=job_id):
                job = queries.require_job(session=session, job_id=job_id)
                reclaim_abandoned_voice(session=session, store=store, voice_id=job.voice_id)
                self.cancelled_at[stage] += 1
        store.request_cancel(job_id, ttl_s=self.settings.visibility_timeout_s * 10)

    def canceller(self, store: FeatureStore, stop: threading.Event) -> None:
        started = {}
        while not stop.is_set():
            for job_id, (stage, delay) in list(self.cancel_plan.items()):
                with self.sessions() as session:
                    job = queries.require_job(session=session, job_id=job_id)
                started.setdefault(job_id, time.monotonic())
                if job.status in DONE_JOB_STATUSES:
                    del self.cancel_plan[job_id]
                    continue
                due = {"queued": job.status == JobStatus.QUEUED,
                       "preparing": job.status == JobStatus.PREPARING,
                       "running": job.status == JobStatus.RUNNING and job.frames_done > 0,
                       "delay": time.monotonic() - started[job_id] >= delay}[stage]
                if due:
                    self.cancel(store, job_id, stage)
                    del self.cancel_plan[job_id]
            time.sleep(0.05)

    def counts(self) -> Counter[str]:
        with self.sessions() as session:
            return Counter(j.status for j in queries.list_jobs(session=session, limit=10 ** 6))

    def sample_rss(self) -> None:
        done = sum(n for s, n in self.counts().items() if s in DONE_JOB_STATUSES)
        for kind, proc in self.stack.workers.items():
            mb = rss_mb(proc.pid)
            if mb is not None:
                self.rss[kind].append((time.monotonic() - self.t0, done, mb))

    def chaos(self, done: int) -> None:
        """SIGKILL the GPU worker at 30 % and the CPU worker at 50 % of jobs done; start them again."""
        for kind, at in (("gpu", 0.3), ("cpu", 0.5)):
            key = f"killed-{kind}"
            if key not in self.events and done >= at * self.args.jobs:
                self.stack.kill(kind)
                self.events.append(key)
                self.rss[kind].append((time.monotonic() - self.t0, done, -1.0))  # marks the restart
                time.sleep(0.5)
                self.stack.start(kind)

    # -- checks ------------------------------------------------------------------------------------------
    def finish_checks(self, store: FeatureStore) -> dict[str, Any]:
        counts = self.counts()
        with self.sessions() as session:
            referenced = queries.referenced_paths(session=session)
            pins = sum(w.pinned for w in _all_worker_voices(session))
            attempts = Counter(j.attempts for j in queries.list_jobs(session=session, limit=10 ** 6))
            prep_paths = Counter(j.prep_path for j in queries.list_jobs(session=session, limit=10 ** 6)
                                 if j.status == JobStatus.SUCCEEDED)
            missing = [j.id for j in queries.list_jobs(session=session, status=JobStatus.SUCCEEDED,
                                                       limit=10 ** 6)
                       if not j.output_path or not self.artifacts.path(j.output_path).is_file()]
        orphans = self.artifacts.list_orphans(referenced=referenced, older_than_s=0)
        feature_keys = list(store.client.scan_iter(match=f"{PREFIX}:feat:*"))
        ttls = [store.client.ttl(k) for k in feature_keys]
        memory = store.client.info("memory")
        evicted = store.client.info("stats").get("evicted_keys", 0)
        completed, cancelled, failed = (counts[JobStatus.SUCCEEDED], counts[JobStatus.CANCELLED],
                                        counts[JobStatus.FAILED])
        return {
            "submitted": len(self.jobs), "completed": completed, "cancelled": cancelled, "failed": failed,
            "not_finished": len(self.jobs) - completed - cancelled - failed,
            "cancelled_at_stage": dict(self.cancelled_at), "attempts": dict(sorted(attempts.items())),
            "prep_paths": dict(prep_paths), "succeeded_without_file": len(missing),
            "orphan_files": [str(p.relative_to(self.artifacts.root)) for p in orphans],
            "pins": pins, "feature_keys": len(feature_keys), "feature_keys_without_ttl":
                sum(1 for t in ttls if t < 0), "voices": self.args.voices,
            "feature_store_used_mb": round(memory["used_memory"] / 2**20, 2),
            "feature_store_maxmemory_mb": self.args.feature_maxmemory_mb or None,
            "feature_keys_evicted": int(evicted),
        }

    def rss_report(self) -> dict[str, Any]:
        """RSS of the last (restarted) process of each worker kind: at warm-up end and at the end."""
        out: dict[str, Any] = {}
        for kind, samples in self.rss.items():
            last = [s for s in samples[_last_restart(samples) + 1:] if s[2] > 0]
            if len(last) < 4:
                continue
            warm = last[len(last) // 4]
            peak = max(s[2] for s in last[len(last) // 4:])
            end = last[-1]
            out[kind] = {"warm_mb": round(warm[2], 1), "peak_after_warm_mb": round(peak, 1),
                         "end_mb": round(end[2], 1), "growth_pct": round(100 * (peak - warm[2]) / warm[2], 1),
                         "samples": len(last)}
        return out

    def run(self) -> dict[str, Any]:
        self.stack.start_redis()
        store = FeatureStore.from_url(self.settings.feature_store_url, ttl_s=self.settings.feature_ttl_s)
        stop = threading.Event()
        try:
            self.stack.start("cpu")
            self.stack.start("gpu")
            canceller = threading.Thread(target=self.canceller, args=(store, stop), daemon=True)
            canceller.start()
            submitter = threading.Thread(target=self.submit_all, args=(store,), daemon=True)
            submitter.start()
            deadline = time.monotonic() + self.args.timeout_s
            last_sweep = time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(1.0)
                counts = self.counts()
                done = sum(n for s, n in counts.items() if s in DONE_JOB_STATUSES)
                self.sample_rss()
                self.chaos(done)
                if time.monotonic() - last_sweep > self.args.sweep_every_s:
                    sender = make_celery(self.settings)
                    run_sweep(self.settings, sender)
                    sender.close()
                    last_sweep = time.monotonic()
                if not submitter.is_alive() and done == len(self.jobs):
                    break
            elapsed = time.monotonic() - self.t0
            stop.set()
            time.sleep(1.0)  # the workers' bookkeeping threads settle (unpins)
            report = {"elapsed_s": round(elapsed, 1), **self.finish_checks(store), "rss": self.rss_report(),
                      "events": self.events, "settings": {
                          "jobs": self.args.jobs, "voices": self.args.voices, "slots": self.args.slots,
                          "tokens": [self.args.min_tokens, self.args.max_tokens],
                          "cancel_fraction": self.args.cancel_fraction,
                          "feature_maxmemory_mb": self.args.feature_maxmemory_mb,
                          "visibility_timeout_s": self.args.visibility_timeout_s}}
        finally:
            stop.set()
            store.close()
            self.stack.stop()
        report["checks"] = checks(report)
        report["workdir"] = str(self.work)
        return report


def _all_worker_voices(session: Any) -> list[Any]:
    from sqlalchemy import select

    from app.db.models import WorkerVoice

    return list(session.scalars(select(WorkerVoice)))


def _last_restart(samples: list[tuple[float, int, float]]) -> int:
    marks = [i for i, s in enumerate(samples) if s[2] < 0]
    return marks[-1] if marks else -1


def checks(report: dict[str, Any]) -> dict[str, bool]:
    rss = report["rss"]
    return {
        "all_accounted": report["completed"] + report["cancelled"] + report["failed"] == report["submitted"],
        "no_orphan_files": not report["orphan_files"],
        "no_pins": report["pins"] == 0,
        "feature_keys_bounded": report["feature_keys"] <= report["voices"]
        and report["feature_keys_without_ttl"] == 0
        and (not report["feature_store_maxmemory_mb"]
             or report["feature_store_used_mb"] <= report["feature_store_maxmemory_mb"]),
        "nothing_done_without_file": report["succeeded_without_file"] == 0,
        "rss_stable_10pct": bool(rss) and all(abs(v["growth_pct"]) <= 10 for v in rss.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--voices", type=int, default=20)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--min-tokens", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--submit-interval-s", type=float, default=0.05)
    parser.add_argument("--visibility-timeout-s", type=int, default=10)
    parser.add_argument("--sweep-every-s", type=float, default=30.0)
    parser.add_argument("--redis-port", type=int, default=6391, help="this port and the next one")
    parser.add_argument("--feature-maxmemory-mb", type=int, default=0,
                        help="cap the feature store (volatile-lru), so features are evicted mid-run")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="also write the JSON report here")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (logs, database, files)")
    args = parser.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("soak: needs redis-server on PATH", file=sys.stderr)
        return 2
    soak = Soak(args)
    report = soak.run()
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    if not args.keep:
        shutil.rmtree(soak.work, ignore_errors=True)
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
