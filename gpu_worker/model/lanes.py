"""The streams' estimator caches in fixed tensors, so that a decode step's solve has static shapes.

Every open stream holds a lane of `Lanes`; every voice its streams use is copied once into a voice slot:
    own    [N, depth, L, 2, H, CAP, 2 D]  CAP = P + F frame slots per lane and Euler step: its frames
    conv   [N, depth, L, 2, 2 C, 2]       the estimator's causal-conv caches
    noise  [L, tail + F, 80]              frames [P, P + tail + F) of the lane's noise buffer
    spk    [L, 80]                        its projected speaker embedding
    voices [V, N, depth, 2, H, P, 2 D]    the setup caches of the voices in use (read-only)
L lanes, V voice slots, N Euler steps, P prompt frames, F the most new frames of a chunk, tail the
frames of the prompt the reference keeps (100). The `2` is [cond, uncond] right after the lane, so rows
0..B-1 of a solve are lanes 0..B-1 and `own[s, :, :B]` is their [depth, 2B, H, CAP, 2 D] kv, as
(cond, uncond) pairs (`cfm.CFM.solve(pairs=True)`), without a copy.

The reference's trimming (after each chunk keep logical frames [:P] and [-tail:] of newest chunk first,
a chunk's own frames in their order, then the prompt's) for P >= tail:
    its own frames that count  `Lane.order`: its slots in that logical order, cut to the first P after a
                               trim; kept on the host (where a cut falls inside a chunk it keeps that
                               chunk's first frames, so no formula of o gives the set in general)
    its voice's frames          e < P - o, and e >= P - tail (o: the frames it has generated so far)
    its noise offset           P + min(o, tail)
A chunk's new frames go to slots no frame that counts holds (CAP = P + F leaves F of them), so a
step may be run again (a retry) and padding frames may be written past a row's valid ones. A lane with
no new frames in a step (one without a chunk, or a free one) rides along: its writes land on such
slots, its conv caches come back unchanged, its output is not read. So a solve's shape is (rows B, new
frames T, voice window W) and nothing else; each step's plan is one small int tensor:
    Lanes.plan({lane: new frames}, T, B) -> [B, 3 + T + CAP] = (new frames, o, voice slot, the T slots
        to write, 1 for each slot the row reads) per lane 0..B-1, on the host
    LaneStep.of(lanes, plan on the device, W)   every mask and index from it (the CFM's `StepKV`,
                                                `lane_step.py`)
    Lanes.advance(lane, new frames)             after the step: its order and o, trimmed
Lanes are kept dense (`release` moves the highest lane into the freed one), so a solve whose rows are
every open stream covers lanes 0..n-1 and no more. Built with an `EncoderShape`, the lanes also hold
each stream's encoder caches (`encoder_lanes.EncoderLanes`, moved and grown with the rest), so that a
whole decode step (`Flow.step_lanes`) has static shapes. Not in here: the Euler loop (`cfm.py`), which
voice holds which slot (`gpu_worker.voices.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpu_worker.model.encoder_lanes import EncoderLanes, EncoderShape


@dataclass(frozen=True)
class LaneShape:
    steps: int  # N
    depth: int
    heads: int  # H
    head_dim: int  # D
    hidden: int  # C
    prompt_len: int  # P
    tail: int
    max_new: int  # F

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.max_new

    def window(self, generated: list[int]) -> int:
        """The voice frames a solve must see, for rows that have generated these many frames: only the
        last `tail` once every row is past its prompt's length, else all P."""
        return self.tail if min(generated) >= self.prompt_len else self.prompt_len


@dataclass
class Lane:
    """A stream's place; `index` changes when `Lanes.release` moves it down."""

    index: int
    voice: int = 0  # its voice's slot
    frames: int = 0  # o: mel frames generated so far
    order: list[int] = field(default_factory=list)  # the slots it reads, in the reference's order
    encoded: tuple[int, int] = (0, 0)  # the encoder caches' frames it holds: first stage, second stage
    open: bool = True


