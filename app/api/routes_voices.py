"""/v1/voices: upload a reference voice (prepared ahead on a CPU worker), look voices up.

Thin HTTP adapters over `app.voices.service`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from app.api.deps import ApiContext, Ctx, authorize
from app.api.forms import read_upload
from app.api.schemas import Problem, VoiceOut, VoicePatch
from app.db import queries
from app.errors import BadInput
from app.voices import names as voice_names
from app.voices import service as voices

router = APIRouter(prefix="/v1/voices", tags=["voices"], dependencies=[Depends(authorize)],
                   responses={401: {"model": Problem}, 422: {"model": Problem}})


def _register(ctx: ApiContext, data: bytes) -> tuple[VoiceOut, bool]:
    with ctx.session() as s:
        voice_id, created = voices.register_voice(ctx=ctx, session=s, reference_bytes=data)
        return VoiceOut.of(voices.get_voice(session=s, voice_id=voice_id)), created


# The form is read in the handler, not declared as a parameter: FastAPI reads declared form fields
# before it runs the router's dependencies, so an unauthorised upload was received whole before its 401.
# The field is `reference`, as in POST /v1/jobs; `file`, its name before, is still read.
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["reference"],
    "properties": {"reference": {"type": "string", "format": "binary",
                                 "description": "reference audio (WAV, FLAC, OGG, MP3)"}}}}}}}
FIELDS = ("reference", "file")


async def _reference_bytes(request: Request, ctx: ApiContext) -> bytes:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise HTTPException(415, detail="send the reference audio as multipart/form-data, field 'reference'")
    async with request.form(max_files=1, max_fields=1) as form:
        names = set(form.keys())
        upload = next((form.get(name) for name in FIELDS if name in names), None)
        if len(names) != 1 or not names <= set(FIELDS) or not isinstance(upload, UploadFile):
            raise BadInput("send exactly one field, 'reference': the reference audio file")
        return await read_upload(upload, ctx.settings.max_reference_bytes, "reference audio")


@router.post("", status_code=201, response_model=VoiceOut, openapi_extra=UPLOAD_BODY,
             responses={200: {"model": VoiceOut, "description": "the voice existed already"},
                        415: {"model": Problem}})
async def create_voice(request: Request, response: Response, ctx: Ctx) -> VoiceOut:
    """Upload reference audio (WAV, FLAC, OGG, MP3). Its id is the sha256 of the normalised audio, so
    the same voice uploaded twice is one voice; preparation starts on a CPU worker at once."""
    data = await _reference_bytes(request, ctx)
    voice, created = await run_in_threadpool(_register, ctx, data)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/voices/{voice.id}"
    return voice


@router.get("", response_model=list[VoiceOut])
def list_voices(ctx: Ctx, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[VoiceOut]:
    with ctx.session() as s:
        return [VoiceOut.of(v) for v in queries.list_voices(session=s, limit=limit)]


@router.get("/{voice_id}", response_model=VoiceOut, responses={404: {"model": Problem}})
def get_voice(voice_id: str, ctx: Ctx) -> VoiceOut:
    """A voice by its id, its name or a unique prefix of its id."""
    with ctx.session() as s:
        return VoiceOut.of(voices.get_voice(session=s, voice_id=voice_id))


@router.patch("/{voice_id}", response_model=VoiceOut,
              responses={404: {"model": Problem}, 409: {"model": Problem, "description": "name taken"}})
def patch_voice(voice_id: str, patch: VoicePatch, ctx: Ctx) -> VoiceOut:
    """Name a voice (unique; null removes the name). The name then works wherever the id does."""
    with ctx.session() as s:
        voice = voices.get_voice(session=s, voice_id=voice_id)
        return VoiceOut.of(voice_names.rename_voice(session=s, voice_id=voice.id, name=patch.name))
