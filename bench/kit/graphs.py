"""Part 3: what the CUDA graphs buy, and float32's cost. The sweep's points in mode d (voices installed:
the decode step alone) with the graphs off, read against part 2's graphs-on figures at the same points
(`speedup` = on / off frames per second, where part 2 left them in the output folder); then float32 with
graphs on at the preset's two concurrencies (full: C = 1 and 32)."""

from __future__ import annotations

import json
from typing import Any

from bench.kit import points
from bench.kit.part import PartRun
from bench.kit.plan import BY_NAME

MODE = "d"


def graphs_on_figures(ctx: PartRun) -> dict[str, Any]:
    path = ctx.out / BY_NAME["sweep"].file
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("results", {}).get("engine", {})


def compare(ctx: PartRun) -> dict[str, Any]:
    on, off = graphs_on_figures(ctx), ctx.results.get("graphs_off", {})
    if not on:
        ctx.skipped("graphs on vs off: part 2's figures are not in this output folder (run it with part 2)")
    out = {}
    for name, eager in off.items():
        if name in on:
            out[name] = {"fps_graphs_on": on[name]["fps"], "fps_graphs_off": eager["fps"],
                         "speedup": on[name]["fps"] / eager["fps"],
                         "step_p50_on_s": on[name]["step_s"]["p50"], "step_p50_off_s": eager["step_s"]["p50"]}
    return out


def run(ctx: PartRun) -> None:
    sizes = ctx.sizes
    rows = max(sizes.concurrency)
    setup = points.build_recorded(ctx, "build_graphs_off", sizes.dtype, rows, graphs=False)
    if setup is not None:
        try:
            points.points(ctx, setup, (MODE,), sizes.concurrency, key="graphs_off", tag="off")
        finally:
            setup.close()
        del setup
    ctx.attempt("graphs_on_vs_off", lambda: compare(ctx))
    if ctx.left() < 5:
        ctx.skipped("fp32 points")
        return
    fp32 = points.build_recorded(ctx, "build_fp32", "fp32", max(sizes.fp32_concurrency), graphs=True)
    if fp32 is not None:
        try:
            points.points(ctx, fp32, (MODE,), sizes.fp32_concurrency, key="fp32_graphs_on", tag="fp32")
        finally:
            fp32.close()
