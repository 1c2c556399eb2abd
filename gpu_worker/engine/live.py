"""The engine's record of each job it holds (`Live`), and the engine's policy knobs (`EngineConfig`).

A `Live` is created when a job is admitted and dropped at the finish phase after its outcome is set; only
the engine thread touches it. The resolver reads a waiting one through its `Waiting` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_worker.engine.streams import Chunk, EngineJob


@dataclass(frozen=True)
class EngineConfig:
    """The engine's policy knobs (the worker's settings map onto them in `gpu_worker.worker.runtime`)."""

    micro_batch_size: int = 8  # rows per step
    prep_wait_ms: float = 2000.0  # how long a job waits for its voice's CPU preparation
    admission_window_ms: float = 0.0  # an idle engine gathers a burst this long (0: starts at once)
    install_batch: int = 1  # stored voices found in one pump that share a setup solve


@dataclass
class Live:
    job: EngineJob
    tokens: torch.Tensor  # [N] int64, CPU
    chunks: list[Chunk]
    arrival: int
    admitted: float
    deadline: float = 0.0  # end of the prep wait
    prep_path: str | None = None
    polled: bool = False  # the feature store's answer for it arrived at least once
    stream: Any = None
    pinned: bool = False
    next_chunk: int = 0
    samples: int = 0
    times: dict[str, float] = field(default_factory=dict)
    outcome: str | None = None  # finished | failed | aborted: released at the next finish phase

    @property
    def waiting(self) -> bool:
        """Still waiting for its voice: no stream yet, and not over."""
        return self.stream is None and self.outcome is None
