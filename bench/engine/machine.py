"""What a benchmark report says about where it ran, and the small measuring tools every part shares.

    machine_info() -> dict      cpu model, cores, threads, torch and python versions, memory, load average
    git_info(repo) -> dict      revision, branch and the uncommitted files the run measured
    PeakRss                     peak resident memory of this process over a block (Linux VmHWM, reset)
    Timer / summarize(values)   wall-clock seconds and p50 / p95 / mean of a list

No model code here.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "mem_total_gib": _mem_total_gib(),
        "load_average_at_start": load_average(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda_version"] = torch.version.cuda
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info() -> dict[str, Any]:
    """The commit and, because a run measures the working tree, every source file that differs from it
    (modified, or not yet committed)."""
    status = _git("status", "--porcelain", "--untracked-files=all") or ""
    changed = [line[3:] for line in status.splitlines() if line.endswith(".py")]
    return {
        "revision": _git("rev-parse", "HEAD"),
        "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        "modified_files": sorted(changed),
    }


def command_line(argv: Sequence[str]) -> str:
    import shlex

    return shlex.join(["python", "-m", "bench.engine", *argv])


class PeakRss:
    """Peak resident set size (MiB) of this process inside a `with` block.

    On Linux the kernel's high-water mark is reset on entry (`/proc/self/clear_refs` = 5) and read on
    exit, so each block gets its own peak; elsewhere the process-lifetime peak is reported instead.
    """

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self.start_mib: float | None = None
        self.process_lifetime = False

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.process_lifetime = True
        self.start_mib = _status_mib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        peak = None if self.process_lifetime else _status_mib("VmHWM")
        if peak is None:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            self.process_lifetime = True
        self.peak_mib = round(peak, 1)


def _status_mib(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """`with Timer(device) as t: ...` then `t.s`; synchronises a CUDA device on both ends."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.s = 0.0

    def __enter__(self) -> Timer:
        sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        sync(self.device)
        self.s = time.perf_counter() - self._start

