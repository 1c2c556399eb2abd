"""A wavefarm cluster on one machine: several CPU and GPU workers as separate processes sharing one
broker, feature store, database and artifact root, started with `wavefarm cpu-worker | gpu-worker` as a
deployment starts them (settings from WAVEFARM_* variables; tiny preset and dummy weights on the CPU).

    cluster = Cluster(settings, logs)
    cluster.start("gpu", "g1"); cluster.start("cpu", "c1"); cluster.wait_ready()
    ...                       # submit jobs (app.submission.jobs.submit_job), watch the database
    cluster.kill("g1")        # SIGKILL, no shutdown
    cluster.stop_all()

Used by the cluster test (tests/integration/test_cluster.py) and the affinity benchmark
(scripts/bench_affinity.py). Each process runs one torch thread and, for a CPU worker, one Celery process.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from service_stack import READY_TIMEOUT_S, _ping, env_of  # noqa: E402

from app.dev import services  # noqa: E402
from app.settings import Settings  # noqa: E402


def reference(i: int, seconds: float = 2.0, sr: int = 16000) -> bytes:
    """A distinct, non-silent reference voice per index (two tones and seeded noise), as WAV bytes."""
    rng = np.random.default_rng(1000 + i)
    t = np.arange(int(seconds * sr)) / sr
    pcm = 0.2 * np.sin(2 * np.pi * (140 + 23 * i) * t) + 0.1 * np.sin(2 * np.pi * (310 + 17 * i) * t)
    pcm = (pcm + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, pcm, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


class Cluster:
    def __init__(self, settings: Settings, logs: Path) -> None:
        self.settings, self.logs = settings, logs
        self.env = {**env_of(settings), "OMP_NUM_THREADS": "1", "WAVEFARM_TORCH_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kinds: dict[str, str] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def node(self, name: str) -> str:
        return f"{name}@{socket.gethostname()}"

    def start(self, kind: str, name: str) -> str:
        """A `kind` ("cpu" or "gpu") worker under node name `<name>@<host>`; returns the node name."""
        args = [f"{kind}-worker", "--hostname", self.node(name)]
        if kind == "cpu":
            args += ["--concurrency", "1"]
        self.procs[name] = services.start_cli(args, env=self.env, log_path=self.logs / f"{name}.log")
        self.kinds[name] = kind
        return self.node(name)

    def wait_ready(self, names: list[str] | None = None, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every worker (or those named) answers a Celery ping; a worker that exits first is an error."""
        wanted = names or list(self.procs)

        def ready() -> bool:
            for name in wanted:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"worker {name} exited:\n{self.tail(name)}")
            return _ping(self.settings, [self.node(n) for n in wanted])

        if not services.wait_until(ready, timeout_s, interval=0.5):
            raise RuntimeError(f"workers not ready in {timeout_s:.0f} s:\n{self.tails()}")

    def kill(self, name: str) -> None:
        """SIGKILL the worker's whole process group (Celery and its pool): nothing is shut down."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}

    def tail(self, name: str, lines: int = 40) -> str:
        return services.log_tail(self.logs / f"{name}.log", lines)

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"== {name}\n{self.tail(name, lines)}" for name in self.procs)

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            services.stop_process(proc)
