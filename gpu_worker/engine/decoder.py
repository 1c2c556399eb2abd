"""The batched streaming decoder: one step decodes one chunk of each of up to `micro_batch_size` streams.

    open_stream(voice, seed) -> StreamState          close_stream(stream): its lane back (aborted jobs)
    step([ChunkRow(stream, tokens, last), ...]) -> [audio [S_i] per row]
        = the flow over the decoder's lanes (`Flow.step_lanes`: every row's chunk through the encoder
          and one masked CFM solve, static shapes, no host read, one CUDA graph when `model.flow` is
          `accel.flow_graphs.GraphedFlow`), then the vocoder with each stream's HiFT streaming state.

Every open stream holds a lane (`model/lanes.py`): its encoder caches, slots for its own estimator
frames, its conv caches, its noise frames and speaker embedding, at fixed addresses; its voice's setup
frames are copied once into a voice slot that every stream of the voice reads (`voice_slots.VoiceSlots`).
A step's plan (what each lane holds, its chunk's tokens, where its new frames go) is built on the host
from bookkeeping alone and goes to the device as one copy. A solve covers lanes
0..B-1, B its highest row's lane + 1 (lanes stay dense, so with a row for every open stream B is the
number of rows); an open lane without a chunk in the step rides along with no new frames and is left
as it was. A stream takes its voice's frames into the lanes at its first step, once the engine has made
the device wait for the voice's install (`VoiceCache.wait_ready`).

A stream's audio depends only on (voice, tokens, seed), not on what else shares its steps: its noise
buffer and its vocoder draws come from one generator seeded with the job's seed, in that order (the
reference's global-RNG order when seeded the same way).

HiFT streaming (MODEL.md): each chunk vocodes [8 cached mel frames | new frames] with the previous
3840 source samples, cross-fades its first 3840 samples with the previous tail through hamming(7680),
keeps its last 3840 samples as the next tail and emits them only after the last chunk. The vocoder runs
once per group of rows with equal shapes (its convolutions are not causal, so rows are never padded).

A step changes its streams only after every row succeeded (the vocoder generators are restored on
failure, the encoder and conv caches committed last, and the solve writes new frames only to slots no
row reads yet), so a failed step can be retried row by row with the same result.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gpu_worker.engine.streams import ChunkRow, chunk_frames, plan_chunks
from gpu_worker.model.config import (
    ATT_CACHE_TAIL,
    HIFT_MEL_CACHE,
    HIFT_SOURCE_CACHE,
    LOOKAHEAD_TOKENS,
)
from gpu_worker.model.encoder_lanes import EncoderShape
from gpu_worker.model.flow import CHUNK_FRAMES
from gpu_worker.model.hift import SourceNoise, draw_source_noise
from gpu_worker.model.lanes import Lane, Lanes, LaneShape
from gpu_worker.voices.prompt import VoicePrompt, seeded_noise
from gpu_worker.voices.slots import VoiceSlots


@dataclass
class StreamState:
    """One job's stream. Mutated only by its decoder."""

    voice: VoicePrompt
    seed: int
    generator: torch.Generator  # vocoder source noise, continues after the noise buffer's draw
    noise: Tensor  # [tail + F, 80]: frames [P, P + tail + F) of its seeded noise buffer, until it has a lane
    mel_tail: Tensor  # [1, 80, <= 8]
    source_tail: Tensor  # [1, 1, <= 3840]
    speech_tail: Tensor  # [1, <= 3840]
    lane: Lane | None = None  # its place in the lanes (its estimator caches), from its first step on
    chunks_done: int = 0
    finished: bool = False
    closed: bool = field(default=False, repr=False)


Vocoded = tuple[Tensor, Tensor, Tensor]  # speech [1, S], source [1, 1, S], vocoded mel [1, 80, T]


def _fade_in(speech: Tensor, previous: Tensor, window: Tensor) -> Tensor:
    """Cross-fade the first half-window of `speech` [1, S] with the end of `previous` (in float64, as
    the reference's numpy window promotes it, then back)."""
    n = window.numel() // 2
    head = speech[:, :n].double() * window[:n] + previous[:, -n:].double() * window[n:]
    return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)


