"""Part 6 (optional, if budget remains): `torch.compile` of the DiT (the flow's estimator) under the CUDA
graphs, at the preset's compile concurrency in mode d, read against part 2's graphs-on figure at the same
point. The point's wall time includes compiling each shape it meets (its first call) and capturing it
(its second), so its frames/s understate the compiled steady state; its step p50 is nearer to it.
Inductor on CUDA; on a CPU the `eager` backend (dynamo's tracing without code generation: inductor on a
CPU may fail on the oneDNN linears, docs/PERFORMANCE.md) over the DiT's plain linears (dynamo's trace of
the fused oneDNN linear found no primitive on a Zen 3/4 CPU), unless
WAVEFARM_KIT_COMPILE_BACKEND names another. A compile that fails is recorded, never fatal. With a budget
under its floor (`plan.COMPILE_MIN_CUDA_S`, `COMPILE_MIN_CPU_S`) the part skips itself before importing
torch (`part.main`: status "skipped", exit 0), where before it was killed at its budget on a cold machine."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from bench.engine.workload import BenchSetup
from bench.kit import points
from bench.kit.part import PartRun
from bench.kit.plan import BY_NAME
from gpu_worker.accel.onednn import use_cpu_linear

MODE = "d"


def backend(ctx: PartRun) -> str:
    return os.environ.get("WAVEFARM_KIT_COMPILE_BACKEND", "inductor" if ctx.cuda else "eager")


def compiled_setup(ctx: PartRun, rows: int) -> tuple[BenchSetup, dict[str, Any]]:
    setup = points.build(ctx, ctx.sizes.dtype, rows, graphs=False)
    if not ctx.cuda:  # oneDNN's fused linear under dynamo fails on some CPUs (no primitive on a Zen 3/4)
        use_cpu_linear(setup.model, "blas")
    cfm = setup.model.flow.decoder
    cfm.estimator = torch.compile(cfm.estimator, backend=backend(ctx))  # type: ignore[assignment]
    start = time.monotonic()
    # Each shape is compiled on its first call and captured the second time it is seen (a capture's
    # warm-up would otherwise compile every row bucket up front: minutes of inductor).
    points.wrap_graphs(ctx, setup, rows, capture_now=False)
    return setup, {"backend": backend(ctx), "wrap_s": time.monotonic() - start, **points.graph_stats(setup)}


def against_part2(ctx: PartRun) -> dict[str, Any]:
    path = ctx.out / BY_NAME["sweep"].file
    base = json.loads(path.read_text()).get("results", {}).get("engine", {}) if path.is_file() else {}
    if not base:
        ctx.skipped("compiled vs graphs only: part 2's figures are not in this output folder")
    out = {}
    for name, value in ctx.results.get("compiled", {}).items():
        if name in base:
            out[name] = {"fps_compiled": value["fps"], "fps_graphs_only": base[name]["fps"],
                         "speedup": value["fps"] / base[name]["fps"]}
    return out


def run(ctx: PartRun) -> None:
    rows = max(ctx.sizes.compile_concurrency)
    made: list[BenchSetup] = []

    def build() -> dict[str, Any]:
        setup, figures = compiled_setup(ctx, rows)
        made.append(setup)
        return figures

    ctx.attempt("build_compiled", build)
    if not made:
        return
    try:
        points.points(ctx, made[0], (MODE,), ctx.sizes.compile_concurrency, key="compiled", tag="compiled")
    finally:
        made[0].close()
    ctx.attempt("compiled_vs_graphs_only", lambda: against_part2(ctx))
