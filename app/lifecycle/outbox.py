"""Settling a job with its follow-up work: the outbox the settling transaction writes, sent after it
commits.

Settling a job that was the last open segment of a chapter records the chapter ready in the same
transaction (`settle`, through `app.lifecycle.books.count_outcome`): that record is the outbox.
`settle_and_send` commits it and then rings each such chapter's `book.chapter` (a doorbell: the task
reads the database). A send that fails is logged, not raised: the job is settled, the record stays, and
the reconciler rings the chapter again (`app.reconcile.books.resume_chapters`), as it does for the paths
that settle without sending (`finish`: a cancel through the API, a job out of attempts).
"""

from __future__ import annotations

import logging

import kombu.exceptions
import redis
from sqlalchemy.orm import Session

from app.broker.wire import TaskSender, send_chapter
from app.db.models import JobStatus
from app.lifecycle.jobs import settle
from app.settings import Settings

log = logging.getLogger(__name__)

# A broker that does not answer (either transport): the ring is lost, and the reconciler's to make again.
SEND_FAILURES = (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError,
                 ConnectionError, OSError)


def settle_and_send(*, session: Session, sender: TaskSender, settings: Settings, job_id: str,
                    status: JobStatus, output_path: str | None = None, error: str | None = None) -> bool:
    """`settle` the job, commit, then send the `book.chapter` of each chapter it made ready. -> whether
    the job moved to its final status here (False: it was final already, and nothing is sent)."""
    settled = settle(session=session, job_id=job_id, status=status, output_path=output_path, error=error)
    session.commit()  # the ready records first: a chapter is never rung before it reads as ready
    for book_id, index in settled.chapters_ready:
        try:
            send_chapter(sender, settings, book_id, index)
        except SEND_FAILURES as exc:
            log.warning("job %s: book %s chapter %d is ready; book.chapter not sent (%s)", job_id, book_id,
                        index, exc)
    return settled.finished