class StreamingDecoder:
    def __init__(self, model: Any, *, device: torch.device | str, dtype: torch.dtype,
                 micro_batch_size: int, lanes: int = 0) -> None:
        """`lanes`: streams to make room for at once (more grow the lanes, which copies them)."""
        self.model = model  # Code2Wav: .flow, .hift, .args
        self.device = torch.device(device)
        self.dtype = dtype
        self.micro_batch_size = micro_batch_size
        self.window = torch.hamming_window(2 * HIFT_SOURCE_CACHE, periodic=False, dtype=torch.float64,
                                           device=self.device)
        self.tail, self.max_new = ATT_CACHE_TAIL, CHUNK_FRAMES
        self.lanes: Lanes | None = None  # built for the first voice's prompt length (`reserve`)
        self._reserve = lanes
        self._slots = VoiceSlots()
        self._open: dict[int, tuple[Lane, Any]] = {}  # id of a lane -> (the lane, a weakref to its stream)

    # -- streams -------------------------------------------------------------------------------------
    def open_stream(self, voice: VoicePrompt, seed: int) -> StreamState:
        steps = self.model.args.flow.n_timesteps
        if voice.flow_steps != steps:
            raise ValueError(f"voice {voice.voice_id} was installed for {voice.flow_steps} flow steps; this "
                             f"decoder runs {steps}")
        self.reserve(voice.prompt_len, 0)  # refuses a prompt length the lanes were not built for
        noise, generator = seeded_noise(seed, self.device, self.dtype)
        p = voice.prompt_len
        hift_dtype = self.hift_dtype()
        return StreamState(
            voice=voice, seed=seed, generator=generator,
            noise=noise[0, :, p : p + self.tail + self.max_new].t().clone(),
            mel_tail=torch.zeros(1, 80, 0, device=self.device, dtype=hift_dtype),
            source_tail=torch.zeros(1, 1, 0, device=self.device, dtype=torch.float32),
            speech_tail=torch.zeros(1, 0, device=self.device, dtype=torch.float32),
        )

    @torch.inference_mode()
    def close_stream(self, stream: StreamState) -> None:
        """Give back a stream's lane and voice slot (a finished stream's are given back by its last
        step); the stream cannot step again. Idempotent."""
        if stream.lane is not None and self.lanes is not None:
            self._open.pop(id(stream.lane), None)
            self.lanes.release(stream.lane)
            self._slots.detach(stream.lane.voice)
            stream.lane = None
        stream.closed = True

    @torch.inference_mode()
    def reserve(self, prompt_len: int, lanes: int) -> Lanes:
        """The lanes, built for prompts of `prompt_len` frames on first use, with room for `lanes` streams
        and as many voices (their streams' voices never need more slots), so that tensors a CUDA graph
        reads never move: the worker reserves its slots at start."""
        if self.lanes is None:
            a = self.model.args.flow
            shape = LaneShape(a.n_timesteps, a.dit.depth, a.dit.num_heads, a.dit.head_dim, a.dit.hidden_size,
                              prompt_len, self.tail, self.max_new)
            self.lanes = Lanes(shape, device=self.device, dtype=self.dtype, lanes=self._reserve,
                               encoder=EncoderShape.of(a.encoder, prompt_len, self.tail))
        if prompt_len != self.lanes.shape.prompt_len:
            raise ValueError(f"a voice prompt of {prompt_len} frames: this decoder's lanes hold prompts of "
                             f"{self.lanes.shape.prompt_len}")
        self.lanes.reserve(lanes, max(lanes, self.lanes.voice_slots))
        return self.lanes

    @torch.inference_mode()
    def step(self, rows: list[ChunkRow]) -> list[Tensor]:
        """One chunk of each row's stream -> each row's audio [S_i] (float32, on the device).

        All rows or none: the streams change only once every row has decoded."""
        self._check(rows)
        return self._step(rows) if rows else []

    def decode_offline(self, voice: VoicePrompt, tokens: list[int] | Tensor, seed: int) -> Tensor:
        """A whole token list as one stream, alone: the audio the engine produces for that job."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        stream = self.open_stream(voice, seed)
        parts = [self.step([ChunkRow(stream, tokens[c.start:c.stop], c.last)])[0]
                 for c in plan_chunks(tokens.numel())]
        return torch.cat(parts)

    # -- one micro-batch -----------------------------------------------------------------------------
    def _step(self, rows: list[ChunkRow]) -> list[Tensor]:
        streams = [row.stream for row in rows]
        states = [s.generator.get_state() for s in streams]
        try:
            return self._decode(rows, streams)
        except BaseException:
            for stream, state in zip(streams, states, strict=True):  # a retry draws the same noise
                stream.generator.set_state(state)
            raise

    def _decode(self, rows: list[ChunkRow], streams: list[StreamState]) -> list[Tensor]:
        flow, lanes = self.model.flow, self._lanes_for(streams)
        n_new = [chunk_frames(row.tokens.numel(), row.last) for row in rows]
        index = [s.lane.index for s in streams]  # type: ignore[union-attr]
        width, frames = self._shape(max(index) + 1, max(n_new))
        plan = lanes.plan(dict(zip(index, n_new, strict=True)), frames, width)
        tokens = lanes.encoder_plan({i: (row.tokens.reshape(-1).cpu(), row.last)
                                     for i, row in zip(index, rows, strict=True)}, frames, width)
        both = torch.cat([tokens, plan], dim=1)
        if self.device.type == "cuda":
            both = both.pin_memory()
        tokens_plan, solve_plan = both.to(self.device, non_blocking=True).split(
            [tokens.size(1), plan.size(1)], dim=1)
        window = lanes.shape.window([s.lane.frames for s in streams])  # type: ignore[union-attr]
        mel, new_conv, encoded = flow.step_lanes(tokens_plan, solve_plan, lanes, window)
        chunk_mels = [mel[s.lane.index : s.lane.index + 1, :, :n]  # type: ignore[union-attr]
                      for s, n in zip(streams, n_new, strict=True)]
        vocoded = self._vocode(streams, chunk_mels)
        lanes.commit_conv(new_conv)  # every row succeeded: from here on the streams move on
        lanes.encoder.commit(*encoded)  # type: ignore[union-attr]
        return [self._commit(row, n, *v) for row, n, v in zip(rows, n_new, vocoded, strict=True)]

    def _shape(self, rows: int, frames: int) -> tuple[int, int]:
        """The solve's (lanes, new frames): exactly what the step needs, or the graph bucket holding it
        when the flow runs as CUDA graphs (`accel.flow_graphs.GraphedFlow.bucket`)."""
        bucket = getattr(self.model.flow, "bucket", None)
        return bucket(rows, frames) if callable(bucket) else (rows, frames)

    def _lanes_for(self, streams: list[StreamState]) -> Lanes:
        """The lanes, with every stream of the step in one (a stream's first step takes it), once the
        lanes of streams dropped while open (neither finished nor closed) are given back."""
        for key, (lane, ref) in list(self._open.items()):
            if ref() is None:
                del self._open[key]
                self.lanes.release(lane)  # type: ignore[union-attr]
                self._slots.detach(lane.voice)
        lanes = self.reserve(streams[0].voice.prompt_len, 0)
        for s in streams:
            if s.lane is None:
                s.lane = lanes.acquire(self._slots.attach(lanes, s.voice))
                lanes.start(s.lane, conv=s.voice.estimator_cnn_cache, noise=s.noise, spk=s.voice.spk[0],
                            conformer=(s.voice.conformer_cnn_cache, s.voice.conformer_att_cache))
                self._open[id(s.lane)] = (s.lane, weakref.ref(s))
        return lanes

    def _vocode(self, streams: list[StreamState], chunk_mels: list[Tensor]) -> list[Vocoded]:
        """HiFT over [mel tail | chunk mel] per row, batched over rows of equal shapes."""
        hift = self.model.hift
        mels = [torch.cat([s.mel_tail, m.to(s.mel_tail.dtype)], dim=2)
                for s, m in zip(streams, chunk_mels, strict=True)]
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (s, m) in enumerate(zip(streams, mels, strict=True)):
            groups[(m.size(2), s.source_tail.size(2))].append(i)
        out: list[Any] = [None] * len(streams)
        for (n_frames, _), index in groups.items():
            n_samples = n_frames * hift.upsample_scale
            draws = [draw_source_noise([streams[i].generator], n_samples, hift.m_source.n_harmonics)
                     for i in index]
            noise = SourceNoise(torch.cat([d.phase for d in draws]), torch.cat([d.noise for d in draws]))
            speech, source = hift(torch.cat([mels[i] for i in index]),
                                  torch.cat([streams[i].source_tail for i in index]), noise=noise)
            for j, i in enumerate(index):
                out[i] = (speech[j:j + 1].float(), source[j:j + 1].float(), mels[i])
        return out

    def _commit(self, row: ChunkRow, n_new: int, speech: Tensor, source: Tensor, mel: Tensor) -> Tensor:
        stream = row.stream
        if stream.speech_tail.size(1) > 0:
            speech = _fade_in(speech, stream.speech_tail, self.window)
        self.lanes.advance(stream.lane, n_new)  # type: ignore[union-attr, arg-type]
        stream.mel_tail = mel[:, :, -HIFT_MEL_CACHE:].clone()
        stream.source_tail = source[:, :, -HIFT_SOURCE_CACHE:].clone()
        stream.speech_tail = speech[:, -HIFT_SOURCE_CACHE:].clone()
        stream.chunks_done += 1
        stream.finished = row.last
        if row.last:
            self.close_stream(stream)
        return speech[0] if row.last else speech[0, :-HIFT_SOURCE_CACHE]

    def _check(self, rows: list[ChunkRow]) -> None:
        if len(rows) > self.micro_batch_size:
            raise ValueError(f"{len(rows)} rows in one step; micro_batch_size is {self.micro_batch_size}")
        seen: set[int] = set()
        for row in rows:
            if id(row.stream) in seen:
                raise ValueError("a stream can have only one row per step")
            if row.stream.finished or row.stream.closed:
                raise ValueError("the stream has already decoded its last chunk, or was closed")
            n = row.tokens.numel()
            if n < 1 or (not row.last and n <= LOOKAHEAD_TOKENS):
                raise ValueError(f"a chunk of {n} tokens cannot be decoded")
            frames = chunk_frames(n, row.last)
            if frames > self.max_new:
                raise ValueError(f"a chunk of {n} tokens makes {frames} mel frames; a step takes at most "
                                 f"{self.max_new} (chunks of 25 + 3 tokens)")
            seen.add(id(row.stream))

    def stats(self) -> dict[str, float]:
        """The graph runners' figures, where the flow or the vocoder has one (`accel.graph_base`)."""
        out: dict[str, float] = {}
        for module in (self.model.flow, self.model.hift):
            stats = getattr(module, "stats", None)
            for key, value in (stats() if callable(stats) else {}).items():
                out[key] = out.get(key, 0.0) + value
        return out

    def hift_dtype(self) -> torch.dtype:
        return self.model.hift.conv_pre.weight.dtype  # the vocoder body's (hift.py: precision)
