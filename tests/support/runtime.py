"""GPU worker runtimes for tests, as a pytest plugin (the root conftest loads it): `make_runtime` builds
runtimes on the test's SQLite file (tiny preset, dummy weights, real Redis), `sqlite_sessions` opens
sessions on that file; `submit`, `prepare_ahead` and `job_row` play the other processes' parts, and
`RecordingTask` stands in for the bound Celery task a `synth` body gets."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from app.audio import load_reference
from app.context import Context
from app.db import queries
from app.db.session import make_engine, make_sessionmaker
from app.dev import SAMPLES
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.voices.features import host_half
from gpu_worker.worker.runtime import Runtime, build_runtime
from tests.conftest import make_test_settings

VOICE_A, VOICE_B = (SAMPLES / "voice_a.wav").read_bytes(), (SAMPLES / "voice_b.wav").read_bytes()


class RecordingSender:
    """Celery's send_task at the submission boundary: records what would be enqueued."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        self.sent.append((name, args))


class RecordingTask:
    """The bound Celery task as JobRun uses it: events and state are recorded."""

    def __init__(self) -> None:
        self.request = SimpleNamespace(id=None, hostname="gpu-test@host")
        self.events: list[tuple[str, dict[str, Any]]] = []

    def send_event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))


@pytest.fixture
def sqlite_sessions(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(sqlite_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def settings_for(sqlite_url: str, artifacts: ArtifactStore, **extra: Any) -> Settings:
    base = {"model_preset": "tiny", "prep_wait_ms": 100, "progress_interval_s": 0.05, "micro_batch_size": 4,
            "worker_slots": 4, "voice_cache_capacity": 2}
    return make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root,
                              tag=f"t{os.getpid()}-{uuid.uuid4().hex[:6]}", **{**base, **extra})


@pytest.fixture
def make_runtime(sqlite_url, artifacts, store) -> Iterator:
    built: list[Runtime] = []

    def make(**extra: Any) -> Runtime:
        rt = build_runtime(settings_for(sqlite_url, artifacts, **extra), f"gpu-{len(built)}@test",
                           sender=RecordingSender())  # what the worker rings (a ready chapter's book.chapter)
        built.append(rt)
        return rt

    torch.set_num_threads(1)  # tiny ops on a shared machine
    yield make
    for rt in built:
        rt.close()


def submit(rt: Runtime, sessions, reference: bytes, n_tokens: int, seed: int = 7) -> str:
    generator = torch.Generator().manual_seed(n_tokens)
    tokens = torch.randint(0, VOCAB_SIZE, (n_tokens,), generator=generator).tolist()
    with sessions() as session:
        return submit_job(ctx=producer_of(rt), session=session, request=JobRequest(
            tokens=tokens, reference_bytes=reference, seed=seed))


def producer_of(rt: Runtime) -> Context:
    """The runtime's clients as a producer's, its messages recorded apart from what the worker sends."""
    return Context(**{**rt.clients(), "sender": RecordingSender()})


def prepare_ahead(rt: Runtime, reference: bytes) -> str:
    pcm, voice_id = load_reference(reference)
    rt.store.put(voice_id, host_half(pcm, voice_id).to_bytes())
    return voice_id


def job_row(sessions, job_id: str):
    with sessions() as session:
        return queries.require_job(session=session, job_id=job_id)
