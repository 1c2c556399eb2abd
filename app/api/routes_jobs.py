"""/v1/jobs: submit (JSON or multipart, or many at once: /v1/jobs/batch), follow, list, cancel, download the
audio.

Thin HTTP adapters over `app.submission.jobs`: they parse and bound the request, call the service and shape
the answer; what a job is, and when one is refused or may be cancelled, is the service's.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile

from app.api.batch import NDJSON_TYPES, BatchOut, batch_out, parse_items
from app.api.deps import ApiContext, Ctx, authorize
from app.api.forms import number_field, read_upload, text_field
from app.api.schemas import AFTER, JobOut, JobRequest, Problem, StorableStr, parse_tokens
from app.broker import wire
from app.db import queries
from app.db.models import JobStatus
from app.errors import BadInput, BadTokens
from app.speech import MEDIA_TYPES, OutputFormat
from app.submission import batch, jobs
from app.submission import request as submission_request
from app.voices import names as voice_names

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(authorize)],
                   responses={401: {"model": Problem}})

FORM_FIELDS = ("voice_id", "reference", "tokens", "text", "language", "seed", "output_format", "priority",
               "idempotency_key")
MULTIPART_SCHEMA = {
    "type": "object",
    "properties": {
        "voice_id": {"type": "string", "description": "a voice from POST /v1/voices (or send reference)"},
        "reference": {"type": "string", "format": "binary", "description": "reference audio file"},
        "tokens": {"type": "string", "format": "binary", "description": "JSON list of token ids (or text)"},
        "text": {"type": "string", "description": "instead of tokens: text to speak"},
        "language": {"type": "string", "description": "the text's language tag (default en)"},
        "seed": {"type": "integer", "minimum": 0},
        "output_format": {"type": "string", "enum": list(OutputFormat), "default": OutputFormat.WAV},
        "priority": {"type": "integer", "minimum": 0, "maximum": wire.MAX_PRIORITY, "default": 0},
        "idempotency_key": {"type": "string", "maxLength": submission_request.IDEMPOTENCY_KEY_MAX},
    },
}
SUBMIT_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": JobRequest.model_json_schema()},
    "multipart/form-data": {"schema": MULTIPART_SCHEMA},
}}}


def _tokens_limit(ctx: ApiContext) -> int:
    return 8 * ctx.settings.max_tokens + 64 * 1024  # "6560, " per token is 6 bytes; room for spaces


async def _json_fields(request: Request, ctx: ApiContext) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > _tokens_limit(ctx):
            raise BadTokens("request body is larger than the token limit allows")
    try:
        req = JobRequest.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    return req.model_dump()


async def _form_fields(request: Request, ctx: ApiContext) -> dict[str, Any]:
    # `async with`: the spooled upload files are closed (and deleted) when we are done with them.
    async with request.form(max_files=2, max_fields=len(FORM_FIELDS),
                            max_part_size=_tokens_limit(ctx)) as form:
        return await _read_form(form, ctx)


async def _read_form(form: FormData, ctx: ApiContext) -> dict[str, Any]:
    unknown = set(form.keys()) - set(FORM_FIELDS)
    if unknown:
        raise BadInput(f"unknown form fields: {sorted(unknown)}")
    fields: dict[str, Any] = {"voice_id": text_field(form.get("voice_id"), "voice_id")}
    reference = form.get("reference")
    if reference is not None and not isinstance(reference, UploadFile):
        raise BadInput("reference must be an uploaded file")
    fields["reference_bytes"] = (await read_upload(reference, ctx.settings.max_reference_bytes,
                                                   "reference audio")) if reference else None
    tokens = form.get("tokens")
    fields["text"] = text_field(form.get("text"), "text")
    fields["language"] = text_field(form.get("language"), "language")
    if tokens is None and fields["text"] is None:
        raise BadTokens("tokens are missing (send tokens, or text)")
    if tokens is not None:
        raw = await tokens.read(_tokens_limit(ctx) + 1) if isinstance(tokens, UploadFile) else tokens
        if len(raw) > _tokens_limit(ctx):
            raise BadTokens("tokens file is larger than the token limit allows")
        fields["tokens"] = parse_tokens(raw)
    fields["seed"] = number_field(form.get("seed"), "seed")
    fields["priority"] = number_field(form.get("priority"), "priority") or 0
    fields["output_format"] = text_field(form.get("output_format"), "output_format") or "wav"
    fields["idempotency_key"] = text_field(form.get("idempotency_key"), "idempotency_key")
    return fields


def _submit(ctx: ApiContext, fields: dict[str, Any]) -> Response:
    with ctx.session() as s:
        job = jobs.submit(ctx=ctx, session=s, request=submission_request.JobRequest.of(fields))
        # As submitted: no re-read. The answer is `JobOut`'s JSON, written here: FastAPI would validate
        # the model once more to serialise it (`response_model` still documents it).
        return Response(JobOut.of(job).model_dump_json(), status_code=202, media_type="application/json",
                        headers={"Location": f"/v1/jobs/{job.id}"})


@router.post("", status_code=202, response_model=JobOut, openapi_extra=SUBMIT_BODY,
             responses={404: {"model": Problem}, 415: {"model": Problem}, 422: {"model": Problem}})
async def create_job(
    request: Request, ctx: Ctx,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    """Submit a job: tokens, or text, in a voice. JSON names a voice id; multipart may upload the
    reference instead and send the tokens as a file. Text is tokenized on a CPU worker (the job stays
    queued meanwhile, n_tokens 0). Returns at once (202); follow GET /v1/jobs/{id}."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        fields = await _json_fields(request, ctx)
    elif ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        fields = await _form_fields(request, ctx)
    else:
        raise HTTPException(415, detail="send application/json or a form (multipart/form-data)")
    fields["idempotency_key"] = fields.get("idempotency_key") or idempotency_key
    return await ctx.submitting(_submit, ctx, fields)


