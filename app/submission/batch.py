"""Batch submission: many jobs in one request, one transaction and one publish round.

`submit_batch` takes a request's items, each parsed already (the fields of a `JobRequest`, as a JSON
submission gives them) or refused by the parser, and answers one `Outcome` per item, in order: accepted (the
job's id and status, and whether an idempotency key named a job that existed) or refused with the error a
single submission would have raised. A bad item never sinks the others. Per distinct voice, once: its
lookup, its routing decision (`app.submission.routing.route_voice`), its use count and its preparation check.
The new jobs are inserted in one statement with their routes, everything is committed once, and only then
are the messages sent, all over one broker connection as one round (`app.broker.wire.one_round`: on
RabbitMQ, the publisher confirms awaited once for the round; on Redis, one pipeline). When the broker
refuses a message, the jobs not sent yet are taken back out and their items refused (the error kept),
as a single submission's job would be.

An idempotency key used twice in one batch names one job: the later item gets it (existed) if it asks
for the same job, and Conflict if not, as a retry across requests does. Not here: reference uploads (a
batch names stored voices) and HTTP (`app.api.batch`).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from app.broker import wire
from app.db import queries
from app.db.models import JobKind, JobStatus, Voice
from app.errors import BadInput, Conflict, WavefarmError
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.submission import jobs, routing
from app.submission.request import JobRequest, Request, check_request
from app.voices import service as voices

if TYPE_CHECKING:
    from app.context import Context

log = logging.getLogger(__name__)

BATCH_MAX = 1000  # jobs one request may hold


@dataclass
class Outcome:
    """One item's answer: a job (`job_id`, `status`, `existed`), or `error` (why it was refused)."""

    job_id: str | None = None
    status: str | None = None
    existed: bool = False
    error: Exception | None = None


@dataclass
class _Item:
    index: int
    request: Request
    seed: int  # the seed to use (chosen when the request left it open)
    voice_ref: str
    key: str | None
    voice_id: str = ""
    job: queries.NewJob | None = None
    first: int | None = None  # the earlier item of this batch with the same idempotency key


def submit_batch(*, ctx: Context, session: Session,
                 items: Sequence[dict[str, Any] | WavefarmError]) -> list[Outcome]:
    """One outcome per item, in order (module docstring). Commits `session`."""
    settings, artifacts = ctx.settings, ctx.artifacts
    if not 0 < len(items) <= BATCH_MAX:
        raise BadInput(f"a batch holds 1 to {BATCH_MAX} jobs; this one has {len(items)}")
    outcomes = [Outcome(error=item if isinstance(item, WavefarmError) else None) for item in items]
    checked = [c for i, item in enumerate(items) if not isinstance(item, WavefarmError)
               if (c := _check(settings, i, item, outcomes)) is not None]
    found = _voices(ctx, session, {c.voice_ref for c in checked})
    for c in checked:
        voice = found[c.voice_ref]
        if isinstance(voice, Voice):
            c.voice_id = voice.id
        else:
            outcomes[c.index].error = voice
    fresh = _replays(session, artifacts, [c for c in checked if c.voice_id], outcomes)
    routes = {v: routing.route_voice(session=session, settings=settings, voice_id=v,
                                     live_workers=ctx.live_workers)
              for v in {c.voice_id for c in fresh if c.request.tokens is not None}}
    created = _insert(session, artifacts, fresh, routes, outcomes)
    by_id = {v.id: v for v in found.values() if isinstance(v, Voice)}
    prepare = []
    for voice_id, n in Counter(c.voice_id for c in created).items():
        queries.add_voice_use(session=session, voice_id=voice_id, delta=n)
        if voices.needs_prepare(session=session, store=ctx.store, voice=by_id[voice_id],
                                stored=ctx.stored_features):
            prepare.append((voice_id, max(c.request.priority for c in created if c.voice_id == voice_id)))
    session.commit()  # the workers find the rows (and the routes) before any message
    _publish(ctx, session, _Round(created, prepare, routes), outcomes)
    _share_keys(checked, outcomes)
    return outcomes


def _check(settings: Settings, index: int, fields: dict[str, Any], outcomes: list[Outcome]) -> _Item | None:
    try:
        request, seed = check_request(settings=settings, request=JobRequest.of(fields))
    except WavefarmError as exc:
        outcomes[index].error = exc
        return None
    return _Item(index=index, request=request, seed=seed, voice_ref=str(fields.get("voice_id") or ""),
                 key=fields.get("idempotency_key"))


def _voices(ctx: Context, session: Session, refs: set[str]) -> dict[str, Voice | WavefarmError]:
    """Each distinct voice a batch names (id, name or id prefix), looked up once; or why not."""
    found: dict[str, Voice | WavefarmError] = {}
    for ref in refs:
        try:
            found[ref] = voices.resolve_voice(ctx=ctx, session=session, reference_bytes=None, voice_id=ref)
        except WavefarmError as exc:
            found[ref] = exc
    return found


def _replays(session: Session, artifacts: ArtifactStore, items: list[_Item],
             outcomes: list[Outcome]) -> list[_Item]:
    """The items that need a new job: those whose idempotency key names a job already (stored, or an
    earlier item's) are answered with it, or with Conflict when they ask for another job."""
    stored = queries.jobs_by_idempotency_keys(session=session, keys={c.key for c in items if c.key})
    first: dict[str, _Item] = {}
    fresh = []
    for c in items:
        out = outcomes[c.index]
        try:
            if c.key in stored:
                job = stored[c.key]
                out.job_id = jobs.replayed(job, c.request, c.voice_id, artifacts)
                out.status, out.existed = job.status, True
            elif c.key in first:
                _same_as_earlier(first[c.key], c)
                c.first, out.existed = first[c.key].index, True  # its answer: `_share_keys`
            else:
                if c.key:
                    first[c.key] = c
                fresh.append(c)
        except WavefarmError as exc:
            out.error = exc
    return fresh


