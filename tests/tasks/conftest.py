"""What the task tests share: the tasks' `Resources` on the test's settings, database, store and artifacts."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.settings import Settings
from app.store import FeatureStore
from tasks.voice import Resources


@pytest.fixture
def res(settings: Settings, sessions: sessionmaker[Session], store: FeatureStore,
        artifacts: ArtifactStore) -> Resources:
    return Resources(settings=settings, sessions=sessions, store=store, artifacts=artifacts)
