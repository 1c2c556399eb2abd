"""The DiT's attention cache of a stream, kept without copies: shared prompt frames + own slots.

The estimator attention has no positions (q/k LayerNorm only), so a chunk's result depends on the SET of
cached frames, not on their order. The reference keeps them in one tensor ordered newest chunk first and
trims it to logical [:prompt_len] + [-100:] after every chunk, which copies the whole cache (about
0.5 GB fp32 per stream at full size) several times per chunk. Here a stream's cache is

    shared: [N, depth, 2, H, P, 2 D]   the voice's setup cache, read-only, shared by all its streams
    own:    SlotBuffer [N, depth, 2, H, CAP, 2 D]  the stream's generated frames, one slot per frame
    order:  the reference's logical order as entries: e < P is shared frame e, e >= P is own slot e - P

Trimming rewrites `order` only. A solve writes a chunk's new frames into slots that are free in the
cache it starts from, so that cache stays valid (a failed step can be retried from it). A `SlotBuffer`
remembers which cache last wrote it (`head`) and its parent: a cache that is neither (a fork, or an
older cache of a stream that has moved on) is refused rather than read after its slots were reused.

    EstimatorKV.of(att)            reference layout [N, depth, 2, H, L, 2 D] (or None) -> lean view, no copy
    kv.trimmed(head, tail)         the reference's trimming rule, bookkeeping only
    kv.reference_layout()          -> [N, depth, 2, H, L, 2 D] in the reference's order (for tests, export)
    BatchKV(rows, n_new, like, steps, depth, heads, head_dim, workspace=None)
                                   one masked solve's view for the CFM: kv(step) -> [depth, 2B, H, T + W, 2 D]
                                   (rows' live frames packed after T new-frame slots, zeros past them),
                                   keep(step, kv) stores each row's new frames in its own slots;
                                   n_alive [B], results() -> new EstimatorKV per row
    Workspace()                    the memory of that one-step buffer, kept from one solve to the next

Capacity: after a trim with head = P >= tail a stream owns at most P generated frames (the last `tail`
logical frames are then the prompt's), else at most `tail`; a chunk adds at most `chunk_frames`. The
first chunk allocates max(P, tail) + max(new frames, chunk_frames) slots (356 for a 6 s prompt), and a
buffer that is too small is replaced by a larger copy (never in the decoder's steady state).

Not in here: the attention itself (`dit.py`), the Euler loop (`cfm.py`), conformer caches (`flow.py`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch import Tensor

_versions = itertools.count(1)


class Workspace:
    """Memory for `BatchKV`'s one-step buffer, reused by every solve of one caller.

    A new buffer per step is, on a CPU, fresh pages from the kernel (glibc serves blocks over 32 MB with
    mmap and returns them on free), whose page faults and zero-fill cost a measurable part of a step
    (docs/PERFORMANCE.md). It grows to the largest step seen and is never shrunk. One caller at a time: a
    solve on another CUDA stream (a side-stream install) must not share it.
    """

    def __init__(self) -> None:
        self._flat: Tensor | None = None

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A tensor of `shape` (dtype and device of `like`); its contents are left from earlier solves."""
        n = math.prod(shape)
        flat = self._flat
        if flat is None or flat.numel() < n or flat.dtype != like.dtype or flat.device != like.device:
            self._flat = flat = None  # the old block goes before the larger one is taken
            self._flat = flat = like.new_zeros(n)
        return flat[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()


class SlotBuffer:
    """A stream's own frames: data [N, depth, 2, H, CAP, 2 D]; `head` / `parent` are cache versions."""

    def __init__(self, data: Tensor, version: int) -> None:
        self.data = data
        self.head = version  # the cache that may write next (the last one produced)
        self.parent = -1  # the cache `head` was produced from: may write again (a retried step)

    @property
    def capacity(self) -> int:
        return self.data.size(4)

    def claim(self, version: int) -> int:
        """A solve starts from cache `version`: -> the version of the cache it produces."""
        if version not in (self.head, self.parent):
            raise RuntimeError("this flow cache is stale: its stream has moved on (or it was forked), and "
                               "its free slots have been reused; continue from the stream's latest cache")
        new = next(_versions)
        self.head, self.parent = new, version
        return new


@dataclass(frozen=True)
class EstimatorKV:
    shared: Tensor | None  # [N, depth, 2, H, P, 2 D], read-only
    own: SlotBuffer | None
    order: tuple[int, ...]  # logical (reference) order, newest chunk first
    version: int = 0

    @classmethod
    def of(cls, att: Tensor | None) -> EstimatorKV:
        """A reference-layout cache as the shared, read-only frames of a new lean cache (no copy)."""
        return cls(None, None, ()) if att is None else cls(att, None, tuple(range(att.size(4))))

    def __len__(self) -> int:
        return len(self.order)

    @property
    def n_shared(self) -> int:
        return 0 if self.shared is None else self.shared.size(4)

    def split(self) -> tuple[list[int], list[int]]:
        """Live shared frames and live own slots, each ascending."""
        p = self.n_shared
        return sorted(e for e in self.order if e < p), sorted(e - p for e in self.order if e >= p)

    def trimmed(self, head: int, tail: int) -> EstimatorKV:
        """Keeps logical frames [:head] and [-tail:] (the reference's rule); no tensor is touched."""
        if len(self.order) <= head + tail:
            return self
        new = EstimatorKV(self.shared, self.own, self.order[:head] + self.order[len(self.order) - tail:],
                          next(_versions))
        if self.own is not None and self.own.head == self.version:
            self.own.head = new.version  # the trimmed cache is the stream's latest
        return new

    def reference_layout(self) -> Tensor | None:
        """-> [N, depth, 2, H, L, 2 D] in the reference's order. May be a stored tensor: do not write it."""
        p = self.n_shared
        if self.own is None and self.order == tuple(range(p)):
            return self.shared
        if self.shared is None and self.own is not None and self.order == tuple(range(self.own.capacity)):
            return self.own.data
        if not self.order:
            return None
        sources = [t for t in (self.shared, None if self.own is None else self.own.data) if t is not None]
        out = sources[0].new_empty(*sources[0].shape[:4], len(self.order), sources[0].size(5))
        for pos, entry, n in _runs(list(self.order), boundary=p):
            src, start = (sources[0], entry) if entry < p else (sources[-1], entry - p)
            out[..., pos : pos + n, :] = src[..., start : start + n, :]
        return out

    def own_nbytes(self) -> int:
        """Bytes of the stream's own slot buffer (the shared frames are the voice's)."""
        return 0 if self.own is None else self.own.data.numel() * self.own.data.element_size()


def _runs(entries: list[int], boundary: int = -1) -> list[tuple[int, int, int]]:
    """[(position, first entry, length)] of the maximal runs of consecutive entries (none across
    `boundary`: the first own entry after the last shared one)."""
    runs: list[tuple[int, int, int]] = []
    for pos, e in enumerate(entries):
        if runs and runs[-1][1] + runs[-1][2] == e != boundary and runs[-1][0] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, e, 1))
    return runs