class Lanes:
    """The fixed tensors of every open stream and voice in use. Grows (a new, larger tensor and a copy)
    when a lane or a voice slot is needed and none is free: `version` counts it, since a CUDA graph
    captured over the old tensors must be captured again."""

    def __init__(self, shape: LaneShape, *, device: torch.device, dtype: torch.dtype,
                 lanes: int = 0, voices: int = 1, encoder: EncoderShape | None = None) -> None:
        if shape.prompt_len < shape.tail:
            raise ValueError(f"lanes need prompts of at least {shape.tail} frames, got {shape.prompt_len}")
        self.shape, self.device, self.dtype = shape, device, dtype
        self.version = 0
        self.own = self._zeros(shape.steps, shape.depth, 0, 2, shape.heads, shape.capacity,
                               2 * shape.head_dim)
        self.conv = self._zeros(shape.steps, shape.depth, 0, 2, 2 * shape.hidden, 2)
        self.noise = self._zeros(0, shape.tail + shape.max_new, 80)
        self.spk = self._zeros(0, 80)
        self.voices = self._zeros(0, shape.steps, shape.depth, 2, shape.heads, shape.prompt_len,
                                  2 * shape.head_dim)
        self.encoder = None if encoder is None else EncoderLanes(encoder, device=device, dtype=dtype)
        self._lanes: list[Lane] = []
        self.reserve(lanes, max(1, voices))

    @property
    def n_open(self) -> int:
        return len(self._lanes)

    @property
    def capacity(self) -> int:
        return self.own.size(2)

    def lane_nbytes(self) -> int:
        """Device bytes one lane holds: its frame slots, conv caches, noise and speaker embedding."""
        per = [t[:, :, :1] if t.dim() > 5 else t[:1] for t in (self.own, self.conv, self.noise, self.spk)]
        encoder = 0 if self.encoder is None else self.encoder.lane_nbytes()
        return encoder + sum(t.numel() * t.element_size() for t in per)

    def voice_nbytes(self) -> int:
        return self.voices[:1].numel() * self.voices.element_size()

    # -- lanes ---------------------------------------------------------------------------------------
    def acquire(self, voice: int) -> Lane:
        """The next lane (lanes 0..n-1 are the open ones), for a stream of the voice in slot `voice`; its
        frame slots are zeroed, so nothing a stream that held it before left there (even a NaN) is read."""
        if self.n_open == self.capacity:
            self.reserve(max(1, 2 * self.capacity), self.voice_slots)
        lane = Lane(self.n_open, voice)
        self.own[:, :, lane.index].zero_()
        self._lanes.append(lane)
        return lane

    def release(self, lane: Lane) -> None:
        """Close a lane: the highest open lane moves into it (its tensors copied), so lanes stay dense."""
        if not lane.open:
            return
        lane.open = False
        last = self._lanes.pop()
        if last is not lane:
            for t in (self.own, self.conv):
                t[:, :, lane.index] = t[:, :, last.index]
            for t in (self.noise, self.spk):
                t[lane.index] = t[last.index]
            if self.encoder is not None:
                self.encoder.move(lane.index, last.index)
            self._lanes[lane.index] = last
            last.index = lane.index

    def start(self, lane: Lane, *, conv: Tensor, noise: Tensor, spk: Tensor,
              conformer: tuple[Tensor, Tensor] | None = None) -> None:
        """A stream's first state: its voice's conv caches [N, depth, 2, 2C, 2], its noise frames
        [tail + F, 80] and speaker embedding [80] (its frame slots need nothing: o = 0); with encoder
        lanes, its voice's conformer caches (cnn, att) in the reference's layout."""
        self.conv[:, :, lane.index] = conv
        self.noise[lane.index] = noise
        self.spk[lane.index] = spk
        if self.encoder is not None:
            assert conformer is not None, "lanes with encoder caches start a lane from its voice's"
            lane.encoded = self.encoder.start(lane.index, *conformer)

    # -- a step's plan ------------------------------------------------------------------------------
    def plan(self, new: dict[int, int], frames: int, rows: int) -> Tensor:
        """The plan of a solve over lanes 0..rows-1: `new` maps a lane index (< rows) to its chunk's new
        frames, `frames` is the solve's T. Open lanes in range without an entry ride along with none;
        lanes past the open ones are free (made if the lanes hold fewer than `rows`)."""
        if new and max(new) >= rows:
            raise ValueError(f"a plan of {rows} lanes cannot hold lane {max(new)}")
        self.reserve(rows, self.voice_slots)
        cap = self.shape.capacity
        plan = torch.zeros(rows, 3 + frames + cap, dtype=torch.int64)
        plan[:, 3 : 3 + frames] = torch.arange(frames)  # a free lane reads one slot it writes, nothing else
        plan[:, 3 + frames] = 1
        for lane in self._lanes[:rows]:
            n, write = new.get(lane.index, 0), self._free(lane, frames)
            row = plan[lane.index]
            row[0], row[1], row[2] = n, lane.frames, lane.voice
            row[3 : 3 + frames] = torch.tensor(write)
            row[3 + frames :] = 0
            row[3 + frames + torch.tensor(lane.order + write[: max(n, 1)], dtype=torch.int64)] = 1
        return plan

    def encoder_plan(self, chunks: dict[int, tuple[Tensor, bool]], frames: int, rows: int) -> Tensor:
        """The encoder's plan over lanes 0..rows-1 (`EncoderLanes.plan`): `chunks` maps a lane index to
        its chunk's tokens [T] and whether it is the stream's last; other lanes ride along (a free one
        as if full, so that each row has keys to attend to)."""
        assert self.encoder is not None
        full = (self.encoder.shape.first_width, self.encoder.shape.second_width)
        held = [lane.encoded for lane in self._lanes[:rows]] + [full] * max(0, rows - self.n_open)
        return self.encoder.plan([(h, *chunks.get(i, (None, True))) for i, h in enumerate(held)], frames)

    def advance(self, lane: Lane, n_new: int) -> None:
        """A lane's chunk of `n_new` frames is done: they are its newest (in their order), then the
        reference's trim ([:P] + [-tail:] of the whole logical order; the tail is the voice's)."""
        s = self.shape
        if self.encoder is not None:
            lane.encoded = self.encoder.held_after(lane.encoded, n_new // self.encoder.shape.up)
        order = self._free(lane, n_new) + lane.order
        shared = self._shared(lane.frames)
        if len(order) + shared > s.prompt_len + s.tail:
            order = order[: s.prompt_len]
        lane.order, lane.frames = order, lane.frames + n_new

    def _free(self, lane: Lane, n: int) -> list[int]:
        """The first n slots the lane does not read: where its next n frames go."""
        held = set(lane.order)
        return [slot for slot in range(self.shape.capacity) if slot not in held][:n]

    def _shared(self, done: int) -> int:
        """How many of its voice's frames a lane that has generated `done` frames still reads."""
        s = self.shape
        return min(s.prompt_len, max(0, s.prompt_len - done) + s.tail)

    def commit_conv(self, new_conv: Tensor) -> None:
        """A solve's new conv caches [N, depth, 2B, 2C, 2] into lanes 0..B-1 (a lane without a chunk
        gets its own back)."""
        b = new_conv.size(2) // 2
        self.conv[:, :, :b] = new_conv.view(*new_conv.shape[:2], b, 2, *new_conv.shape[3:])

    # -- voices --------------------------------------------------------------------------------------
    @property
    def voice_slots(self) -> int:
        return self.voices.size(0)

    def put_voice(self, index: int, frames: Tensor) -> None:
        """A voice's setup cache [N, depth, 2, H, P, 2 D] into slot `index` (which voice holds which slot
        is the caller's bookkeeping: `gpu_worker.engine.decoder`)."""
        if tuple(frames.shape) != tuple(self.voices.shape[1:]):
            raise ValueError(f"a voice cache of shape {tuple(frames.shape)} does not fit lanes built for "
                             f"{tuple(self.voices.shape[1:])} (prompts of {self.shape.prompt_len} frames)")
        self.voices[index] = frames

    # -- growth --------------------------------------------------------------------------------------
    def reserve(self, lanes: int, voices: int) -> None:
        """At least this many lanes and voice slots (growing copies what is held; a new `version`)."""
        grow_lanes, grow_voices = lanes > self.capacity, voices > self.voices.size(0)
        if grow_lanes:
            self.own, self.conv = (self._grown(t, 2, lanes) for t in (self.own, self.conv))
            self.noise, self.spk = (self._grown(t, 0, lanes) for t in (self.noise, self.spk))
            if self.encoder is not None:
                self.encoder.grow(lanes)
        if grow_voices:
            self.voices = self._grown(self.voices, 0, voices)
        if grow_lanes or grow_voices:
            self.version += 1

    def _grown(self, t: Tensor, dim: int, size: int) -> Tensor:
        shape = list(t.shape)
        shape[dim] = size
        out = self._zeros(*shape)
        out.narrow(dim, 0, t.size(dim)).copy_(t)
        return out

    def _zeros(self, *shape: int) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

