"""Streams decoded by the flow alone (no vocoder), two ways, for the benchmarks and the flow's tests.

    LaneFlow(flow, voices, tail=..., max_new=...)   the decoder's way: every stream in a lane of
        `model.lanes.Lanes` (its encoder caches too), one static-shape `Flow.step_lanes` per step;
        `solve(rows, rows_to=, frames_to=)` pads a step to a graph bucket's shape, `commit=False` leaves
        the streams as they were (a step run again)
    PerStreamFlow(flow, voices, tail=...)           the way before the lanes: every stream owns its
        estimator slots (`model.kvcache`), packed into one step's attention buffer at every Euler step
        by `Flow.stream_chunks`; kept to measure the lanes against

voices: (spk [1, 80], setup cache) each, as `Flow.setup` returns them, all with prompts of one length.
Rows are (stream, tokens [1, T], last); `solve` returns each row's mel [1, 80, n].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_worker.engine.streams import chunk_frames
from gpu_worker.model.encoder_lanes import EncoderShape
from gpu_worker.model.flow import Flow, FlowCache, trim_cache
from gpu_worker.model.kvcache import Workspace
from gpu_worker.model.lanes import Lane, Lanes, LaneShape

Row = tuple[Any, torch.Tensor, bool]


@dataclass
class LaneStream:
    lane: Lane
    mels: list[torch.Tensor] = field(default_factory=list)


class LaneFlow:
    def __init__(self, flow: Flow, voices: list[tuple[torch.Tensor, FlowCache]], *, tail: int,
                 max_new: int) -> None:
        a, like = flow.args, voices[0][0]
        self.flow, self.voices = flow, voices
        self.shape = LaneShape(a.n_timesteps, a.dit.depth, a.dit.num_heads, a.dit.head_dim, a.dit.hidden_size,
                               voices[0][1].estimator_att.size(4), tail, max_new)  # type: ignore[union-attr]
        self.lanes = Lanes(self.shape, device=like.device, dtype=like.dtype, voices=len(voices),
                           encoder=EncoderShape.of(a.encoder, self.shape.prompt_len, tail))
        for i, (_, cache) in enumerate(voices):
            self.lanes.put_voice(i, cache.estimator_att)  # type: ignore[arg-type]
        self.streams: list[LaneStream] = []

    def open(self, voice: int, noise: torch.Tensor) -> LaneStream:
        """noise: the stream's [1, 80, N] buffer."""
        spk, cache = self.voices[voice]
        lane = self.lanes.acquire(voice)
        p, s = self.shape.prompt_len, self.shape
        assert cache.estimator_cnn is not None, "a voice's setup cache"
        assert cache.conformer_cnn is not None and cache.conformer_att is not None
        self.lanes.start(lane, conv=cache.estimator_cnn, noise=noise[0, :, p : p + s.tail + s.max_new].t(),
                         spk=spk[0], conformer=(cache.conformer_cnn, cache.conformer_att))
        self.streams.append(LaneStream(lane))
        return self.streams[-1]

    def close(self, stream: LaneStream) -> None:
        self.lanes.release(stream.lane)
        self.streams.remove(stream)

    def solve(self, rows: list[Row], *, rows_to: int = 0, frames_to: int = 0, commit: bool = True
              ) -> list[torch.Tensor]:
        n_new = [chunk_frames(t.size(1), last) for _, t, last in rows]
        frames, width = max(max(n_new), frames_to), max(self.lanes.n_open, rows_to)
        plan = self.lanes.plan({s.lane.index: n for (s, _, _), n in zip(rows, n_new, strict=True)}, frames,
                               width)
        tokens = self.lanes.encoder_plan({s.lane.index: (t[0].cpu(), last) for s, t, last in rows}, frames,
                                         width)
        window = self.shape.window([s.lane.frames for s, _, _ in rows])
        device = self.lanes.device
        mel, conv, encoded = self.flow.step_lanes(tokens.to(device), plan.to(device), self.lanes, window)
        out = [mel[s.lane.index : s.lane.index + 1, :, :n] for (s, _, _), n in zip(rows, n_new, strict=True)]
        if commit:
            self.lanes.commit_conv(conv[:, :, : 2 * min(self.lanes.n_open, plan.size(0))])
            self.lanes.encoder.commit(*encoded)  # type: ignore[union-attr]
            for (s, _, _), n, m in zip(rows, n_new, out, strict=True):
                self.lanes.advance(s.lane, n)
                s.mels.append(m)
        return out

    def gathered_bytes(self, rows: int, window: int) -> tuple[int, int]:
        """(what one solve gathers of its rows' voice frames over every Euler step and block, the largest
        gather alive at once: one block's [2B, H, W, 2 D])."""
        s = self.shape
        block = rows * 2 * s.heads * window * 2 * s.head_dim * self.lanes.own.element_size()
        return block * s.steps * s.depth, block


@dataclass
class PerStream:
    voice: int
    cache: FlowCache  # the voice's, then its own (estimator slots included)
    noise: torch.Tensor


class PerStreamFlow:
    def __init__(self, flow: Flow, voices: list[tuple[torch.Tensor, FlowCache]], *, tail: int) -> None:
        self.flow, self.voices, self.tail = flow, voices, tail
        self.prompt_len = voices[0][1].estimator_att.size(4)  # type: ignore[union-attr]
        self.workspace = Workspace()

    def open(self, voice: int, noise: torch.Tensor) -> PerStream:
        return PerStream(voice, self.voices[voice][1], noise)

    def solve(self, rows: list[Row]) -> list[torch.Tensor]:
        spk = torch.cat([self.voices[s.voice][0] for s, _, _ in rows])
        mel, n, caches = self.flow.stream_chunks([t for _, t, _ in rows], spk, [s.cache for s, _, _ in rows],
                                                 [last for _, _, last in rows], [s.noise for s, _, _ in rows],
                                                 workspace=self.workspace)
        for (s, _, _), cache in zip(rows, caches, strict=True):
            s.cache = trim_cache(cache, self.prompt_len, self.tail)
        return [mel[i : i + 1, :, :k] for i, k in enumerate(n)]

    def packed_bytes(self, streams: list[PerStream]) -> int:
        """What one solve copies into its attention buffer: every row's own frames, every Euler step."""
        frames = sum(len(s.cache.estimator().split()[1]) for s in streams)
        d, steps = self.flow.args.dit, self.flow.args.n_timesteps
        return frames * steps * d.depth * 2 * d.num_heads * 2 * d.head_dim * self.voices[0][0].element_size()
