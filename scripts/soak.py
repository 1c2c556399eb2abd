"""Soak: a two-by-two cluster under load while jobs are cancelled, workers killed and features flushed.

    python scripts/soak.py                                   # 500 jobs, 40 voices, Redis + SQLite
    python scripts/soak.py --broker rabbitmq --postgres      # the deployed pair: RabbitMQ + PostgreSQL

Two GPU workers (`wavefarm gpu-worker`: thread pool, tiny preset, dummy weights, CPU device) and two CPU
workers (`wavefarm cpu-worker`) run as separate processes (`scripts/cluster.py`) on their own Redis
servers (broker + results on one, the feature store on the next port; temp folder, no persistence), or
RabbitMQ on a vhost of their own, with one database (a SQLite file, or a PostgreSQL database made for
the run and dropped after it) and one artifact root. Every setting a user meets is left at its
default (visibility timeout, heartbeats, stuck-job and maintenance periods: the CPU workers send the
sweep themselves), but for the model preset, the slots and the queue names.

Jobs of 25..150 tokens are submitted through `app.submission.jobs` over the voices in a shuffled order, a few
per second; a fifth of them are cancelled (`app.submission.jobs.cancel_job`, as the API does) at a stage drawn
for each: queued, preparing, running (audio started) or after a random delay. As jobs end, by the share done:
  15 %  g1 SIGKILLed, started again 5 s later under its name (a supervisor)
  30 %  c1 SIGKILLed, started again 5 s later
  45 %  g2 SIGKILLed, started again only after 90 s (its peer takes over its queue and jobs first)
  50 %  the feature store flushed (every prepared voice lost)
  60 %  c2 SIGKILLed, started again after 90 s
Then it checks: submitted = completed + cancelled + failed; no job succeeded twice (the GPU workers'
Celery logs); every succeeded job has its file; no orphan file (no sweep grace is waited out: whatever
the run left behind counts); no pin; Redis keys bounded (feature keys at most the voices, each with a
TTL; in the results database and a Redis broker's, no key without a TTL but kombu's fixed ones: its
queue lists and unacked bookkeeping); each worker's RSS (its process group; of a GPU worker the process
that started the most jobs, of a CPU worker the longest-lived) within 10 % between half-way through
that process's life and its peak after. It also records, for each killed GPU worker, how long after the
kill each job it held was claimed by a next attempt (`recovery`).
Prints a JSON report (`--report` writes it too); exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, select, text

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cluster import Cluster, reference  # noqa: E402

from app.context import Context  # noqa: E402
from app.db import queries, upgrade  # noqa: E402
from app.db.models import DONE_JOB_STATUSES, Job, JobStatus, WorkerVoice, utcnow  # noqa: E402
from app.db.session import make_engine, make_sessionmaker  # noqa: E402
from app.errors import Conflict  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.speech import VOCAB_SIZE  # noqa: E402
from app.storage.artifacts import ArtifactStore  # noqa: E402
from app.storage.feature_store import FeatureStore  # noqa: E402
from app.storage.keys import PREFIX  # noqa: E402
from app.submission.jobs import cancel_job, submit_job  # noqa: E402
from app.submission.request import JobRequest  # noqa: E402
from app.submission.routing import LIVE_BEAT_S  # noqa: E402

STAGES = ("queued", "preparing", "running", "delay")
GPU, CPU = ("g1", "g2"), ("c1", "c2")
# (share of jobs ended, what, worker, seconds until a supervisor starts it again)
CHAOS = ((0.15, "kill", "g1", 5.0), (0.30, "kill", "c1", 5.0), (0.45, "kill", "g2", 90.0),
         (0.50, "flush", "features", 0.0), (0.60, "kill", "c2", 90.0))
SUCCEEDED = re.compile(r"synth\[([0-9a-f-]{36})\] succeeded in [0-9.]+s: \{[^}]*'status': 'succeeded'")
# kombu's own keys on a Redis broker: they live as long as the broker (queues are lists, one per priority)
KOMBU_FIXED = re.compile(r"^(_kombu\.binding.*|unacked|unacked_index|unacked_mutex|.*-cpu.*|.*-gpu.*)$")


class Services:
    """The run's own Redis servers (and RabbitMQ vhost, PostgreSQL database when asked): made at start,
    removed at the end, so nothing of any other Redis, queue or database is touched."""

    def __init__(self, work: Path, port: int, broker: str, postgres: bool) -> None:
        self.work, self.port, self.broker, self.postgres = work, port, broker, postgres
        self.tag = f"soak{uuid.uuid4().hex[:8]}"
        self.redis: list[subprocess.Popen[bytes]] = []

    def urls(self) -> dict[str, str]:
        r = f"redis://127.0.0.1:{self.port}"
        broker = (f"amqp://guest:guest@127.0.0.1:5672/{self.tag}" if self.broker == "rabbitmq" else f"{r}/0")
        database = (f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.tag}" if self.postgres
                    else f"sqlite:///{self.work / 'soak.sqlite'}")
        return {"broker_url": broker, "result_backend": f"{r}/1", "database_url": database,
                "feature_store_url": f"redis://127.0.0.1:{self.port + 1}/0"}

    def start(self) -> None:
        for port in (self.port, self.port + 1):
            self.redis.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--dir", str(self.work)], stdout=subprocess.DEVNULL))
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"redis-server on port {port} did not start")
        if self.broker == "rabbitmq":
            for cmd in (["add_vhost", self.tag],
                        ["set_permissions", "-p", self.tag, "guest", ".*", ".*", ".*"]):
                subprocess.run(["rabbitmqctl", "-q", *cmd], check=True, capture_output=True)
        if self.postgres:
            with _pg_admin() as conn:
                conn.execute(text(f'CREATE DATABASE "{self.tag}"'))

    def stop(self) -> None:
        for proc in self.redis:
            proc.terminate()
            proc.wait(10)
        if self.broker == "rabbitmq":
            subprocess.run(["rabbitmqctl", "-q", "delete_vhost", self.tag], check=False, capture_output=True)
        if self.postgres:
            with _pg_admin() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.tag}" WITH (FORCE)'))


def _pg_admin() -> Any:
    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                           isolation_level="AUTOCOMMIT")
    return engine.connect()


def group_rss_mb(pid: int) -> float | None:
    """Resident memory of a worker's whole process group (Celery's main process and its pool)."""
    total, found = 0.0, False
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            if int(Path(status.parent / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pid:
                continue  # not in the group led by pid (its pgid is field 5 of stat)
        except (OSError, ValueError, IndexError):
            continue
        found = True
        total += int(fields.get("VmRSS", "0 kB").split()[0]) / 1024.0
    return total if found else None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(tempfile.mkdtemp(prefix="wavefarm-soak-"))
        self.services = Services(self.work, args.redis_port, args.broker, args.postgres)
        self.settings = Settings(
            **self.services.urls(), artifact_root=self.work / "artifacts",
            queue_cpu=f"{self.services.tag}-cpu", queue_gpu=f"{self.services.tag}-gpu", model_preset="tiny",
            worker_slots=args.slots, micro_batch_size=args.slots)
        self.cluster = Cluster(self.settings, self.work / "logs")
        self.artifacts = ArtifactStore(self.settings.artifact_root)
        self.jobs: list[str] = []
        self.cancel_plan: dict[str, tuple[str, float]] = {}  # job -> (stage, delay), until it is due
        self.planned = 0
        self.cancelled_at: Counter[str] = Counter()
        self.rss: dict[str, list[list[tuple[float, float]]]] = {n: [[]] for n in (*GPU, *CPU)}  # per life
        self.lives: dict[str, list[datetime]] = {n: [] for n in (*GPU, *CPU)}  # when each process started
        self.events: list[dict[str, Any]] = []
        self.restarts: list[tuple[float, str]] = []  # (when, worker)
        self.redis_keys_peak: dict[str, int] = {}
        self.recovery: dict[str, dict[str, Any]] = {}  # "kill g1" -> what it held and when each ran again
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # -- driving ----------------------------------------------------------------------------------------
    def submit_all(self) -> None:
        refs = [reference(i) for i in range(self.args.voices)]
        order = [i % self.args.voices for i in range(self.args.jobs)]
        self.rng.shuffle(order)
        ctx = Context.build(self.settings)
        try:
            for i, voice in enumerate(order):
                n = self.rng.randint(self.args.min_tokens, self.args.max_tokens)
                with ctx.session() as session:
                    job_id = submit_job(ctx=ctx, session=session, request=JobRequest(
                        reference_bytes=refs[voice], seed=i,
                        tokens=[self.rng.randrange(VOCAB_SIZE) for _ in range(n)]))
                if self.rng.random() < self.args.cancel_fraction:
                    self.cancel_plan[job_id] = (STAGES[self.planned % len(STAGES)], self.rng.uniform(0, 5))
                    self.planned += 1
                self.jobs.append(job_id)
                time.sleep(self.args.submit_interval_s)
        finally:
            ctx.close()

    def canceller(self, stop: threading.Event) -> None:
        ctx = Context.build(self.settings)
        try:
            self._cancel_as_planned(ctx, stop)
        finally:
            ctx.close()

    def _cancel_as_planned(self, ctx: Context, stop: threading.Event) -> None:
        seen: dict[str, float] = {}
        while not stop.is_set():
            plan = dict(self.cancel_plan)
            with self.sessions() as session:  # one query a round: a stage can last well under a second
                rows = {job.id: (job.status, job.frames_done)
                        for job in session.scalars(select(Job).where(Job.id.in_(list(plan))))}
            for job_id, (stage, delay) in plan.items():
                status, frames_done = rows[job_id]
                seen.setdefault(job_id, time.monotonic())
                if status in DONE_JOB_STATUSES:
                    del self.cancel_plan[job_id]  # it ended before its stage came
                    continue
                due = {"queued": status == JobStatus.QUEUED,
                       "preparing": status == JobStatus.PREPARING,
                       "running": status == JobStatus.RUNNING and frames_done > 0,
                       "delay": time.monotonic() - seen[job_id] >= delay}[stage]
                if due:
                    with self.sessions() as session:
                        try:
                            cancel_job(ctx=ctx, session=session, job_id=job_id)
                            self.cancelled_at[stage] += 1
                        except Conflict:
                            pass  # it ended in between
                    del self.cancel_plan[job_id]
            time.sleep(0.05)

    def counts(self) -> Counter[str]:
        with self.sessions() as session:
            return Counter(j.status for j in queries.list_jobs(session=session, limit=10 ** 6))

    def sample(self, store: FeatureStore, dbs: dict[str, redis.Redis]) -> None:
        for name, pid in self.cluster.pids().items():
            mb = group_rss_mb(pid)
            if mb is not None:
                self.rss[name][-1].append((self.now(), mb))
        for name, client in {"features": store.client, **dbs}.items():
            self.redis_keys_peak[name] = max(self.redis_keys_peak.get(name, 0), client.dbsize())

    def start(self, name: str) -> None:
        self.cluster.start("gpu" if name in GPU else "cpu", name)
        self.lives[name].append(utcnow())

    def chaos(self, ended: int, store: FeatureStore) -> None:
        for share, what, name, restart_after in CHAOS:
            key = f"{what} {name}"
            if any(e["what"] == key for e in self.events) or ended < share * self.args.jobs:
                continue
            if what == "kill":
                held = self.held_by(name)
                self.cluster.kill(name)
                if name in GPU:
                    self.recovery[key] = {"killed_at": utcnow(), "held": held, "again_s": {}, "ended": []}
                self.rss[name].append([])  # its next process's samples
                self.restarts.append((time.monotonic() + restart_after, name))
            else:
                store.client.flushdb()
            self.events.append({"what": key, "at_s": self.now(), "jobs_ended": ended})
        for when, name in list(self.restarts):
            if time.monotonic() >= when:
                self.restarts.remove((when, name))
                self.start(name)
                self.events.append({"what": f"start {name}", "at_s": self.now(), "jobs_ended": ended})

    def held_by(self, name: str) -> dict[str, int]:
        """The jobs a GPU worker has claimed now: id -> attempts."""
        node = self.cluster.node(name)
        with self.sessions() as session:
            rows = session.execute(select(Job.id, Job.attempts).where(
                Job.worker == node, Job.status.in_((JobStatus.PREPARING, JobStatus.RUNNING))))
            return {str(job_id): int(attempts) for job_id, attempts in rows.tuples()}

    def watch_recovery(self) -> None:
        """For each killed GPU worker's jobs: when a next attempt claimed it (seconds after the kill, from
        the row's `started_at`), or that it ended without one (cancelled meanwhile)."""
        for kill in self.recovery.values():
            waiting = [j for j in kill["held"] if j not in kill["again_s"] and j not in kill["ended"]]
            if not waiting:
                continue
            with self.sessions() as session:
                rows = session.scalars(select(Job).where(Job.id.in_(waiting))).all()
            for job in rows:
                if job.attempts > kill["held"][job.id] and job.started_at is not None:
                    kill["again_s"][job.id] = round(
                        (_aware(job.started_at) - kill["killed_at"]).total_seconds(), 1)
                elif job.status in DONE_JOB_STATUSES:
                    kill["ended"].append(job.id)

    def recovery_report(self) -> dict[str, Any]:
        out = {}
        for key, kill in self.recovery.items():
            again = sorted(kill["again_s"].values())
            out[key] = {"held": len(kill["held"]), "ran_again": len(again),
                        "ended_before_running_again": len(kill["ended"]),
                        "again_s_min": again[0] if again else None,
                        "again_s_median": again[len(again) // 2] if again else None,
                        "again_s_max": again[-1] if again else None}
        return out

    # -- checks ------------------------------------------------------------------------------------------
    def finish_checks(self, store: FeatureStore, dbs: dict[str, redis.Redis]) -> dict[str, Any]:
        counts = self.counts()
        with self.sessions() as session:
            jobs = queries.list_jobs(session=session, limit=10 ** 6)
            referenced = queries.referenced_paths(session=session)
            pins = sum(w.pinned for w in session.query(WorkerVoice))
            installs = queries.list_install_events(session=session)
        succeeded = [j for j in jobs if j.status == JobStatus.SUCCEEDED]
        logs = "".join(self.cluster.log_text(n) for n in GPU)
        said = Counter(SUCCEEDED.findall(logs))
        feature_keys = list(store.client.scan_iter(match=f"{PREFIX}:feat:*"))
        ttls = [store.client.ttl(k) for k in feature_keys]
        without_ttl = [f"{name}: {k.decode()}" for name, client in dbs.items() for k in client.scan_iter()
                       if client.ttl(k) < 0 and not (name == "broker" and KOMBU_FIXED.match(k.decode()))]
        return {
            "submitted": len(self.jobs), "completed": counts[JobStatus.SUCCEEDED],
            "cancelled": counts[JobStatus.CANCELLED], "failed": counts[JobStatus.FAILED],
            "not_finished": len(self.jobs) - sum(counts[s] for s in DONE_JOB_STATUSES),
            "succeeded_twice": sorted(j for j, n in said.items() if n > 1),
            "succeeded_unsaid": len({j.id for j in succeeded} - set(said)),
            "cancelled_at_stage": dict(sorted(self.cancelled_at.items())),
            "attempts": dict(sorted(Counter(j.attempts for j in jobs).items())),
            "prep_paths": dict(sorted(Counter(j.prep_path or "" for j in succeeded).items())),
            "routes": dict(sorted(Counter(j.route or "" for j in jobs).items())),
            "ran_on": dict(sorted(Counter((j.worker or "").split("@")[0] for j in succeeded).items())),
            "installs": dict(sorted(Counter(e.worker_id.split("@")[0] for e in installs).items())),
            "succeeded_without_file": sum(1 for j in succeeded if not j.output_path
                                          or not self.artifacts.path(j.output_path).is_file()),
            "orphan_files": [str(p.relative_to(self.artifacts.root)) for p in
                             self.artifacts.list_orphans(referenced=referenced, older_than_s=0)],
            "pins": pins, "voices": self.args.voices, "feature_keys": len(feature_keys),
            "feature_keys_without_ttl": sum(1 for t in ttls if t < 0),
            "keys_without_ttl": without_ttl[:20], "redis_keys_peak": self.redis_keys_peak,
            "redis_keys_end": {name: c.dbsize() for name, c in {"features": store.client, **dbs}.items()},
        }

    def rss_report(self, jobs: list[Any]) -> dict[str, Any]:
        """Per worker, the process that did the most: for a GPU worker the one that started the most jobs
        (a process started again near the end is still warming up), for a CPU worker the longest-lived.
        Its RSS half-way through its life (the first half is its warm-up: voices installed, lanes grown
        to its slots), the peak after that and at the end, and every fifth sample (one a second). Its
        other processes are listed by their sample counts and jobs."""
        out: dict[str, Any] = {}
        for name, lives in self.rss.items():
            node = self.cluster.node(name)
            bounds = [*self.lives[name][1:], None]
            ran = [sum(1 for j in jobs if j.worker == node and j.started_at is not None
                       and _aware(j.started_at) >= start and (end is None or _aware(j.started_at) < end))
                   for start, end in zip(self.lives[name], bounds, strict=True)]
            pick = max(range(len(lives)), key=lambda i: (ran[i], len(lives[i])) if name in GPU
                       else (len(lives[i]), ran[i]))
            samples = lives[pick]
            if len(samples) < 8:
                out[name] = {"samples": len(samples)}
                continue
            warm = samples[len(samples) // 2][1]
            peak = max(mb for _, mb in samples[len(samples) // 2:])
            out[name] = {"since_s": samples[0][0], "warm_mb": round(warm, 1),
                         "peak_after_warm_mb": round(peak, 1), "end_mb": round(samples[-1][1], 1),
                         "growth_pct": round(100 * (peak - warm) / warm, 1), "samples": len(samples),
                         "processes_samples": [len(life) for life in lives],
                         "processes_jobs": ran if name in GPU else None, "process": pick,
                         "series_mb": [[t, round(mb)] for t, mb in samples[::5]]}  # every 5th sample
        return out

    # -- the run -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.services.start()
        upgrade(self.settings.database_url)
        db_engine = make_engine(self.settings.database_url)
        self.sessions = make_sessionmaker(db_engine)
        self.artifacts.ensure_layout()
        store = FeatureStore.from_url(self.settings.feature_store_url, ttl_s=self.settings.feature_ttl_s)
        dbs = {"results": redis.Redis.from_url(self.settings.result_backend)}  # and a Redis broker's
        if self.args.broker == "redis":
            dbs["broker"] = redis.Redis.from_url(self.settings.broker_url)
        stop = threading.Event()
        report: dict[str, Any] = {}
        try:
            for name in (*GPU, *CPU):
                self.start(name)
            self.cluster.wait_ready()
            self.wait_live_gpu_workers()
            self.t0 = time.monotonic()
            threads = [threading.Thread(target=self.canceller, args=(stop,), daemon=True),
                       threading.Thread(target=self.submit_all, daemon=True)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + self.args.timeout_s
            while time.monotonic() < deadline:
                time.sleep(1.0)
                ended = sum(n for s, n in self.counts().items() if s in DONE_JOB_STATUSES)
                self.sample(store, dbs)
                self.chaos(ended, store)
                self.watch_recovery()
                if not threads[1].is_alive() and ended == len(self.jobs) and not self.restarts:
                    break
            report["elapsed_s"] = self.now()
            stop.set()
            time.sleep(2.0)  # the workers' bookkeeping threads settle (unpins)
            report.update(self.finish_checks(store, dbs))
            self.watch_recovery()
            report["recovery"] = self.recovery_report()
            with self.sessions() as session:
                report["rss"] = self.rss_report(queries.list_jobs(session=session, limit=10 ** 6))
        finally:
            stop.set()
            store.close()
            self.cluster.stop_all()
            db_engine.dispose()
            for client in dbs.values():
                client.close()
            self.services.stop()
        report.update(events=self.events, settings={
            "jobs": self.args.jobs, "voices": self.args.voices, "slots": self.args.slots,
            "tokens": [self.args.min_tokens, self.args.max_tokens], "broker": self.args.broker,
            "database": "postgresql" if self.args.postgres else "sqlite",
            "cancel_fraction": self.args.cancel_fraction, "submit_interval_s": self.args.submit_interval_s,
            "visibility_timeout_s": self.settings.visibility_timeout_s,
            "stuck_job_after_s": self.settings.stuck_job_after_s,
            "maintenance_interval_s": self.settings.maintenance_interval_s})
        report["checks"] = checks(report)
        report["workdir"] = str(self.work)
        return report

    def wait_live_gpu_workers(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.sessions() as session:
                live = queries.live_workers(session=session,
                                            beat_after=utcnow() - timedelta(seconds=LIVE_BEAT_S))
            if len(live) == len(GPU):
                return
            time.sleep(0.2)
        raise RuntimeError(f"GPU workers' heartbeats not seen\n{self.cluster.tails()}")


def _aware(when: datetime) -> datetime:
    """A database timestamp as an aware UTC datetime (SQLite hands them back naive)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def checks(report: dict[str, Any]) -> dict[str, bool]:
    rss = report["rss"]
    return {
        "all_accounted": report["completed"] + report["cancelled"] + report["failed"] == report["submitted"],
        "none_succeeded_twice": not report["succeeded_twice"],
        "nothing_done_without_file": report["succeeded_without_file"] == 0,
        "no_orphan_files": not report["orphan_files"],
        "no_pins": report["pins"] == 0,
        "redis_keys_bounded": report["feature_keys"] <= report["voices"]
        and report["feature_keys_without_ttl"] == 0 and not report["keys_without_ttl"],
        "rss_flat_10pct": all("growth_pct" in v and abs(v["growth_pct"]) <= 10 for v in rss.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--voices", type=int, default=40)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--min-tokens", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--slots", type=int, default=4, help="each GPU worker's slots (and micro-batch)")
    parser.add_argument("--submit-interval-s", type=float, default=0.25)
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    parser.add_argument("--postgres", action="store_true", help="a PostgreSQL database on 127.0.0.1:5432 "
                        "(made for the run, dropped after it) instead of a SQLite file")
    parser.add_argument("--redis-port", type=int, default=6391, help="this port and the next one")
    parser.add_argument("--timeout-s", type=float, default=2400.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="also write the JSON report here")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (logs, database, files)")
    args = parser.parse_args(argv)
    for tool in ("redis-server", *(["rabbitmqctl"] if args.broker == "rabbitmq" else [])):
        if shutil.which(tool) is None:
            print(f"soak: needs {tool} on PATH", file=sys.stderr)
            return 2
    soak = Soak(args)
    report = soak.run()
    text_out = json.dumps(report, indent=2, sort_keys=True)
    print(text_out)
    if args.report:
        args.report.write_text(text_out + "\n")
    if not args.keep:
        shutil.rmtree(soak.work, ignore_errors=True)
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
