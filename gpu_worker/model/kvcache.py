"""The DiT's attention cache of a stream without copies: the voice's shared frames + the stream's own slots.

The estimator attention has no positions (q/k LayerNorm only), so a chunk's result depends on the SET of
cached frames, not their order. The reference keeps one tensor, newest chunk first, trimmed to logical
[:prompt_len] + [-100:] after every chunk. Here a stream's cache is
    shared: [N, depth, 2, H, P, 2 D]   its voice's setup cache, read-only, shared by all its streams
    own:    SlotBuffer [N, depth, 2, H, CAP, 2 D]  its generated frames, one slot per frame
    order:  the reference's logical order: entry e < P is shared frame e, e >= P own slot e - P
Trimming rewrites `order` only. A solve writes new frames into slots free in the cache it starts from,
so that cache stays valid (a failed step is retried from it); a `SlotBuffer` refuses a cache that is
neither its latest nor that one's parent (a fork, or a stale cache whose slots were reused).

    EstimatorKV.of(att) / kv.trimmed(head, tail) / kv.reference_layout()
    BatchKV(rows, n_new, like, ...)  one solve's `StepKV` (cfm.py): kv(step) packs the rows' own frames,
                                     voice(step) hands each voice's shared frames to be read in place,
                                     keep(step, kv) stores the new frames, results() the rows' new caches
    Workspace()                      the memory of BatchKV's one-step buffer, kept between solves
A stream owns at most max(P, tail) generated frames after a trim, plus one chunk's before it: its first
chunk allocates that capacity, and a buffer too small for a chunk is replaced by a larger copy.

Not in here: the attention itself (`dit.py`, `attention.py`), the Euler loop (`cfm.py`), conformer caches.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gpu_worker.model.dit import FoldedVoice

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
    gather: list[tuple[Tensor, int, int, int]]  # (own slots [N, ...], first slot, length, destination)
    store: list[tuple[int, int, int]]  # (new frame, own slot, length)
    result: EstimatorKV
    shared_live: list[int]  # the shared frames the row attends to
    n_own: int  # its live own frames


@dataclass(frozen=True)
class VoiceFrames:
    """The rows of one voice in a solve and that voice's shared frames, read where they are."""

    rows: Tensor | None  # [2 n] int64: the voice's conditional rows, then their unconditional twins (+ B);
    # None: every row of the solve, in order
    frames: Tensor  # [N, depth, 2 (cond | uncond), H, S, 2 D]: a view of the voice's setup cache, frames
    # [lo, hi): the span of its rows' live ones (in the steady state the prompt's last 100 frames)
    mask: Tensor  # [1, 1, n T, S] bool: row r's query t (at r T + t) may see frame lo + s


