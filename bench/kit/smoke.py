"""Part 1: the environment (GPU, driver, torch, clocks) and the correctness smoke at tiny size
(scripts/gpu_check.py: voices installed on the side stream against prepared inline, by its criterion;
each job against its decode alone; the decode step and vocoder in CUDA graphs against eager within 1e-5
with TF32 off, the graphs captured and the fallbacks counted, by part; allocated memory over repeated
rounds). Each of gpu_check's failures fails the part (on CUDA it is strict: no graph, a fallback or a
missed graph fails). On CUDA also one bf16 matrix product's rate (the device's ceiling, to read the
other parts against)."""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine.machine import machine_info
from bench.kit.part import PartRun

REPO = Path(__file__).resolve().parents[2]
SMI_FIELDS = ("name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem,"
              "temperature.gpu,power.draw,pstate")


def nvidia_smi() -> dict[str, str] | str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi unavailable: {exc}"
    return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in out.splitlines()[0].split(",")), strict=False))


def environment(ctx: PartRun) -> dict[str, Any]:
    device = torch.device(ctx.device)
    info: dict[str, Any] = {**machine_info(device), "python": sys.version.split()[0],
                            "machine": platform.machine(),
                            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                            "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(device)
        info.update({"capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count,
                     "gpu_memory_gib": props.total_memory / 2**30,
                     "cudnn": torch.backends.cudnn.version(), "nvidia_smi": nvidia_smi()})
    else:
        ctx.not_applicable("GPU, driver and clocks (nvidia-smi)")
    return info


def matmul_rate() -> dict[str, float]:
    """bf16 8192^3 products: TFLOP/s, the mean of 10 after 3 warm-ups (CUDA events)."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    return {"n": n, "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12}


def gpu_check(ctx: PartRun) -> dict[str, Any]:
    """scripts/gpu_check.py's main on this device, its report back (exit code included)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = ["--install-batch", "4", "--install-preset", "full"] if ctx.preset == "full" and ctx.cuda else \
        ["--install-batch", "2", "--install-preset", "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu_check.json"
        start = time.monotonic()
        rounds = "3" if ctx.cuda else "1"  # memory is read per round on CUDA only (flat after the first)
        code = module.main(["--device", ctx.device, "--rounds", rounds, *batch, "--out", str(out)])
        report = json.loads(out.read_text())
    report.update({"exit_code": code, "passed": code == 0, "seconds": time.monotonic() - start})
    return report


def run(ctx: PartRun) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctx.attempt("environment", lambda: environment(ctx))
    if ctx.cuda:
        ctx.attempt("matmul_bf16", matmul_rate)
    else:
        ctx.not_applicable("the bf16 matrix product's rate (a GPU ceiling)")
    check = ctx.attempt("gpu_check", lambda: gpu_check(ctx))
    for why in (check or {}).get("failures", []):  # strict on CUDA: a fallback or a graph that did not run
        ctx.fail(f"gpu_check: {why}")
    if not ctx.cuda:
        ctx.not_applicable("side-stream installs and graph capture (gpu_check ran them eagerly)")
