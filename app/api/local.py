"""`LocalClient`: the API's operations on the services in this process (`app.submission.jobs`,
`app.voices.service`, `app.books`), for the CLI's `--local` commands. It answers with the API's JSON shapes,
as `HttpClient` does (`app.api.client.Client`), so the CLI prints one thing whichever way it went.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.api.batch import batch_out, request_fields
from app.api.local_database import check_database_file, check_tables
from app.api.schemas import JobOut, VoiceOut
from app.api.schemas_books import BookOut
from app.books.quality_view import book_quality
from app.books.reading.publication import split_genre_list
from app.books.service import BookOptions, BookRequest, Submission, cancel, submit_book, target_lufs_field
from app.books.status import book_status, book_statuses, output_file
from app.books.writing.encoding import DEFAULT_KBPS
from app.context import Context
from app.db import queries
from app.errors import BadInput
from app.settings import Settings
from app.submission.batch import submit_batch
from app.submission.jobs import audio_path, cancel_job, get_job, submit_job
from app.submission.request import JobRequest
from app.voices import names as voice_names
from app.voices.service import get_voice, register_voice


class LocalClient:
    """The same operations straight against the database, the feature store and the broker."""

    def __init__(self, settings: Settings) -> None:
        check_database_file(settings)  # before connecting: SQLite would create an empty file
        self.ctx = Context.build(settings)
        try:
            check_tables(self.ctx.engine)
        except BadInput:
            self.ctx.close()
            raise

    def submit(self, *, voice: str | bytes, tokens: Sequence[Any] | None, seed: int | None,
               output_format: str, priority: int, idempotency_key: str | None, text: str | None = None,
               language: str | None = None) -> dict[str, Any]:
        ctx = self.ctx
        with ctx.session() as s:
            job_id = submit_job(
                ctx=ctx, session=s, request=JobRequest(
                    tokens=None if tokens is None else list(tokens), text=text, language=language,
                    voice_id=None if isinstance(voice, bytes) else voice,
                    reference_bytes=voice if isinstance(voice, bytes) else None, seed=seed,
                    output_format=output_format, priority=priority, idempotency_key=idempotency_key))
            return _job_out(get_job(session=s, job_id=job_id))

    def submit_batch(self, items: list[Any]) -> dict[str, Any]:
        ctx = self.ctx
        with ctx.session() as s:
            outcomes = submit_batch(ctx=ctx, session=s, items=[request_fields(item) for item in items])
        return batch_out(outcomes).model_dump(mode="json")

    def job(self, job_id: str) -> dict[str, Any]:
        with self.ctx.session() as s:
            return _job_out(get_job(session=s, job_id=job_id))

    def jobs(self, *, status: str | None = None, voice_id: str | None = None,
             limit: int = 100) -> list[dict[str, Any]]:
        return self.jobs_page(status=status, voice_id=voice_id, after=None, limit=limit)[0]

    def jobs_page(self, *, status: str | None, voice_id: str | None, after: str | None,
                  limit: int) -> tuple[list[dict[str, Any]], str | None]:
        with self.ctx.session() as s:
            rows, cursor = queries.page_jobs(session=s, status=status, voice_id=voice_id, after=after,
                                             limit=limit)
            return [_job_out(j) for j in rows], cursor

    def cancel(self, job_id: str) -> dict[str, Any]:
        ctx = self.ctx
        with ctx.session() as s:
            return _job_out(cancel_job(ctx=ctx, session=s, job_id=job_id))

    def audio(self, job_id: str) -> bytes:
        with self.ctx.session() as s:
            return audio_path(session=s, artifacts=self.ctx.artifacts, job_id=job_id).read_bytes()

    def voices(self) -> list[dict[str, Any]]:
        with self.ctx.session() as s:
            return [VoiceOut.of(v).model_dump(mode="json") for v in queries.list_voices(session=s, limit=100)]

    def add_voice(self, data: bytes) -> dict[str, Any]:
        ctx = self.ctx
        with ctx.session() as s:
            voice_id, created = register_voice(ctx=ctx, session=s, reference_bytes=data)
            return {**VoiceOut.of(get_voice(session=s, voice_id=voice_id)).model_dump(mode="json"),
                    "created": created}

    def rename_voice(self, voice: str, name: str | None) -> dict[str, Any]:
        with self.ctx.session() as s:
            voice_id = get_voice(session=s, voice_id=voice).id
            return VoiceOut.of(voice_names.rename_voice(session=s, voice_id=voice_id, name=name)).model_dump(
                mode="json")

    def submit_book(self, data: bytes, filename: str, voice: str | bytes, form: dict[str, str],
                    base_dir: Path) -> dict[str, Any]:
        ctx = self.ctx
        options = BookOptions(output_format=form["output_format"], m4b=form["m4b"] == "true",
                              mp3=form.get("mp3") == "true", timed=form.get("timed") == "true",
                              epub3=form.get("epub3") == "true", series=form.get("series"),
                              series_part=form.get("series_part"),
                              preview_s=float(form["preview_s"]) if form.get("preview_s") else None,
                              bitrate_kbps=int(form.get("bitrate_kbps") or DEFAULT_KBPS),
                              mp3_bitrate_kbps=int(form.get("mp3_bitrate_kbps") or DEFAULT_KBPS),
                              sample_rate=int(form["sample_rate"]) if form.get("sample_rate") else None,
                              target_lufs=target_lufs_field(form.get("target_lufs")),
                              seed=int(form["seed"]), priority=int(form["priority"]),
                              quality=form.get("quality") or "on")
        with ctx.session() as s:
            book_id = submit_book(ctx=ctx, session=s, data=data, request=_book_request(form, filename, voice,
                                                                                      options, base_dir))
        return self.book(book_id)

    def book(self, book_id: str) -> dict[str, Any]:
        with self.ctx.session() as s:
            view = book_status(session=s, artifacts=self.ctx.artifacts, book_id=book_id)
            return BookOut.of(view).model_dump(mode="json")

    def book_quality(self, book_id: str) -> dict[str, Any]:
        with self.ctx.session() as s:
            return asdict(book_quality(session=s, artifacts=self.ctx.artifacts, book_id=book_id))

    def books_page(self, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
        with self.ctx.session() as s:
            rows, cursor = queries.page_books(session=s, after=after, limit=limit)
            views = book_statuses(session=s, artifacts=self.ctx.artifacts, books=rows)
            return [BookOut.of(view).model_dump(mode="json") for view in views], cursor

    def cancel_book(self, book_id: str) -> dict[str, Any]:
        with self.ctx.session() as s:
            cancel(ctx=self.ctx, session=s, book_id=book_id)
        return self.book(book_id)

    def book_file(self, book_id: str, name: str, dest: Path) -> None:
        with self.ctx.session() as s:
            path = output_file(session=s, artifacts=self.ctx.artifacts, book_id=book_id, name=name)
        shutil.copyfile(path, dest)


def _job_out(job: Any) -> dict[str, Any]:
    return JobOut.of(job).model_dump(mode="json")


def _book_request(form: dict[str, str], filename: str, voice: str | bytes, options: BookOptions,
                  base_dir: Path) -> BookRequest:
    """The CLI's `--local` book request: the form's fields, the voice (a stored voice or reference audio),
    and the folder a manifest's audio files are read from."""
    submission = Submission(options=options, filename=filename, base_dir=str(base_dir.resolve()),
                            title=form.get("title"), author=form.get("author"), narrator=form.get("narrator"),
                            description=form.get("description"), language=form.get("language"),
                            chapters=form.get("chapters"), **_publication(form))
    return BookRequest(submission=submission, voice_id=voice if isinstance(voice, str) else None,
                       reference_bytes=voice if isinstance(voice, bytes) else None,
                       lexicon=form["lexicon"].encode() if form.get("lexicon") else None,
                       cast=form["cast"].encode() if form.get("cast") else None)


def _publication(form: dict[str, str]) -> dict[str, Any]:
    """The form's publisher, year, isbn and genres (comma-separated), those given."""
    given: dict[str, Any] = {k: form[k] for k in ("publisher", "year", "isbn") if k in form}
    if "genres" in form:
        given["genres"] = split_genre_list(form["genres"])
    return given