def _same_as_earlier(earlier: _Item, item: _Item) -> None:
    a, b = earlier.request, item.request
    differs = [name for name, same in (
        ("voice", earlier.voice_id == item.voice_id),
        ("tokens" if b.tokens is not None else "text", (a.tokens, a.text, a.language) == (b.tokens, b.text,
                                                                                           b.language)),
        ("seed", b.seed is None or b.seed == earlier.seed),
        ("output format", a.output_format == b.output_format), ("priority", a.priority == b.priority))
        if not same]
    if differs:
        raise Conflict(f"idempotency key {item.key!r} was used by item {earlier.index} of this batch, which "
                       f"has another {', '.join(differs)}; use a new key for a new job")


def _insert(session: Session, artifacts: ArtifactStore, fresh: list[_Item], routes: dict[str, routing.Route],
            outcomes: list[Outcome]) -> list[_Item]:
    """Insert the new jobs (one statement); returns the items whose job was created. An item whose key
    another request took meanwhile is answered with that job (or Conflict), as `submit_job` does."""
    for c in fresh:
        c.job = _new_job(artifacts, c, routes.get(c.voice_id))
    created_ids = queries.insert_jobs(session=session, jobs=[c.job for c in fresh if c.job is not None])
    created, lost = [], []
    for c in fresh:
        assert c.job is not None
        if c.job.id in created_ids:
            created.append(c)
            outcomes[c.index].job_id, outcomes[c.index].status = c.job.id, JobStatus.QUEUED
        else:
            lost.append(c)
            if c.job.tokens_path:
                artifacts.remove(c.job.tokens_path)
    if lost:
        _replays(session, artifacts, lost, outcomes)
    return created


def _share_keys(items: list[_Item], outcomes: list[Outcome]) -> None:
    """An item whose idempotency key an earlier item of the batch used gets that item's answer."""
    for c in items:
        if c.first is not None:
            earlier, out = outcomes[c.first], outcomes[c.index]
            out.job_id, out.status, out.error = earlier.job_id, earlier.status, earlier.error


def _new_job(artifacts: ArtifactStore, c: _Item, route: routing.Route | None) -> queries.NewJob:
    job_id = str(uuid.uuid4())
    r = c.request
    if r.tokens is None:
        return queries.NewJob(id=job_id, voice_id=c.voice_id, tokens=None, n_tokens=0, seed=c.seed,
                              output_format=r.output_format, priority=r.priority, idempotency_key=c.key,
                              kind=JobKind.TEXT, text=r.text, language=r.language)
    inline = len(r.tokens) <= jobs.INLINE_TOKENS_MAX
    return queries.NewJob(
        id=job_id, voice_id=c.voice_id, tokens=r.tokens if inline else None, n_tokens=len(r.tokens),
        seed=c.seed, output_format=r.output_format, priority=r.priority, idempotency_key=c.key,
        tokens_path=None if inline else artifacts.put_tokens(job_id, r.tokens),
        routed_to=route.worker if route else None, route=route.reason if route else None)


@dataclass
class _Round:
    """What one batch sends: the voices to prepare (with their jobs' top priority), then each new job's
    `synth` (to its voice's route) or, for a text job, its `job.tokenize`."""

    created: list[_Item]
    prepare: list[tuple[str, int]]
    routes: dict[str, routing.Route]


def _publish(ctx: Context, session: Session, send: _Round, outcomes: list[Outcome]) -> None:
    """Send the round over one connection; on the first refusal, take back what was not sent."""
    settings = ctx.settings
    prepared = sent = 0
    deferred = False
    try:
        with wire.one_round(ctx.sender) as one:
            deferred = getattr(one, "deferred", False)  # sent only once the round's confirms are in
            for voice_id, priority in send.prepare:
                wire.send_prepare(one, settings, voice_id, priority)
                prepared += 1
            for c in send.created:
                assert c.job is not None
                if c.job.kind == JobKind.TEXT:
                    wire.send_tokenize(one, settings, c.job.id, c.job.priority)
                else:
                    route = send.routes[c.voice_id]
                    wire.send_synth(one, settings, c.job.id, c.job.priority, queue=route.queue)
                sent += 1
    except Exception as exc:  # noqa: BLE001 - the broker's errors are many kinds; each item gets it
        if deferred:
            prepared = sent = 0
        log.exception("batch: the broker refused a message; withdrawing %d of %d new jobs",
                      len(send.created) - sent, len(send.created))
        for voice_id, _ in send.prepare[prepared:]:
            ctx.store.release_prepare(voice_id)
        _withdraw(session, ctx.artifacts, send.created[sent:], exc, outcomes)


def _withdraw(session: Session, artifacts: ArtifactStore, items: list[_Item], exc: Exception,
              outcomes: list[Outcome]) -> None:
    """Take committed jobs back out (their messages were not sent), so a retry starts afresh."""
    queries.delete_jobs(session=session, job_ids=[c.job.id for c in items if c.job is not None])
    for voice_id, n in Counter(c.voice_id for c in items).items():
        queries.add_voice_use(session=session, voice_id=voice_id, delta=-n)
    session.commit()
    for c in items:
        if c.job is not None and c.job.tokens_path:
            artifacts.remove(c.job.tokens_path)
        outcomes[c.index] = Outcome(error=exc)
