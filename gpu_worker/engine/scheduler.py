"""Scheduling policy: which live streams get a row in the next engine step.

Pure policy over small records; no model, no tensors, no clock. The engine builds one `StreamView` per
live stream each step and asks `Scheduler.pick` for up to `micro_batch_size` of them.

The policy:
1. only streams that are ready (a chunk's tokens are available and the voice is installed or its install
   is in flight on the side stream) can be picked; a stream has at most one row per step, because chunk
   k+1 needs the caches chunk k leaves behind;
2. higher `priority` first (strict);
3. within a priority, round robin: every stream holds a ticket; it gets one when first seen (in arrival
   order) and a fresh one each time it is served, and the lowest tickets go first. A new job therefore
   queues behind streams that have waited longer, and a stream that is not ready keeps its place;
4. first chunks go beside continuing ones in the same step (no separate prefill phase);
5. an idle engine (no stream past its first chunk) with a batch that is not full may gather before its
   first step (`gather_until`): until no job has arrived for half the admission window, or the window
   since the first ready job has passed, so that a burst of jobs submitted one by one starts in one step
   instead of the first starting alone and every later step mixing chunk offsets.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamView:
    """What the policy sees of one live stream."""

    job_id: str
    voice_id: str
    ready: bool  # a chunk can be decoded in the next step
    chunk_index: int  # the chunk the next row would decode (0 = the stream's first)
    priority: int = 0  # larger goes first
    arrival: float = 0.0  # admission time or sequence number; orders streams first seen together


def gather_until(*, window_s: float, micro_batch_size: int, ready: Sequence[float],
                 arrived: Sequence[float], started: bool, now: float) -> float | None:
    """When an idle engine's first step may start, or None for now (policy 5). `ready` and `arrived` are
    the admission times of the ready streams and of every live one; `started`: a stream is past its
    first chunk."""
    if window_s <= 0 or not ready or len(ready) >= micro_batch_size or started:
        return None
    until = min(min(ready) + window_s, max(arrived) + window_s / 2)
    return until if now < until else None


class Scheduler:
    """Round robin within strict priority; remembers each stream's place between steps."""

    def __init__(self, *, micro_batch_size: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self._tickets: dict[str, int] = {}
        self._counter = itertools.count()

    def pick(self, streams: Sequence[StreamView]) -> list[StreamView]:
        """Choose the rows of the next step, in ticket order; the chosen streams go to the back."""
        self._issue_tickets(streams)
        ready = [s for s in streams if s.ready]
        ready.sort(key=lambda s: (-s.priority, self._tickets[s.job_id]))
        chosen = ready[: self.micro_batch_size]
        for view in chosen:
            self._tickets[view.job_id] = next(self._counter)
        return chosen

    def forget(self, job_id: str) -> None:
        """Drop a finished, failed or aborted stream's place."""
        self._tickets.pop(job_id, None)

    def _issue_tickets(self, streams: Sequence[StreamView]) -> None:
        seen: set[str] = set()
        for view in sorted(streams, key=lambda s: (s.arrival, s.job_id)):
            if view.job_id in seen:
                raise ValueError(f"stream {view.job_id} listed twice")
            seen.add(view.job_id)
            if view.job_id not in self._tickets:
                self._tickets[view.job_id] = next(self._counter)
