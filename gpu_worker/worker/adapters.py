"""The engine's boundary, wired to the service: features from the feature store, inline preparation from
the voice's stored reference.

    StoreFeatures      FeatureSource over Redis; a store that cannot be read raises ConnectionError, which
                       the resolver counts as "unavailable" and answers by preparing inline
    ReferencePreparer  InlinePreparer: the host half in this process (`app.voices.preparation`, the same unit
    of
                       work the CPU task runs), published for later jobs and other workers

The engine itself knows neither Redis nor the database (`gpu_worker.engine.core`).
"""

from __future__ import annotations

import logging
import time

import redis

from app.context import Context
from app.db import queries
from app.errors import FeaturesMissing
from app.storage.feature_store import FeatureStore
from app.voices import preparation
from app.voices.features import PromptHostFeatures
from gpu_worker.engine.streams import EngineJob

log = logging.getLogger(__name__)


class StoreFeatures:
    """FeatureSource over the Redis feature store; store errors surface as ConnectionError."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        try:
            data = self.store.get(voice_id)
        except redis.RedisError as exc:
            raise ConnectionError(f"feature store: {exc}") from exc
        return None if data is None else PromptHostFeatures.from_bytes(data)


class ReferencePreparer:
    """InlinePreparer: read the voice's stored reference and run the host half in this process."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        ctx = self.ctx
        with ctx.session() as session:
            reference = queries.require_voice(session=session, voice_id=job.voice_id).reference_path
        if reference is None:
            raise FeaturesMissing(f"voice {job.voice_id} has no stored reference audio")
        start = time.perf_counter()
        host = preparation.compute(settings=ctx.settings, artifacts=ctx.artifacts, voice_id=job.voice_id,
                                   reference_path=reference)
        try:  # for later jobs and other workers, as `voice.prepare` would; reclaimed if nobody wants it
            preparation.publish(sessions=ctx.sessions, store=ctx.store, host=host,
                                prepare_ms=1000 * (time.perf_counter() - start))
        except redis.RedisError as exc:
            log.warning("voice %s: could not store inline-prepared features: %s", host.voice_id, exc)
        return host
