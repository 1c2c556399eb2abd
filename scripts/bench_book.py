"""Book throughput through the real service, and where a book's wall time goes.

    python scripts/bench_book.py [--preset tiny|full] [--segments 20] [--tokens 250] [--slots 4]
                                 [--threads 1] [--json OUT]

Starts a real API server, CPU worker and GPU worker (scripts/service_stack.py: dummy weights, SQLite
unless --database-url, the local Redis on databases 8, 9 and 14, emptied first), waits until both
workers answer, renders a small warm-up book in another voice, then two books of one chapter of
`--segments` token segments (`--tokens` each, 25 per second of audio; the manifest of
tests/integration/test_book_render.py's token_manifest) over HTTP:

1. "new voice": multipart upload of the book and of app/dev/samples/voice_a.wav, a voice this service has
   never prepared nor installed, so the book includes its preparation (CPU worker host half, the GPU
   worker's wait for it and its device-half install);
2. "prepared voice": other tokens in the same voice (JSON manifest + voice_id): already installed.

Every phase comes from what the system records, read back after each book: the books, book_chapters,
voices and jobs rows (timestamps), the synth tasks' results in the result backend (per-job engine
timings: prep_wait_s from admission to the voice being ready, install_s for the job its voice was
installed for) and the Redis prep-path counters. The book's wall time (from the client's POST to
`books.finished_at`) is split into consecutive phases that add up to it:

    submit -> GPU      POST, book.plan on the CPU worker, the broker, until the GPU worker claims the
                       book's first segment job (jobs.started_at)
    voice on GPU       from that claim until the voice is ready on the GPU worker (the claim of the job
                       it was installed for + its prep_wait_s): waiting for the host features, then the
                       device half (install_s: S3 tokens, speaker embedding, setup solve)
    decoding           from the voice being ready until the last segment job finished
    assembly           the last segment finished -> chapter file (book.chapter polls every second) ->
                       book.m4b and the index (books.finished_at)

"preparation" is the voice-on-GPU phase; the CPU worker's host half (voices.prepare_started_at ->
prepared_at) is reported beside it, with whether it finished before the GPU worker needed it (then it
overlapped submit -> GPU). "other" is submit -> GPU plus assembly. Prints a table; `--json` writes the
records, the reports, the command, the git revision and the load average before and after each book.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app.dev import SAMPLES  # noqa: E402
from app.speech import TOKEN_RATE, VOCAB_SIZE  # noqa: E402

PORT = 8766
REDIS_DBS = (8, 9, 14)  # broker, results, features: not the tests' (10-13) nor bench_service's (5-7)
DONE = ("succeeded", "failed", "cancelled")


def token_manifest(chapters: int, segments: int, tokens: int, salt: int) -> dict[str, Any]:
    """The integration test's token book: distinct segments (no repeats), keys new for a new salt."""
    return {"title": f"Tokens {salt}", "chapters": [
        {"title": f"Part {c + 1}", "segments": [
            {"tokens": [(salt * 7919 + c * 1009 + s * 31 + i) % VOCAB_SIZE for i in range(tokens)]}
            for s in range(segments)]} for c in range(chapters)]}


# -- the report: pure functions of the recorded times (epoch seconds) --------------------------------

def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole > 0 else 0.0


