"""What makes a GPU check fail: the rules `scripts/gpu_check.py` and the kit's parts share (issue 41). A
run on CUDA that measured the slow path fails loudly; it never passes because nothing was compared.

    graph_figures(stats, before) -> {"graphs_captured", "graph_fallbacks", "graph_misses", "graph_replays"}
        per part (flow, vocoder), from a decoder's stats (the graph runners', `accel.graph_base.call_stats`)
        and the graph fallbacks `gpu_worker.fallbacks` counted since `before` (`graph_counts()`)
    graph_failures(figures) -> [why]   a part with no graph captured, a fallback counted, a miss (a
        decoder call that ran eagerly where its graph should have run)
    fallback_failures(kind_counts) -> [why]   any fallback counter that moved (attention kernel refused,
        bf16 kernel missing, TensorRT, graphs)
    ahead_vs_inline(ahead, inline, one_stream) -> {"one_stream", "bit_for_bit", "max_abs_diff", "ok"}
        installs prepared ahead against prepared inline, by the criterion below

The criterion for ahead against inline: bit for bit where the installs and the decode ran on one stream
(a CPU, or CUDA with the voice cache's `side_stream=False`): the same kernels on the same inputs; within
AHEAD_TOL (float32, TF32 off) where installs ran on the side stream beside the decode, since cuBLAS
promises the same bits only while one stream is active ("Results reproducibility" in its guide: with
concurrent streams it may pick other internal implementations). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARTS = ("flow", "vocoder")
AHEAD_TOL = 1e-5
CRITERION = (f"bit for bit on one stream; within {AHEAD_TOL:g} with installs on the side stream "
             "(cuBLAS is bitwise only with one stream active)")


def graph_counts() -> dict[tuple[str, str], int]:
    """`gpu_worker.fallbacks`' graph counts now: the `before` of `graph_figures`."""
    from gpu_worker import fallbacks

    return fallbacks.counts("graph")


def graph_figures(stats: Mapping[str, float], before: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    now = graph_counts()
    moved = {key: n - before.get(key, 0) for key, n in now.items() if n > before.get(key, 0)}
    return {"graphs_captured": {p: int(stats.get(f"{p}_cuda_graphs", 0)) for p in PARTS},
            "graph_fallbacks": {p: {reason: n for (part, reason), n in moved.items() if part == p}
                                for p in PARTS},
            "graph_misses": {p: int(stats.get(f"{p}_graph_misses", 0)) for p in PARTS},
            "graph_replays": {p: int(stats.get(f"{p}_graph_replays", 0)) for p in PARTS}}


def graph_failures(figures: Mapping[str, Any], parts: tuple[str, ...] = PARTS) -> list[str]:
    out = []
    for part in parts:
        if not figures["graphs_captured"][part]:
            out.append(f"no {part} CUDA graph captured")
        for reason, n in figures["graph_fallbacks"][part].items():
            out.append(f"{part} graph fallbacks: {reason} x{n}")
        if figures["graph_misses"][part]:
            out.append(f"{part}: {figures['graph_misses'][part]} calls ran eagerly where a graph should have")
    return out


def fallback_failures(kind_counts: Mapping[str, Mapping[str, int]]) -> list[str]:
    """`kind_counts`: {kind: {"part/reason": n}} (a part's report's `fallbacks`)."""
    return [f"fallback {kind} {key} x{n}" for kind, counts in kind_counts.items() for key, n in counts.items()
            if n]


def ahead_vs_inline(bit_for_bit: bool, max_abs_diff: float, one_stream: bool) -> dict[str, Any]:
    ok = bit_for_bit if one_stream else max_abs_diff <= AHEAD_TOL
    return {"one_stream": one_stream, "bit_for_bit": bit_for_bit, "max_abs_diff": max_abs_diff, "ok": ok,
            "criterion": "bit for bit" if one_stream else f"within {AHEAD_TOL:g}"}


def first_line(name: str, failures: list[str]) -> str:
    """The one line a check's output starts with."""
    if not failures:
        return f"{name}: passed"
    return f"{name}: FAILED ({len(failures)}): " + "; ".join(failures)
