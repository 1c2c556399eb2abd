"""A text book through the real service with the full-size S3 tokenizer: the CPU workers' CPU time per second
of audio, and how the GPU worker's time splits (issue 44's benchmark).

    python scripts/bench_book_pipeline.py [--segments 320] [--model-dir /tmp/h44/model] [--json OUT]

The model folder holds seeded random weights in the released layout (`gpu_worker.checkpoint.write`): the
tiny decoder preset (flow and vocoder, so the GPU worker can decode on the CPU) and the FULL-size S3
tokenizer v2 (float32, about 472 MiB, s3tokenizer's fixed size), written once and reused while its marker
file is there; it must pass `wavefarm model check`. Starts a real API server, one CPU worker (celery's
processes, `--cpu-concurrency`) and the GPU worker on the CPU (scripts/service_stack.py, SQLite, Redis at
WAVEFARM_BENCH_REDIS on databases 3, 4 and 15, emptied first), renders a small warm-up text book in another
voice (the processes' first tasks and the tokenizer's loads are not in the numbers), then one text book of
`--segments` distinct one-sentence paragraphs (one segment each, counted from the database) with a new
voice (app/dev/samples/voice_a.wav), and waits until it finishes.

Every figure comes from what the system records, read back after the book (jobs rows, the synth results'
engine timings, the text jobs' phase records `tokenize_ms`), plus the CPU time of the worker processes,
sampled from /proc every 0.5 s (utime + stime + cutime + cstime of every process in the worker's session:
celery's main process, its pool and the children they reaped) and interpolated at the recorded times.

    audio_s                        the book's segments' tokens / 25
    render window                  from the first segment ready for the GPU worker (the earliest segment
                                   job's submitted_at: the job is made once its input is stored, its
                                   tokens before issue 44, its guide speech after) to the last segment
                                   job's finished_at
    cpu_worker_cpu_s_per_audio_s   the CPU worker's CPU seconds from the book's POST to the last segment
                                   done (parse, plan, speaking and, before issue 44, tokenizing), per
                                   second of audio; `..._book` to books.finished_at (chapter and book
                                   files included); the idle worker's own rate is given beside it
    gpu worker split               tokenize: the union of the text jobs' tokenize intervals; jobs: the
                                   union of claim -> finish intervals; install: the sum of install_s;
                                   decode: jobs minus install; its CPU seconds over the render window
    gpu_worker_idle_share          `idle_share`: the share of the render window covered by no busy interval
                                   of the GPU worker. A segment job is busy on it from its claim to its
                                   finish ([started_at, finished_at]: voice install, decode, file), and
                                   while it is tokenized ([started_at - tokenize_ms, started_at]:
                                   `tokenize_text_job` runs in the synth task just before its claim;
                                   tokenize_ms covers reading the speech, the log-mel, the wait for the
                                   lane and its forward). Inside the window some segment of the book is
                                   always unfinished (the last one finishes at its end), so every idle
                                   instant is one where segments wait and the GPU worker has none
    audio_s_per_wall_s             audio_s / (books.finished_at - the POST); `..._to_last_segment` up to the
                                   last segment done (without the chapter and book files and, after
                                   issue 46, the quality gate's listeners, which hear every segment then)

Prints a table; `--json` writes the report with the command, the git revision, the machine and the load
average before and after. Tolerant of the code before issue 44 (no phase records: no tokenize intervals),
so the same file runs against an older checkout on PYTHONPATH.
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
from bisect import bisect_left
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent.parent
if (_HERE / "app").is_dir() and str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))  # run from a checkout; copied elsewhere, PYTHONPATH names the checkout

import app  # noqa: E402

REPO = Path(app.__file__).resolve().parent.parent
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))

PORT = 8767
REDIS_DBS = (3, 4, 15)  # broker, results, features
TOKEN_RATE = 25
MARKER = ".bench_book_pipeline_complete"
ADJECTIVES = ("quiet", "amber", "narrow", "distant", "restless", "silver", "hollow", "patient", "sudden",
              "gentle", "crooked", "bright", "weary", "ancient", "humble", "stormy", "careful")
NOUNS = ("river", "lantern", "orchard", "harbour", "meadow", "tower", "library", "valley", "market",
         "bridge", "garden", "forest", "village", "station", "cottage", "island", "canal")
VERBS = ("waited", "wandered", "glimmered", "rested", "listened", "shivered", "gathered", "lingered",
         "whispered", "settled", "turned", "trembled", "drifted")


# -- the report's arithmetic: pure functions of recorded intervals ----------------------------------------

def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals`, each clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def idle_share(window: tuple[float, float], busy: Iterable[tuple[float, float]]) -> float:
    """The share of `window` that no busy interval covers (0 for an empty window)."""
    lo, hi = window
    if hi <= lo:
        return 0.0
    return 1.0 - union_length(busy, lo, hi) / (hi - lo)


def interpolate(samples: list[tuple[float, float]], t: float) -> float:
    """The counter at time `t` from (time, value) samples sorted by time (clamped at the ends)."""
    times = [s[0] for s in samples]
    i = bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i >= len(samples):
        return samples[-1][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def build_report(record: dict[str, Any]) -> dict[str, Any]:
    """The recorded book (see `collect`) -> the benchmark's figures."""
    jobs, t0, end = record["jobs"], record["client_t0"], record["book"]["finished_at"]
    audio_s = sum(j["n_tokens"] for j in jobs) / TOKEN_RATE
    window = (min(j["submitted_at"] for j in jobs), max(j["finished_at"] for j in jobs))
    render_s = window[1] - window[0]
    claims = [(j["started_at"], j["finished_at"]) for j in jobs]
    tokenizing = [(j["started_at"] - j["tokenize_ms"] / 1000, j["started_at"]) for j in jobs
                  if j.get("tokenize_ms") is not None]
    jobs_s = union_length(claims, *window)
    install_s = sum(j["timings"].get("install_s", 0.0) for j in jobs)
    cpu, gpu = record["cpu_samples"], record["gpu_samples"]
    cpu_render = interpolate(cpu, window[1]) - interpolate(cpu, t0)
    cpu_book = interpolate(cpu, end) - interpolate(cpu, t0)
    gpu_render = interpolate(gpu, window[1]) - interpolate(gpu, window[0])
    speak = [j["speak_ms"] for j in jobs if j.get("speak_ms") is not None]
    return {
        "segments": len(jobs), "audio_s": round(audio_s, 2), "wall_s": round(end - t0, 2),
        "audio_s_per_wall_s": round(audio_s / (end - t0), 3),
        "audio_s_per_wall_s_to_last_segment": round(audio_s / (window[1] - t0), 3),
        "render_window_s": round(render_s, 2),
        "render_audio_s_per_wall_s": round(audio_s / render_s, 3) if render_s > 0 else None,
        "cpu_worker_cpu_s": round(cpu_render, 2),
        "cpu_worker_cpu_s_per_audio_s": round(cpu_render / audio_s, 5),
        "cpu_worker_cpu_s_per_audio_s_book": round(cpu_book / audio_s, 5),
        "cpu_worker_idle_cpu_s_per_s": record["cpu_idle_rate"],
        "speak_ms_sum": round(sum(speak), 1) if speak else None,
        "gpu_worker": {
            "tokenize_s": round(union_length(tokenizing, *window), 2),
            "tokenize_ms_sum": round(sum(j["tokenize_ms"] or 0.0 for j in jobs), 1),
            "tokenized_jobs": len(tokenizing),
            "jobs_claim_to_finish_s": round(jobs_s, 2),
            "install_s": round(install_s, 3),
            "decode_s": round(jobs_s - install_s, 2),
            "cpu_s_in_render_window": round(gpu_render, 2),
            "cpu_s_per_audio_s": round(gpu_render / audio_s, 5),
        },
        "gpu_worker_idle_share": round(idle_share(window, claims + tokenizing), 4),
        "attempts": sum(j.get("attempts") or 1 for j in jobs),
    }


