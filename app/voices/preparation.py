"""The host half of a voice as one unit of work: stored reference -> host features -> feature store.

    compute(settings=, artifacts=, voice_id=, reference_path=)  -> PromptHostFeatures (BadAudio if the
                                                                   file is not, or no longer, that voice)
    publish(sessions=, store=, host=, prepare_ms=)               -> Published: stored with a TTL, the voice
                                                                   ready, reclaimed at once if every job
                                                                   that wanted it was cancelled meanwhile

The CPU task `voice.prepare` (tasks/voice.py) runs both ahead of the GPU; a GPU worker whose job could not
wait for it runs them inline (`gpu_worker.worker.adapters`), so a voice is prepared and published one way
whoever does it. Which errors are retried, counted or only logged is the callers' choice: an unusable
reference is BadAudio, Redis and the database raise their own errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from app import audio
from app.db import queries
from app.db.session import session_scope
from app.errors import BadAudio
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.voices import features
from app.voices import service as voices
from app.voices.features import PromptHostFeatures


@dataclass(frozen=True)
class Published:
    nbytes: int
    reclaimed: bool  # every job that wanted the voice had been cancelled: the features went again


def compute(*, settings: Settings, artifacts: ArtifactStore, voice_id: str,
            reference_path: str) -> PromptHostFeatures:
    """The voice's stored reference file -> its host features."""
    data = artifacts.read_bytes(reference_path)
    pcm24k, computed_id = audio.load_reference(data, voices.reference_limits(settings))
    if computed_id != voice_id:
        raise BadAudio(f"stored reference {reference_path} normalises to voice {computed_id}, not {voice_id}")
    return features.host_half(pcm24k, voice_id)


def publish(*, sessions: sessionmaker[Session], store: FeatureStore, host: PromptHostFeatures,
            prepare_ms: float, ttl_s: int | None = None) -> Published:
    """Store the features for every worker, mark the voice ready, then reclaim the features if nobody
    wants the voice any more (its jobs were cancelled while it was being prepared)."""
    data = host.to_bytes()
    store.put(host.voice_id, data, ttl_s)
    with session_scope(sessions) as session:
        queries.mark_voice_ready(session=session, voice_id=host.voice_id, prepare_ms=prepare_ms,
                                 feature_nbytes=len(data))
    with session_scope(sessions) as session:
        reclaimed = voices.reclaim_abandoned_voice(session=session, store=store, voice_id=host.voice_id)
    return Published(nbytes=len(data), reclaimed=reclaimed)
