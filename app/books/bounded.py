"""Run a Python module as a child process that can be stopped: a wall-clock limit, a stop flag polled
while it runs, and what it cost (CPU seconds, peak memory) once it ends.

    run_child(module, args, wall_s=..., stopped=...) -> ChildExit

The child sets its own CPU, memory and output limits (`app.books.intake_child.limit_self`); this module
bounds what the child cannot bound itself: time spent waiting (a read blocked on nothing) and a client
who no longer wants the result. The child runs in a session of its own, so everything it started dies
with it. Its stderr goes to a file (bounded by the child's own output limit), never to a pipe that
could fill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.1
STOP_EVERY_S = 0.5  # how often `stopped` is asked (it may be a database query)


@dataclass(frozen=True)
class ChildExit:
    returncode: int | None  # the exit status; None when it ended by a signal
    signal: int | None  # the signal that ended it
    timed_out: bool  # killed here at the wall-clock limit
    stopped: bool  # killed here because `stopped()` said so
    wall_s: float
    cpu_s: float  # user + system, as the kernel counted it
    max_rss_mb: float  # its peak resident memory (VmHWM) as last read while it ran, every POLL_S

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_child(module: str, args: Sequence[str], *, wall_s: float, stderr: Path,
              stopped: Callable[[], bool] = lambda: False) -> ChildExit:
    """`python -m module args...` until it exits, `wall_s` passes or `stopped()` is true."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env)
    timed_out = was_stopped = False
    asked, peak_kb = start, 0
    while True:
        peak_kb = max(peak_kb, _peak_kb(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.monotonic()
        if now - start > wall_s:
            timed_out = True
        elif now - asked >= STOP_EVERY_S:
            asked = now
            was_stopped = stopped()
        if timed_out or was_stopped:
            _kill(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(POLL_S)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return ChildExit(returncode=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                     signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                     timed_out=timed_out, stopped=was_stopped, wall_s=time.monotonic() - start,
                     cpu_s=usage.ru_utime + usage.ru_stime, max_rss_mb=peak_kb / 1024)


def _peak_kb(pid: int) -> int:
    """The process's VmHWM (its own, not the parent's it was forked from: rusage's ru_maxrss counts
    that too), 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _kill(pid: int) -> None:
    """The child and whatever it started (its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
