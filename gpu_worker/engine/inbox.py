"""What the engine's input side hands it: new jobs (with their checked tokens), aborts, and the feature
store's answers (`FeaturesArrived`), under one lock.

The `synth` tasks add and abort from their own threads. The store is read on the input side too, before a
step and never inside it (`Engine.fetch_features`, with `read_features`): each answer arrives here as an
event. The engine thread drains all three at the start of each step and tells the inbox when jobs are
gone for good, so the same job id may come again later (a new attempt) but never twice at once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from app.voices.features import PromptHostFeatures
from gpu_worker.engine.streams import EngineJob

log = logging.getLogger(__name__)

# What one read of the feature store found for a voice: its features, nothing (not prepared yet), or why
# the store could not be used (ConnectionError: unreadable; anything else: unusable features).
Found = PromptHostFeatures | None | Exception


class FeatureSource(Protocol):
    def get(self, voice_id: str) -> PromptHostFeatures | None:
        """Prepared features, or None while not (yet) there. Raise ConnectionError if unreadable."""


@dataclass(frozen=True)
class FeaturesArrived:
    """The store's answer for one voice, read on the input side before a step."""

    voice_id: str
    found: Found


def read_features(source: FeatureSource, voice_id: str) -> Found:
    """One read of the store for `voice_id`; a failure is an answer (the job prepares inline), not raised."""
    try:
        got = source.get(voice_id)
    except Exception as exc:  # any store problem means "prepare inline", counted
        log.warning("feature store read for voice %s failed: %s", voice_id, exc)
        return exc
    if got is not None and got.voice_id != voice_id:
        return ValueError(f"feature store returned voice {got.voice_id} for {voice_id}")
    return got


@dataclass
class Drained:
    """What arrived since the last drain: jobs, aborted ids, the store's answers by voice id."""

    jobs: list[tuple[EngineJob, torch.Tensor]] = field(default_factory=list)
    aborts: set[str] = field(default_factory=set)
    features: dict[str, Found] = field(default_factory=dict)


class Inbox:
    def __init__(self) -> None:
        self._jobs: deque[tuple[EngineJob, torch.Tensor]] = deque()
        self._aborts: set[str] = set()
        self._features: dict[str, Found] = {}  # voice id -> the latest answer not yet drained
        self._known: set[str] = set()  # queued or live job ids
        self._cond = threading.Condition()

    def add(self, job: EngineJob, tokens: torch.Tensor) -> None:
        with self._cond:
            if job.job_id in self._known:
                raise ValueError(f"job {job.job_id} is already in the engine")
            self._known.add(job.job_id)
            self._jobs.append((job, tokens))
            self._cond.notify_all()

    def abort(self, job_id: str) -> None:
        """Unknown ids (finished, or never added) are ignored."""
        with self._cond:
            if job_id in self._known:
                self._aborts.add(job_id)
                self._cond.notify_all()

    def arrived(self, event: FeaturesArrived) -> None:
        """The store's answer for a voice; a later answer for it before the next drain replaces this one."""
        with self._cond:
            self._features[event.voice_id] = event.found

    def pending(self) -> tuple[list[EngineJob], set[str]]:
        """The jobs added and the ids aborted since the last drain: what the next step admits and drops."""
        with self._cond:
            return [job for job, _ in self._jobs], set(self._aborts)

    def drain(self) -> Drained:
        """What arrived since the last drain."""
        with self._cond:
            drained = Drained(list(self._jobs), set(self._aborts), dict(self._features))
            self._jobs.clear()
            self._aborts.clear()
            self._features.clear()
            return drained

    def forget(self, job_ids: Iterable[str]) -> None:
        """These jobs left the engine: their ids may be added again."""
        with self._cond:
            self._known.difference_update(job_ids)

    def wait(self, busy: Callable[[], bool], timeout: float | None) -> bool:
        """Block until a job or an abort is queued or `busy()` says the engine has work; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._jobs or self._aborts) or busy(), timeout)