def build_report(record: dict[str, Any]) -> dict[str, Any]:
    """One book's record (see `collect`) -> wall, audio, throughput and the phases of the wall time."""
    t0, book, jobs, voice = record["client_t0"], record["book"], record["jobs"], record["voice"]
    if not jobs:
        raise ValueError("the book rendered no segment jobs (every segment was already rendered?)")
    end = book["finished_at"]
    wall = end - t0
    audio_s = sum(j["n_tokens"] for j in jobs) / TOKEN_RATE
    first_claim = min(j["started_at"] for j in jobs)
    # The voice is ready on the GPU worker when the job it was installed for starts (claim + prep_wait_s,
    # which runs from the job's admission: the engine was idle, waiting for the voice, so admission
    # follows the claim at once). Jobs admitted later may have waited behind a step before admission,
    # so their own claim + prep_wait_s is earlier than the moment they started: not used for this.
    installing = [j for j in jobs if "install_s" in j["timings"]] or jobs
    ready = min(j["started_at"] + j["timings"].get("prep_wait_s", 0.0) for j in installing)
    last_done = max(j["finished_at"] for j in jobs)
    chapters_done = max((c["assembled_at"] for c in record["chapters"]), default=end)
    install_s = sum(j["timings"].get("install_s", 0.0) for j in jobs)
    phases = {"submit_to_gpu": first_claim - t0, "voice_on_gpu": ready - first_claim,
              "decoding": last_done - ready, "assembly": end - last_done}
    started = voice.get("prepare_started_at")
    prepared_here = started is not None and started >= t0  # prepared for this book, not before it
    host = None
    if prepared_here:
        host = {"queued_s": round(started - t0, 3),
                "span_s": round(voice["prepared_at"] - started, 3),  # read reference, host half, store, db
                "host_half_ms": voice.get("prepare_ms"),
                "done_before_gpu_claim": voice["prepared_at"] <= first_claim}
    summary = {"preparation": phases["voice_on_gpu"], "decoding": phases["decoding"],
               "other": phases["submit_to_gpu"] + phases["assembly"]}
    return {
        "label": record["label"], "segments": len(jobs), "wall_s": round(wall, 3),
        "audio_s": round(audio_s, 3),
        "audio_min_per_wall_min": round(audio_s / wall, 3) if wall > 0 else None,
        "first_audio_s": round(min(j["first_audio_at"] for j in jobs) - t0, 3),
        # the integration test's definition: books.started_at (book.plan ran) -> finished_at
        "started_to_finished_s": round(end - book["started_at"], 3),
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "phase_shares": {k: _share(v, wall) for k, v in phases.items()},
        "summary_s": {k: round(v, 3) for k, v in summary.items()},
        "summary_shares": {k: _share(v, wall) for k, v in summary.items()},
        "assembly_s": {"chapters": round(chapters_done - last_done, 3),
                       "book": round(end - chapters_done, 3)},
        "install_s": round(install_s, 3),
        "gpu_wait_for_features_s": round(phases["voice_on_gpu"] - install_s, 3),
        "host_half": host,
        "decode_audio_min_per_min": (round(audio_s / phases["decoding"], 3) if phases["decoding"] > 0
                                     else None),
        "prep_paths": {k: v for k, v in record.get("prep_paths", {}).items() if v},
        "attempts": sum(j.get("attempts", 1) for j in jobs),
    }


def render_table(reports: list[dict[str, Any]]) -> str:
    head = (f"{'book':<16}{'wall s':>8}{'audio s':>9}{'audio min/':>11}{'prep s':>15}{'decode s':>15}"
            f"{'other s':>15}{'install s':>10}{'host half':>10}  prep paths\n"
            f"{'':<16}{'':>8}{'':>9}{'wall min':>11}{'(share)':>15}{'(share)':>15}{'(share)':>15}"
            f"{'':>10}{'ms':>10}\n")
    lines = []
    for r in reports:
        s, sh = r["summary_s"], r["summary_shares"]
        cells = [f"{s[k]:.2f} ({100 * sh[k]:.0f}%)" for k in ("preparation", "decoding", "other")]
        host = r["host_half"]
        host_ms = f"{host['host_half_ms']:.0f}" if host and host["host_half_ms"] is not None else "-"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r["prep_paths"].items()))
        lines.append(f"{r['label']:<16}{r['wall_s']:>8.2f}{r['audio_s']:>9.0f}"
                     f"{r['audio_min_per_wall_min']:>11.2f}{cells[0]:>15}{cells[1]:>15}{cells[2]:>15}"
                     f"{r['install_s']:>10.3f}{host_ms:>10}  {paths}")
    return head + "\n".join(lines)


