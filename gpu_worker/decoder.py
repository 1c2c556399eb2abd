"""The batched streaming decoder: one step decodes one chunk of each of up to `micro_batch_size` streams.

    open_stream(voice, seed) -> StreamState
    step([ChunkRow(stream, tokens, last), ...]) -> [audio [S_i] per row]
        = encode each row's chunk, one masked CFM solve over all rows (`Flow.stream_chunks`), the
          reference's cache trimming, then the vocoder with each stream's HiFT streaming state.

A stream owns its growing caches (new tensors every chunk; the voice's prompt caches it starts from are
shared read-only by every stream of the voice), its slice of a seeded (1, 80, 30000) noise buffer and a
`torch.Generator` for the vocoder's source noise, so a job's audio depends only on (voice, tokens, seed),
not on what else shares its steps. The noise buffer and the vocoder draws come from one generator seeded
with the job's seed, in that order (the reference's global-RNG order when seeded the same way).

HiFT streaming (MODEL.md): each chunk vocodes [8 cached mel frames | new frames] with the previous
3840 source samples, cross-fades its first 3840 samples with the previous tail through hamming(7680),
keeps its last 3840 samples as the next tail and emits them only after the last chunk. The vocoder runs
once per group of rows with equal shapes (its convolutions are not causal, so rows are never padded).

A step changes its streams only after every row succeeded (the vocoder generators are restored on
failure), so a failed step can be retried row by row with the same result.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpu_worker.model.config import (
    ATT_CACHE_TAIL,
    CHUNK_TOKENS,
    HIFT_MEL_CACHE,
    HIFT_SOURCE_CACHE,
    LOOKAHEAD_TOKENS,
    MEL_PER_TOKEN,
)
from gpu_worker.model.flow import FlowCache, trim_cache
from gpu_worker.model.hift import SourceNoise, draw_source_noise
from gpu_worker.model.kvcache import Workspace
from gpu_worker.prompt import VoicePrompt, seeded_noise
from gpu_worker.streams import ChunkRow, plan_chunks

# A chunk's noise offset never passes prompt_len + 100 (the trimmed cache) and a chunk has at most
# 2 x 28 mel frames, so a stream keeps only that much of its noise buffer.
NOISE_KEEP_AFTER_PROMPT = ATT_CACHE_TAIL + MEL_PER_TOKEN * (CHUNK_TOKENS + LOOKAHEAD_TOKENS)


@dataclass
class StreamState:
    """One job's stream. Mutated only by `StreamingDecoder.step`."""

    voice: VoicePrompt
    seed: int
    generator: torch.Generator  # vocoder source noise, continues after the noise buffer's draw
    noise: Tensor  # [1, 80, K] leading slice of the seeded noise buffer (K covers every offset)
    cache: FlowCache  # starts as the voice's (shared, read-only), then the stream's own
    mel_tail: Tensor  # [1, 80, <= 8]
    source_tail: Tensor  # [1, 1, <= 3840]
    speech_tail: Tensor  # [1, <= 3840]
    chunks_done: int = 0
    finished: bool = False


Vocoded = tuple[Tensor, Tensor, Tensor]  # speech [1, S], source [1, 1, S], vocoded mel [1, 80, T]


def _fade_in(speech: Tensor, previous: Tensor, window: Tensor) -> Tensor:
    """Cross-fade the first half-window of `speech` [1, S] with the end of `previous` (in float64, as
    the reference's numpy window promotes it, then back)."""
    n = window.numel() // 2
    head = speech[:, :n].double() * window[:n] + previous[:, -n:].double() * window[n:]
    return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)


