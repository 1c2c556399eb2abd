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
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.settings import Settings  # noqa: E402
from app.store import FeatureStore  # noqa: E402
from gpu_worker.runtime import StoreFeatures, build_engine  # noqa: E402
from gpu_worker.streams import EngineJob, Failed, Finished  # noqa: E402
from scripts.service_stack import bench_settings, flush_redis, running_stack  # noqa: E402

SAMPLES = REPO / "app" / "samples"
PORT = 8765


def job_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings_for(root: Path, preset: str, slots: int, threads: int) -> Settings:
    return bench_settings(root, preset=preset, slots=slots, threads=threads, redis_dbs=(5, 6, 7),
                          queue="bench")


def run_http_jobs(client: httpx.Client, voices: list[str], n_jobs: int, n_tokens: int, seed0: int) -> float:
    """Submit n_jobs at once, wait for every one to succeed; returns wall seconds."""
    start = time.perf_counter()
    ids = []
    for i in range(n_jobs):
        body = {"voice_id": voices[i % len(voices)], "tokens": job_tokens(n_tokens, seed0 + i),
                "seed": seed0 + i}
        response = client.post("/v1/jobs", json=body)
        response.raise_for_status()
        ids.append(response.json()["id"])
    pending = set(ids)
    while pending:
        for job_id in list(pending):
            status = client.get(f"/v1/jobs/{job_id}").json()["status"]
            if status == "succeeded":
                pending.discard(job_id)
            elif status in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} ended {status}")
        time.sleep(0.05)
    return time.perf_counter() - start


def run_engine_jobs(engine, voices: list[str], n_jobs: int, n_tokens: int, seed0: int) -> float:
    start = time.perf_counter()
    jobs = [EngineJob(f"e{seed0}-{i}", voices[i % len(voices)], job_tokens(n_tokens, seed0 + i), seed0 + i)
            for i in range(n_jobs)]
    for job in jobs:
        engine.add(job)
    ended: set[str] = set()
    while len(ended) < n_jobs:
        for event in engine.step():
            if isinstance(event, Failed):
                raise RuntimeError(f"engine job {event.job_id} failed: {event.error}")
            if isinstance(event, Finished):
                ended.add(event.job_id)
    return time.perf_counter() - start


def service_run(settings: Settings, args: argparse.Namespace,
                logs: Path) -> tuple[list[str], dict[int, float]]:
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


def engine_run(settings: Settings, voices: list[str], args: argparse.Namespace) -> dict[int, float]:
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)

    class NoInline:
        def prepare(self, job: EngineJob):
            raise RuntimeError("features must be in the store (prepared by the service run)")

    engine = build_engine(settings, StoreFeatures(store), NoInline())
    walls: dict[int, float] = {}

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
        rows.append({"concurrency": c, "service_s": round(service[c], 3), "engine_s": round(engine[c], 3),
                     "service_jobs_per_min": round(60 * c / service[c], 2),
                     "service_frames_per_s": round(frames[c] / service[c], 1),
                     "engine_frames_per_s": round(frames[c] / engine[c], 1),
                     "service_over_engine": round(engine[c] / service[c], 3)})
    print(f"preset {args.preset}, {args.tokens} tokens per job, dummy weights, torch threads "
          f"{args.threads or 'default'}, {os.cpu_count()} cores")
    print("C  service s  engine s  jobs/min  service fps  engine fps  service/engine")
    for r in rows:
        print(f"{r['concurrency']:<3}{r['service_s']:>9}{r['engine_s']:>10}{r['service_jobs_per_min']:>10}"
              f"{r['service_frames_per_s']:>13}{r['engine_frames_per_s']:>12}{r['service_over_engine']:>16}")
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