def render_phases(report: dict[str, Any]) -> str:
    p, a = report["phases_s"], report["assembly_s"]
    host = report["host_half"]
    text = (f"{report['label']}: submit->GPU {p['submit_to_gpu']:.2f} s | voice on GPU "
            f"{p['voice_on_gpu']:.2f} s (install {report['install_s']:.3f} s, waiting for features "
            f"{report['gpu_wait_for_features_s']:.3f} s)"
            f" | decoding {p['decoding']:.2f} s ({report['decode_audio_min_per_min']} audio min/min) | "
            f"assembly {p['assembly']:.2f} s (chapter {a['chapters']:.2f}, book {a['book']:.2f}); "
            f"first audio at {report['first_audio_s']:.2f} s; books.started_at->finished_at "
            f"{report['started_to_finished_s']:.2f} s")
    if host:
        text += (f"; CPU worker host half: queued {host['queued_s']:.2f} s, took {host['span_s']:.3f} s "
                 f"({host['host_half_ms']:.0f} ms compute), "
                 f"{'done before' if host['done_before_gpu_claim'] else 'NOT done by'} the GPU worker's "
                 "first claim")
    return text


# -- running a book and reading its records back -----------------------------------------------------

def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def collect(sessions: Any, celery: Any, book_id: str, client_t0: float, label: str,
            prep_paths: dict[str, int]) -> dict[str, Any]:
    """Everything the system recorded about one finished book, as plain numbers (epoch seconds)."""
    from app.db import queries
    from app.db.session import session_scope

    with session_scope(sessions) as session:
        book = queries.require_book(session=session, book_id=book_id)
        voice = queries.require_voice(session=session, voice_id=book.voice_id)
        chapters = queries.list_chapters(session=session, book_id=book_id)
        states = queries.book_segment_states(session=session, book_id=book_id)
        jobs = [queries.require_job(session=session, job_id=s.job_id) for s in states if s.job_id]
        record: dict[str, Any] = {
            "label": label, "book_id": book_id, "client_t0": client_t0,
            "book": {"status": book.status, "submitted_at": _ts(book.submitted_at),
                     "started_at": _ts(book.started_at), "finished_at": _ts(book.finished_at)},
            "chapters": [{"index": c.index, "scheduled_at": _ts(c.scheduled_at),
                          "assembled_at": _ts(c.assembled_at), "seconds": c.seconds} for c in chapters],
            "voice": {"id": voice.id, "prepare_started_at": _ts(voice.prepare_started_at),
                      "prepared_at": _ts(voice.prepared_at), "prepare_ms": voice.prepare_ms},
            "jobs": [{"id": j.id, "n_tokens": j.n_tokens, "attempts": j.attempts, "prep_path": j.prep_path,
                      "started_at": _ts(j.started_at), "first_audio_at": _ts(j.first_audio_at),
                      "finished_at": _ts(j.finished_at)} for j in jobs],
            "prep_paths": prep_paths,
        }
    for job in record["jobs"]:  # the synth task's result: the engine's timings of the job's last attempt
        result = celery.AsyncResult(job["id"]).get(timeout=60, propagate=False)
        job["timings"] = dict(result.get("timings", {})) if isinstance(result, dict) else {}
    return record


