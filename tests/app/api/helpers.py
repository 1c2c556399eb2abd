"""What the API tests share: a client on a test's settings, requests they make, the GPU worker's part
played in process, and the broker's queued messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import redis
import torch
from fastapi.testclient import TestClient

from app import lifecycle
from app.api.main import create_app
from app.db import queries
from app.db.models import JobStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore

TOKENS = [1, 2, 3, 4, 5, 6560, 0, 42]


def make_client(settings: Settings, **kwargs: Any) -> Iterator[TestClient]:
    with TestClient(create_app(settings), **kwargs) as client:
        yield client


def queued(broker: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The task messages waiting on a queue (every priority list), as kombu wrote them."""
    keys = [queue] + [f"{queue}\x06\x16{n}" for n in range(1, 10)]
    return [json.loads(raw) for key in keys for raw in broker.lrange(key, 0, -1)]


def upload_voice(client: TestClient, data: bytes, field: str = "reference") -> Any:
    return client.post("/v1/voices", files={field: ("ref.wav", data, "audio/wav")})


def submit(client: TestClient, voice_id: str, tokens: list[Any] = TOKENS, **extra: Any) -> Any:
    return client.post("/v1/jobs", json={"voice_id": voice_id, "tokens": tokens, **extra})


def finish(settings: Settings, job_id: str, status: JobStatus, output: bytes | None = None) -> None:
    """Play the GPU worker's part: finish a job (writing its output file when given)."""
    artifacts = ArtifactStore(settings.artifact_root)
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        relpath = None
        if output is not None:
            relpath = artifacts.output_relpath(job_id, "wav")
            artifacts.write_bytes(relpath, output)
        assert lifecycle.finish(session=s, job_id=job_id, status=status, output_path=relpath)
    engine.dispose()


def mark_prepared(settings: Settings, voice_id: str) -> FeatureStore:
    """Play the CPU worker: features in the store, voice ready."""
    from safetensors.torch import save

    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=600)
    store.put(voice_id, save({"x": torch.zeros(1)}))
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        queries.mark_voice_ready(session=s, voice_id=voice_id, prepare_ms=1.0, feature_nbytes=8)
    engine.dispose()
    return store