class BatchKV:
    """The estimator attention caches of one masked solve over B rows (the CFM's `StepKV`).

    Row i's new frames sit at [0, n_new_i) of its kv rows (i and B + i: cond and uncond), its live own
    frames packed at [T, T + n_alive_i), zeros after them: the key mask is `slot < n_new_i or
    T <= slot < T + n_alive_i`. One buffer serves every Euler step: kv(step) refills the own frames of
    that step, so the extra memory is one step's, [depth, 2B, H, T + W, 2 D], not the whole cache's.
    The voices' shared frames are not copied: `voice(step)` hands the DiT each voice's setup cache at that
    step with the rows that attend to it (`VoiceFrames`), and the DiT attends to it in a part of its own
    (`attention.py`). With a `Workspace` the buffer is the workspace's memory: only the slots past each
    row's live frames are zeroed (new-frame slots are written by every step's attention, own ones by
    `kv(step)`), so nothing an earlier solve left there is read. `copy_shared` packs the shared frames
    into the buffer beside the own ones instead, for every row at every step (the way before the voice
    part; kept as the benchmarks' "before").
    """

    def __init__(self, rows: list[EstimatorKV], n_new: list[int], like: Tensor, *, steps: int,
                 depth: int, heads: int, head_dim: int, tail: int, chunk_frames: int,
                 workspace: Workspace | None = None, copy_shared: bool = False) -> None:
        if len({id(r.own) for r in rows if r.own is not None}) < sum(r.own is not None for r in rows):
            raise ValueError("two rows of one solve continue the same stream")
        self.t_max, self.b = max(n_new), len(rows)
        self._shape = (steps, depth, 2, heads)
        self._width = 2 * head_dim
        self._tail, self._chunk_frames = tail, chunk_frames
        self._plans = [self._plan(r, n, like, copy_shared) for r, n in zip(rows, n_new, strict=True)]
        self.n_alive = [plan.n_own + (len(plan.shared_live) if copy_shared else 0) for plan in self._plans]
        self._voices = [] if copy_shared else self._voice_frames(rows, like.device)
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
        """-> [depth, 2B, H, T + W, 2 D] with every row's own frames of Euler step `step`."""
        for i, plan in enumerate(self._plans):
            rows = self._kv[:, i :: self.b]  # [depth, 2 (cond, uncond), H, T + W, 2 D]
            for src, start, n, dst in plan.gather:
                rows[:, :, :, self.t_max + dst : self.t_max + dst + n] = src[step, ..., start : start + n, :]
        return self._kv

    def voice(self, step: int) -> list[FoldedVoice]:
        """[FoldedVoice(rows [2 n] or None, shared frames of step `step` [depth, 2, H, S, 2 D] (a view),
        mask [1, 1, n T, S])]: one entry per voice in the solve."""
        return [FoldedVoice(v.rows, v.frames[step], v.mask) for v in self._voices]

    def keep(self, step: int, kv: Tensor) -> None:
        """Copies each row's new frames of step `step` (kv[..., :n_new_i, :]) into its own slots."""
        for i, plan in enumerate(self._plans):
            own = plan.result.own.data[step]  # type: ignore[union-attr]
            for frame, slot, n in plan.store:
                own[..., slot : slot + n, :] = kv[:, i :: self.b, :, frame : frame + n]

    def results(self) -> list[EstimatorKV]:
        return [plan.result for plan in self._plans]

    def _voice_frames(self, rows: list[EstimatorKV], device: torch.device) -> list[VoiceFrames]:
        """The rows grouped by the shared frames they read; each row's live ones as a mask over them,
        repeated for its T query slots (masks built here, moved to the device in one copy per voice)."""
        groups: dict[int, tuple[Tensor, list[int]]] = {}
        for i, row in enumerate(rows):
            if row.shared is not None and self._plans[i].shared_live:
                groups.setdefault(id(row.shared), (row.shared, []))[1].append(i)
        out = []
        for shared, members in groups.values():
            lo = min(self._plans[i].shared_live[0] for i in members)  # shared_live is ascending
            hi = max(self._plans[i].shared_live[-1] for i in members) + 1
            mask = torch.zeros(len(members), self.t_max, hi - lo, dtype=torch.bool)
            for j, i in enumerate(members):
                mask[j, :, [e - lo for e in self._plans[i].shared_live]] = True
            index = None
            if members != list(range(self.b)):
                index = torch.tensor(members + [i + self.b for i in members]).to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            out.append(VoiceFrames(index, shared[..., lo:hi, :], mask.view(1, 1, -1, hi - lo)))
        return out

    def _plan(self, row: EstimatorKV, n_new: int, like: Tensor, copy_shared: bool) -> _RowPlan:
        version = next(_versions) if row.own is None else row.own.claim(row.version)
        shared_live, own_live = row.split()
        own, p = row.own, row.n_shared
        if own is None or own.capacity - len(own_live) < n_new:
            own, row, own_live = self._grown(row, own_live, n_new, like, version)
        live = set(own_live)
        slots = list(itertools.islice((s for s in range(own.capacity) if s not in live), n_new))
        gather: list[tuple[Tensor, int, int, int]] = []
        if copy_shared and row.shared is not None:
            gather = [(row.shared, e, n, dst) for dst, e, n in _runs(shared_live)]
        first = len(shared_live) if copy_shared else 0  # own frames after the copied shared ones
        gather += [(own.data, s, n, first + dst) for dst, s, n in _runs(own_live)]
        store = [(frame, s, n) for frame, s, n in _runs(slots)]
        order = tuple(p + s for s in slots) + row.order
        result = EstimatorKV(row.shared, own, order, version)  # type: ignore[arg-type]
        return _RowPlan(gather, store, result, shared_live, len(own_live))

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

