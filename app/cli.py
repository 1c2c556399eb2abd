"""The `wavefarm` command: run the services, talk to the API, run the demo.

Service commands (serve, cpu-worker, gpu-worker, flower) and `bench` replace this process with the real server
so signals reach it directly. Client commands (submit, status, cancel, jobs, voices) speak HTTP to
the API, or, with `--local`, use `app.submit` and the database directly. Heavy imports happen
inside the commands: building the parser (shell completion, `tests/test_compose.py`) stays cheap.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.errors import BadInput, WavefarmError

log = logging.getLogger("wavefarm")

DEFAULT_API = "http://127.0.0.1:8000"
CELERY_CPU_APP = "tasks.celery_app"
CELERY_GPU_APP = "gpu_worker.worker"
Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wavefarm", description="Offline speech synthesis service.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_service_commands(sub)
    _add_client_commands(sub)
    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="apply the Alembic migrations (idempotent)").set_defaults(
        handler=cmd_db_upgrade)
    demo = sub.add_parser("demo", help="one-command embedded run: local Redis, SQLite, workers, samples")
    demo.add_argument("--jobs-per-voice", type=int, default=2, help="sample jobs per sample voice")
    demo.add_argument("--var", type=Path, default=Path("var"), help="folder for the database, files, logs")
    demo.add_argument("--timeout", type=float, default=270.0, help="seconds to wait for the jobs")
    demo.set_defaults(handler=cmd_demo)
    _add_maintenance_command(sub)
    _add_book_commands(sub)
    return parser


def _add_service_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the HTTP API (uvicorn)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(handler=cmd_serve)
    for name, what in (("cpu-worker", "voice preparation and maintenance tasks (celery -Q cpu)"),
                       ("gpu-worker", "the synthesis worker (celery -Q gpu, thread pool of worker_slots)")):
        worker = sub.add_parser(name, help=what)
        worker.add_argument("--loglevel", default="info")
        worker.add_argument("--hostname", help="celery node name (default: <kind>@%%h)")
        if name == "cpu-worker":
            worker.add_argument("--concurrency", type=int, help="processes (default: one per core)")
        else:
            worker.add_argument("--metrics-port", type=int,
                                help="serve Prometheus metrics (engine, installs) on this port")
        worker.set_defaults(handler=cmd_worker, kind=name.split("-")[0])
    flower = sub.add_parser("flower", help="Celery's monitoring UI (basic auth from FLOWER_BASIC_AUTH)")
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--port", type=int, default=5555)
    flower.set_defaults(handler=cmd_flower)
    bench = sub.add_parser("bench", add_help=False,
                           help="the engine benchmark (python -m gpu_worker.bench; `wavefarm bench --help`)")
    bench.set_defaults(handler=cmd_bench, bench_args=[])


def _add_client_commands(sub: Any) -> None:
    def client(name: str, help_: str, handler: Handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--api", default=DEFAULT_API, help=f"API base URL (default {DEFAULT_API})")
        p.add_argument("--local", action="store_true", help="use the database directly, not the API")
        p.set_defaults(handler=handler)
        return p

    submit = client("submit", "submit a job: a voice (id or reference file) and speech tokens", cmd_submit)
    submit.add_argument("--voice", required=True, help="voice id (sha256) or a reference audio file")
    submit.add_argument("--tokens", required=True, type=Path, help="JSON file: [ids] or {\"tokens\": [ids]}")
    submit.add_argument("-o", "--output", type=Path, help="where to write the audio (implies --wait)")
    submit.add_argument("--seed", type=int)
    submit.add_argument("--format", dest="output_format", choices=("wav", "flac"), default="wav")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--idempotency-key")
    submit.add_argument("--wait", action="store_true", help="follow progress until the job finishes")
    status = client("status", "show a job", cmd_status)
    status.add_argument("job_id")
    cancel = client("cancel", "cancel a job", cmd_cancel)
    cancel.add_argument("job_id")
    jobs = client("jobs", "list recent jobs", cmd_jobs)
    jobs.add_argument("--status")
    jobs.add_argument("--voice-id")
    jobs.add_argument("--limit", type=int, default=20)
    voices = client("voices", "list voices, or upload one with --add", cmd_voices)
    voices.add_argument("--add", type=Path, metavar="FILE", help="upload a reference audio file")


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every command path ('serve', 'db upgrade', ...) -> its parser; for tests and completion."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    path = f"{prefix} {name}".strip()
                    found[path] = child
                    walk(child, path)

    walk(parser or build_parser(), "")
    return found


# Service commands --------------------------------------------------------------------------------


def _settings() -> Any:
    from app.settings import get_settings

    return get_settings()


def _upgrade_schema() -> None:
    """Services bring the database schema up to date on start (concurrent starts upgrade once)."""
    from app.db import upgrade

    upgrade(_settings().database_url)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    _upgrade_schema()
    uvicorn.run("app.api.main:app_from_environment", factory=True, host=args.host, port=args.port,
                log_level=args.log_level)
    return 0


def worker_argv(kind: str, settings: Any, *, loglevel: str = "info", hostname: str | None = None,
                concurrency: int | None = None) -> list[str]:
    """The celery command line of a CPU or GPU worker."""
    if kind == "gpu":
        # Threads: every slot is a synth task waiting on the one engine thread that owns the device.
        argv = ["-A", CELERY_GPU_APP, "worker", "-Q", settings.queue_gpu, "-P", "threads",
                "-c", str(settings.worker_slots)]
    else:
        argv = ["-A", CELERY_CPU_APP, "worker", "-Q", settings.queue_cpu]
        if concurrency:
            argv += ["-c", str(concurrency)]
    return argv + ["-n", hostname or f"{kind}@%h", "--loglevel", loglevel]


def flower_argv(*, address: str, port: int) -> list[str]:
    # Basic auth is read by Flower from FLOWER_BASIC_AUTH itself: credentials stay out of argv (ps).
    return ["-A", CELERY_CPU_APP, "flower", f"--address={address}", f"--port={port}"]


def _exec_celery(argv: list[str]) -> int:
    log.info("exec: celery %s", " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "celery", *argv])
    return 0  # not reached


def cmd_worker(args: argparse.Namespace) -> int:
    _upgrade_schema()
    argv = worker_argv(args.kind, _settings(), loglevel=args.loglevel, hostname=args.hostname,
                       concurrency=getattr(args, "concurrency", None))
    port = getattr(args, "metrics_port", None)
    if port is None:
        return _exec_celery(argv)
    # The GPU worker's pool is threads: one process, so an exporter started here serves the
    # metrics its engine registers in prometheus_client's default registry.
    from app.api.metrics import start_exporter

    start_exporter(port)
    log.info("worker metrics on :%d/metrics", port)
    return _run_celery(argv)


def _run_celery(argv: list[str]) -> int:
    """Celery in this process (not exec'd), for when this process must keep something running."""
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *argv]
    celery_main()  # exits
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    if not os.environ.get("FLOWER_BASIC_AUTH"):
        log.warning("FLOWER_BASIC_AUTH is not set: Flower runs WITHOUT authentication")
    return _exec_celery(flower_argv(address=args.address, port=args.port))