class StreamingDecoder:
    def __init__(self, model: Any, *, device: torch.device | str, dtype: torch.dtype,
                 micro_batch_size: int) -> None:
        self.model = model  # Code2Wav: .flow, .hift, .args
        self.device = torch.device(device)
        self.dtype = dtype
        self.micro_batch_size = micro_batch_size
        self.window = torch.hamming_window(2 * HIFT_SOURCE_CACHE, periodic=False, dtype=torch.float64,
                                           device=self.device)
        # the solve's attention buffer, kept from step to step (kvcache.py); None: a fresh one each step
        self.workspace: Workspace | None = Workspace()
        # True: the voices' shared frames copied beside every row at every Euler step, the way before they
        # were read in place (kvcache.BatchKV); for the benchmarks' before-and-after only
        self.copy_shared_frames = False

    # -- streams -------------------------------------------------------------------------------------
    def open_stream(self, voice: VoicePrompt, seed: int) -> StreamState:
        steps = self.model.args.flow.n_timesteps
        if voice.flow_steps != steps:
            raise ValueError(f"voice {voice.voice_id} was installed for {voice.flow_steps} flow steps; this "
                             f"decoder runs {steps}")
        noise, generator = seeded_noise(seed, self.device, self.dtype)
        keep = voice.prompt_len + NOISE_KEEP_AFTER_PROMPT
        hift_dtype = self.hift_dtype()
        return StreamState(
            voice=voice, seed=seed, generator=generator, noise=noise[:, :, :keep].clone(),
            cache=voice.flow_cache(),
            mel_tail=torch.zeros(1, 80, 0, device=self.device, dtype=hift_dtype),
            source_tail=torch.zeros(1, 1, 0, device=self.device, dtype=torch.float32),
            speech_tail=torch.zeros(1, 0, device=self.device, dtype=torch.float32),
        )

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
        flow = self.model.flow
        tokens = [row.tokens.to(self.device, torch.int64)[None] for row in rows]
        spk = torch.cat([s.voice.spk for s in streams])
        mel, n_frames, caches = flow.stream_chunks(tokens, spk, [s.cache for s in streams],
                                                   [row.last for row in rows], [s.noise for s in streams],
                                                   workspace=self.workspace,
                                                   copy_shared=self.copy_shared_frames)
        caches = [trim_cache(c, s.voice.prompt_len) for c, s in zip(caches, streams, strict=True)]
        chunk_mels = [mel[i:i + 1, :, :n] for i, n in enumerate(n_frames)]
        vocoded = self._vocode(streams, chunk_mels)
        outputs = []
        for row, cache, (speech, source, full_mel) in zip(rows, caches, vocoded, strict=True):
            outputs.append(self._commit(row, cache, speech, source, full_mel))
        return outputs

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

    def _commit(self, row: ChunkRow, cache: FlowCache, speech: Tensor, source: Tensor, mel: Tensor) -> Tensor:
        stream = row.stream
        if stream.speech_tail.size(1) > 0:
            speech = _fade_in(speech, stream.speech_tail, self.window)
        stream.cache = cache
        stream.mel_tail = mel[:, :, -HIFT_MEL_CACHE:].clone()
        stream.source_tail = source[:, :, -HIFT_SOURCE_CACHE:].clone()
        stream.speech_tail = speech[:, -HIFT_SOURCE_CACHE:].clone()
        stream.chunks_done += 1
        stream.finished = row.last
        return speech[0] if row.last else speech[0, :-HIFT_SOURCE_CACHE]

    def _check(self, rows: list[ChunkRow]) -> None:
        if len(rows) > self.micro_batch_size:
            raise ValueError(f"{len(rows)} rows in one step; micro_batch_size is {self.micro_batch_size}")
        seen: set[int] = set()
        for row in rows:
            if id(row.stream) in seen:
                raise ValueError("a stream can have only one row per step")
            if row.stream.finished:
                raise ValueError("the stream has already decoded its last chunk")
            if row.tokens.numel() < 1 or (not row.last and row.tokens.numel() <= LOOKAHEAD_TOKENS):
                raise ValueError(f"a chunk of {row.tokens.numel()} tokens cannot be decoded")
            seen.add(id(row.stream))

    def stats(self) -> dict[str, float]:
        """The vocoder's graph runner's figures, when it has one (`gpu_worker.accel.graphs`)."""
        stats = getattr(self.model.hift, "stats", None)
        return stats() if callable(stats) else {}

    def hift_dtype(self) -> torch.dtype:
        return self.model.hift.conv_pre.weight.dtype  # the vocoder body's (hift.py: precision)
