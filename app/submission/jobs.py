"""Jobs as a service: submit, look up, cancel, and a job's tokens. Used by the API's routes, the CLI,
the book pipeline and the GPU worker, so every interface accepts, refuses and cancels a job the same way.

`submit_job` checks the request (a `JobRequest`, `app.submission.request`), stores the reference audio under
its content hash, writes the voice and job rows, commits, and only then queues `voice.prepare` (cpu queue;
skipped when the voice's features are in the store already) and `synth` (gpu queue). A job may bring text
instead of tokens: then `job.tokenize` (cpu queue, `app.text.tokens`) makes its tokens and sends its
`synth`. If the broker refuses, the job is taken back out, so the client can simply retry. Tasks are sent by
name (`app.broker.wire`): nothing here imports task code.
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from sqlalchemy.orm import Session

from app import audio, lifecycle
from app.broker import wire
from app.db import queries
from app.db.models import Job, JobKind, JobStatus
from app.errors import BadInput, Conflict, Gone, NotFound
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.keys import check_job_id, check_voice_id, known_id
from app.submission import routing
from app.submission.request import JobRequest, Request, check_request
from app.voices import names as voice_names
from app.voices import service as voices

if TYPE_CHECKING:  # the services' bundle of clients; importing it would pull the broker client in
    from app.context import Context

log = logging.getLogger(__name__)

INLINE_TOKENS_MAX = 4096  # longer token lists go to the artifact store instead of the jobs row


def new_job(*, session: Session, artifacts: ArtifactStore, voice_id: str, request: Request, seed: int,
            route: routing.Route | None = None) -> tuple[Job, bool]:
    """Insert a queued job for a checked `request`: its tokens (a long list goes to the artifact store;
    `route`: where its `synth` goes, recorded with it), or its text (tokens None: `job.tokenize` makes
    them); `seed` is the one to use.

    Returns (job, created); with an idempotency key another submission used first, that job and False."""
    new = _new_row(artifacts, voice_id, request, seed, route)
    job, created = queries.create_job(session=session, new=new)
    if not created and new.tokens_path:
        artifacts.remove(new.tokens_path)
    return job, created


def new_job_using_voice(*, session: Session, artifacts: ArtifactStore, voice_id: str, request: Request,
                        seed: int, route: routing.Route | None = None) -> tuple[queries.VoiceUse, Job, bool]:
    """`new_job`, with one more use of the voice counted in the same statement (`queries.
    create_job_using_voice`); NotFound, and nothing kept, if there is no such voice.

    Returns (the voice's id and status, job, created)."""
    new = _new_row(artifacts, voice_id, request, seed, route)
    try:
        used, job, created = queries.create_job_using_voice(session=session, new=new)
    except NotFound:
        if new.tokens_path:
            artifacts.remove(new.tokens_path)
        raise
    if not created and new.tokens_path:
        artifacts.remove(new.tokens_path)
    return used, job, created


def _new_row(artifacts: ArtifactStore, voice_id: str, request: Request, seed: int,
             route: routing.Route | None) -> queries.NewJob:
    """A new job's row; a token list longer than `INLINE_TOKENS_MAX` is written to the artifact store."""
    job_id = str(uuid.uuid4())
    tokens, idempotency_key = request.tokens, request.idempotency_key
    if tokens is None:
        return queries.NewJob(
            id=job_id, voice_id=voice_id, tokens=None, n_tokens=0, seed=seed,
            output_format=request.output_format, priority=request.priority, idempotency_key=idempotency_key,
            kind=JobKind.TEXT, text=request.text, language=request.language)
    inline = len(tokens) <= INLINE_TOKENS_MAX
    return queries.NewJob(
        id=job_id, voice_id=voice_id, tokens=tokens if inline else None,
        n_tokens=len(tokens), seed=seed, output_format=request.output_format, priority=request.priority,
        idempotency_key=idempotency_key, tokens_path=None if inline else artifacts.put_tokens(job_id, tokens),
        routed_to=route.worker if route else None, route=route.reason if route else None)


def store_tokens(*, session: Session, artifacts: ArtifactStore, job_id: str, tokens: list[int]) -> bool:
    """A text job's tokens, once made (inline, or in the artifact store when long); False when the job
    is no longer waiting for them (cancelled, or tokenized by an earlier delivery)."""
    inline = len(tokens) <= INLINE_TOKENS_MAX
    tokens_path = None if inline else artifacts.put_tokens(job_id, tokens)
    stored = queries.set_job_tokens(session=session, job_id=job_id, tokens=tokens if inline else None,
                                    n_tokens=len(tokens), tokens_path=tokens_path)
    if not stored and tokens_path:
        artifacts.remove(tokens_path)
    return stored


def submit_job(*, ctx: Context, session: Session, request: JobRequest) -> str:
    """`submit`, for its job's id."""
    return submit(ctx=ctx, session=session, request=request).id


def submit(*, ctx: Context, session: Session, request: JobRequest) -> Job:
    """Accept one job and return it, as written (an answer needs no re-read): speech `tokens`, or `text`
    (in `language`, default "en") that a CPU worker turns into tokens first. An idempotency key already
    used returns that job if the request is the same (voice, tokens or text and language, output format,
    priority, and the seed when one is given) and raises Conflict if it is not; this is judged after a
    lost insert race as well, so two concurrent requests with one key get one job, or one job and a
    Conflict. The job is routed before its insert (`app.submission.routing`), so its row and route are
    committed once, before any message.

    Commits `session` (workers must see the rows before the tasks arrive). Raises BadTokens, BadAudio,
    BadInput or NotFound before anything is stored."""
    settings, artifacts = ctx.settings, ctx.artifacts
    checked, chosen_seed = check_request(settings=settings, request=request)
    reference_bytes, priority, key = request.reference_bytes, checked.priority, checked.idempotency_key
    voice_id = voice_names.resolve_ref(session=session, ref=request.voice_id)  # a name or id prefix: its id
    if key is not None:
        existing = queries.get_job_by_idempotency_key(session=session, idempotency_key=key)
        if existing is not None:  # a retry: the same request, or a Conflict
            replayed(existing, checked, _voice_id_of(settings, reference_bytes, voice_id), artifacts)
            return existing
    voice_id = voices.voice_to_use(ctx=ctx, session=session, reference_bytes=reference_bytes,
                                   voice_id=voice_id)
    # Routed before the insert, so the route is written with the row: one commit before any message.
    route = None if checked.text is not None else routing.route_voice(
        session=session, settings=settings, voice_id=voice_id, live_workers=ctx.live_workers)
    # The voice's use counted and the job written (PostgreSQL: one statement); the use is given back
    # below if the job is not new.
    voice, job, created = new_job_using_voice(session=session, artifacts=artifacts, voice_id=voice_id,
                                              request=checked, seed=chosen_seed, route=route)
    if not created:  # a concurrent submission with the same key won the insert: judged the same way
        queries.add_voice_use(session=session, voice_id=voice.id, delta=-1)
        replayed(job, checked, voice.id, artifacts)
        session.commit()
        return job
    try:
        voices.queue_preparation(ctx=ctx, session=session, voice=voice, priority=priority)  # commits first
        if route is not None:
            wire.send_synth(ctx.sender, settings, job.id, priority, queue=route.queue)
        else:
            wire.send_tokenize(ctx.sender, settings, job.id, priority)
    except Exception:
        log.exception("job %s: could not enqueue; withdrawing it", job.id)
        _withdraw(session=session, artifacts=artifacts, job=job)
        raise
    return job


def _voice_id_of(settings: Settings, reference_bytes: bytes | None, voice_id: str | None) -> str:
    """The voice a request names, without storing anything (a retry's reference is stored already)."""
    if (reference_bytes is None) == (voice_id is None):
        raise BadInput("give exactly one of reference audio or a voice id")
    if reference_bytes is not None:
        return audio.load_reference(reference_bytes, voices.reference_limits(settings))[1]
    try:
        return check_voice_id(voice_id or "")
    except ValueError as exc:
        raise BadInput(str(exc)) from exc


def replayed(job: Job, request: Request, voice_id: str, artifacts: ArtifactStore) -> str:
    """The job an idempotency key already names, if this request is the same one; Conflict otherwise."""
    tokens = request.tokens
    if tokens is None:
        what, same_input = "text", (job.kind, job.text, job.language) == (JobKind.TEXT, request.text,
                                                                          request.language)
    else:
        what, same_input = "tokens", (job.kind == JobKind.TOKENS and job.n_tokens == len(tokens)
                                      and job_tokens(job=job, artifacts=artifacts) == tokens)
    differs = [name for name, same in (
        ("voice", job.voice_id == voice_id), (what, same_input),
        ("seed", request.seed is None or job.seed == request.seed),
        ("output format", job.output_format == request.output_format),
        ("priority", job.priority == request.priority)) if not same]
    if differs:
        raise Conflict(f"idempotency key {job.idempotency_key!r} was used for job {job.id}, which has "
                       f"another {', '.join(differs)}; use a new key for a new job")
    return job.id


def _withdraw(*, session: Session, artifacts: ArtifactStore, job: Job) -> None:
    """Take a committed job back out (the broker refused it), so that the client's retry starts afresh."""
    queries.delete_jobs(session=session, job_ids=[job.id])
    queries.add_voice_use(session=session, voice_id=job.voice_id, delta=-1)
    session.commit()
    if job.tokens_path:
        artifacts.remove(job.tokens_path)


JOB_PREFIX = re.compile(r"[0-9a-f][0-9a-f-]{3,35}")  # what the CLI and the web page print: 8 hex digits


def get_job(*, session: Session, job_id: str) -> Job:
    """The job with this id, or with this unique id prefix (at least 4 characters); NotFound for an
    unknown or malformed one, BadInput naming the candidates for a prefix several ids begin with."""
    if isinstance(job_id, str) and JOB_PREFIX.fullmatch(job_id) and len(job_id) < 36:
        found = queries.job_ids_with_prefix(session=session, prefix=job_id, limit=6)
        if len(found) > 1:
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            raise BadInput(f"job {job_id!r} is ambiguous: it begins {len(found)} job ids ({shown}); "
                           "give more of the id")
        if found:
            job_id = found[0]
    return queries.require_job(session=session, job_id=known_id(job_id, check_job_id, "job"))


def list_jobs(*, session: Session, status: str | None = None, voice_id: str | None = None,
              limit: int = 100) -> list[Job]:
    """Newest first."""
    return queries.list_jobs(session=session, status=status, voice_id=voice_id, limit=limit)


def cancel_job(*, ctx: Context, session: Session, job_id: str) -> Job:
    """Cancel a queued or running job (idempotent); commits. Conflict if it had already finished.

    The database is the record: once the cancel is committed the answer is the cancelled job, whatever
    Redis does. After it, best effort: the voice's prepared features are reclaimed if no other job wants
    the voice (else the maintenance sweep does it), and the cancel flag is set, which the GPU worker polls
    between steps (a hint only: it reads the job's status from the database at its next progress report
    as well)."""
    job = get_job(session=session, job_id=job_id)
    cancelled_now = lifecycle.cancel(session=session, job_id=job.id)
    job = queries.require_job(session=session, job_id=job.id)
    session.commit()
    if job.status != JobStatus.CANCELLED:
        raise Conflict(f"job {job.id} already {job.status}")
    try:
        if cancelled_now:
            voices.reclaim_abandoned_voice(session=session, store=ctx.store, voice_id=job.voice_id)
            session.commit()
        ctx.store.request_cancel(job.id, ttl_s=ctx.settings.visibility_timeout_s)
    except redis.RedisError as exc:
        session.rollback()
        log.warning("job %s: cancelled, but Redis did not answer (%s): the cancel flag is not set and the "
                    "voice's features are left to the sweep", job.id, exc)
    return job


def audio_path(*, session: Session, artifacts: ArtifactStore, job_id: str) -> Path:
    """A succeeded job's audio file: Conflict until the job succeeded, Gone once its file was removed."""
    job = get_job(session=session, job_id=job_id)
    if job.status != JobStatus.SUCCEEDED or job.output_path is None:
        raise Conflict(f"job {job.id} is {job.status}; audio exists once it succeeded")
    path = artifacts.path(job.output_path)
    if not path.is_file():
        raise Gone(f"the audio of job {job.id} has been removed")
    return path


def job_tokens(*, job: Job, artifacts: ArtifactStore) -> list[int]:
    """A job's tokens, wherever they are kept (inline in the row or in the artifact store); a text job
    has them once `job.tokenize` ran (`queries.is_tokenized`)."""
    if job.tokens is not None:
        return list(job.tokens)
    assert job.tokens_path is not None, f"job {job.id} has no tokens"
    return artifacts.read_tokens(job.tokens_path)
