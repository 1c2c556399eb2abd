"""Part 2: the engine sweep at the preset's size (full: C = 1, 4, 16, 32, 64), bf16, CUDA graphs on,
modes b (inline preparation), c (prepared ahead, installed on the side stream) and d (installed):
frames/s of the whole engine (flow + vocoder), first-audio and step p50/p95, peak device memory
(`bench.engine.sweep`'s workload, `points`). First the reference implementation's batch-1 figure on
the same device, weights, voice and tokens (`bench.engine.reference`, float32 as a user would run it):
the baseline every figure here is read against. Last the S3 tokenizer's batched tokenization of book
segments beside the decoder (`bench.kit.tokenize`: segments/s, its share of a second of audio's cost)."""

from __future__ import annotations

from typing import Any

import torch

from bench.engine.reference import build_reference, reference_fps
from bench.engine.workload import BenchSetup
from bench.kit import points, tokenize
from bench.kit.part import PartRun

# of part 2's seconds kept from the engine's points for the tokenizer's (chosen, not measured: the full
# tokenizer's batches are a few forwards of 0.1-3 TFLOP each)
TOKENIZE_RESERVE_S = {"cuda": 15.0, "cpu": 5.0}


def reference(setup: BenchSetup, timed: int) -> dict[str, Any]:
    ref = build_reference(setup, torch.float32)
    try:
        with torch.inference_mode():
            return reference_fps(setup, ref, voice_index=0, timed=timed)
    finally:
        del ref


def run(ctx: PartRun) -> None:
    sizes = ctx.sizes
    rows = max(sizes.concurrency)
    setup = points.build_recorded(ctx, "build", sizes.dtype, rows, graphs=True)
    if setup is None:
        return
    ctx.results["config"] = {"model": sizes.model, "dtype": sizes.dtype, "micro_batch_size": rows,
                             "chunks_per_job": sizes.chunks, "jobs_per_client": sizes.jobs_per_client,
                             "speaker": "standin", "cuda_graphs": ctx.cuda}
    reserve = TOKENIZE_RESERVE_S[ctx.device]
    ctx.deadline -= reserve
    try:
        ctx.attempt("reference_batch1", lambda: reference(setup, sizes.reference_chunks))
        points.points(ctx, setup, sizes.modes, sizes.concurrency, key="engine")
    finally:
        ctx.deadline += reserve
        setup.close()
    if ctx.left() > 5.0:  # the tokenizer beside the decoder: its share of what a second of audio costs
        ctx.attempt("tokenize", lambda: tokenize.sweep(ctx, ctx.results.get("engine")))
    else:
        ctx.skipped("tokenize")