def wait_book(client: Any, book_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get(f"/v1/books/{book_id}")
        response.raise_for_status()
        view = response.json()
        if view["status"] in DONE:
            return view
        if time.monotonic() > deadline:
            raise TimeoutError(f"book {book_id} still {view['status']} after {timeout_s:.0f} s "
                               f"({view['segments_done']}/{view['segments_total']} segments)")
        time.sleep(0.25)


def render_book(client: Any, store: Any, *, manifest: dict[str, Any], reference: bytes | None,
                voice_id: str | None, timeout_s: float) -> tuple[str, float, dict[str, int], list[float]]:
    """Submit one book and wait for it: (book id, client t0, prep-path counter deltas, load averages)."""
    from app.storage.keys import COUNTER_PREP_PATH

    before = store.counters(COUNTER_PREP_PATH)
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    if reference is not None:
        files = {"book": ("book.json", json.dumps(manifest).encode(), "application/json"),
                 "reference": ("voice.wav", reference, "audio/wav")}
        response = client.post("/v1/books", files=files)
    else:
        response = client.post("/v1/books", json={"voice_id": voice_id, "manifest": manifest})
    response.raise_for_status()
    book_id = response.json()["id"]
    view = wait_book(client, book_id, timeout_s)
    if view["status"] != "succeeded":
        raise RuntimeError(f"book {book_id} ended {view['status']}: {view['error']}")
    load += [round(x, 2) for x in os.getloadavg()]
    after = store.counters(COUNTER_PREP_PATH)
    return book_id, t0, {k: after.get(k, 0) - before.get(k, 0) for k in after}, load


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.rstrip("\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from app.broker.celery_config import make_celery
    from app.db.session import make_engine, make_sessionmaker
    from app.storage.feature_store import FeatureStore
    from scripts.service_stack import bench_settings, flush_redis, running_stack

    root = Path(tempfile.mkdtemp(prefix="wavefarm-bench-book-"))
    settings = bench_settings(root, preset=args.preset, slots=args.slots, threads=args.threads,
                              redis_dbs=REDIS_DBS, queue="bench-book", database_url=args.database_url)
    flush_redis(settings)
    salt = int(time.time())  # new segment keys even on a database that rendered this book before
    reports, records, loads = [], [], {}
    with running_stack(settings, root / "logs", PORT, cpu_concurrency=args.cpu_concurrency) as logs, \
            httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
        store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
        celery = make_celery(settings)
        sessions = make_sessionmaker(make_engine(settings.database_url))
        try:
            if args.warmup:  # worker processes' first tasks, torch's first steps: not in the numbers
                render_book(client, store, manifest=token_manifest(1, 2, 50, salt + 2),
                            reference=(SAMPLES / "voice_b.wav").read_bytes(), voice_id=None,
                            timeout_s=args.timeout)
            plan = [("new voice", token_manifest(1, args.segments, args.tokens, salt),
                     (SAMPLES / "voice_a.wav").read_bytes()),
                    ("prepared voice", token_manifest(1, args.segments, args.tokens, salt + 1), None)]
            voice_id = None
            for label, manifest, reference in plan:
                book_id, t0, paths, load = render_book(client, store, manifest=manifest, reference=reference,
                                                       voice_id=voice_id, timeout_s=args.timeout)
                record = collect(sessions, celery, book_id, t0, label, paths)
                voice_id = record["voice"]["id"]
                records.append(record)
                reports.append(build_report(record))
                loads[label] = {"before": load[:3], "after": load[3:]}
        finally:
            celery.close()
            store.close()
        gpu_log = logs["gpu"].read_text(errors="replace")
    installs = [line.strip() for line in gpu_log.splitlines() if " installed in " in line]
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "git": _git("rev-parse", "HEAD"),
            "git_modified": _git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "started": datetime.fromtimestamp(records[0]["client_t0"]).astimezone().isoformat(),
            "machine": platform.uname()._asdict(), "cores": os.cpu_count(),
            "settings": {"preset": args.preset, "slots": args.slots,
                         "micro_batch_size": settings.micro_batch_size,
                         "engine_threads": args.threads, "prep_wait_ms": settings.prep_wait_ms,
                         "cpu_concurrency": args.cpu_concurrency or "celery default (one per core)",
                         "cpu_worker_threads": settings.cpu_worker_threads,
                         "database": settings.database_url.split(":", 1)[0], "warmup": args.warmup,
                         "segments": args.segments, "tokens": args.tokens},
            "load_average": loads, "gpu_log_installs": installs, "reports": reports, "records": records,
            "logs": str(root / "logs")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--segments", type=int, default=20, help="segments of the chapter")
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per segment (25 per second)")
    parser.add_argument("--slots", type=int, default=4, help="GPU worker slots and micro-batch size")
    parser.add_argument("--threads", type=int, default=1, help="engine CPU threads (0: torch's default)")
    parser.add_argument("--cpu-concurrency", type=int, default=None,
                        help="CPU worker processes (default: celery's, one per core)")
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="render a 2-segment book in another voice first")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per book")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = run(args)
    s = out["settings"]
    print(f"preset {s['preset']}, dummy weights, {s['segments']} segments x {s['tokens']} tokens, "
          f"{s['slots']} slots, {s['engine_threads']} engine thread(s), {out['cores']} cores, "
          f"git {out['git'][:7]}")
    print(render_table(out["reports"]))
    for report in out["reports"]:
        print(render_phases(report))
    for label, load in out["load_average"].items():
        print(f"load average {label}: before {load['before']}, after {load['after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
