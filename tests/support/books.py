"""Submitting a book and reading it in the test's own process, as the API and a CPU worker's `book.parse`
would (the child process that reads it is the real one): for tests that want a book planned or refused
without a Celery worker.

    RecordingSender                 records what would be sent to the broker
    read_now(...)                   `app.books.intake.read_book` on the test's settings
    submit_and_read(...)            `app.books.service.submit_book`, then `read_now`
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.artifacts import ArtifactStore
from app.books import intake
from app.books.service import submit_book
from app.settings import Settings
from app.store import FeatureStore


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, **options: Any) -> None:
        self.sent.append((name, args, options))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.sent]


def sessions_of(session: Session) -> sessionmaker[Session]:
    """A session factory on the engine `session` uses (`read_book` opens sessions of its own)."""
    from app.db.session import make_sessionmaker

    return make_sessionmaker(session.get_bind().engine)  # type: ignore[union-attr]


def read_now(*, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore,
             book_id: str, sender: Any = None) -> str:
    """Read a `parsing` book as `book.parse` would; 'planned', 'failed', 'stopped' or 'skipped'."""
    session.commit()  # whatever the test wrote is seen by the reader's own sessions
    svc = intake.Services(settings=settings, sessions=sessions_of(session), store=store, artifacts=artifacts,
                          sender=sender or RecordingSender())
    outcome = intake.read_book(book_id, svc)
    session.expire_all()
    return outcome


def submit_and_read(*, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore,
                    data: bytes, sender: Any = None, **kw: Any) -> tuple[str, str]:
    """(book id, what reading it gave)."""
    sender = sender or RecordingSender()
    book_id = submit_book(settings=settings, session=session, sender=sender, store=store, artifacts=artifacts,
                          data=data, **kw)
    return book_id, read_now(settings=settings, session=session, store=store, artifacts=artifacts,
                             book_id=book_id, sender=sender)


def read_in(ctx: Any, book_id: str) -> str:
    """Read a `parsing` book with an app's context (`app.state.ctx` of a TestClient's app), as a CPU
    worker's `book.parse` would."""
    svc = intake.Services(settings=ctx.settings, sessions=ctx.sessions, store=ctx.store,
                          artifacts=ctx.artifacts, sender=ctx.sender)
    return intake.read_book(book_id, svc)


def post_and_read(client: Any, **request: Any) -> Any:
    """POST /v1/books, then read the book as a CPU worker would; -> the POST's response, with the book's
    status after reading as `.book` (None when the POST was refused)."""
    response = client.post("/v1/books", **request)
    response.book = None
    if response.status_code == 202:
        read_in(client.app.state.ctx, response.json()["id"])
        response.book = client.get(f"/v1/books/{response.json()['id']}").json()
    return response
