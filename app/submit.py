"""Job submission, shared by every interface (API, CLI, book splitting).

`submit_job` validates the request, stores the reference audio under its
content hash, writes the voice and job rows, commits, and only then
enqueues `voice.prepare` (cpu queue; skipped when the voice's features are
already in the store) and `synth` (gpu queue). Tasks are sent by name, so
this module never imports the task code.
"""

from __future__ import annotations

import logging
import numbers
import secrets
import uuid
from collections.abc import Iterable
from typing import Any, Protocol

from sqlalchemy.orm import Session

from app import audio
from app.artifacts import ArtifactStore
from app.db import queries
from app.db.models import Job, OutputFormat, Voice, VoiceStatus
from app.errors import BadInput, BadTokens
from app.keys import check_voice_id
from app.settings import Settings
from app.store import FeatureStore

log = logging.getLogger(__name__)

VOCAB_SIZE = 6561  # speech token ids are 0..6560 (MODEL.md)
MAX_PRIORITY = 9  # job priority 0..9, larger goes first
INLINE_TOKENS_MAX = 4096  # longer token lists go to the artifact store instead of the jobs row
PREPARE_CLAIM_TTL_S = 600  # N submissions of one voice within this window enqueue one preparation
MAX_SEED = 2**63 - 1
IDEMPOTENCY_KEY_MAX = 128

PREPARE_TASK = "voice.prepare"
SYNTH_TASK = "synth"


class TaskSender(Protocol):
    """What submission needs from Celery (`Celery.send_task`)."""

    def send_task(self, name: str, args: Any = None, **options: Any) -> Any: ...


def reference_limits(settings: Settings) -> audio.AudioLimits:
    return audio.AudioLimits(
        max_bytes=settings.max_reference_bytes, max_seconds=settings.max_reference_seconds
    )


def broker_priority(priority: int) -> int:
    """Job priority (larger first) -> Redis transport priority (0 is served first)."""
    return MAX_PRIORITY - priority


def check_tokens(tokens: Iterable[Any], *, max_tokens: int) -> list[int]:
    """A non-empty list of ints in 0..6560, at most `max_tokens` long; BadTokens otherwise."""
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Iterable):
        raise BadTokens("tokens must be a list of integers")
    out = list(tokens)
    if not out:
        raise BadTokens("tokens are empty")
    if len(out) > max_tokens:
        raise BadTokens(f"{len(out)} tokens; at most {max_tokens} are accepted per job")
    ids: list[int] = []
    for i, token in enumerate(out):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise BadTokens(f"token {i} is {token!r}, not an integer")
        if not 0 <= int(token) < VOCAB_SIZE:
            raise BadTokens(f"token {i} is {token}; ids are 0..{VOCAB_SIZE - 1}")
        ids.append(int(token))
    return ids


def _check_options(
    *, seed: int | None, output_format: str, priority: int, idempotency_key: str | None
) -> int:
    """Validate the scalar options; returns the seed to use."""
    if output_format not in tuple(OutputFormat):
        raise BadInput(f"output format {output_format!r} is not one of {[f.value for f in OutputFormat]}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise BadInput(f"priority must be an integer 0..{MAX_PRIORITY}")
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= IDEMPOTENCY_KEY_MAX
    ):
        raise BadInput(f"idempotency key must be a string of 1..{IDEMPOTENCY_KEY_MAX} characters")
    if seed is None:
        return secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise BadInput("seed must be an integer 0..2**63-1")
    return seed


def _store_reference(
    *, settings: Settings, session: Session, artifacts: ArtifactStore, reference_bytes: bytes
) -> tuple[Voice, bool]:
    """Decode and normalise the upload (BadAudio if unusable); store it once per voice.

    Returns (voice, created)."""
    decoded = audio.decode_audio(reference_bytes, reference_limits(settings))
    _, voice_id = audio.normalise_reference(decoded.pcm, decoded.sample_rate)
    voice = queries.get_voice(session=session, voice_id=voice_id)
    if voice is not None and voice.reference_path and artifacts.path(voice.reference_path).exists():
        return voice, False
    relpath = artifacts.put_reference(reference_bytes, decoded.format)
    voice, created = queries.get_or_create_voice(session=session, voice_id=voice_id, reference_path=relpath)
    if not created and voice.reference_path != relpath:  # the stored file had gone missing
        voice.reference_path = relpath
        session.flush()
    return voice, created


def _voice_from_reference(
    *, settings: Settings, session: Session, artifacts: ArtifactStore, reference_bytes: bytes
) -> Voice:
    # Kept for callers written before register_voice existed.
    return _store_reference(
        settings=settings, session=session, artifacts=artifacts, reference_bytes=reference_bytes
    )[0]


def resolve_voice(
    *,
    settings: Settings,
    session: Session,
    artifacts: ArtifactStore,
    reference_bytes: bytes | None,
    voice_id: str | None,
) -> Voice:
    if (reference_bytes is None) == (voice_id is None):
        raise BadInput("give exactly one of reference audio or a voice id")
    if reference_bytes is not None:
        return _voice_from_reference(
            settings=settings, session=session, artifacts=artifacts, reference_bytes=reference_bytes
        )
    try:
        check_voice_id(voice_id or "")
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    return queries.require_voice(session=session, voice_id=voice_id or "")


