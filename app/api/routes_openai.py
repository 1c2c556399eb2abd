"""OpenAI's speech API over wavefarm's job queue: POST /v1/audio/speech, GET /v1/models and
GET /v1/audio/voices, as OpenAI's clients call them.

`input` is spoken as a text job (a CPU worker makes its tokens through the guide voice, the GPU worker
re-voices them in `voice`: a stored voice's id, name or unique id prefix), so a speech request is a job
like any other: a row, a priority (header `X-Wavefarm-Priority`), a cancel, metrics, and idempotency
(header `Idempotency-Key`). The answer streams the audio as the GPU worker writes it (chunked), in
`response_format`; a client that disconnects cancels its job, unless another client holds it
(`app.api.speech_listeners`: another speech request streaming it, or a job that existed under the
key). The job's id is in `X-Wavefarm-Job-Id`.

Until the first audio the status can still say what went wrong (`Problem` bodies, as every other error
of the API): the job failed, 502; cancelled, 409; succeeded with its audio since removed, 410; no audio
within `speech_first_audio_timeout_s`, 503 (no GPU worker took the job) or 504 (one did), the job
cancelled. Once audio has been sent a failure cuts the stream (`app.api.speech_stream`).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import ApiContext, Ctx, authorize
from app.api.schemas import Problem, StorableStr, problem
from app.api.speech_codec import FORMATS, MEDIA_TYPES, check_format
from app.api.speech_listeners import Listener
from app.api.speech_stream import JobEnded, NoFirstAudio, PcmTail, first_audio, stream_job
from app.api.speech_tempo import MAX_SPEED, MIN_SPEED, encoder
from app.api.speech_voices import speech_voice_id
from app.broker import wire
from app.db import queries
from app.db.models import JobStatus
from app.errors import BadInput, NotFound
from app.speech import SAMPLES_PER_TOKEN
from app.submission import jobs
from app.submission.request import JobRequest

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(authorize)],
                   responses={401: {"model": Problem}})

MODEL = "wavefarm-code2wav"
# OpenAI's speech model names, accepted so that a client's default works: all are this one model.
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class VoiceRef(BaseModel):
    id: StorableStr


class SpeechRequest(BaseModel):
    """The body OpenAI's API defines for POST /v1/audio/speech (plus `language`, wavefarm's own)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description=f"{MODEL} (or an OpenAI name: {', '.join(MODEL_ALIASES)})")
    input: StorableStr = Field(min_length=1, description="the text to speak")
    voice: StorableStr | VoiceRef = Field(description="a stored voice's id, name or unique id prefix, or an "
                                          "OpenAI voice name mapped by WAVEFARM_OPENAI_VOICES")
    response_format: str = Field(default="mp3", description=f"one of {', '.join(FORMATS)}")
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED,
                         description="the pace against the voice's own (1.0); pitch kept")
    instructions: str | None = Field(default=None, description="not supported: a voice is its reference")
    stream_format: Literal["audio", "sse"] = Field(default="audio", description="audio only")
    language: StorableStr | None = Field(default=None, description="the input's language tag (default en)")


def _check(req: SpeechRequest) -> None:
    if req.model not in (MODEL, *MODEL_ALIASES):
        raise NotFound(f"no model {req.model!r}: GET /v1/models lists {MODEL}")
    check_format(req.response_format)
    if req.instructions:
        raise BadInput("instructions are not supported: the voice is its reference recording")
    if req.stream_format != "audio":
        raise BadInput("stream_format 'sse' is not supported: the audio itself streams")


def _submit(ctx: ApiContext, req: SpeechRequest, priority: int, key: str | None) -> Listener:
    """The job's listener, joined: whether this request created the job is judged by the key's look-up
    before the submission (`app.api.speech_listeners`)."""
    voice = req.voice.id if isinstance(req.voice, VoiceRef) else req.voice
    with ctx.session() as s:
        voice = speech_voice_id(session=s, ref=voice, mapping=ctx.settings.openai_voice_map())
        existed = key is not None and queries.get_job_by_idempotency_key(session=s, idempotency_key=key)
        job_id = jobs.submit_job(ctx=ctx, session=s, request=JobRequest(
            text=req.input, language=req.language, voice_id=voice, output_format="wav", priority=priority,
            idempotency_key=key))
    listener = Listener(ctx, job_id, keyed=key is not None, created=not existed)
    listener.join()
    return listener


