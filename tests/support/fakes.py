"""The fakes at the engine's boundary, and the small real model the decoder tests use, in one place.

    FakeDecoder, FakeStream, FakePrompt, install    a deterministic decoder: each token becomes 10 samples of
                                                    voice level + seed + token (`expected_audio` is a job's)
    FakeStore, FakePreparer, FakeClock              the feature store, inline preparation and the clock
    harness(...) -> Harness                         an Engine over those, stepped by the test
    FakeSpeaker, host_features, tiny_model          S3 + CAM++ stand-in, seeded host features, the tiny
                                                    preset with seeded random weights (the real decoder)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from app.speech import VOCAB_SIZE
from app.voices.features import PromptHostFeatures
from gpu_worker.checkpoint.load import random_code2wav
from gpu_worker.engine.core import Engine, EngineConfig
from gpu_worker.engine.streams import (
    Audio,
    ChunkRow,
    EngineJob,
    plan_chunks,
)
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import (
    ModelArgs,
)
from gpu_worker.voices.cache import VoiceCache

ARGS = ModelArgs.tiny()


def tiny_model(seed: int = 0) -> Code2Wav:
    """Seeded random weights (the loader's dummy model): speech-like F0, non-zero velocities."""
    return random_code2wav(ARGS, seed)


class FakeSpeaker:
    """Deterministic stand-in for S3 + CAM++: tokens and embedding are functions of the features."""

    def quantize_and_embed(self, logmel128: torch.Tensor, fbank80: torch.Tensor):
        frames = logmel128[:, : logmel128.size(1) // 4 * 4].reshape(128, -1, 4).mean(dim=(0, 2))  # [T16 / 4]
        tokens = (frames.abs() * 7919).long() % VOCAB_SIZE
        m = fbank80.mean(dim=0)
        return tokens[None], torch.cat([m, m, m[:32]])[None] * 3.0


def host_features(voice_id: str, seed: int, mel_frames: int = 300) -> PromptHostFeatures:
    gen = torch.Generator().manual_seed(seed)
    return PromptHostFeatures(voice_id=voice_id, logmel128=torch.randn(128, 600, generator=gen),
                              fbank80=torch.randn(598, 80, generator=gen),
                              mel80=torch.randn(mel_frames, 80, generator=gen) - 5.0)


def features(voice_id: str) -> PromptHostFeatures:
    seed = sum(voice_id.encode())
    return PromptHostFeatures(voice_id=voice_id, logmel128=torch.full((128, 4), float(seed)),
                              fbank80=torch.zeros(4, 80), mel80=torch.zeros(2, 80))


@dataclass
class FakePrompt:
    voice_id: str
    level: float
    size: int = 1000

    def nbytes(self) -> int:
        return self.size

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(())


def install(host: PromptHostFeatures) -> FakePrompt:
    if host.voice_id.startswith("broken"):
        raise RuntimeError("corrupt features")
    return FakePrompt(host.voice_id, float(host.logmel128[0, 0]))


@dataclass
class FakeStream:
    voice: FakePrompt
    seed: int
    chunk: int = 0


class FakeDecoder:
    """Deterministic fake audio: each token becomes 10 samples of voice level + seed + token."""

    def __init__(self, poisoned_seeds: frozenset[int] = frozenset()) -> None:
        self.batches: list[list[tuple[int, int]]] = []  # (seed, chunk) per row
        self.poisoned = poisoned_seeds
        self.closed: list[int] = []  # seeds of the streams closed, in order

    def open_stream(self, voice: FakePrompt, seed: int) -> FakeStream:
        return FakeStream(voice, seed)

    def close_stream(self, stream: FakeStream) -> None:
        self.closed.append(stream.seed)

    def step(self, rows: list[ChunkRow]) -> list[torch.Tensor]:
        if any(row.stream.seed in self.poisoned for row in rows):
            raise RuntimeError("NaN in the solve")
        self.batches.append([(row.stream.seed, row.stream.chunk) for row in rows])
        out = []
        for row in rows:
            out.append(expected_chunk(row.stream.voice.level, row.stream.seed, row.tokens))
            row.stream.chunk += 1
        return out


def expected_chunk(level: float, seed: int, tokens: torch.Tensor) -> torch.Tensor:
    return (level + seed + tokens.to(torch.float32)).repeat_interleave(10)


def expected_audio(voice_id: str, seed: int, tokens: list[int]) -> torch.Tensor:
    level = float(sum(voice_id.encode()))
    all_tokens = torch.tensor(tokens)
    parts = [expected_chunk(level, seed, all_tokens[c.start:c.stop]) for c in plan_chunks(len(tokens))]
    return torch.cat(parts)


class FakeStore:
    def __init__(self, *voice_ids: str) -> None:
        self.entries = {v: features(v) for v in voice_ids}
        self.error: Exception | None = None
        self.gets = 0

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        self.gets += 1
        if self.error is not None:
            raise self.error
        return self.entries.get(voice_id)


@dataclass
class FakePreparer:
    calls: list[str] = field(default_factory=list)
    fail: bool = False

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        self.calls.append(job.job_id)
        if self.fail:
            raise OSError("reference audio is gone")
        return features(job.voice_id)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    engine: Engine
    decoder: FakeDecoder
    store: FakeStore
    preparer: Any  # FakePreparer, or the test's own
    clock: FakeClock
    events: list = field(default_factory=list)

    def step(self, n: int = 1) -> list:
        new = []
        for _ in range(n):
            self.engine.fetch_features()  # the input side, as the worker's loop runs it
            new += self.engine.step()
        self.events += new
        return new

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.engine.live_jobs() and not self.engine.wait_for_work(0):
                return
            self.step()
        raise AssertionError("engine did not drain")

    def audio(self, job_id: str) -> torch.Tensor:
        chunks = [e for e in self.events if isinstance(e, Audio) and e.job_id == job_id]
        assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
        return torch.cat([c.samples for c in chunks])

    def of(self, kind: type, job_id: str | None = None) -> list:
        return [e for e in self.events if isinstance(e, kind) and (job_id is None or e.job_id == job_id)]


def harness(*stored: str, micro_batch_size: int = 4, prep_wait_ms: float = 500, max_voices: int = 8,
            poisoned: frozenset[int] = frozenset(), installer=install, preparer: Any = None,
            prep_pool: Executor | None = None, install_lane: Executor | None = None,
            admission_window_ms: float = 0, install_batch: int = 1, batch_installer=None) -> Harness:
    clock = FakeClock()
    decoder = FakeDecoder(poisoned)
    store = FakeStore(*stored)
    preparer = preparer or FakePreparer()
    voices = VoiceCache(installer, device="cpu", max_voices=max_voices, batch_installer=batch_installer)
    config = EngineConfig(micro_batch_size=micro_batch_size, prep_wait_ms=prep_wait_ms,
                          admission_window_ms=admission_window_ms, install_batch=install_batch)
    engine = Engine(decoder, voices, features=store, preparer=preparer, config=config, clock=clock,
                    prep_pool=prep_pool, install_lane=install_lane)
    return Harness(engine, decoder, store, preparer, clock)


TOKENS = list(range(100, 180))  # 80 tokens: chunks of 28, 28, 30 (last)


def job(job_id: str, voice: str = "alice", seed: int = 1, tokens: list[int] | None = None, **kw) -> EngineJob:
    return EngineJob(job_id=job_id, voice_id=voice, tokens=tokens or TOKENS, seed=seed, **kw)
