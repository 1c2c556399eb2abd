"""Service overhead: the same jobs through the whole service and through the engine alone, one run.

    python scripts/bench_service.py [--preset full|tiny] [--concurrency 1,4,8] [--tokens 100] [--json OUT]

Service: a real API server (uvicorn), CPU worker and GPU worker (subprocesses, dummy weights, SQLite,
the local Redis on databases 5-7), jobs submitted over HTTP and followed until their files exist.
Engine alone: the GPU worker's engine built in this process with the same settings, fed the same
jobs directly. Both start with the voices prepared and installed (a warm-up job per voice), so the
ratio is what the transport (HTTP, database, broker, task threads, files) costs on top of decoding.
Prints a table; `--json` writes the numbers with the machine, the command and the git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.settings import Settings  # noqa: E402
from app.store import FeatureStore  # noqa: E402
from gpu_worker.runtime import StoreFeatures, build_engine  # noqa: E402
from gpu_worker.streams import Audio, EngineJob, Failed, Finished  # noqa: E402
from scripts.service_stack import bench_settings, flush_redis, running_stack  # noqa: E402

SAMPLES = REPO / "app" / "samples"
PORT = 8765


def job_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings_for(root: Path, preset: str, slots: int, threads: int) -> Settings:
    return bench_settings(root, preset=preset, slots=slots, threads=threads, redis_dbs=(5, 6, 7),
                          queue="bench")


def run_http_jobs(client: httpx.Client, voices: list[str], n_jobs: int, n_tokens: int,
                  seed0: int) -> tuple[float, dict[str, float]]:
    """Submit n_jobs at once, wait for every one to succeed; returns wall seconds and `phases`: seconds
    from the first submission until the last POST returned, and (the jobs' recorded timings) until the
    first and the last job started, the first and the last first audio, and the last job finished."""
    start, epoch = time.perf_counter(), time.time()
    ids = []
    for i in range(n_jobs):
        body = {"voice_id": voices[i % len(voices)], "tokens": job_tokens(n_tokens, seed0 + i),
                "seed": seed0 + i}
        response = client.post("/v1/jobs", json=body)
        response.raise_for_status()
        ids.append(response.json()["id"])
    posted = time.perf_counter() - start
    pending = set(ids)
    while pending:
        for job_id in list(pending):
            status = client.get(f"/v1/jobs/{job_id}").json()["status"]
            if status == "succeeded":
                pending.discard(job_id)
            elif status in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} ended {status}")
        time.sleep(0.05)
    wall = time.perf_counter() - start
    timings = [client.get(f"/v1/jobs/{job_id}").json()["timings"] for job_id in ids]

    def at(key: str) -> list[float]:
        return [datetime.fromisoformat(t[key]).replace(tzinfo=UTC).timestamp() - epoch for t in timings]

    phases = {"posted": posted, "first_started": min(at("started_at")), "last_started": max(at("started_at")),
              "first_audio_first": min(at("first_audio_at")), "first_audio_last": max(at("first_audio_at")),
              "last_finished": max(at("finished_at"))}
    return wall, {k: round(v, 3) for k, v in phases.items()}


def run_engine_jobs(engine, voices: list[str], n_jobs: int, n_tokens: int,
                    seed0: int) -> tuple[float, dict[str, float]]:
    """The same jobs added to the engine at once; wall seconds and phases as `run_http_jobs`'s (from the
    engine's own events: first audio and the last finish)."""
    start = time.perf_counter()
    jobs = [EngineJob(f"e{seed0}-{i}", voices[i % len(voices)], job_tokens(n_tokens, seed0 + i), seed0 + i)
            for i in range(n_jobs)]
    for job in jobs:
        engine.add(job)
    first_audio: dict[str, float] = {}
    ended: set[str] = set()
    while len(ended) < n_jobs:
        for event in engine.step():
            if isinstance(event, Failed):
                raise RuntimeError(f"engine job {event.job_id} failed: {event.error}")
            if isinstance(event, Audio) and event.chunk_index == 0:
                first_audio[event.job_id] = time.perf_counter() - start
            if isinstance(event, Finished):
                ended.add(event.job_id)
    wall = time.perf_counter() - start
    phases = {"first_audio_first": min(first_audio.values()), "first_audio_last": max(first_audio.values()),
              "last_finished": wall}
    return wall, {k: round(v, 3) for k, v in phases.items()}


def service_run(settings: Settings, args: argparse.Namespace,
                logs: Path) -> tuple[list[str], dict[int, tuple[float, dict[str, float]]]]:
    with running_stack(settings, logs, PORT), \
            httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60) as client:
        voices = []
        for name in ("voice_a.wav", "voice_b.wav"):
            files = {"file": (name, (SAMPLES / name).read_bytes(), "audio/wav")}
            response = client.post("/v1/voices", files=files)
            response.raise_for_status()
            voices.append(response.json()["id"])
        run_http_jobs(client, voices, 2, 30, seed0=1)  # warm-up: prepare and install both voices
        walls = {c: run_http_jobs(client, voices, c, args.tokens, seed0=100 * c)
                 for c in args.concurrency}
    return voices, walls