BATCH_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "array", "items": JobRequest.model_json_schema(),
                                    "minItems": 1, "maxItems": batch.BATCH_MAX}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one job request a line"}},
}}}


def _submit_batch(ctx: ApiContext, items: list[Any]) -> BatchOut:
    with ctx.session() as s:
        return batch_out(batch.submit_batch(ctx=ctx, session=s, items=items))


@router.post("/batch", response_model=BatchOut, openapi_extra=BATCH_BODY,
             responses={413: {"model": Problem}, 415: {"model": Problem}, 422: {"model": Problem}})
async def create_jobs(request: Request, ctx: Ctx) -> BatchOut:
    """Submit up to 1000 jobs at once, as a JSON array of what POST /v1/jobs takes as JSON (name stored
    voices), or as JSON lines (application/x-ndjson). One result per item, in order: accepted (the job,
    and whether its idempotency key named one already) or refused with the reason; a bad item never
    sinks the others. The jobs are written in one transaction and queued in one round."""
    ctype = request.headers.get("content-type", "")
    lines = ctype.startswith(NDJSON_TYPES)
    if not (lines or ctype.startswith("application/json")):
        raise HTTPException(415, detail="send a JSON array (application/json) or JSON lines "
                            "(application/x-ndjson)")
    body = bytearray()
    async for chunk in request.stream():  # bounded by the body limit (app.api.limits): 413 past it
        body += chunk
    items = await run_in_threadpool(parse_items, bytes(body), lines=lines)
    return await ctx.submitting(_submit_batch, ctx, items)


VOICE_FILTER = "the jobs of one voice: its id, name or a unique id prefix (404 when it names none)"


@router.get("", response_model=list[JobOut], responses={
    404: {"model": Problem}, 422: {"model": Problem}, 200: {"headers": {
        "X-Next-Cursor": {"description": "the next page's `after` (absent on the last page)",
                          "schema": {"type": "string"}}}}})
def list_jobs(ctx: Ctx, response: Response, status: JobStatus | None = None,
              voice_id: Annotated[StorableStr | None, Query(max_length=256, description=VOICE_FILTER)] = None,
              after: Annotated[str | None, Query(description=AFTER)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobOut]:
    """Newest first, a page at a time: the X-Next-Cursor header is the next page's `after`."""
    with ctx.session() as s:
        if voice_id is not None:  # like every voice field: a name or a prefix finds its voice's id
            voice_id = voice_names.find_voice_id(session=s, ref=voice_id)
        rows, cursor = queries.page_jobs(session=s, status=status, voice_id=voice_id, after=after,
                                         limit=limit)
        if cursor is not None:
            response.headers["X-Next-Cursor"] = cursor
        return [JobOut.of(job) for job in rows]


@router.get("/{job_id}", response_model=JobOut, responses={404: {"model": Problem}})
def get_job(job_id: str, ctx: Ctx) -> JobOut:
    with ctx.session() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        return JobOut.of(job, phase=_phase(ctx, job.id) if job.kind == "text" else None)


def _phase(ctx: ApiContext, job_id: str) -> dict[str, str] | None:
    """A text job's phase record; None (not shown) when the feature store does not answer."""
    try:
        return ctx.store.phase(job_id)
    except redis.RedisError as exc:
        log.warning("job %s: phase not read: %s", job_id, exc)
        return None


@router.get("/{job_id}/audio", response_class=FileResponse, responses={
    200: {"content": {t: {} for t in MEDIA_TYPES.values()}, "description": "the rendered audio"},
    404: {"model": Problem}, 409: {"model": Problem, "description": "the job has not succeeded"},
    410: {"model": Problem, "description": "the audio has been removed"}})
def get_audio(job_id: str, ctx: Ctx) -> FileResponse:
    with ctx.session() as s:
        path = jobs.audio_path(session=s, artifacts=ctx.artifacts, job_id=job_id)
    fmt = OutputFormat(path.suffix.removeprefix("."))
    return FileResponse(path, media_type=MEDIA_TYPES[fmt], filename=f"{job_id}.{fmt}")


@router.post("/{job_id}/cancel", response_model=JobOut,
             responses={404: {"model": Problem}, 409: {"model": Problem, "description": "already finished"}})
def cancel_job(job_id: str, ctx: Ctx) -> JobOut:
    """Cancel a queued or running job (idempotent). A finished job cannot be cancelled: 409."""
    with ctx.session() as s:
        return JobOut.of(jobs.cancel_job(ctx=ctx, session=s, job_id=job_id))
