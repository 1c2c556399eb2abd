"""`wavefarm demo`: the whole service on one machine, in one command, and tidied away afterwards.

SQLite and artifacts under ./var, a Redis on localhost (ours if none listens; on a shared one, databases 0-2
unless another stack uses them, then 3-5: `services.choose_redis`), a CPU worker and a GPU worker as child
processes, the bundled sample voices and tokens submitted through `app.submission.jobs`, progress bars and
the report (`app.dev.progress`), then where the audio is and how each voice was prepared. Everything started
here is stopped on the way out, also on Ctrl-C or failure. Dummy weights (noise) unless WAVEFARM_MODEL_DIR
is set, with the tiny preset unless WAVEFARM_MODEL_PRESET says otherwise, so it fits in minutes on a small
CPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.dev import SAMPLES, services
from app.dev.progress import follow, report, say
from app.storage.keys import COUNTER_PREP_PATH, COUNTER_PREPARE

SAMPLE_JOBS = [("voice_a.wav", "tokens_a.json"), ("voice_b.wav", "tokens_b.json")]

def banner(lines: list[str]) -> None:
    width = max(len(line) for line in lines) + 4
    say("!" * width)
    for line in lines:
        say(f"! {line.ljust(width - 4)} !")
    say("!" * width)


def demo_environment(var: Path) -> dict[str, str]:
    """WAVEFARM_* defaults for the embedded run; anything the user already set wins."""
    var = var.resolve()
    defaults = {"WAVEFARM_ARTIFACT_ROOT": str(var / "artifacts"),
                "WAVEFARM_DATABASE_URL": f"sqlite:///{var / 'wavefarm.sqlite'}",
                "WAVEFARM_WORKER_SLOTS": "4", "WAVEFARM_PREP_WAIT_MS": "5000"}
    if not os.environ.get("WAVEFARM_MODEL_DIR"):
        defaults["WAVEFARM_MODEL_PRESET"] = "tiny"
    return {**defaults, **{k: v for k, v in os.environ.items() if k.startswith("WAVEFARM_")}}


def default_redis_urls() -> list[str]:
    from app.settings import Settings

    return [str(Settings.model_fields[name.removeprefix("WAVEFARM_").lower()].default)
            for name in services.REDIS_VARS]


def announce_model(env: dict[str, str]) -> None:
    if env.get("WAVEFARM_MODEL_DIR"):
        say(f"model: checkpoints from {env['WAVEFARM_MODEL_DIR']} "
            f"(preset {env.get('WAVEFARM_MODEL_PRESET', 'full')})")
        return
    preset = env.get("WAVEFARM_MODEL_PRESET", "tiny")
    banner(["DUMMY WEIGHTS: WAVEFARM_MODEL_DIR is not set.",
            "The model has random weights: the audio it renders is NOISE, not speech.",
            f"Preset '{preset}'" + (" (small and fast, so the demo fits a laptop CPU)." if preset == "tiny"
                                    else "."),
            "Point WAVEFARM_MODEL_DIR at the released checkpoints for real speech."])


class _Interrupt:
    """Ctrl-C and `kill`, made sticky.

    Python raises KeyboardInterrupt wherever the main thread is when the signal lands; inside a
    weakref callback or a `__del__` it is printed and dropped ("Exception ignored in ..."), and the
    demo would go on to the end. The handler therefore also records the signal, and the waits check
    the record, so a dropped raise comes back at the next poll.
    """

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


def run_demo(*, var: Path, jobs_per_voice: int = 2, timeout_s: float = 270.0) -> int:
    """The embedded run; returns the process exit code (0 when every sample job succeeded)."""
    interrupt = _Interrupt()
    signal.signal(signal.SIGTERM, interrupt)  # `kill` tidies up like Ctrl-C does
    # Ctrl-C stops the demo even when it was started with SIGINT ignored (a non-interactive shell's
    # background job inherits that, and Python keeps an inherited SIG_IGN).
    signal.signal(signal.SIGINT, interrupt)
    env = demo_environment(var)
    announce_model(env)
    logs = var.resolve() / "logs"
    job_ids: list[str] = []
    with ExitStack() as stack:
        try:
            env.update(_start_redis(stack, env, var.resolve()))
            stack.callback(_give_back_environment, dict(os.environ))  # a caller in process keeps its own
            os.environ.update(env)  # this process is an entry point: its Settings come from here too
            from app.settings import Settings

            settings = Settings()
            # Runs after the workers stop (callbacks unwind in reverse): unfinished sample jobs are
            # cancelled, so the next demo does not find them queued with their messages gone.
            stack.callback(_cancel_unfinished, settings, job_ids)
            procs = _start_services(stack, settings, env, var.resolve(), logs)
            counts_before = _submit_samples(settings, jobs_per_voice, job_ids, interrupt.check)
            jobs = follow(settings, job_ids, timeout_s, _watchdog(procs, logs, interrupt.check))
            interrupt.check()
            report(settings, jobs, counts_before)
            return 0 if all(job["status"] == "succeeded" for job in jobs) else 1
        except services.ServiceError as exc:
            say(f"\ndemo: {exc}")
            _show_logs(logs)
            return 1
        except KeyboardInterrupt:
            say("\ndemo: interrupted; stopping what it started")
            return 130
        finally:
            say("stopping the demo's processes ...")


def _show_logs(logs: Path) -> None:
    for kind in ("cpu-worker", "gpu-worker"):
        path = logs / f"{kind}.log"
        if path.exists():
            say(f"--- last lines of {path} ---\n{services.log_tail(path, 15)}")


Procs = dict[str, subprocess.Popen[bytes]]


def _start_redis(stack: ExitStack, env: dict[str, str], var: Path) -> dict[str, str]:
    """A Redis for the broker and the feature store (ours if none listens); the URLs to use on it."""
    defaults = default_redis_urls()
    broker, _, features = (env.get(name, url)
                           for name, url in zip(services.REDIS_VARS, defaults, strict=True))
    for url in dict.fromkeys((broker, features)):
        stop = services.ensure_redis(url, var / "redis")
        if stop is not None:
            stack.callback(stop)
    urls, line = services.choose_redis(env, owner=f"{socket.gethostname()}:{var}", defaults=defaults)
    say(line)
    return urls


def _start_services(stack: ExitStack, settings: Any, env: dict[str, str], var: Path, logs: Path) -> Procs:
    from app.db import upgrade

    upgrade(settings.database_url)
    say(f"database: {settings.database_url}")
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    procs: Procs = {}
    for kind, extra in (("cpu-worker", ["--concurrency", "1"]), ("gpu-worker", [])):
        procs[kind] = services.start_cli([kind, "--loglevel", "info", *extra], env=child_env,
                                         log_path=logs / f"{kind}.log")
        stack.callback(services.stop_process, procs[kind])
    say(f"workers started (logs in {logs})")
    return procs


def _watchdog(procs: Procs, logs: Path, interrupted: Callable[[], None]) -> Callable[[], None]:
    """A check to call while waiting: stops on a recorded Ctrl-C, fails fast, with the log tail,
    when a worker died."""
    def check() -> None:
        interrupted()
        for kind, proc in procs.items():
            if proc.poll() is not None:
                tail = services.log_tail(logs / f"{kind}.log")
                raise services.ServiceError(f"the {kind} exited with code {proc.returncode}:\n{tail}")

    return check


def _cancel_unfinished(settings: Any, job_ids: list[str]) -> None:
    from app import lifecycle
    from app.db.session import make_engine, make_sessionmaker, session_scope

    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as s:
            cancelled = sum(lifecycle.cancel(session=s, job_id=job_id) for job_id in job_ids)
        if cancelled:
            say(f"cancelled {cancelled} unfinished sample jobs")
    finally:
        engine.dispose()


def _give_back_environment(saved: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(saved)


def _submit_samples(settings: Any, jobs_per_voice: int, job_ids: list[str],
                    interrupted: Callable[[], None]) -> dict[str, dict[str, int]]:
    """Submit the sample jobs, appending their ids to `job_ids` as they are accepted."""
    from app.context import Context
    from app.submission.jobs import submit_job
    from app.submission.request import JobRequest

    ctx = Context.build(settings)
    ctx.artifacts.ensure_layout()
    before = {group: ctx.store.counters(group) for group in (COUNTER_PREP_PATH, COUNTER_PREPARE)}
    try:
        for reference_name, tokens_name in SAMPLE_JOBS:
            reference = (SAMPLES / reference_name).read_bytes()
            tokens = json.loads((SAMPLES / tokens_name).read_text())
            for i in range(jobs_per_voice):
                interrupted()
                with ctx.session() as session:
                    job_ids.append(submit_job(ctx=ctx, session=session, request=JobRequest(
                        tokens=tokens, reference_bytes=reference, seed=i)))
        say(f"submitted {len(job_ids)} jobs: {jobs_per_voice} per voice, {len(SAMPLE_JOBS)} voices")
    finally:
        ctx.close()
    return before