def engine_run(settings: Settings, voices: list[str],
               args: argparse.Namespace) -> dict[int, tuple[float, dict[str, float]]]:
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)

    class NoInline:
        def prepare(self, job: EngineJob):
            raise RuntimeError("features must be in the store (prepared by the service run)")

    engine = build_engine(settings, StoreFeatures(store), NoInline())
    walls: dict[int, tuple[float, dict[str, float]]] = {}

    def body() -> None:  # the worker steps its engine in a thread too
        with torch.inference_mode():
            run_engine_jobs(engine, voices, 2, 30, seed0=1)  # the same warm-up
            walls.update({c: run_engine_jobs(engine, voices, c, args.tokens, seed0=100 * c)
                          for c in args.concurrency})

    thread = threading.Thread(target=body, name="bench-engine")
    thread.start()
    thread.join()
    return walls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=100, help="speech tokens per job (25 per second)")
    parser.add_argument("--threads", type=int, default=0, help="engine CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    slots = max(args.concurrency)
    root = Path(tempfile.mkdtemp(prefix="wavefarm-bench-service-"))
    settings = settings_for(root, args.preset, slots, args.threads)
    logs = root / "logs"
    logs.mkdir(parents=True)
    flush_redis(settings)  # this benchmark's own Redis databases (5-7)
    voices, service = service_run(settings, args, logs)
    engine = engine_run(settings, voices, args)
    frames = {c: c * args.tokens * 2 for c in args.concurrency}  # mel frames: 50 per second of audio
    rows = []
    for c in args.concurrency:
        (service_s, service_phases), (engine_s, engine_phases) = service[c], engine[c]
        rows.append({"concurrency": c, "service_s": round(service_s, 3), "engine_s": round(engine_s, 3),
                     "service_jobs_per_min": round(60 * c / service_s, 2),
                     "service_frames_per_s": round(frames[c] / service_s, 1),
                     "engine_frames_per_s": round(frames[c] / engine_s, 1),
                     "service_over_engine": round(engine_s / service_s, 3),
                     "service_phases_s": service_phases, "engine_phases_s": engine_phases})
    print(f"preset {args.preset}, {args.tokens} tokens per job, dummy weights, torch threads "
          f"{args.threads or 'default'}, {os.cpu_count()} cores")
    print("C  service s  engine s  jobs/min  service fps  engine fps  service/engine")
    for r in rows:
        print(f"{r['concurrency']:<3}{r['service_s']:>9}{r['engine_s']:>10}{r['service_jobs_per_min']:>10}"
              f"{r['service_frames_per_s']:>13}{r['engine_frames_per_s']:>12}{r['service_over_engine']:>16}")
    print("seconds from the first submission (service: the jobs' recorded timings; engine: its events)")
    for r in rows:
        print(f"C={r['concurrency']:<3} service {r['service_phases_s']}")
        print(f"      engine  {r['engine_phases_s']}")
    if args.json:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout
        report = {"command": " ".join(sys.argv), "git": revision.strip(),
                  "machine": platform.uname()._asdict(),
                  "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "preset": args.preset, "tokens_per_job": args.tokens, "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