def render_table(runs: dict[str, dict[str, Any]]) -> str:
    rows = [("segments", "segments"), ("audio s", "audio_s"), ("wall s", "wall_s"),
            ("audio s / wall s", "audio_s_per_wall_s"),
            ("  ... to the last segment", "audio_s_per_wall_s_to_last_segment"),
            ("render window s", "render_window_s"),
            ("CPU worker CPU s / audio s", "cpu_worker_cpu_s_per_audio_s"),
            ("  ... to the book's end", "cpu_worker_cpu_s_per_audio_s_book"),
            ("  idle worker CPU s / s", "cpu_worker_idle_cpu_s_per_s"),
            ("GPU tokenize s", "gpu_worker.tokenize_s"), ("GPU install s", "gpu_worker.install_s"),
            ("GPU decode s", "gpu_worker.decode_s"), ("GPU CPU s / audio s", "gpu_worker.cpu_s_per_audio_s"),
            ("GPU worker idle share", "gpu_worker_idle_share")]
    names = list(runs)
    lines = [f"{'':<30}" + "".join(f"{n:>14}" for n in names)]
    for label, path in rows:
        values = []
        for name in names:
            value: Any = runs[name]
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            values.append(f"{value!s:>14}")
        lines.append(f"{label:<30}" + "".join(values))
    return "\n".join(lines)


