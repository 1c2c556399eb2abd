"""The vocabulary of streams shared by engine, decoder and worker: jobs, chunk plans, rows, events.

No model and no transport here: `EngineJob` (what the worker hands the engine), the chunk plan (how a
job's speech tokens are cut into streaming chunks, MODEL.md "Streaming"), `ChunkRow` (one row of a
decoder step) and the events one engine step hands out.

A chunk is 25 new tokens plus 3 lookahead tokens; the next chunk starts 25 tokens later, so the
lookahead tokens are fed again as that chunk's new tokens. The tail (whatever is left once fewer than
28 tokens remain, at least the 3 lookahead tokens of the previous chunk) is the final chunk, which the
encoder pads with 3 zero frames. This is exactly how Step-Audio 2's `token2wav` streaming example feeds
`Token2wav.stream`: chunk 0 starts at the job's first token; its left context is the voice's prompt,
whose own lookahead in the setup solve was three silence tokens (4218).

Audio per chunk: a non-final chunk yields 25 * 2 mel frames, the final one 2 * its tokens; the vocoder
holds back its last 3840 samples (8 mel frames) for the cross-fade except after the final chunk, so a job
of N tokens yields exactly N * 960 samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from app.speech import check_tokens
from gpu_worker.model.config import (
    CHUNK_TOKENS,
    LOOKAHEAD_TOKENS,
    MEL_PER_TOKEN,
)


@dataclass(frozen=True)
class EngineJob:
    job_id: str
    voice_id: str
    tokens: Sequence[int] | torch.Tensor
    seed: int
    priority: int = 0
    prep_hint: str | None = None  # "queue_full" or "failed": the CPU preparation will not come


def validate_tokens(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Speech tokens -> [N] int64 CPU tensor; BadTokens if empty or out of range (`app.speech`)."""
    values = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else tokens
    return torch.tensor(check_tokens(values), dtype=torch.int64)


def chunk_frames(tokens: int, last: bool) -> int:
    """Mel frames a chunk of `tokens` makes: its last 3 are lookahead, unless it is the stream's last."""
    return MEL_PER_TOKEN * (tokens if last else tokens - LOOKAHEAD_TOKENS)


class Chunk(NamedTuple):
    start: int  # first token (inclusive)
    stop: int  # last token (exclusive), lookahead included
    last: bool

    @property
    def mel_frames(self) -> int:
        return chunk_frames(self.stop - self.start, self.last)


class StreamDecoder(Protocol):
    """What the engine needs of a decoder (`gpu_worker.engine.decoder.StreamingDecoder`)."""

    def open_stream(self, voice: Any, seed: int) -> Any: ...

    def step(self, rows: list[Any]) -> list[torch.Tensor]: ...

    def close_stream(self, stream: Any) -> None:
        """The stream's job has left the engine (finished, failed or aborted): free what it holds."""
        ...


def audio_to_host(audios: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step's device audio rows -> float32 CPU tensors, with one transfer for the whole step."""
    if not audios:
        return []
    lengths = [a.numel() for a in audios]
    flat = torch.cat([a.reshape(-1) for a in audios]).to("cpu", torch.float32)
    return list(torch.split(flat, lengths))


class ChunkRow(NamedTuple):
    """One row of a decoder step: a stream and the tokens of its next chunk."""

    stream: Any  # gpu_worker.engine.decoder.StreamState
    tokens: torch.Tensor  # [T] int64: 25 new + 3 lookahead, or the final tail
    last: bool


def plan_chunks(n_tokens: int) -> list[Chunk]:
    """[Chunk(0, 28, False), Chunk(25, 53, False), ..., Chunk(k, n_tokens, True)]."""
    if n_tokens < 1:
        raise ValueError(f"a stream needs at least one token, got {n_tokens}")
    window = CHUNK_TOKENS + LOOKAHEAD_TOKENS
    chunks: list[Chunk] = []
    start = 0
    while n_tokens - start >= window:
        chunks.append(Chunk(start, start + window, False))
        start += CHUNK_TOKENS
    chunks.append(Chunk(start, n_tokens, True))
    return chunks


# -- events: what one step hands out ---------------------------------------------------------------
@dataclass(frozen=True)
class VoiceReady:
    job_id: str
    voice_id: str
    prep_path: str
    wait_s: float  # from admission to the voice being ready on this worker


@dataclass(frozen=True)
class Audio:  # a chunk's audio; chunk_index / n_chunks is the job's progress
    job_id: str
    chunk_index: int
    n_chunks: int
    samples: torch.Tensor  # [S] float32, CPU, 24 kHz
    last: bool


@dataclass(frozen=True)
class Finished:
    job_id: str
    prep_path: str
    n_samples: int
    audio_s: float
    # prep_wait_s, first_audio_s, total_s (from admission); install_s when the voice was installed for
    # this job (the device half, host time: on CUDA the side stream may still be running)
    timings: dict[str, float]


@dataclass(frozen=True)
class Failed:
    job_id: str
    error: str
    prep_path: str | None


@dataclass(frozen=True)
class Aborted:
    job_id: str
    prep_path: str | None


@dataclass(frozen=True)
class VoiceInstalled:
    voice_id: str
    nbytes: int
    install_s: float


@dataclass(frozen=True)
class VoiceEvicted:
    voice_id: str


EngineEvent = VoiceReady | Audio | Finished | Failed | Aborted | VoiceInstalled | VoiceEvicted
