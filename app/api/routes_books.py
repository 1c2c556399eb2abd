"""/v1/books: submit a book (upload or inline manifest), follow it, cancel it, download its files.

    POST /v1/books                    multipart: `book` file (text, Markdown, EPUB, JSON manifest) and a
                                      voice (`voice_id` or `reference` file); or JSON with an inline
                                      `manifest` of speech tokens and a `voice_id`
    GET  /v1/books, /v1/books/{id}    progress per book and chapter (segments, audio seconds, ETA)
    GET  /v1/books/{id}/quality       the quality gate's verdicts per chapter and the worst segments
    POST /v1/books/{id}/cancel
    GET  /v1/books/{id}/files/{name}  chapter-001.flac ..., book.m4b, chapters.json, chapters.vtt

The API never reads a book: what can be refused without reading it (options, sizes, the language tag, the
chapter selection, the voice) is a 4xx at once; the upload is stored as it streams and the book answers
202 in `parsing`; a CPU worker reads it in a bounded child process and the book becomes `queued` or
`failed` with the reason (`app.books.intake`). Thin HTTP adapters over `app.books.intake`,
`app.books.service` and `app.books.status`; the bodies are in `app.api.schemas_books`.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile

from app.api.deps import ApiContext, Ctx, authorize
from app.api.forms import number_field, read_upload, text_field
from app.api.schemas import AFTER, Problem
from app.api.schemas_books import QUALITY_HELP, BookOut
from app.api.schemas_books import BookRequest as BookBody
from app.books import intake, quality_view, service, status
from app.books.planning.cast import MAX_BYTES as CAST_MAX_BYTES
from app.books.planning.lexicon import MAX_BYTES as LEXICON_MAX_BYTES
from app.books.reading.parse import FORMATS
from app.books.reading.publication import split_genre_list
from app.books.reading.source import DEFAULT_LIMITS
from app.books.submission import BookOptions, BookRequest, Submission, target_lufs_field
from app.books.writing.encoding import BITRATES, DEFAULT_KBPS, SAMPLE_RATES
from app.db import queries
from app.errors import BadInput
from app.quality.report import GateMode
from app.speech import MEDIA_TYPES as AUDIO_MEDIA_TYPES
from app.speech import OutputFormat

router = APIRouter(prefix="/v1/books", tags=["books"], dependencies=[Depends(authorize)],
                   responses={401: {"model": Problem}})

FORM_FIELDS = ("book", "voice_id", "reference", "book_format", "output_format", "m4b", "mp3", "timed",
               "epub3", "target_lufs", "seed", "priority", "title", "author", "narrator", "description",
               "language", "chapters", "lexicon", "cast", "bitrate_kbps", "mp3_bitrate_kbps", "sample_rate",
               "series", "series_part", "preview_s", "publisher", "year", "isbn", "genres", "quality")
# A JSON book is a manifest at its size limit and a few small fields around it.
JSON_BODY_MAX = DEFAULT_LIMITS.max_text_bytes + 64 * 1024
MEDIA_TYPES = {**{f".{fmt}": media for fmt, media in AUDIO_MEDIA_TYPES.items()}, ".m4b": "audio/mp4",
               ".mp3": "audio/mpeg", ".epub": "application/epub+zip",
               ".json": "application/json", ".vtt": "text/vtt", ".jpg": "image/jpeg", ".png": "image/png"}


_BOOK_FORM_SCHEMA = {
    "type": "object", "required": ["book"],
    "properties": {
        "book": {"type": "string", "format": "binary",
                 "description": "the book: plain text, Markdown, EPUB, HTML, PDF, DOCX or a JSON manifest"},
        "voice_id": {"type": "string", "minLength": 1, "maxLength": 64,
                     "description": "a stored voice (or send `reference`)"},
        "reference": {"type": "string", "format": "binary", "description": "reference audio for the voice"},
        "book_format": {"type": "string", "enum": list(FORMATS),
                        "description": "default: from the file name"},
        "output_format": {"type": "string", "enum": [f.value for f in OutputFormat], "default": "flac"},
        "m4b": {"type": "boolean", "default": True},
        "mp3": {"type": "boolean", "default": False, "description": "an MP3 per chapter too (ID3 tags)"},
        "timed": {"type": "boolean", "default": False,
                  "description": "subtitles: each cue's speech placed at its start time"},
        "epub3": {"type": "boolean", "default": False,
                  "description": "a read-along EPUB 3 too (the text, chapter audio, Media Overlays)"},
        "target_lufs": {"type": "string", "default": "-20",
                        "description": "chapter loudness, LUFS (-70..-5), or off: measured, not normalised"},
        "seed": {"type": "integer", "minimum": 0, "default": 0},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9, "default": 0},
        "series": {"type": "string", "description": "for the tags and metadata.json (Audiobookshelf)"},
        "preview_s": {"type": "number", "minimum": 1, "maximum": 300,
                      "description": "a preview: the first chapter chosen (`chapters`, default 1), its first "
                      "segments up to about this many seconds"},
        "series_part": {"type": "string", "description": "the book's place in its series: 1, 2.5, 3a"},
        "publisher": {"type": "string", "description": "the tags' and metadata.json's (default: the book's)"},
        "year": {"type": "string", "description": "publication year, 4 digits (default: the book's)"},
        "isbn": {"type": "string", "description": "ISBN-10 or -13, hyphens allowed (default: the book's)"},
        "genres": {"type": "string", "description": "genres separated by commas (default: the book's; "
                   "none: 'Audiobook')"},
        "bitrate_kbps": {"type": "integer", "default": 64, "enum": list(BITRATES),
                         "description": "the M4B's AAC bitrate (and the read-along EPUB's), kbit/s"},
        "mp3_bitrate_kbps": {"type": "integer", "default": 64, "enum": list(BITRATES),
                             "description": "the MP3s' bitrate, kbit/s, constant (ACX asks 192)"},
        "sample_rate": {"type": "integer", "enum": list(SAMPLE_RATES),
                        "description": "of the M4B and the MP3s; default: the render's own, 24000"},
        "title": {"type": "string"}, "author": {"type": "string"},
        "narrator": {"type": "string", "description": "for the M4B's and MP3s' tags (composer)"},
        "description": {"type": "string", "description": "for the tags; default: the book's own"},
        "lexicon": {"type": "string", "format": "binary",
                    "description": "a pronunciation lexicon, JSON or YAML (docs/BOOKS.md); a file or text"},
        "cast": {"type": "string", "format": "binary",
                 "description": "voices for the names the text's markup uses: name -> voice id (JSON, YAML)"},
        "language": {"type": "string", "description": "of the text, for the guide voice (e.g. en)"},
        "chapters": {"type": "string", "description": "render only these chapters, counted from 1: 3-7,12"},
        "quality": {"type": "string", "enum": [m.value for m in GateMode], "default": "on",
                    "description": QUALITY_HELP},
    },
}
BOOK_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": _BOOK_FORM_SCHEMA},
    "application/json": {"schema": BookBody.model_json_schema()},
}}}


def _book_out(ctx: ApiContext, book_id: str) -> BookOut:
    with ctx.session() as s:
        return BookOut.of(status.book_status(session=s, artifacts=ctx.artifacts, book_id=book_id))


def _submit(ctx: ApiContext, body: tuple[BinaryIO, BookRequest]) -> BookOut:
    """Accept a parsed body: (the book's stream, its request)."""
    source, request = body
    with ctx.session() as s:
        book_id = intake.accept_book(ctx=ctx, session=s, source=source, request=request)
    return _book_out(ctx, book_id)


async def _json_fields(request: Request) -> tuple[BinaryIO, BookRequest]:
    """Read the body up to its limit as it streams (413 past it, before anything is parsed), then parse
    it in a worker thread: a large manifest never holds up the event loop, so other requests go on."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > JSON_BODY_MAX:
            raise HTTPException(413, detail=f"the JSON body is larger than {JSON_BODY_MAX} bytes (a manifest "
                                            f"may have {DEFAULT_LIMITS.max_text_bytes}); stopped reading")
    return await run_in_threadpool(_parse_json, bytes(body))


def _parse_json(body: bytes) -> tuple[BinaryIO, BookRequest]:
    """The request's JSON (pydantic bounds its nesting); the manifest inside is read by a CPU worker."""
    try:
        req = BookBody.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    options = BookOptions(output_format=req.output_format, m4b=req.m4b, mp3=req.mp3, timed=req.timed,
                          epub3=req.epub3, bitrate_kbps=req.bitrate_kbps,
                          mp3_bitrate_kbps=req.mp3_bitrate_kbps, sample_rate=req.sample_rate,
                          series=req.series, series_part=req.series_part, preview_s=req.preview_s,
                          target_lufs=req.target_lufs, seed=req.seed, priority=req.priority,
                          quality=req.quality)
    submission = Submission(options=options, book_format="manifest", chapters=req.chapters,
                            narrator=req.narrator, description=req.description, publisher=req.publisher,
                            year=None if req.year is None else str(req.year), isbn=req.isbn,
                            genres=req.genres)
    return io.BytesIO(json.dumps(req.manifest).encode()), BookRequest(
        submission=submission, voice_id=req.voice_id, lexicon=req.lexicon, cast=req.cast)


async def _file_or_text(value: Any, limit: int) -> bytes | None:
    """A form field sent as a file or as text -> its bytes (one byte past `limit` at most: the reader
    refuses it with the reason)."""
    if isinstance(value, UploadFile):
        return await value.read(limit + 1)
    return value.encode() if value else None


def _encoding_fields(form: FormData) -> dict[str, Any]:
    """bitrate_kbps, mp3_bitrate_kbps, sample_rate as numbers (absent: the defaults)."""
    out: dict[str, Any] = {name: number_field(form.get(name), name, int) or DEFAULT_KBPS
                           for name in ("bitrate_kbps", "mp3_bitrate_kbps")}
    return {**out, "sample_rate": number_field(form.get("sample_rate"), "sample_rate", int)}


def _genres_field(form: FormData) -> list[str] | None:
    """`genres`, comma-separated, in one field or several; None when absent."""
    given = [v for v in (text_field(v, "genres") for v in form.getlist("genres")) if v is not None]
    return [g for v in given for g in split_genre_list(v)] if given else None


def _flag(text: str | None, default: bool) -> bool:
    return default if text is None else text.lower() not in ("false", "0", "no", "off")




async def _read_form(form: FormData, ctx: ApiContext) -> tuple[BinaryIO, BookRequest]:
    unknown = set(form.keys()) - set(FORM_FIELDS)
    if unknown:
        raise BadInput(f"unknown form fields: {sorted(unknown)}; allowed: {list(FORM_FIELDS)}")
    book = form.get("book")
    if not isinstance(book, UploadFile):
        raise BadInput("send the book as a file in the 'book' field")
    reference = form.get("reference")
    if reference is not None and not isinstance(reference, UploadFile):
        raise BadInput("reference must be an uploaded file")
    text = {name: text_field(form.get(name), name) for name in
            ("voice_id", "book_format", "output_format", "title", "author", "narrator", "description",
             "language", "m4b", "mp3", "timed", "epub3", "chapters", "series", "series_part", "publisher",
             "year", "isbn", "quality")}
    options = BookOptions(output_format=text["output_format"] or OutputFormat.FLAC,
                          m4b=_flag(text["m4b"], True), mp3=_flag(text["mp3"], False),
                          timed=_flag(text["timed"], False), epub3=_flag(text["epub3"], False),
                          target_lufs=target_lufs_field(text_field(form.get("target_lufs"), "target_lufs")),
                          seed=number_field(form.get("seed"), "seed", int) or 0,
                          **_encoding_fields(form), series=text["series"], series_part=text["series_part"],
                          preview_s=number_field(form.get("preview_s"), "preview_s", float),
                          priority=number_field(form.get("priority"), "priority", int) or 0,
                          quality=text["quality"] or GateMode.ON)
    submission = Submission(options=options, filename=book.filename, book_format=text["book_format"],
                            title=text["title"], author=text["author"], narrator=text["narrator"],
                            description=text["description"], language=text["language"],
                            chapters=text["chapters"], publisher=text["publisher"], year=text["year"],
                            isbn=text["isbn"], genres=_genres_field(form))
    # The book's file is handed on as the form spooled it (to disk past 1 MB): copied in chunks to the
    # book's folder, never read whole into this process.
    return book.file, BookRequest(
        submission=submission, voice_id=text["voice_id"],
        lexicon=await _file_or_text(form.get("lexicon"), LEXICON_MAX_BYTES),
        cast=await _file_or_text(form.get("cast"), CAST_MAX_BYTES),
        reference_bytes=(await read_upload(reference, ctx.settings.max_reference_bytes,
                                           "reference audio")) if reference else None)


@router.post("", status_code=202, response_model=BookOut, openapi_extra=BOOK_BODY,
             responses={404: {"model": Problem}, 413: {"model": Problem}, 415: {"model": Problem},
                        422: {"model": Problem}})
async def create_book(request: Request, response: Response, ctx: Ctx) -> BookOut:
    """Submit a book. Multipart: `book` file + `voice_id` or `reference`; JSON: an inline token manifest.
    Returns at once (202, `parsing`): a CPU worker reads it; follow GET /v1/books/{id}."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        book = await run_in_threadpool(_submit, ctx, await _json_fields(request))
    elif ctype.startswith("multipart/form-data"):
        async with request.form(max_files=4, max_fields=len(FORM_FIELDS),
                                max_part_size=DEFAULT_LIMITS.max_text_bytes) as form:
            book = await run_in_threadpool(_submit, ctx, await _read_form(form, ctx))  # the form's files live
    else:
        raise HTTPException(415, detail="send multipart/form-data (a book file) or application/json "
                                        "(an inline manifest)")
    response.headers["Location"] = f"/v1/books/{book.id}"
    return book


@router.get("", response_model=list[BookOut], responses={422: {"model": Problem}, 200: {"headers": {
    "X-Next-Cursor": {"description": "the next page's `after` (absent on the last page)",
                      "schema": {"type": "string"}}}}})
def list_books(ctx: Ctx, response: Response, after: Annotated[str | None, Query(description=AFTER)] = None,
               limit: Annotated[int, Query(ge=1, le=200)] = 50) -> list[BookOut]:
    """Newest first, a page at a time: the X-Next-Cursor header is the next page's `after`."""
    with ctx.session() as s:
        rows, cursor = queries.page_books(session=s, after=after, limit=limit)
        out = [BookOut.of(view) for view in status.book_statuses(session=s, artifacts=ctx.artifacts,
                                                                 books=rows)]
    if cursor is not None:
        response.headers["X-Next-Cursor"] = cursor
    return out


@router.get("/{book_id}", response_model=BookOut, responses={404: {"model": Problem}})
def get_book(book_id: str, ctx: Ctx) -> BookOut:
    return _book_out(ctx, book_id)


@router.get("/{book_id}/quality", responses={404: {"model": Problem}})
def get_quality(book_id: str, ctx: Ctx) -> dict[str, Any]:
    """Per chapter its segments passed, re-rendered, failed (kept) and not heard; the worst, to play."""
    with ctx.session() as s:
        return asdict(quality_view.book_quality(session=s, artifacts=ctx.artifacts, book_id=book_id))


@router.post("/{book_id}/cancel", response_model=BookOut,
             responses={404: {"model": Problem}, 409: {"model": Problem, "description": "already finished"}})
def cancel(book_id: str, ctx: Ctx) -> BookOut:
    """Cancel a live book (idempotent); its finished segments are kept for a later render."""
    with ctx.session() as s:
        service.cancel(ctx=ctx, session=s, book_id=book_id)
    return _book_out(ctx, book_id)


@router.get("/{book_id}/files/{name}", response_class=FileResponse, responses={
    200: {"content": {t: {} for t in MEDIA_TYPES.values()}, "description": "a finished output file"},
    404: {"model": Problem}})
def get_file(book_id: str, name: str, ctx: Ctx) -> FileResponse:
    with ctx.session() as s:
        path = status.output_file(session=s, artifacts=ctx.artifacts, book_id=book_id, name=name)
    return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
                        filename=name)
