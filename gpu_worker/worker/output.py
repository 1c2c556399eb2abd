"""A job's audio file, written as its audio arrives: beside its final name, renamed into place at the end
(`gpu_worker.worker.job` writes it). It watches what it writes (finite? the lowest and highest sample) so
that audio that is not audio is never committed as a success.

`quiet_gain` is a test hook (`WAVEFARM_TEST_QUIET_RENDERS`, unset in service): the quality gate's tests
make a chosen segment's render silence to the ear, on one seed or on all, to see it rendered again or kept.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from app.audio import commit_output, open_output
from app.storage.artifacts import ArtifactStore


class Output:
    """The job's audio file, written incrementally beside its final name and renamed into place; it
    watches what it writes (finite? the lowest and highest sample) so that garbage is not committed."""

    def __init__(self, artifacts: ArtifactStore, job_id: str, fmt: str, gain: float = 1.0) -> None:
        self.gain = gain  # 1.0 but under the test hook `quiet_gain`
        self.relpath = artifacts.output_relpath(job_id, fmt)
        self.path: Path = artifacts.path(self.relpath)
        drop_partials(artifacts, job_id)  # a killed earlier attempt's
        self.handle, self.tmp = open_output(self.path, fmt)
        self.samples, self.finite, self.low, self.high = 0, True, math.inf, -math.inf

    def write(self, samples: Any) -> None:
        pcm = samples.numpy() if self.gain == 1.0 else samples.numpy() * self.gain
        if pcm.size:
            self.samples += pcm.size
            self.finite = self.finite and bool(np.isfinite(pcm).all())
            if self.finite:
                self.low, self.high = min(self.low, float(pcm.min())), max(self.high, float(pcm.max()))
        self.handle.write(pcm)

    def defect(self) -> str | None:
        """Why this audio must not be reported as a success; None when it may be."""
        if not self.samples or not self.finite or self.low == self.high:
            what = ("no samples" if not self.samples else "NaN or infinite samples" if not self.finite
                    else f"the constant {self.low:g} in all {self.samples} samples")
            return f"the decoded audio has {what} (the voice's prompt or the model is broken)"
        return None

    def commit(self) -> None:
        commit_output(self.handle, self.tmp, self.path)

    def discard(self) -> None:
        if not self.handle.closed:
            self.handle.close()
        self.tmp.unlink(missing_ok=True)

    def withdraw(self) -> None:
        """Remove the committed file (the job was cancelled while it was being finished)."""
        self.path.unlink(missing_ok=True)


def drop_partials(artifacts: ArtifactStore, job_id: str) -> None:
    """Remove partial outputs of a job (only one attempt of a job runs at a time: they are stale)."""
    outputs = artifacts.output_path(job_id, "wav").parent
    for stale in outputs.glob(f".{job_id}.*.part"):
        stale.unlink(missing_ok=True)


# -60 dB: speech falls under the gate's -50 dBFS, yet stays above 16-bit zero (one value throughout would
# fail the job itself: `Output.defect`).
QUIET_GAIN = 1e-3


def quiet_gain(spec: str | None, n_tokens: int, seed: int) -> float:
    """The test hook's gain for a job of `n_tokens` tokens rendered with `seed`: QUIET_GAIN when `spec`
    ("40,52@0": every render of 40 tokens, and renders of 52 tokens with seed 0) names it, else 1.0."""
    for item in (spec or "").split(","):
        count, _, only_seed = item.partition("@")
        if count and int(count) == n_tokens and (not only_seed or int(only_seed) == seed):
            return QUIET_GAIN
    return 1.0
