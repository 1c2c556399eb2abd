"""Voices as a service: store a reference once, queue its preparation once, reclaim what cancelled jobs
leave behind. Used by every interface that takes a voice (jobs, books, `POST /v1/voices`, the CLI) and by
the tasks and the GPU worker once a preparation settles.

A voice is the sha256 of its normalised reference (`app.audio`); its row (`app.db`) says where the
reference file is and how far its preparation got; its prepared host features live in the feature store
(`app.storage.feature_store`) under a TTL. A claim in the store (`PREPARE_CLAIM_TTL_S`) makes N submissions of
one voice queue one `voice.prepare`. Not in here: the preparation itself (`app.voices.preparation`), GPU
installs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from app import audio
from app.broker import wire
from app.db import queries
from app.db.models import Voice, VoiceStatus
from app.errors import BadInput
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.storage.keys import check_voice_id, known_id
from app.voices import names as voice_names

if TYPE_CHECKING:
    from app.context import Context

PREPARE_CLAIM_TTL_S = 600  # N submissions of one voice within this window queue one preparation

VoiceState = Voice | queries.VoiceUse  # what the preparation's checks read: the voice's id and status


def reference_limits(settings: Settings) -> audio.AudioLimits:
    return audio.AudioLimits(max_bytes=settings.max_reference_bytes,
                             max_seconds=settings.max_reference_seconds)


def store_reference(*, settings: Settings, session: Session, artifacts: ArtifactStore,
                    reference_bytes: bytes) -> tuple[Voice, bool]:
    """Decode and normalise an upload (BadAudio if unusable) and store it once per voice; flushes.

    Returns (voice, created)."""
    decoded = audio.decode_audio(reference_bytes, reference_limits(settings))
    _, voice_id = audio.normalise_reference(decoded.pcm, decoded.sample_rate)
    voice = queries.get_voice(session=session, voice_id=voice_id)
    if voice is not None and voice.reference_path and artifacts.path(voice.reference_path).exists():
        return voice, False
    relpath = artifacts.put_reference(reference_bytes, decoded.format)
    voice, created = queries.get_or_create_voice(session=session, voice_id=voice_id, reference_path=relpath)
    notes = "\n".join(audio.reference_notes(decoded.pcm, decoded.sample_rate)) or None
    if voice.reference_path != relpath or voice.reference_notes != notes:  # new, or its file had gone
        voice.reference_path, voice.reference_notes = relpath, notes
        session.flush()
    return voice, created


def get_voice(*, session: Session, voice_id: str) -> Voice:
    """The voice with this id (or name, or unique id prefix: `app.voices.names`); NotFound for an unknown
    or malformed one."""
    if not _looks_like_id(voice_id):
        voice_id = voice_names.resolve_ref(session=session, ref=voice_id) or voice_id
    return queries.require_voice(session=session, voice_id=known_id(voice_id, check_voice_id, "voice"))


def _looks_like_id(value: str) -> bool:
    try:
        check_voice_id(value)
    except ValueError:
        return False
    return True


def resolve_voice(*, ctx: Context, session: Session, reference_bytes: bytes | None,
                  voice_id: str | None) -> Voice:
    """The voice of a request that names one (an id) or uploads one (reference bytes), not both."""
    if (reference_bytes is None) == (voice_id is None):
        raise BadInput("give exactly one of reference audio or a voice id")
    if reference_bytes is not None:
        return store_reference(settings=ctx.settings, session=session, artifacts=ctx.artifacts,
                               reference_bytes=reference_bytes)[0]
    return queries.require_voice(session=session, voice_id=_stored_id(session, voice_id))


def voice_to_use(*, ctx: Context, session: Session, reference_bytes: bytes | None,
                 voice_id: str | None) -> str:
    """The id of the voice a submission names, without reading its row (the job's insert counts its use
    and finds whether it exists: `queries.create_job_using_voice`); an uploaded reference is stored first
    (`store_reference`). BadInput for both or neither, or an id of the wrong shape."""
    if (reference_bytes is None) == (voice_id is None):
        raise BadInput("give exactly one of reference audio or a voice id")
    if reference_bytes is not None:
        return store_reference(settings=ctx.settings, session=session, artifacts=ctx.artifacts,
                               reference_bytes=reference_bytes)[0].id
    return _stored_id(session, voice_id)


def _stored_id(session: Session, ref: str | None) -> str:
    """The id a voice reference names (a name or an id prefix: its id), checked in shape."""
    voice_id = voice_names.resolve_ref(session=session, ref=ref) or ""
    try:
        check_voice_id(voice_id)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    return voice_id


class StoredFeatures:
    """The voices whose features one process found in the feature store within the last `TRUST_S`: a
    submission of a ready voice found here skips the store's EXISTS (a Redis round trip a submission).

    The store evicts features by itself (their TTL, or its LRU under `maxmemory`), so a hit here may be
    up to `TRUST_S` old: a voice evicted in that time is not re-armed by this process until the entry runs
    out, and its jobs meanwhile reach the GPU worker without features (the voice's row still ready, so
    no hint): they wait `prep_wait_ms` for them and are then prepared inline, which stores the features
    again (`gpu_worker.engine.resolver`, prep path `inline`). The first submission after the entry runs
    out re-arms the voice as before. Only ready voices are remembered: a voice whose features this
    service deletes (`reclaim_abandoned_voice`) goes back to pending in the same commit, and a pending or
    failed voice is checked against the store every time. Shared by a process's threads."""

    TRUST_S = 1.0
    KEEP_MAX = 4096  # entries kept; past it the ones run out are dropped

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[str, float] = {}

    def recent(self, voice_id: str) -> bool:
        return self._until.get(voice_id, 0.0) > self.clock()

    def found(self, voice_id: str) -> None:
        now = self.clock()
        if len(self._until) >= self.KEEP_MAX:
            self._until = {v: until for v, until in self._until.items() if until > now}
        self._until[voice_id] = now + self.TRUST_S


