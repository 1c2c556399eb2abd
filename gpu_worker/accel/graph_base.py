"""What both CUDA-graph runners share: the runner base, capture on one stream, buckets, probes and stats.

    GraphRunner(inner, part=, key_name=, max_graphs=, capturable=)   the base of `graphs.GraphedHiFT` and
        `flow_graphs.GraphedFlow`: attribute passthrough to the wrapped module, the slots per key, a key
        captured the second time it is seen (`_slot_for`), a capture probed and given up for good on failure
        (`_try_capture`), capture time and graph memory (`_timed`), the graph pool (`_record`), `stats()`
    row_buckets(max_rows), bucket_of(n, buckets)    the row counts graphs are made for
    capture_stream(), record(run, pool)             warm-up and capture on one stream per device
    CALLS, MISSES, eager_reason, call_stats         why a call ran eagerly, and the counts the GPU check reads
    replay_matches(graphed, eager)                  a probe's verdict: a replay against the eager call

A runner keeps what only it knows (its key, its static buffers, how a call loads them and how a capture is
probed); the bookkeeping is here, so both count, fall back and report the same way.

Degrade, never die (`gpu_worker.fallbacks`): a capture that raises or a replay that differs from the eager
call leaves that key eager for good (until the runner drops its graphs), logged once and counted in
`wavefarm_graph_fallbacks_total{part,reason}` (reason capture_error | replay_mismatch).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn as nn
from torch import Tensor

from gpu_worker import fallbacks

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts graphs are made for: powers of two up to `max_rows`, and `max_rows` itself."""
    return tuple(sorted({b for b in BUCKETS if b < max_rows} | {max_rows}))


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding n (n itself past the largest: that shape runs eagerly)."""
    return next((b for b in buckets if b >= n), n)


_CAPTURE_STREAMS: dict[int, Any] = {}  # device index -> the stream every capture on it uses


def capture_stream() -> Any:
    """The one stream this process warms graphs up and captures them on, per device. A stream that runs a
    matrix product gets a cuBLAS workspace of its own, so a new stream per capture held one per capture;
    warming up on the capture stream itself also makes that workspace before the capture, not in it."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


def record(run: Any, pool: Any) -> tuple[Any, Any]:
    """`run` warmed up on the capture stream (as capture requires; the warm-up runs are real calls), then
    captured there into `pool` (a `torch.cuda.graph_pool_handle()`): -> (the graph, the outputs it writes
    on every replay). Capture only records: replay the graph for its first outputs."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs


# Why a runner's call ran eagerly: `first_sight` (a key is captured the second time it is seen: by design),
# `fallback` (its capture failed or its replay differed: counted in gpu_worker.fallbacks too),
# `over_limit` (max_graphs held already), `not_capturable` (not on CUDA). The last three are misses: on
# CUDA a bucket that should have run as a graph did not (the GPU check fails on them).
CALLS = ("replay", "first_sight", "fallback", "over_limit", "not_capturable")
MISSES = ("fallback", "over_limit", "not_capturable")


def eager_reason(capturable: bool, seen: int, failed: bool) -> str:
    if not capturable:
        return "not_capturable"
    if failed:
        return "fallback"
    return "first_sight" if seen < 2 else "over_limit"


def call_stats(part: str, calls: Counter[str]) -> dict[str, float]:
    """A runner's calls as stats: replays, eager first sightings and misses (`CALLS`)."""
    return {f"{part}_graph_replays": calls["replay"], f"{part}_eager_first_sight": calls["first_sight"],
            f"{part}_graph_misses": sum(calls[k] for k in MISSES)}


def replay_matches(graphed: Sequence[Tensor], eager: Sequence[Tensor]) -> str | None:
    """None if a replay's outputs are the eager call's within rounding (float32: 1e-4, half types: 3e-2,
    of the larger of 1 and the eager output's magnitude), else what differs."""
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        if a.shape != b.shape:
            return f"output {i}: shape {tuple(a.shape)} against {tuple(b.shape)}"
        if a.numel() == 0 or not a.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        x, y = a.float(), b.float()
        finite = torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), finite):
            return f"output {i}: non-finite values where eager has none (or the reverse)"
        scale = max(1.0, float(y[finite].abs().max()) if bool(finite.any()) else 1.0)
        diff = float(torch.where(finite, (x - y).abs(), torch.zeros_like(x)).max())
        if diff > (1e-4 if b.dtype == torch.float32 else 3e-2) * scale:
            return f"output {i}: max |replay - eager| = {diff:.3g} (scale {scale:.3g})"
    return None


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