@router.post("/audio/speech", response_class=StreamingResponse, responses={
    200: {"content": {t: {} for t in MEDIA_TYPES.values()}, "description": "the audio, streamed"},
    404: {"model": Problem}, 409: {"model": Problem, "description": "the job was cancelled before any audio"},
    410: {"model": Problem, "description": "the job succeeded, but its audio has been removed"},
    422: {"model": Problem},
    502: {"model": Problem, "description": "the job failed before any audio; the reason is its error"},
    503: {"model": Problem, "description": "no GPU worker took the job within the bound; it is cancelled"},
    504: {"model": Problem, "description": "a GPU worker took the job but wrote no audio within the bound; "
                                           "it is cancelled"}})
async def create_speech(
    req: SpeechRequest, request: Request, ctx: Ctx,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    priority: Annotated[int, Header(alias="X-Wavefarm-Priority", ge=0, le=wire.MAX_PRIORITY)] = 0,
) -> Response:
    """Speak `input` in `voice`; the audio streams as it is rendered."""
    _check(req)
    listener = await ctx.submitting(_submit, ctx, req, priority, idempotency_key)
    tail = PcmTail(ctx.artifacts, listener.job_id)
    headers = {"X-Wavefarm-Job-Id": listener.job_id}
    try:
        first = await first_audio(ctx, tail, listener, request.is_disconnected)
    except (JobEnded, NoFirstAudio) as exc:
        tail.close()
        await run_in_threadpool(partial(listener.leave, cancel=False))
        status, error = _no_audio_answer(exc)
        return JSONResponse(status_code=status, content=problem(error, str(exc)), headers=headers)
    if first is None:  # the client left before the first audio; it left its job
        return Response(status_code=499, headers=headers)
    samples = await run_in_threadpool(_job_samples, ctx, listener.job_id)
    stream = stream_job(ctx, tail, listener, encoder(req.response_format, req.speed, samples), first)
    return StreamingResponse(stream, media_type=MEDIA_TYPES[req.response_format], headers=headers)


def _job_samples(ctx: ApiContext, job_id: str) -> int | None:
    """The job's length in samples (its tokens are known once its audio has begun), or None."""
    with ctx.session() as s:
        n_tokens = queries.require_job(session=s, job_id=job_id).n_tokens
    return n_tokens * SAMPLES_PER_TOKEN if n_tokens else None


def _no_audio_answer(exc: JobEnded | NoFirstAudio) -> tuple[int, str]:
    """The status and error kind of a speech request whose job gave no audio."""
    if isinstance(exc, NoFirstAudio):
        return (504, "NoAudioInTime") if exc.claimed else (503, "NoGpuWorker")
    return {JobStatus.FAILED: (502, "JobFailed"), JobStatus.CANCELLED: (409, "JobCancelled")}.get(
        JobStatus(exc.status), (410, "Gone"))


def _model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "wavefarm"}


@router.get("/models")
def list_models() -> dict[str, Any]:
    """The speech model, under its own name and the OpenAI names it answers to."""
    return {"object": "list", "data": [_model(m) for m in (MODEL, *MODEL_ALIASES)]}


@router.get("/models/{model_id}", responses={404: {"model": Problem}})
def get_model(model_id: str) -> dict[str, Any]:
    if model_id not in (MODEL, *MODEL_ALIASES):
        raise NotFound(f"no model {model_id!r}")
    return _model(model_id)


@router.get("/audio/voices")
def list_speech_voices(ctx: Ctx) -> dict[str, Any]:
    """The stored voices a speech request may name (by id or name)."""
    with ctx.session() as s:
        voices = queries.list_voices(session=s, limit=1000)
        return {"object": "list", "data": [{"id": v.id, "name": v.name, "object": "voice", "status": v.status}
                                           for v in voices]}