def needs_prepare(*, session: Session, store: FeatureStore, voice: VoiceState,
                  stored: StoredFeatures | None = None) -> bool:
    """Whether to queue `voice.prepare` now (this caller holds the claim then); re-arms a voice whose
    features are gone or whose last preparation failed. `stored`: the process's recent finds of features
    (`StoredFeatures`; None: ask the store every time)."""
    if voice.status == VoiceStatus.READY:
        if stored is not None and stored.recent(voice.id):
            return False
        if store.exists(voice.id):
            if stored is not None:
                stored.found(voice.id)
            return False
    if voice.status in (VoiceStatus.READY, VoiceStatus.FAILED):
        queries.mark_voice_pending(session=session, voice_id=voice.id)
        store.release_prepare(voice.id)
    # A preparation already queued for this voice serves this caller too.
    return store.claim_prepare(voice.id, PREPARE_CLAIM_TTL_S)


def queue_preparation(*, ctx: Context, session: Session, voice: VoiceState, priority: int = 0) -> bool:
    """Commit `session` (the worker must find the rows), then queue the voice's preparation if it needs
    one; returns whether it was queued. If the broker refuses, the claim is released, so the next upload
    or job queues it again, and the error is raised."""
    prepare = needs_prepare(session=session, store=ctx.store, voice=voice, stored=ctx.stored_features)
    voice_id = voice.id
    session.commit()
    if prepare:
        try:
            wire.send_prepare(ctx.sender, ctx.settings, voice_id, priority)
        except Exception:
            ctx.store.release_prepare(voice_id)
            raise
    return prepare


def register_voice(*, ctx: Context, session: Session, reference_bytes: bytes) -> tuple[str, bool]:
    """Store a reference voice on its own and queue its preparation; returns (voice id, created).
    Commits `session`. The voice is stored, deduplicated and prepared exactly as one sent with a job."""
    voice, created = store_reference(settings=ctx.settings, session=session, artifacts=ctx.artifacts,
                                     reference_bytes=reference_bytes)
    queue_preparation(ctx=ctx, session=session, voice=voice)
    return voice.id, created


def reclaim_abandoned_voice(*, session: Session, store: FeatureStore, voice_id: str) -> bool:
    """Drop a voice's prepared features if every job that wanted it was cancelled; the caller commits.

    Call after cancelling a job, and once a preparation settles. The voice goes back to pending, so a
    later job prepares it again. GPU installs are the GPU worker's to reclaim."""
    if not queries.is_voice_abandoned(session=session, voice_id=voice_id):
        return False
    store.delete(voice_id)
    store.release_prepare(voice_id)
    queries.mark_voice_pending(session=session, voice_id=voice_id)
    return True