def register_voice(
    *,
    settings: Settings,
    session: Session,
    sender: TaskSender,
    store: FeatureStore,
    artifacts: ArtifactStore,
    reference_bytes: bytes,
) -> tuple[str, bool]:
    """Store a reference voice on its own and queue its preparation; returns (voice id, created).

    Commits `session`. The voice is stored, deduplicated and prepared exactly as one sent with a job."""
    voice, created = _store_reference(
        settings=settings, session=session, artifacts=artifacts, reference_bytes=reference_bytes
    )
    prepare = needs_prepare(session=session, store=store, voice=voice)
    voice_id = voice.id
    session.commit()
    if prepare:
        try:
            sender.send_task(
                PREPARE_TASK, args=[voice_id], queue=settings.queue_cpu, priority=broker_priority(0)
            )
        except Exception:
            store.release_prepare(voice_id)  # the next upload or job queues it again
            raise
    return voice_id, created


def needs_prepare(*, session: Session, store: FeatureStore, voice: Voice) -> bool:
    """Whether to enqueue `voice.prepare`; re-arms a voice whose features are gone or that failed."""
    if voice.status == VoiceStatus.READY and store.exists(voice.id):
        return False
    if voice.status in (VoiceStatus.READY, VoiceStatus.FAILED):
        queries.mark_voice_pending(session=session, voice_id=voice.id)
        store.release_prepare(voice.id)
    # A preparation already queued for this voice serves this job too.
    return store.claim_prepare(voice.id, PREPARE_CLAIM_TTL_S)


def submit_job(
    *,
    settings: Settings,
    session: Session,
    sender: TaskSender,
    store: FeatureStore,
    artifacts: ArtifactStore,
    tokens: Iterable[int],
    reference_bytes: bytes | None = None,
    voice_id: str | None = None,
    seed: int | None = None,
    output_format: str = "wav",
    priority: int = 0,
    idempotency_key: str | None = None,
) -> str:
    """Accept one job and return its id; the same idempotency key returns the same id.

    Commits `session` (workers must see the rows before the tasks arrive).
    Raises BadTokens, BadAudio, BadInput or NotFound before anything is stored."""
    token_list = check_tokens(tokens, max_tokens=settings.max_tokens)
    seed = _check_options(
        seed=seed, output_format=output_format, priority=priority, idempotency_key=idempotency_key
    )
    if idempotency_key is not None:
        existing = queries.get_job_by_idempotency_key(session=session, idempotency_key=idempotency_key)
        if existing is not None:
            return existing.id
    voice = resolve_voice(
        settings=settings,
        session=session,
        artifacts=artifacts,
        reference_bytes=reference_bytes,
        voice_id=voice_id,
    )
    job_id = str(uuid.uuid4())
    inline = len(token_list) <= INLINE_TOKENS_MAX
    tokens_path = None if inline else artifacts.put_tokens(job_id, token_list)
    job, created = queries.create_job(
        session=session,
        job_id=job_id,
        voice_id=voice.id,
        tokens=token_list if inline else None,
        n_tokens=len(token_list),
        seed=seed,
        output_format=output_format,
        priority=priority,
        idempotency_key=idempotency_key,
        tokens_path=tokens_path,
    )
    if not created:  # a concurrent submission with the same key won
        session.commit()
        if tokens_path:
            artifacts.remove(tokens_path)
        return job.id
    queries.add_voice_use(session=session, voice_id=voice.id)
    prepare = needs_prepare(session=session, store=store, voice=voice)
    session.commit()
    _enqueue(
        settings=settings,
        session=session,
        sender=sender,
        store=store,
        artifacts=artifacts,
        job=job,
        prepare=prepare,
    )
    return job.id


def _enqueue(
    *,
    settings: Settings,
    session: Session,
    sender: TaskSender,
    store: FeatureStore,
    artifacts: ArtifactStore,
    job: Job,
    prepare: bool,
) -> None:
    """Send the tasks; if the broker refuses, take the job back out so the client can retry."""
    pri = broker_priority(job.priority)
    try:
        if prepare:
            sender.send_task(PREPARE_TASK, args=[job.voice_id], queue=settings.queue_cpu, priority=pri)
        # task_id = job id: Flower and revocation address the job by its own id.
        sender.send_task(SYNTH_TASK, args=[job.id], queue=settings.queue_gpu, task_id=job.id, priority=pri)
    except Exception:
        log.exception("job %s: could not enqueue; withdrawing it", job.id)
        if prepare:
            store.release_prepare(job.voice_id)
        session.delete(job)
        queries.add_voice_use(session=session, voice_id=job.voice_id, delta=-1)
        session.commit()
        if job.tokens_path:
            artifacts.remove(job.tokens_path)
        raise


def reclaim_abandoned_voice(*, session: Session, store: FeatureStore, voice_id: str) -> bool:
    """Drop a voice's prepared features if every job that wanted it was cancelled.

    Call after cancelling a job, and once a preparation settles (voice.prepare does).
    The voice goes back to pending, so a later job prepares it again; the caller commits.
    GPU installs are the GPU worker's to reclaim."""
    if not queries.is_voice_abandoned(session=session, voice_id=voice_id):
        return False
    store.delete(voice_id)
    store.release_prepare(voice_id)
    queries.mark_voice_pending(session=session, voice_id=voice_id)
    return True


def job_tokens(*, job: Job, artifacts: ArtifactStore) -> list[int]:
    """A job's tokens, wherever they are kept (inline in the row or in the artifact store)."""
    if job.tokens is not None:
        return list(job.tokens)
    assert job.tokens_path is not None, f"job {job.id} has no tokens"
    return artifacts.read_tokens(job.tokens_path)
