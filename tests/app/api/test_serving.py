"""A serving process (`wavefarm serve`'s app factory): what the first reference upload would import is
imported before the first request, and what the process holds from then on is frozen out of the garbage
collector's walks (a full collection walked it all, about 200 ms, every few thousand submissions). Run in
a process of its own: freezing this test process would keep its garbage forever."""

from __future__ import annotations

import os
import subprocess
import sys

from app.settings import Settings
from tests.conftest import REPO, settings_env

PROCESS = """
import gc, sys
from app.api.main import app_from_environment
before = set(sys.modules)
app_from_environment()
from app import audio
from app.dev import SAMPLES
from app.audio import load_reference
loaded = set(sys.modules)
load_reference((SAMPLES / "voice_a.wav").read_bytes())  # what a reference upload does
print(gc.get_freeze_count(), len(gc.get_objects()), "torch" in before, "torch" in loaded,
      sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] in ("torch", "torchaudio"))[:5])
"""


def test_a_serving_process_loads_the_resampler_first_and_freezes_what_it_holds(settings: Settings):
    env = {**os.environ, **settings_env(settings)}
    done = subprocess.run([sys.executable, "-c", PROCESS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, young, torch_before, torch_after_start, imported_by_upload = done.stdout.split(maxsplit=4)
    assert torch_before == "False" and torch_after_start == "True"  # the factory imported it
    assert imported_by_upload.strip() == "[]"  # the first upload imports nothing of torch's
    assert int(frozen) > 100_000 and int(frozen) > 5 * int(young), (frozen, young)