def cmd_bench(args: argparse.Namespace) -> int:
    # Its own process and parser: the benchmark belongs to the GPU side, which app never imports.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "gpu_worker.bench", *args.bench_args])
    return 0  # not reached


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from app.db import upgrade

    settings = _settings()
    upgrade(settings.database_url)
    print(f"database at {_redact(settings.database_url)} is up to date")
    return 0


def _redact(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    return run_demo(var=args.var, jobs_per_voice=args.jobs_per_voice, timeout_s=args.timeout)


def _add_maintenance_command(sub: Any) -> None:
    maint = sub.add_parser("maintenance", help="one sweep: orphan files, jobs without a broker message, "
                           "abandoned voices (what the maintenance.sweep task does)")
    maint.add_argument("--grace-s", type=float, help="remove orphan files older than this "
                       "(default: WAVEFARM_ORPHAN_GRACE_S)")
    maint.set_defaults(handler=cmd_maintenance)


def cmd_maintenance(args: argparse.Namespace) -> int:
    from app.celery_config import make_celery
    from app.maintenance import run_sweep

    settings = _settings()
    sender = make_celery(settings, include=())
    try:
        report = run_sweep(settings, sender, grace_s=args.grace_s)
    finally:
        sender.close()
    _print_json(report.as_dict())
    return 1 if report.errors else 0


# Client commands ---------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    if args.local:
        from app.api.client import LocalClient

        return LocalClient(_settings())
    from app.api.client import HttpClient

    token = _settings().api_token
    return HttpClient(args.api, token=token.get_secret_value() if token else None)


def cmd_submit(args: argparse.Namespace) -> int:
    from app.api.client import follow
    from app.api.schemas import parse_tokens

    client = _client(args)
    tokens = parse_tokens(args.tokens.read_bytes())
    voice: str | bytes = args.voice
    if Path(args.voice).is_file():
        voice = Path(args.voice).read_bytes()
    elif not re.fullmatch(r"[0-9a-f]{64}", args.voice):
        raise BadInput(f"--voice {args.voice!r} is neither a reference audio file nor a voice id (sha256)")
    job = client.submit(voice=voice, tokens=tokens, seed=args.seed, output_format=args.output_format,
                        priority=args.priority, idempotency_key=args.idempotency_key)
    print(job["id"])
    if not (args.wait or args.output):
        return 0
    job = follow(client, job["id"])
    print(f"job {job['id']}: {job['status']}" + (f" ({job['error']})" if job.get("error") else ""))
    if job["status"] != "succeeded":
        return 1
    if args.output:
        args.output.write_bytes(client.audio(job["id"]))
        print(f"audio written to {args.output}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _print_json(_client(args).job(args.job_id))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.job_id)
    print(f"job {job['id']}: {job['status']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    for job in _client(args).jobs(status=args.status, voice_id=args.voice_id, limit=args.limit):
        done, total = job["progress"]["frames_done"], job["progress"]["frames_total"]
        print(f"{job['id']}  {job['status']:<10} {done:>7}/{total:<7} voice {job['voice_id'][:12]}")
    return 0


def cmd_voices(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.add:
        _print_json(client.add_voice(args.add.read_bytes()))
        return 0
    for voice in client.voices():
        print(f"{voice['id']}  {voice['status']:<9} uses {voice['uses']}")
    return 0


# Books -------------------------------------------------------------------------------------------


def _add_book_commands(sub: Any) -> None:
    book = sub.add_parser("book", help="render a book (text, Markdown, EPUB, manifest): chapters and an M4B")
    book_sub = book.add_subparsers(dest="book_command", required=True, metavar="ACTION")

    def action(name: str, help_: str, handler: Handler) -> argparse.ArgumentParser:
        p = book_sub.add_parser(name, help=help_)
        p.add_argument("--api", default=DEFAULT_API, help=f"API base URL (default {DEFAULT_API})")
        p.add_argument("--local", action="store_true", help="use the database directly, not the API")
        p.set_defaults(handler=handler)
        return p

    render = action("render", "submit a book; --wait follows it and writes its files to --out",
                    cmd_book_render)
    render.add_argument("book", type=Path, help="a .txt, .md, .epub or .json manifest file")
    render.add_argument("--voice", required=True, help="voice id (sha256) or a reference audio file")
    render.add_argument("--out", type=Path, help="folder for the chapter files, book.m4b and the index")
    render.add_argument("--format", dest="book_output", choices=("m4b", "flac", "wav"), default="m4b",
                        help="m4b: FLAC chapters and an M4B (default); flac or wav: chapter files only")
    render.add_argument("--wait", action="store_true", help="show progress until done, then download")
    render.add_argument("--title")
    render.add_argument("--author")
    render.add_argument("--language", help="BCP 47 tag (default: from the book, else en)")
    render.add_argument("--priority", type=int, default=0, help="segment job priority (0 yields to all)")
    render.add_argument("--target-lufs", type=float, help="normalise each chapter's loudness")
    render.add_argument("--seed", type=int, default=0)
    action("status", "show a book's progress", cmd_book_status).add_argument("book_id")
    action("cancel", "cancel a book (finished segments are kept)", cmd_book_cancel).add_argument("book_id")


class _Books:
    """The book routes over HTTP, or (--local) the same route functions in process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.local = bool(args.local)
        if self.local:
            from app.api.main import build_context

            self.ctx = build_context(_settings())
        else:
            from app.api.client import HttpClient

            token = _settings().api_token
            self.http = HttpClient(args.api, token=token.get_secret_value() if token else None)

    def submit(self, data: bytes, filename: str, voice: str | bytes, form: dict[str, str],
               base_dir: Path) -> dict[str, Any]:
        if self.local:
            from app.api.routes_books import _submit
            from app.books.service import BookOptions

            options = BookOptions(output_format=form["output_format"], m4b=form["m4b"] == "true",
                                  target_lufs=float(form["target_lufs"]) if "target_lufs" in form else None,
                                  seed=int(form["seed"]), priority=int(form["priority"]))
            fields = {"data": data, "filename": filename, "options": options, "base_dir": base_dir,
                      "voice_id": voice if isinstance(voice, str) else None,
                      "reference_bytes": voice if isinstance(voice, bytes) else None,
                      **{k: form.get(k) for k in ("title", "author", "language")}}
            return _submit(self.ctx, fields).model_dump(mode="json")
        files: dict[str, Any] = {"book": (filename, data)}
        if isinstance(voice, bytes):
            files["reference"] = ("reference", voice)
        else:
            form = {**form, "voice_id": voice}
        return self.http._call("POST", "/v1/books", data=form, files=files).json()

    def status(self, book_id: str) -> dict[str, Any]:
        if self.local:
            from app.api.routes_books import get_book

            return get_book(book_id, self.ctx).model_dump(mode="json")
        return self.http._call("GET", f"/v1/books/{book_id}").json()

    def cancel(self, book_id: str) -> dict[str, Any]:
        if self.local:
            from app.api.routes_books import cancel

            return cancel(book_id, self.ctx).model_dump(mode="json")
        return self.http._call("POST", f"/v1/books/{book_id}/cancel").json()

    def download(self, book_id: str, name: str, dest: Path) -> None:
        if self.local:
            import shutil

            from app.api.routes_books import get_file

            shutil.copyfile(get_file(book_id, name, self.ctx).path, dest)
            return
        dest.write_bytes(self.http._call("GET", f"/v1/books/{book_id}/files/{name}").content)


def cmd_book_render(args: argparse.Namespace) -> int:
    voice: str | bytes = args.voice
    if Path(args.voice).is_file():
        voice = Path(args.voice).read_bytes()
    elif not re.fullmatch(r"[0-9a-f]{64}", args.voice):
        raise BadInput(f"--voice {args.voice!r} is neither a reference audio file nor a voice id (sha256)")
    if not args.book.is_file():
        raise BadInput(f"no book file {args.book}")
    form = {"output_format": "flac" if args.book_output == "m4b" else args.book_output,
            "m4b": "true" if args.book_output == "m4b" else "false", "seed": str(args.seed),
            "priority": str(args.priority)}
    form.update({k: str(v) for k, v in (("title", args.title), ("author", args.author),
                                        ("language", args.language), ("target_lufs", args.target_lufs))
                 if v is not None})
    books = _Books(args)
    book = books.submit(args.book.read_bytes(), args.book.name, voice, form, args.book.resolve().parent)
    print(book["id"])
    if not (args.wait or args.out):
        return 0
    book = follow_book(books, book["id"])
    print(f"book {book['id']}: {book['status']}" + (f" ({book['error']})" if book.get("error") else ""))
    if book["status"] != "succeeded":
        return 1
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in book["files"]:
            books.download(book["id"], name, args.out / name)
        print(f"{len(book['files'])} files written to {args.out}")
    return 0


def follow_book(books: _Books, book_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """Poll a book until it finishes, with a tqdm bar over its segments; returns the last state."""
    import time

    from tqdm import tqdm

    book = books.status(book_id)
    with tqdm(total=book["segments_total"] or None, unit="seg", desc=book["title"][:24]) as bar:
        while True:
            bar.total = book["segments_total"] or bar.total
            eta = f", ETA {book['eta_s']:.0f} s" if book.get("eta_s") else ""
            bar.set_postfix_str(f"{book['status']}, {book['audio_seconds']:.0f} s audio{eta}")
            bar.update(book["segments_done"] - bar.n)
            if book["status"] in ("succeeded", "failed", "cancelled"):
                return book
            time.sleep(poll_s)
            book = books.status(book_id)


def cmd_book_status(args: argparse.Namespace) -> int:
    book = _Books(args).status(args.book_id)
    eta = f"  ETA {book['eta_s']:.0f} s" if book.get("eta_s") else ""
    print(f"{book['id']}  {book['status']}  {book['segments_done']}/{book['segments_total']} segments  "
          f"{book['audio_seconds']:.1f} s audio{eta}  {book['title']}")
    for c in book["chapters"]:
        print(f"  {c['index'] + 1:>3}. {c['segments_done']:>4}/{c['segments_total']:<4} "
              f"{c['audio_seconds']:>7.1f} s  {c['title']}")
    if book.get("error"):
        print(f"  error: {book['error']}")
    return 0


def cmd_book_cancel(args: argparse.Namespace) -> int:
    book = _Books(args).cancel(args.book_id)
    print(f"book {book['id']}: {book['status']}")
    return 0


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `bench` hands everything after it to the benchmark's own parser (argparse's REMAINDER would
    # refuse a leading option such as --help).
    split = argv.index("bench") if "bench" in argv else -1
    if split >= 0 and all(a.startswith("-") for a in argv[:split]):
        args, extra = parser.parse_args(argv[:split + 1]), argv[split + 1:]
        args.bench_args = extra
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration step otherwise
    try:
        return int(args.handler(args))
    except WavefarmError as exc:  # refused input or missing ids: a message, not a traceback
        print(f"wavefarm: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wavefarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