# -- the model folder and the book -------------------------------------------------------------------------

def ensure_model(folder: Path) -> dict[str, Any]:
    """The tiny decoder and the full-size tokenizer in `folder` (written once), checked as a deployment
    checks it."""
    from gpu_worker.checkpoint import check as model_check

    if not (folder / MARKER).is_file():
        from gpu_worker.checkpoint.write import write_official_layout, write_s3_tokenizer_onnx
        from gpu_worker.model.config import ModelArgs

        write_official_layout(folder, ModelArgs.tiny(), seed=44, tokenizer=False)
        write_s3_tokenizer_onnx(folder / "speech_tokenizer_v2_25hz.onnx", seed=44)
        (folder / MARKER).write_text("ok\n")
    if model_check.main([str(folder)]) != 0:
        raise RuntimeError(f"{folder} does not pass the model check")
    tokenizer = folder / "speech_tokenizer_v2_25hz.onnx"
    return {"folder": str(folder), "decoder_preset": "tiny", "tokenizer": "full",
            "tokenizer_bytes": tokenizer.stat().st_size}


def book_text(paragraphs: int, salt: int) -> str:
    """A title and `paragraphs` distinct one-sentence paragraphs (a repeated sentence renders once)."""
    lines = [f"The Pipeline Book {salt}"]
    for i in range(paragraphs):
        a, n, v = ADJECTIVES[i % 17], NOUNS[(i // 17) % 17], VERBS[(i * 7 + salt) % 13]
        lines.append(f"Near the {a} {n}, the traveller {v} for {i + 1} minutes before the bell rang.")
    return "\n\n".join(lines) + "\n"


# -- process CPU time from /proc ---------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the third (state) on


def session_cpu_s(sid: int) -> float:
    """utime + stime + cutime + cstime of every live process in session `sid`."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (fields := _stat(pid)) is not None and int(fields[3]) == sid:
            total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK


def session_of(node: str) -> int:
    """The session id of the worker whose command line names celery node `node`."""
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if node.encode() in cmdline and (fields := _stat(pid)) is not None:
            return int(fields[3])
    raise RuntimeError(f"no process of celery node {node}")


class Sampler:
    """(time, CPU seconds) of each named session every `interval_s`, on a thread of its own."""

    def __init__(self, sessions: dict[str, int], interval_s: float = 0.5) -> None:
        self.sessions, self.interval_s = sessions, interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sessions}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            for name, sid in self.sessions.items():
                self.samples[name].append((time.time(), session_cpu_s(sid)))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- running the book and reading it back ------------------------------------------------------------------

def flush(settings: Any) -> None:
    """Empty the benchmark's Redis databases on the server their URLs name (older checkouts' flush_redis
    emptied 6379's whatever the URL)."""
    import redis

    for url in dict.fromkeys((settings.broker_url, settings.result_backend, settings.feature_store_url)):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()


def submit(client: Any, text: str, reference: bytes, timeout_s: float,
           quality: str | None = None) -> tuple[str, float]:
    from bench_book import wait_book

    t0 = time.time()
    response = client.post("/v1/books", files={"book": ("book.txt", text.encode(), "text/plain"),
                                               "reference": ("voice.wav", reference, "audio/wav")},
                           data={"quality": quality} if quality else None)
    response.raise_for_status()
    book_id = response.json()["id"]
    view = wait_book(client, book_id, timeout_s)
    if view["status"] != "succeeded":
        raise RuntimeError(f"book {book_id} ended {view['status']}: {view.get('error')}")
    return book_id, t0


def collect(sessions: Any, celery: Any, store: Any, book_id: str, t0: float) -> dict[str, Any]:
    """bench_book's record of the book, with each job's submitted_at and its phase record (if any)."""
    from bench_book import _ts
    from bench_book import collect as collect_book

    from app.db import queries
    from app.db.session import session_scope

    record = collect_book(sessions, celery, book_id, t0, "text book", {})
    with session_scope(sessions) as session:
        for job in record["jobs"]:
            job["submitted_at"] = _ts(queries.require_job(session=session, job_id=job["id"]).submitted_at)
    phase = getattr(store, "phase", None)  # the phase records came with issue 44
    for job in record["jobs"]:
        notes = phase(job["id"]) if phase is not None else {}
        for name in ("tokenize_ms", "speak_ms"):
            job[name] = float(notes[name]) if name in notes else None
    return record


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from service_stack import bench_settings, running_stack

    from app.broker.celery_config import make_celery
    from app.db.session import make_engine, make_sessionmaker
    from app.dev import SAMPLES
    from app.storage.feature_store import FeatureStore

    model = ensure_model(Path(args.model_dir))
    root = Path(tempfile.mkdtemp(prefix="bench-book-pipeline-", dir=args.work_dir))
    from app.settings import Settings

    # The quality gate (issue 46, after issue 44) re-renders every segment of random weights: off, so the
    # book renders each segment once; its listeners still hear each segment once after the last one.
    gate = {"quality_rerenders": 0} if "quality_rerenders" in Settings.model_fields else {}
    settings = bench_settings(root, preset="tiny", slots=args.slots, threads=args.threads,
                              redis_dbs=REDIS_DBS, queue="bench-pipeline", model_dir=Path(args.model_dir),
                              **gate)
    flush(settings)
    salt = int(time.time())
    with running_stack(settings, root / "logs", PORT, cpu_concurrency=args.cpu_concurrency), \
            httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
        host = __import__("socket").gethostname()
        sids = {name: session_of(f"bench-{name}-{os.getpid()}@{host}") for name in ("cpu", "gpu")}
        store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
        celery = make_celery(settings)
        sessions = make_sessionmaker(make_engine(settings.database_url))
        try:
            submit(client, book_text(args.warmup, salt + 1), (SAMPLES / "voice_b.wav").read_bytes(),
                   args.timeout, args.quality)
            with Sampler(sids) as sampler:
                time.sleep(args.idle_s)  # the idle workers' own CPU rate
                load = [round(x, 2) for x in os.getloadavg()]
                book_id, t0 = submit(client, book_text(args.segments, salt),
                                     (SAMPLES / "voice_a.wav").read_bytes(), args.timeout, args.quality)
                load_after = [round(x, 2) for x in os.getloadavg()]
            record = collect(sessions, celery, store, book_id, t0)
        finally:
            celery.close()
            store.close()
    idle = [s for s in sampler.samples["cpu"] if s[0] <= t0]
    record["cpu_idle_rate"] = (round((idle[-1][1] - idle[0][1]) / (idle[-1][0] - idle[0][0]), 4)
                               if len(idle) > 1 and idle[-1][0] > idle[0][0] else None)
    record["cpu_samples"], record["gpu_samples"] = sampler.samples["cpu"], sampler.samples["gpu"]
    report = build_report(record)
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "git": _git("rev-parse", "HEAD"),
            "git_subject": _git("log", "-1", "--format=%s"),
            "git_modified": _git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "machine": {**platform.uname()._asdict(), "cores": os.cpu_count(), "cpu": _cpu_model()},
            "load_average": {"before": load, "after": load_after,
                             "note": "a shared 2-core machine: other helpers ran beside this; prefer the "
                                     "CPU-time figures to the wall-time ones"},
            "tokenizer": "full", "model": model,
            "settings": {"segments_asked": args.segments, "cpu_concurrency": args.cpu_concurrency,
                         "slots": args.slots, "engine_threads": args.threads, "warmup_segments": args.warmup,
                         "database": "sqlite", "quality_gate": gate or "none in this revision",
                         "book_quality": args.quality or "the default"},
            "report": report, "book_id": book_id, "logs": str(root / "logs")}


def _cpu_model() -> str:
    """The model name with its family and model numbers ("AMD EPYC" alone names several generations)."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor()
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{fields['model name']} (family {family}, model {model})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=320, help="one-sentence paragraphs of the book")
    parser.add_argument("--warmup", type=int, default=6, help="paragraphs of the warm-up book")
    parser.add_argument("--quality", choices=("on", "report", "off"),
                        help="the books' quality gate (default: the service's, on); 'off' skips the "
                             "listeners that hear every segment after the last, which no figure to the "
                             "last segment includes")
    parser.add_argument("--model-dir", default="/tmp/h44/model", help="written there once, then reused")
    parser.add_argument("--work-dir", default=None, help="the service's database, artifacts and logs")
    parser.add_argument("--cpu-concurrency", type=int, default=2, help="CPU worker processes")
    parser.add_argument("--slots", type=int, default=4, help="GPU worker slots and micro-batch size")
    parser.add_argument("--threads", type=int, default=1, help="engine CPU threads")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle workers' CPU sampled this long")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per book")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = run(args)
    print(f"git {out['git'][:10]} ({out['git_subject'][:60]}), tokenizer full, decoder tiny, "
          f"{out['machine']['cores']} cores {out['machine']['cpu']}, load {out['load_average']['before']} -> "
          f"{out['load_average']['after']}")
    print(render_table({"this run": out["report"]}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
