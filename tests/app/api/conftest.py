"""Fixtures of the API tests: a sample reference, a TestClient on the test's settings (real Redis, both
databases), the broker's queues emptied after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient

from app.dev import SAMPLES
from app.settings import Settings
from tests.app.api.helpers import make_client


@pytest.fixture
def reference() -> bytes:
    return (SAMPLES / "voice_a.wav").read_bytes()


@pytest.fixture
def client(settings: Settings, feature_redis: redis.Redis) -> Iterator[TestClient]:
    """An app on this test's database and queues; the feature store is flushed around the test."""
    yield from make_client(settings)


