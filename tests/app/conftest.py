"""Fixtures of the service tests: `submit`, a job submitted through `app.submission.jobs` with the test's
settings (and the root's `celery` producer), and the CLI and demo tests' module-wide settings (`cli_settings`,
`cli_env`: one database and queue pair, a bearer token)."""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.orm import Session

from app.db import upgrade
from app.settings import Settings, get_settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from tests.app.cli.helpers import TOKEN
from tests.conftest import SESSION_TAG, make_test_settings, settings_env
from tests.support.audio import wav_bytes


@pytest.fixture
def submit(
    ctx, settings: Settings, session: Session, celery: Celery, store: FeatureStore, artifacts: ArtifactStore
):
    def _submit(**kwargs: Any) -> str:
        kwargs.setdefault("tokens", [1, 2, 3])
        if "voice_id" not in kwargs:
            kwargs.setdefault("reference_bytes", wav_bytes())
        return submit_job(
            ctx=ctx, session=session, request=JobRequest(**kwargs)
        )

    return _submit


@pytest.fixture(scope="module")
def cli_settings(tmp_path_factory: pytest.TempPathFactory, redis_session_lock: None) -> Settings:
    """One database and queue pair for the module: the server it starts is shared (startup is slow)."""
    root = tmp_path_factory.mktemp("cli")
    url = f"sqlite:///{root / 'wavefarm.sqlite'}"
    upgrade(url)
    return make_test_settings(database_url=url, artifact_root=root / "artifacts",
                              tag=f"{SESSION_TAG}-{uuid.uuid4().hex[:8]}", api_token=TOKEN)


@pytest.fixture
def cli_env(cli_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This module's settings as WAVEFARM_* variables, in this process (for in-process CLI calls) too."""
    env = settings_env(cli_settings)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()
