"""/v1/books: submit a book (upload or inline manifest), follow it, cancel it, download its files.

    POST /v1/books                    multipart: `book` file (text, Markdown, EPUB, JSON manifest) and a
                                      voice (`voice_id` or `reference` file); or JSON with an inline
                                      `manifest` of speech tokens and a `voice_id`
    GET  /v1/books, /v1/books/{id}    progress per book and chapter (segments, audio seconds, ETA)
    POST /v1/books/{id}/cancel
    GET  /v1/books/{id}/files/{name}  chapter-001.flac ..., book.m4b, chapters.json, chapters.vtt

A bad book is refused at submission (422 with the reason), before anything is queued.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.datastructures import FormData, UploadFile

from app import submit
from app.api.deps import ApiContext, Ctx, authorize, session
from app.api.routes_voices import read_upload
from app.api.schemas import Problem
from app.books import DEFAULT_LIMITS
from app.books.service import BookOptions, BookStatusView, book_status, cancel_book, output_file, submit_book
from app.db import queries
from app.db.models import BookStatus
from app.errors import BadInput, NotFound
from app.keys import check_job_id

router = APIRouter(prefix="/v1/books", tags=["books"], dependencies=[Depends(authorize)],
                   responses={401: {"model": Problem}})

FORM_FIELDS = ("book", "voice_id", "reference", "book_format", "output_format", "m4b", "target_lufs", "seed",
               "priority", "title", "author", "language")
MEDIA_TYPES = {".wav": "audio/wav", ".flac": "audio/flac", ".m4b": "audio/mp4", ".json": "application/json",
               ".vtt": "text/vtt"}


class BookRequest(BaseModel):
    """POST /v1/books as JSON: a manifest of speech tokens inline. Text and EPUB books: multipart."""

    model_config = ConfigDict(extra="forbid")

    voice_id: str = Field(min_length=64, max_length=64)
    manifest: dict[str, Any] = Field(description='{"title", "chapters": [{"title", "segments": '
                                                 '[{"tokens": [...]}]}]}')
    output_format: Literal["wav", "flac"] = "flac"
    m4b: bool = True
    target_lufs: float | None = Field(None, ge=-70, le=-5)
    seed: StrictInt = Field(0, ge=0, le=submit.MAX_SEED,
                            description="fixed by default, so rendering the book again resumes it")
    priority: StrictInt = Field(0, ge=0, le=submit.MAX_PRIORITY,
                                description="of the segment jobs; 0 (default) yields to every other job")


class ChapterOut(BaseModel):
    index: int
    title: str
    segments_total: int
    segments_done: int
    audio_seconds: float = Field(description="speech rendered so far")
    est_seconds: float = Field(description="planned speech (an estimate until rendered)")
    eta_s: float | None
    seconds: float | None = Field(description="length of the assembled chapter file")
    file_url: str | None


class BookOut(BaseModel):
    id: str
    voice_id: str
    status: str = Field(description="queued | rendering | assembling | succeeded | failed | cancelled")
    title: str
    author: str
    language: str
    output_format: str
    m4b: bool
    priority: int
    segments_total: int = Field(description="distinct segments (a repeated sentence renders once)")
    segments_done: int
    audio_seconds: float
    est_seconds: float
    eta_s: float | None
    submitted_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    chapters: list[ChapterOut]
    files: dict[str, str] = Field(description="file name -> download URL")

    @classmethod
    def of(cls, view: BookStatusView) -> BookOut:
        b = view.book
        base = f"/v1/books/{b.id}/files/"
        chapters = [ChapterOut(index=c.index, title=c.title, segments_total=c.segments_total,
                               segments_done=c.segments_done, audio_seconds=round(c.audio_seconds, 2),
                               est_seconds=round(c.est_seconds, 2), eta_s=c.eta_s, seconds=c.seconds,
                               file_url=base + c.file if c.file else None) for c in view.chapters]
        return cls(id=b.id, voice_id=b.voice_id, status=b.status, title=b.title, author=b.author,
                   language=b.language, output_format=b.output_format, m4b=b.m4b, priority=b.priority,
                   segments_total=view.segments_total, segments_done=view.segments_done,
                   audio_seconds=round(view.audio_seconds, 2), est_seconds=round(b.est_seconds, 2),
                   eta_s=view.eta_s, submitted_at=b.submitted_at, started_at=b.started_at,
                   finished_at=b.finished_at, error=b.error, chapters=chapters,
                   files={name: base + name for name in view.files})


def _book_out(ctx: ApiContext, book_id: str) -> BookOut:
    with session(ctx) as s:
        return BookOut.of(book_status(session=s, artifacts=ctx.artifacts, book_id=book_id))


def _book_id(book_id: str) -> str:
    try:
        return check_job_id(book_id)
    except ValueError as exc:
        raise NotFound(f"no book {book_id}") from exc


def _submit(ctx: ApiContext, fields: dict[str, Any]) -> BookOut:
    with session(ctx) as s:
        book_id = submit_book(settings=ctx.settings, session=s, sender=ctx.sender, store=ctx.store,
                              artifacts=ctx.artifacts, **fields)
    return _book_out(ctx, book_id)


async def _json_fields(request: Request) -> dict[str, Any]:
    try:
        req = BookRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    options = BookOptions(output_format=req.output_format, m4b=req.m4b, target_lufs=req.target_lufs,
                          seed=req.seed, priority=req.priority)
    return {"data": json.dumps(req.manifest).encode(), "book_format": "manifest", "voice_id": req.voice_id,
            "options": options}


async def _form_fields(request: Request, ctx: ApiContext) -> dict[str, Any]:
    async with request.form(max_files=2, max_fields=len(FORM_FIELDS),
                            max_part_size=DEFAULT_LIMITS.max_text_bytes) as form:
        return await _read_form(form, ctx)


async def _read_form(form: FormData, ctx: ApiContext) -> dict[str, Any]:
    unknown = set(form.keys()) - set(FORM_FIELDS)
    if unknown:
        raise BadInput(f"unknown form fields: {sorted(unknown)}; allowed: {list(FORM_FIELDS)}")
    book = form.get("book")
    if not isinstance(book, UploadFile):
        raise BadInput("send the book as a file in the 'book' field")
    data = await book.read(DEFAULT_LIMITS.max_epub_bytes + 1)
    if len(data) > DEFAULT_LIMITS.max_epub_bytes:
        raise BadInput(f"the book is larger than {DEFAULT_LIMITS.max_epub_bytes} bytes")
    reference = form.get("reference")
    if reference is not None and not isinstance(reference, UploadFile):
        raise BadInput("reference must be an uploaded file")
    text = {name: _text(form.get(name), name) for name in
            ("voice_id", "book_format", "output_format", "title", "author", "language", "m4b")}
    options = BookOptions(output_format=text["output_format"] or "flac",
                          m4b=(text["m4b"] or "true").lower() not in ("false", "0", "no"),
                          target_lufs=_number(form.get("target_lufs"), "target_lufs", float),
                          seed=_number(form.get("seed"), "seed", int) or 0,
                          priority=_number(form.get("priority"), "priority", int) or 0)
    return {"data": data, "filename": book.filename, "book_format": text["book_format"],
            "voice_id": text["voice_id"], "title": text["title"], "author": text["author"],
            "language": text["language"], "options": options,
            "reference_bytes": (await read_upload(reference, ctx.settings.max_reference_bytes,
                                                  "reference audio")) if reference else None}


def _text(value: Any, name: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadInput(f"{name} must be a text field")
    return value


def _number(value: Any, name: str, kind: type) -> Any:
    text = _text(value, name)
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError as exc:
        raise BadInput(f"{name} must be a number, not {text!r}") from exc


@router.post("", status_code=202, response_model=BookOut,
             responses={404: {"model": Problem}, 415: {"model": Problem}, 422: {"model": Problem}})
async def create_book(request: Request, response: Response, ctx: Ctx) -> BookOut:
    """Submit a book. Multipart: `book` file + `voice_id` or `reference`; JSON: an inline token manifest.
    Returns at once (202); follow GET /v1/books/{id}."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        fields = await _json_fields(request)
    elif ctype.startswith("multipart/form-data"):
        fields = await _form_fields(request, ctx)
    else:
        raise HTTPException(415, detail="send multipart/form-data (a book file) or application/json "
                                        "(an inline manifest)")
    book = await run_in_threadpool(_submit, ctx, fields)
    response.headers["Location"] = f"/v1/books/{book.id}"
    return book


