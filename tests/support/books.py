"""Submitting a book and reading it in the test's own process, as the API and a CPU worker's `book.parse`
would (the child process that reads it is the real one): for tests that want a book planned or refused
without a Celery worker.

    RecordingSender                 records what would be sent to the broker
    read_now(...)                   `app.books.intake.read_book` on the test's context
    submit_and_read(...)            `app.books.service.submit_book`, then `read_now`
    book_request(...)               a `BookRequest` from flat fields: the request's, its submission's,
                                    its options' (a test names only what it sets)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import numpy as np
import soundfile as sf
from sqlalchemy.orm import Session

from app import lifecycle
from app.books import intake
from app.books.service import BookOptions, BookRequest, Submission, submit_book
from app.context import Context
from app.db import queries
from app.db.models import JobStatus


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        self.sent.append((name, args, options))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.sent]


def read_now(*, ctx: Context, session: Session, book_id: str, sender: Any = None) -> str:
    """Read a `parsing` book as `book.parse` would, sending through `sender` (a RecordingSender by
    default); 'planned', 'failed', 'stopped' or 'skipped'."""
    session.commit()  # whatever the test wrote is seen by the reader's own sessions
    outcome = intake.read_book(book_id, replace(ctx, sender=sender or RecordingSender()))
    session.expire_all()
    return outcome


def submit_and_read(*, ctx: Context, session: Session, data: bytes, sender: Any = None,
                    **kw: Any) -> tuple[str, str]:
    """(book id, what reading it gave)."""
    ctx = replace(ctx, sender=sender or RecordingSender())
    limits = kw.pop("limits", None)
    book_id = submit_book(ctx=ctx, session=session, data=data, request=book_request(**kw), limits=limits)
    return book_id, read_now(ctx=ctx, session=session, book_id=book_id, sender=ctx.sender)


def book_request(**given: Any) -> BookRequest:
    """A `BookRequest` from flat fields, each put where it belongs: the request's own (voice, reference,
    lexicon, cast), its submission's (file name, title, chapters ...; `publication` as a mapping of them),
    or its options' (format, seed, priority ...; or `options` whole)."""
    names = {kind: {f.name for f in fields(kind)} for kind in (BookRequest, Submission, BookOptions)}
    given = {**(given.pop("publication", None) or {}), **given}
    unknown = set(given) - set().union(*names.values())
    assert not unknown, f"not a book request's field: {sorted(unknown)}"
    options = given.pop("options", None) or BookOptions(
        **{k: v for k, v in given.items() if k in names[BookOptions] and k not in names[Submission]})
    submission = Submission(options=options, **{k: v for k, v in given.items() if k in names[Submission]})
    return BookRequest(submission=submission, **{k: v for k, v in given.items() if k in names[BookRequest]})


def read_in(ctx: Context, book_id: str) -> str:
    """Read a `parsing` book with an app's context (`app.state.ctx` of a TestClient's app), as a CPU
    worker's `book.parse` would."""
    return intake.read_book(book_id, ctx)


def post_and_read(client: Any, **request: Any) -> Any:
    """POST /v1/books, then read the book as a CPU worker would; -> the POST's response, with the book's
    status after reading as `.book` (None when the POST was refused)."""
    response = client.post("/v1/books", **request)
    response.book = None
    if response.status_code == 202:
        read_in(client.app.state.ctx, response.json()["id"])
        response.book = client.get(f"/v1/books/{response.json()['id']}").json()
    return response


def finish_segments(ctx: Context, book_id: str, silent: Callable[[str, int], bool]) -> dict[int, str]:
    """Finish every live segment job of the book as a GPU worker would (the worker played in process):
    digital silence where `silent(segment key, token count)`, a 220 Hz sine elsewhere; -> {token count:
    job id} of the jobs finished."""
    finished = {}
    with ctx.sessions() as session:
        for s in queries.book_segment_states(session=session, book_id=book_id):
            if not (s.live and s.job_id):
                continue
            job = queries.require_job(session=session, job_id=s.job_id)
            relpath = ctx.artifacts.output_relpath(job.id, job.output_format)
            t = np.arange(job.n_tokens * 960) / 24000
            wave = np.zeros_like(t) if silent(s.key, job.n_tokens) else 0.3 * np.sin(2 * np.pi * 220 * t)
            sf.write(ctx.artifacts.path(relpath), wave, 24000, format=job.output_format.upper())
            assert lifecycle.finish(session=session, job_id=job.id, status=JobStatus.SUCCEEDED,
                                    output_path=relpath)
            finished[job.n_tokens] = job.id
        session.commit()
    return finished
