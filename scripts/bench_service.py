"""Service overhead: the same jobs through the whole service and through the engine alone, one run.

    python scripts/bench_service.py [--preset full|tiny] [--concurrency 1,4,8] [--tokens 100] [--rounds 3]
                                    [--poll-s 0.5] [--json OUT]

Service: a real API server (uvicorn), CPU worker and GPU worker (subprocesses, dummy weights, SQLite,
the local Redis on databases 5-7), jobs submitted over HTTP and polled, as the CLI polls, until they
succeed. Engine alone: the GPU worker's engine built in this process with the same settings, fed the
same jobs directly. Both start with the voices prepared and installed (a warm-up job per voice), so the
ratio is what the transport (HTTP, database, broker, task threads, files) costs on top of decoding.

The two halves take turns: each round runs every concurrency through the service, then through the
engine, so a machine whose speed drifts over minutes (a shared VM does) slows both alike; the table
gives each concurrency's median over the rounds. A service run's time is from the first POST to the
last job's recorded `finished_at`, not to the poll that saw it, so the poll interval does not enter it.
Prints a table; `--json` writes every round with the machine, the command and the git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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

from app.dev import SAMPLES  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.speech import VOCAB_SIZE  # noqa: E402
from app.storage.feature_store import FeatureStore  # noqa: E402
from gpu_worker.engine.streams import Audio, EngineJob, Failed, Finished  # noqa: E402
from gpu_worker.worker.adapters import StoreFeatures  # noqa: E402
from gpu_worker.worker.runtime import build_engine  # noqa: E402
from scripts.service_stack import bench_settings, flush_redis, running_stack  # noqa: E402

PORT = 8765


def job_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings_for(root: Path, preset: str, slots: int, threads: int) -> Settings:
    return bench_settings(root, preset=preset, slots=slots, threads=threads, redis_dbs=(5, 6, 7),
                          queue="bench")


def run_http_jobs(client: httpx.Client, voices: list[str], n_jobs: int, n_tokens: int,
                  seed0: int, poll_s: float) -> tuple[float, dict[str, float]]:
    """Submit n_jobs at once, poll every `poll_s` until every one succeeded; returns the seconds from the
    first submission to the last recorded finish, and `phases`: seconds from the first submission until
    the last POST returned, and (the jobs' recorded timings) until the first and the last job started,
    the first and the last first audio, and the last job finished."""
    epoch = time.time()
    start = time.perf_counter()
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
        time.sleep(poll_s)
        for job_id in list(pending):
            status = client.get(f"/v1/jobs/{job_id}").json()["status"]
            if status == "succeeded":
                pending.discard(job_id)
            elif status in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} ended {status}")
    timings = [client.get(f"/v1/jobs/{job_id}").json()["timings"] for job_id in ids]

    def at(key: str) -> list[float]:
        return [datetime.fromisoformat(t[key]).replace(tzinfo=UTC).timestamp() - epoch for t in timings]

    phases = {"posted": posted, "first_started": min(at("started_at")), "last_started": max(at("started_at")),
              "first_audio_first": min(at("first_audio_at")), "first_audio_last": max(at("first_audio_at")),
              "last_finished": max(at("finished_at"))}
    return phases["last_finished"], {k: round(v, 3) for k, v in phases.items()}


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
        engine.fetch_features()
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


Runs = dict[int, list[tuple[float, dict[str, float]]]]  # concurrency -> (seconds, phases) per round


def upload_voices(client: httpx.Client) -> list[str]:
    voices = []
    for name in ("voice_a.wav", "voice_b.wav"):
        files = {"file": (name, (SAMPLES / name).read_bytes(), "audio/wav")}
        response = client.post("/v1/voices", files=files)
        response.raise_for_status()
        voices.append(response.json()["id"])
    return voices


def in_engine_thread(work):
    """Run `work()` in a thread under inference mode, as the worker steps its engine in a thread."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(torch.inference_mode()(work)()), name="bench-engine")
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the engine half failed (traceback above)")
    return out[0]


def interleaved(settings: Settings, args: argparse.Namespace, logs: Path) -> tuple[Runs, Runs]:
    """Rounds of: every concurrency through the service, then every concurrency through the engine."""
    service: Runs = {c: [] for c in args.concurrency}
    engine_runs: Runs = {c: [] for c in args.concurrency}
    with running_stack(settings, logs, PORT), \
            httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60) as client:
        voices = upload_voices(client)
        run_http_jobs(client, voices, 2, 30, seed0=1, poll_s=args.poll_s)  # warm-up: prepare and install
        store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)

        class NoInline:
            def prepare(self, job: EngineJob):
                raise RuntimeError("features must be in the store (prepared by the service run)")

        engine = build_engine(settings, StoreFeatures(store), NoInline())
        in_engine_thread(lambda: run_engine_jobs(engine, voices, 2, 30, seed0=1))  # the same warm-up
        for r in range(args.rounds):
            for c in args.concurrency:
                service[c].append(run_http_jobs(client, voices, c, args.tokens, seed0=100 * c + r,
                                                poll_s=args.poll_s))
            for c in args.concurrency:
                engine_runs[c].append(in_engine_thread(
                    lambda c=c, r=r: run_engine_jobs(engine, voices, c, args.tokens, seed0=100 * c + r)))
            ratios = (f"C={c} {engine_runs[c][-1][0] / service[c][-1][0]:.3f}" for c in args.concurrency)
            print(f"round {r + 1} (service/engine): " + ", ".join(ratios), flush=True)
        store.close()
    return service, engine_runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=100, help="speech tokens per job (25 per second)")
    parser.add_argument("--threads", type=int, default=0, help="engine CPU threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved service/engine rounds")
    parser.add_argument("--poll-s", type=float, default=0.5, help="the client's status poll (the CLI's: 0.5)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    slots = max(args.concurrency)
    root = Path(tempfile.mkdtemp(prefix="wavefarm-bench-service-"))
    settings = settings_for(root, args.preset, slots, args.threads)
    logs = root / "logs"
    logs.mkdir(parents=True)
    flush_redis(settings)  # this benchmark's own Redis databases (5-7)
    service, engine = interleaved(settings, args, logs)
    frames = {c: c * args.tokens * 2 for c in args.concurrency}  # mel frames: 50 per second of audio
    rows = []
    for c in args.concurrency:
        service_s = statistics.median(s for s, _ in service[c])
        engine_s = statistics.median(s for s, _ in engine[c])
        rows.append({"concurrency": c, "service_s": round(service_s, 3), "engine_s": round(engine_s, 3),
                     "service_jobs_per_min": round(60 * c / service_s, 2),
                     "service_frames_per_s": round(frames[c] / service_s, 1),
                     "engine_frames_per_s": round(frames[c] / engine_s, 1),
                     "service_over_engine": round(engine_s / service_s, 3),
                     "rounds": [{"service_s": round(ss, 3), "engine_s": round(es, 3),
                                 "service_over_engine": round(es / ss, 3), "service_phases_s": sp,
                                 "engine_phases_s": ep}
                                for (ss, sp), (es, ep) in zip(service[c], engine[c], strict=True)]})
    print(f"preset {args.preset}, {args.tokens} tokens per job, dummy weights, torch threads "
          f"{args.threads or 'default'}, {os.cpu_count()} cores")
    print("C  service s  engine s  jobs/min  service fps  engine fps  service/engine")
    for r in rows:
        print(f"{r['concurrency']:<3}{r['service_s']:>9}{r['engine_s']:>10}{r['service_jobs_per_min']:>10}"
              f"{r['service_frames_per_s']:>13}{r['engine_frames_per_s']:>12}{r['service_over_engine']:>16}")
    per_round = (f"C={r['concurrency']} " + " ".join(str(x["service_over_engine"]) for x in r["rounds"])
                 for r in rows)
    print(f"medians over {args.rounds} interleaved rounds; per round (service/engine): "
          + "; ".join(per_round))
    print("seconds from the first submission, round 1 (service: the jobs' recorded timings; engine: its "
          "events)")
    for r in rows:
        print(f"C={r['concurrency']:<3} service {r['rounds'][0]['service_phases_s']}")
        print(f"      engine  {r['rounds'][0]['engine_phases_s']}")
    if args.json:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout
        report = {"command": " ".join(sys.argv), "git": revision.strip(),
                  "machine": platform.uname()._asdict(),
                  "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "preset": args.preset, "tokens_per_job": args.tokens, "rounds": args.rounds,
                  "poll_s": args.poll_s, "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