@dataclass(frozen=True)
class _RowPlan:
    gather: list[tuple[Tensor, int, int, int]]  # (source [N, ...], first frame, length, destination)
    store: list[tuple[int, int, int]]  # (new frame, own slot, length)
    result: EstimatorKV


class BatchKV:
    """The estimator attention caches of one masked solve over B rows (the CFM's `StepKV`).

    Row i's new frames sit at [0, n_new_i) of its kv rows (i and B + i: cond and uncond), its live cached
    frames packed at [T, T + n_alive_i), zeros after them: the key mask is `slot < n_new_i or
    T <= slot < T + n_alive_i`. One buffer serves every Euler step: kv(step) refills the cached frames of
    that step, so the extra memory is one step's, [depth, 2B, H, T + W, 2 D], not the whole cache's.
    With a `Workspace` that buffer is the workspace's memory: only the slots past each row's live frames are
    zeroed (new-frame slots are written by every step's attention, cached ones by `kv(step)`), so nothing
    an earlier solve left there is read.
    """

    def __init__(self, rows: list[EstimatorKV], n_new: list[int], like: Tensor, *, steps: int,
                 depth: int, heads: int, head_dim: int, tail: int, chunk_frames: int,
                 workspace: Workspace | None = None) -> None:
        if len({id(r.own) for r in rows if r.own is not None}) < sum(r.own is not None for r in rows):
            raise ValueError("two rows of one solve continue the same stream")
        self.t_max, self.b = max(n_new), len(rows)
        self.n_alive = [len(r) for r in rows]
        self._shape = (steps, depth, 2, heads)
        self._width = 2 * head_dim
        self._tail, self._chunk_frames = tail, chunk_frames
        self._plans = [self._plan(r, n, like) for r, n in zip(rows, n_new, strict=True)]
        width = self.t_max + max(self.n_alive)
        shape = (depth, 2 * self.b, heads, width, 2 * head_dim)
        if workspace is None:
            self._kv = like.new_zeros(shape)
        else:
            self._kv = workspace.take(shape, like)
            for i, alive in enumerate(self.n_alive):
                if self.t_max + alive < width:  # masked slots must hold finite values: zeros
                    self._kv[:, i :: self.b, :, self.t_max + alive :].zero_()

    def kv(self, step: int) -> Tensor:
        """-> [depth, 2B, H, T + W, 2 D] with every row's cached frames of Euler step `step`."""
        for i, plan in enumerate(self._plans):
            rows = self._kv[:, i :: self.b]  # [depth, 2 (cond, uncond), H, T + W, 2 D]
            for src, start, n, dst in plan.gather:
                rows[:, :, :, self.t_max + dst : self.t_max + dst + n] = src[step, ..., start : start + n, :]
        return self._kv

    def keep(self, step: int, kv: Tensor) -> None:
        """Copies each row's new frames of step `step` (kv[..., :n_new_i, :]) into its own slots."""
        for i, plan in enumerate(self._plans):
            own = plan.result.own.data[step]  # type: ignore[union-attr]
            for frame, slot, n in plan.store:
                own[..., slot : slot + n, :] = kv[:, i :: self.b, :, frame : frame + n]

    def results(self) -> list[EstimatorKV]:
        return [plan.result for plan in self._plans]

    def _plan(self, row: EstimatorKV, n_new: int, like: Tensor) -> _RowPlan:
        version = next(_versions) if row.own is None else row.own.claim(row.version)
        shared_live, own_live = row.split()
        own, p = row.own, row.n_shared
        if own is None or own.capacity - len(own_live) < n_new:
            own, row, own_live = self._grown(row, own_live, n_new, like, version)
        live = set(own_live)
        slots = list(itertools.islice((s for s in range(own.capacity) if s not in live), n_new))
        gather = [(row.shared, e, n, dst) for dst, e, n in _runs(shared_live)]
        gather += [(own.data, s, n, len(shared_live) + dst) for dst, s, n in _runs(own_live)]
        store = [(frame, s, n) for frame, s, n in _runs(slots)]
        order = tuple(p + s for s in slots) + row.order
        return _RowPlan(gather, store, EstimatorKV(row.shared, own, order, version))  # type: ignore[arg-type]

    def _grown(self, row: EstimatorKV, own_live: list[int], n_new: int, like: Tensor, version: int
               ) -> tuple[SlotBuffer, EstimatorKV, list[int]]:
        """A new slot buffer with room for `n_new` more frames; live own frames copied to [0, n)."""
        if row.own is None and row.shared is None:
            capacity = n_new  # a setup solve: exactly its frames, which become the voice's shared cache
        else:
            bound = max(row.n_shared, self._tail) + max(n_new, self._chunk_frames)
            capacity = max(bound, len(own_live) + n_new)
        buffer = SlotBuffer(like.new_empty(*self._shape, capacity, self._width), version)
        remap: dict[int, int] = {}
        if row.own is not None:
            for dst, s, n in _runs(own_live):
                buffer.data[..., dst : dst + n, :] = row.own.data[..., s : s + n, :]
            remap = {s: i for i, s in enumerate(own_live)}
        p = row.n_shared
        order = tuple(e if e < p else p + remap[e - p] for e in row.order)
        return buffer, EstimatorKV(row.shared, buffer, order, version), list(range(len(own_live)))

