"""Part 5: does a voice install on the side stream hide behind the decode step? CUDA events time, on the
preset's model with graphs on: the steady decode step of `overlap_rows` warm streams alone (main stream),
a new voice's install alone (the voice cache's side stream, `VoiceCache.install`), and both launched
together (install first, then the step), each the median of `REPS`.

    overlap = (install + step - together) / min(install, step)    1: the shorter hides entirely; 0: serial

On a CPU the same calls run one after the other, timed by the wall clock (no streams: not applicable)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.engine.decode import steady_rows, warm_streams
from bench.kit import points
from bench.kit.part import PartRun
from gpu_worker.voices.cache import VoiceCache

REPS = 3
NEW_VOICES = 100  # voice indices for the timed installs start here: never installed before


class Clock:
    """Milliseconds between marks on given streams (CUDA events), or of the wall clock on a CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self, stream: Any = None) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def ms(self, a: int, b: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return float(self.marks[a].elapsed_time(self.marks[b]))
        return (self.marks[b] - self.marks[a]) * 1000


def measure(ctx: PartRun, setup: Any) -> dict[str, Any]:
    streams = warm_streams(setup, ctx.sizes.overlap_rows)
    cache = VoiceCache(setup.installer, device=setup.device)
    side: Any = cache._side_stream  # the stream installs run on (None on a CPU)
    main = torch.cuda.current_stream() if ctx.cuda else None
    hosts = iter([setup.host(NEW_VOICES + i) for i in range(2 * REPS + 1)])  # host halves before any timing
    step_k = iter(range(200, 10_000))

    def step() -> None:
        setup.decoder.step(steady_rows(streams, next(step_k)))

    def timed(fn: Callable[[], object], stream: Any) -> float:
        clock = Clock(ctx.cuda)
        a = clock.mark(stream)
        fn()
        return clock.ms(a, clock.mark(stream))

    cache.install(next(hosts))  # warm-up of the side stream's kernels
    step()
    step_ms = [timed(step, main) for _ in range(REPS)]
    install_ms = [timed(lambda: cache.install(next(hosts)), side) for _ in range(REPS)]
    together_ms = []
    for _ in range(REPS):
        clock = Clock(ctx.cuda)
        start = clock.mark(main)
        if side is not None:
            side.wait_stream(main)  # the install starts after the mark, as the step does
        cache.install(next(hosts))
        end_install = clock.mark(side)
        step()
        end_step = clock.mark(main)
        together_ms.append(max(clock.ms(start, end_install), clock.ms(start, end_step)))
    s, i, t = (statistics.median(v) for v in (step_ms, install_ms, together_ms))
    return {"rows": len(streams), "step_ms": s, "install_ms": i, "together_ms": t,
            "overlap": (s + i - t) / min(s, i) if min(s, i) > 0 else None,
            "samples": {"step_ms": step_ms, "install_ms": install_ms, "together_ms": together_ms},
            "timer": "cuda events" if ctx.cuda else "wall clock (serial)"}


def run(ctx: PartRun) -> None:
    setup = points.build_recorded(ctx, "build", ctx.sizes.dtype, ctx.sizes.overlap_rows, graphs=True)
    if setup is None:
        return
    if not ctx.cuda:
        ctx.not_applicable("side stream and CUDA events (the install and the step ran one after the other)")
    try:
        with torch.inference_mode():
            ctx.attempt("overlap", lambda: measure(ctx, setup))
    finally:
        setup.close()
