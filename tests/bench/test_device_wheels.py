"""The device kit's wheel list (`bench.kit.wheels`): the kit's modules import, and the reference is
built from its files, in an environment holding only the GPU machine's packages and the listed wheels
(`tests.support.device_env`), so a new import on the kit's path cannot silently break the device run."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from bench.kit.wheels import ABSENT, WHEELS
from tests.support import device_env

REPO = Path(__file__).resolve().parents[2]
KIT_MODULES = sorted(f"bench.kit.{p.stem}" for p in (REPO / "gpu_worker" / "kit").glob("*.py"))

PROBE = """
import importlib, importlib.util, sys
sys.path.insert(0, {repo!r})
for name in {modules!r}:
    importlib.import_module(name)
from bench.engine.reference import reference_hift, reference_loader
from gpu_worker.model.config import ModelArgs
reference_loader()
reference_hift(ModelArgs.tiny().hift)
import app.audio, app.voices.features, gpu_worker.fallbacks, gpu_worker.worker.metrics
gone = [n for n in {absent!r} if importlib.util.find_spec(n) is not None]
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {absent!r})
print("absent-but-found", gone, "leaked", leaked)
"""


@pytest.fixture(scope="module")
def device_python(tmp_path_factory) -> Path:
    return device_env.make(tmp_path_factory.mktemp("device-env"))


def test_the_pins_are_what_this_environment_has_and_absent_packages_stay_out() -> None:
    for wheel in WHEELS:
        assert md.version(wheel.name) == wheel.version, f"{wheel.name}: the list and this environment differ"
        assert wheel.file.endswith(".whl") and ("cp312" in wheel.file or "-none-" in wheel.file)
    assert not {canonicalize_name(n) for n in ABSENT} & device_env.allowed()


def test_the_kit_imports_and_builds_the_reference_with_only_the_machine_packages_and_the_wheels(
        device_python) -> None:
    probe = PROBE.format(repo=str(REPO), modules=KIT_MODULES, absent=list(ABSENT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(device_python), "-c", probe], capture_output=True, text=True, cwd="/", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "absent-but-found [] leaked []" in done.stdout


def test_the_environment_really_lacks_what_the_machine_lacks(device_python) -> None:
    done = subprocess.run([str(device_python), "-c", "import celery"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode != 0 and "No module named 'celery'" in done.stderr
