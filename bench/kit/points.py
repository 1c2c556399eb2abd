"""What the measuring parts share: the bench's setup with or without CUDA graphs, and one engine sweep
point with its device memory (the engine and workload are `bench.engine.sweep`'s).

    build(ctx, dtype, micro_batch_size, graphs) -> BenchSetup   seeded weights in the released layout,
        loaded as the worker loads them; with `graphs`, the decode step's flow and the vocoder wrapped as
        the worker wraps them (`accel.flow_graphs`, `accel.graphs`): captured on CUDA, eager on a CPU
    point(ctx, setup, mode, concurrency) -> the sweep's figures + peak device memory, graph stats; with
        graphs on, what the point's calls did (replays, misses, fallbacks): on CUDA a bucket that ran
        without its graph, or a part with no graph at all, fails the part
"""

from __future__ import annotations

import gc
import time
from functools import partial
from typing import Any

import torch

from app.speech import PROMPT_FRAMES
from bench.engine.sweep import MODES, clients_for, equal_tokens, run_mode
from bench.engine.workload import BenchSetup
from bench.kit import verdict
from bench.kit.part import PartRun
from gpu_worker import fallbacks
from gpu_worker.accel.flow_graphs import GraphedFlow, graph_flow
from gpu_worker.accel.graphs import GraphedHiFT, graph_hift
from gpu_worker.checkpoint.load import DTYPES


def build(ctx: PartRun, dtype: str, micro_batch_size: int, graphs: bool,
          speaker: str = "standin") -> BenchSetup:
    if fallbacks.usable_dtype(torch.device(ctx.device), DTYPES[dtype]) != DTYPES[dtype]:
        dtype = "fp32"  # as the worker does: a kernel missing in that dtype (counted in the part's report)
    fallbacks.attention_probe(torch.device(ctx.device), DTYPES[dtype])
    setup = BenchSetup.build(preset=ctx.sizes.model, device=ctx.device, dtype=dtype, speaker=speaker,
                             micro_batch_size=micro_batch_size)
    if graphs:
        wrap_graphs(ctx, setup, micro_batch_size)
    return setup


def wrap_graphs(ctx: PartRun, setup: BenchSetup, rows: int, capture_now: bool = True) -> None:
    """As the worker's runtime does on CUDA: lanes reserved for `rows` streams, the flow's steady shapes
    and the vocoder's captured (without `capture_now`, each shape the second time it is seen). On a CPU the
    same wrappers run their buckets' shapes eagerly."""
    model = setup.model
    if ctx.cuda and not capture_now:
        setup.decoder.reserve(PROMPT_FRAMES, rows)
        model.flow = GraphedFlow(model.flow, max_rows=rows)  # type: ignore[assignment]
        model.hift = GraphedHiFT(model.hift, max_rows=rows)  # type: ignore[assignment]
    elif ctx.cuda:
        lanes = setup.decoder.reserve(PROMPT_FRAMES, rows)
        model.flow = graph_flow(model.flow, lanes, lanes.capacity)  # type: ignore[assignment]
        model.hift = graph_hift(model.hift, rows)  # type: ignore[assignment]
    else:
        model.flow = GraphedFlow(model.flow, max_rows=rows)  # type: ignore[assignment]
        model.hift = GraphedHiFT(model.hift, max_rows=rows)  # type: ignore[assignment]
        ctx.not_applicable("CUDA graph capture (the graph wrappers ran their buckets' shapes eagerly)")


def graph_stats(setup: BenchSetup) -> dict[str, float]:
    return setup.decoder.stats()


def reset_peak(ctx: PartRun) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def device_memory(ctx: PartRun) -> dict[str, float | None]:
    if not ctx.cuda:
        return {"peak_allocated_mib": None, "allocated_mib": None}
    torch.cuda.synchronize()
    return {"peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "allocated_mib": torch.cuda.memory_allocated() / 2**20}


def point(ctx: PartRun, setup: BenchSetup, mode: str, concurrency: int, tag: str = "") -> dict[str, Any]:
    """One sweep point: `concurrency` closed-loop clients in `mode` (`bench.sweep`), every rows' cap the
    decoder's micro-batch."""
    sizes = ctx.sizes
    clients = clients_for(concurrency, equal_tokens(sizes.chunks), sizes.jobs_per_client,
                          f"{tag}{mode}{concurrency}")
    reset_peak(ctx)
    before, counts = graph_stats(setup), verdict.graph_counts()
    result = run_mode(setup, MODES[mode], clients, setup.decoder.micro_batch_size)
    result.update(device_memory(ctx))
    after = graph_stats(setup)
    result.update(after)
    result["frames_ok"] = result["frames"] == result["frames_expected"]
    if isinstance(setup.model.flow, GraphedFlow):  # graphs on: what this point's calls did
        delta = {k: after[k] - before.get(k, 0) for k in after if "misses" in k or "replays" in k}
        result["graph_calls"] = {**delta, **verdict.graph_figures(after, counts)}
        if ctx.cuda:  # a bucket that ran without its graph measured the slow path
            for why in verdict.graph_failures({**result["graph_calls"], "graph_misses": {
                    p: delta[f"{p}_graph_misses"] for p in verdict.PARTS}}):
                ctx.fail(f"{tag}{mode} C{concurrency}: {why}")
    return result


def points(ctx: PartRun, setup: BenchSetup, modes: tuple[str, ...], concurrency: tuple[int, ...],
           key: str, tag: str = "") -> None:
    """Each (C, mode) in turn into results[key][f"C{c}_{mode}"], while the part's budget lasts: a point is
    started only if the last one's seconds, with a margin, still fit."""
    ctx.results.setdefault(key, {})
    last = 0.0
    for c in concurrency:
        for mode in modes:
            name = f"C{c}_{mode}"
            if ctx.left() < 1.5 * last + 1.0:
                ctx.skipped(f"{key} {name}")
                continue
            value = ctx.attempt(f"{key}.{name}", partial(point, ctx, setup, mode, c, tag))
            if value is not None:
                ctx.results.pop(f"{key}.{name}", None)
                ctx.results[key][name] = value
                last = value["wall_s"]
                ctx.save()


def build_recorded(ctx: PartRun, key: str, dtype: str, micro_batch_size: int, graphs: bool,
                   speaker: str = "standin") -> BenchSetup | None:
    """`build`, its seconds and graph figures recorded under results[key]; None if it failed (recorded)."""
    made: list[BenchSetup] = []

    def make() -> dict[str, Any]:
        start = time.monotonic()
        made.append(build(ctx, dtype, micro_batch_size, graphs, speaker))
        dtype_used = str(made[0].dtype).removeprefix("torch.")  # float32 where the probe fell back
        return {"seconds": time.monotonic() - start, "dtype": dtype_used,
                "micro_batch_size": micro_batch_size,
                "graphs": graphs, **graph_stats(made[0]), **device_memory(ctx)}

    ctx.attempt(key, make)
    return made[0] if made else None
