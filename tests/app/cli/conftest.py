"""Fixtures of the CLI tests: one database and queue pair for the module and a real `wavefarm serve` on it
(a child process with a bearer token; startup is slow, so it is shared), its settings in this process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from app.settings import Settings
from tests.conftest import REPO, settings_env
from tests.support.net import free_port


@pytest.fixture(scope="module")
def server_url(cli_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`wavefarm serve` in a child process; yields its base URL once /healthz answers."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=REPO,
                                env={**os.environ, **settings_env(cli_settings)}, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def server(server_url: str, cli_env: dict[str, str]) -> str:
    return server_url
