"""What other threads hand the engine: new jobs (with their checked tokens) and aborts, under one lock.

The `synth` tasks add and abort from their own threads; the engine thread drains both at the start of
each step and tells the inbox when jobs are gone for good, so the same job id may come again later (a
new attempt) but never twice at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

import torch

from gpu_worker.engine.streams import EngineJob


class Inbox:
    def __init__(self) -> None:
        self._jobs: deque[tuple[EngineJob, torch.Tensor]] = deque()
        self._aborts: set[str] = set()
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

    def drain(self) -> tuple[list[tuple[EngineJob, torch.Tensor]], set[str]]:
        """The jobs added and the ids aborted since the last drain."""
        with self._cond:
            jobs, aborts = list(self._jobs), set(self._aborts)
            self._jobs.clear()
            self._aborts.clear()
            return jobs, aborts

    def forget(self, job_ids: Iterable[str]) -> None:
        """These jobs left the engine: their ids may be added again."""
        with self._cond:
            self._known.difference_update(job_ids)

    def wait(self, busy: Callable[[], bool], timeout: float | None) -> bool:
        """Block until a job or an abort is queued or `busy()` says the engine has work; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._jobs or self._aborts) or busy(), timeout)