@router.get("", response_model=list[BookOut])
def list_books(ctx: Ctx, limit: Annotated[int, Query(ge=1, le=200)] = 50) -> list[BookOut]:
    """Newest first."""
    with session(ctx) as s:
        ids = [b.id for b in queries.list_books(session=s, limit=limit)]
    return [_book_out(ctx, book_id) for book_id in ids]


@router.get("/{book_id}", response_model=BookOut, responses={404: {"model": Problem}})
def get_book(book_id: str, ctx: Ctx) -> BookOut:
    return _book_out(ctx, _book_id(book_id))


@router.post("/{book_id}/cancel", response_model=BookOut,
             responses={404: {"model": Problem}, 409: {"model": Problem, "description": "already finished"}})
def cancel(book_id: str, ctx: Ctx) -> BookOut:
    """Cancel a live book (idempotent); its finished segments are kept for a later render."""
    with session(ctx) as s:
        cancel_book(session=s, store=ctx.store, book_id=_book_id(book_id),
                    cancel_ttl_s=ctx.settings.visibility_timeout_s)
    book = _book_out(ctx, book_id)
    if book.status != BookStatus.CANCELLED:
        raise HTTPException(409, detail=f"book {book_id} already {book.status}")
    return book


@router.get("/{book_id}/files/{name}", response_class=FileResponse, responses={
    200: {"content": {t: {} for t in MEDIA_TYPES.values()}, "description": "a finished output file"},
    404: {"model": Problem}})
def get_file(book_id: str, name: str, ctx: Ctx) -> FileResponse:
    with session(ctx) as s:
        path = output_file(session=s, artifacts=ctx.artifacts, book_id=_book_id(book_id), name=name)
    return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
                        filename=name)
