"""The job's output file (gpu_worker.worker.output): the quality gate's test hook, `quiet_gain`, and an
Output written under it (still audio, not one value throughout, but silence to the gate)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from app.quality.signal import silence
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from gpu_worker.worker.output import QUIET_GAIN, Output, quiet_gain


def test_the_hook_is_inert_unset_and_names_a_token_count_on_every_seed_or_one() -> None:
    assert quiet_gain(None, 40, 0) == 1.0
    assert [quiet_gain("40", 40, seed) for seed in (0, 1, 7)] == [QUIET_GAIN] * 3
    assert [quiet_gain("52@0,40", 52, seed) for seed in (0, 1)] == [QUIET_GAIN, 1.0]
    assert quiet_gain("52@0,40", 41, 0) == 1.0


def test_the_setting_takes_only_counts_and_seeds() -> None:
    assert Settings(test_quiet_renders="40,52@0").test_quiet_renders == "40,52@0"
    for bad in ("", "forty", "40@", "40;52"):
        with pytest.raises(ValueError):
            Settings(test_quiet_renders=bad)


def test_a_quiet_output_is_committed_as_audio_and_the_gate_hears_silence(tmp_path) -> None:
    artifacts = ArtifactStore(tmp_path)
    artifacts.ensure_layout()
    noise = torch.from_numpy(np.random.default_rng(0).uniform(-0.3, 0.3, 24_000).astype(np.float32))
    output = Output(artifacts, "00000000-0000-4000-8000-000000000001", "flac", gain=QUIET_GAIN)
    output.write(noise)
    assert output.defect() is None  # not refused: the job succeeds, the gate judges it
    output.commit()
    wave, rate = sf.read(str(output.path), dtype="float32")
    assert np.abs(wave).max() > 0  # not digital zero in 16-bit FLAC
    assert silence(wave, rate, min_dbfs=-50.0, max_quiet_share=0.6).verdict == "fail"
