"""The style's tools over the code: ruff on everything, mypy on the three packages (pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "app", "tasks", "gpu_worker", "bench", "migrations", "tests", "scripts")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_the_packages() -> None:
    done = _run("mypy", "app", "tasks", "gpu_worker", "bench")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