class Slot(Protocol):
    graph: Any  # torch.cuda.CUDAGraph once captured (replay()), else None


M = TypeVar("M", bound=nn.Module)
K = TypeVar("K", bound=Hashable)
S = TypeVar("S", bound=Slot)
T = TypeVar("T")


class GraphRunner(nn.Module, Generic[M, K, S]):
    """A module's calls through static buffers, replayed as CUDA graphs per key on CUDA (module docstring).
    `part` names it in stats and fallbacks (flow | vocoder); `key_name` in a fallback's detail."""

    def __init__(self, inner: M, *, part: str, key_name: str, max_graphs: int,
                 capturable: bool) -> None:
        super().__init__()
        self.inner: M = inner
        self.part, self.key_name = part, key_name
        self.max_graphs = max_graphs
        self.capturable = capturable
        self._slots: dict[K, S] = {}
        self._seen: Counter[K] = Counter()
        self._eager: set[K] = set()  # keys whose capture failed or whose replay differed
        self._pool: Any = None
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.calls: Counter[str] = Counter()  # the calls: replayed, or eager and why (`CALLS`)

    def __getattr__(self, name: str) -> Any:  # whatever the wrapped module has: the runner stands in for it
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    @property
    def graphs(self) -> int:
        return sum(slot.graph is not None for slot in self._slots.values())

    def stats(self) -> dict[str, float]:
        p = self.part
        return {f"{p}_cuda_graphs": self.graphs, f"{p}_graph_capture_s": self.capture_s,
                f"{p}_graph_bytes": self.graph_bytes, **call_stats(p, self.calls)}

    def _slot_for(self, key: K, capture: Callable[[], S | None]) -> S | None:
        """A call of `key` seen: its captured slot (captured now, by `capture`, if it is due), counted as a
        replay; None, counted as an eager call and why, where it runs eagerly."""
        self._seen[key] += 1
        slot = self._slots.get(key)
        if slot is None and self._due(key):
            slot = capture()
        if slot is None:
            self.calls[eager_reason(self.capturable, self._seen[key], key in self._eager)] += 1
        else:
            self.calls["replay"] += 1
        return slot

    def _due(self, key: K) -> bool:
        return (self.capturable and self._seen[key] >= 2 and self.graphs < self.max_graphs
                and key not in self._eager)

    def _try_capture(self, key: K, capture: Callable[[], S], probe: Callable[[S], str | None]) -> S | None:
        """`capture()` (which files the slot under `key`), then `probe(slot)` -> the slot; None (the key
        runs eagerly from now on, counted as a fallback) if either fails."""
        try:
            slot = capture()
            problem = probe(slot)
        except Exception as exc:  # capture raises assorted errors; an eager call beats a dead worker
            self._give_up(key, "capture_error", f"{type(exc).__name__}: {exc}")
            return None
        if problem is not None:
            self._give_up(key, "replay_mismatch", problem)
            return None
        return slot

    def _give_up(self, key: K, reason: str, detail: str) -> None:
        self._slots.pop(key, None)
        self._eager.add(key)
        fallbacks.record("graph", self.part, reason, f"{self.key_name} {key}: {detail}")

    def _forget(self) -> None:
        """Every graph dropped and every key may be tried again (the tensors they read moved)."""
        self._slots.clear()
        self._eager.clear()

    def _timed(self, capture: Callable[[], T]) -> tuple[T, float]:
        """`capture()` -> (its result, seconds), its time and the device memory it took added up."""
        start, before = time.perf_counter(), allocated()
        result = capture()
        took = time.perf_counter() - start
        self.capture_s += took
        self.graph_bytes += max(0, allocated() - before)
        return result, took

    def _record(self, run: Any) -> tuple[Any, Any]:
        """`record(run)` into this runner's graph pool (tests put a stand-in graph here)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record(run, self._pool)
