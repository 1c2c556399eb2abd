"""`--local` run in a folder the services never ran in: a one-line refusal that names the database it
looked for and what to set, and nothing left behind (no traceback, no empty var/wavefarm.sqlite)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.conftest import redis_url


def _local(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("WAVEFARM_DATABASE_URL", "WAVEFARM_ARTIFACT_ROOT")}
    clean.update(WAVEFARM_BROKER_URL=redis_url(0), WAVEFARM_FEATURE_STORE_URL=redis_url(2), **env)
    return subprocess.run([sys.executable, "-m", "app.cli", *args, "--local"], cwd=cwd, env=clean,
                          capture_output=True, text=True, timeout=120)


def test_local_in_another_folder_names_the_database_it_looked_for(tmp_path: Path) -> None:
    done = _local(["jobs"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    looked = tmp_path.resolve() / "var" / "wavefarm.sqlite"
    assert f"no wavefarm database at {looked} (from the default)" in done.stderr
    assert "WAVEFARM_DATABASE_URL" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no var/ and no empty database left


def test_local_on_a_database_without_wavefarm_tables_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "other.sqlite"
    sqlite3.connect(empty).close()
    done = _local(["book", "list"], tmp_path, WAVEFARM_DATABASE_URL=f"sqlite:///{empty}")
    assert done.returncode == 2, done.stderr
    assert "has no wavefarm tables (run `wavefarm db upgrade`" in done.stderr
    assert "Traceback" not in done.stderr
