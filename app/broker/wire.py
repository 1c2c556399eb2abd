"""The wire contract between the producers and the workers: task names, priorities, how tasks are sent.

Tasks are sent by name (`TaskSender.send_task`, which a Celery app is), so no producer imports task code
and `tasks` and `gpu_worker` never import each other. Arguments are JSON: ids in, ids out. The Celery
app itself (serialisation, acknowledgement, queues) is built in `app.broker.celery_config`; this module
imports neither Celery nor anything heavy, so the API's and the CLI's imports stay light.

Priorities: a job's priority is 0..9, larger first. Tasks carry the *broker priority*
(`broker_priority`), in kombu-Redis's order: 0 is served first, 9 last, and a task sent without one
counts as 0 (the book and maintenance tasks: ahead of every job's work); kombu's Redis transport keeps
one list per step of `PRIORITY_STEPS` (nothing in wavefarm reads them: `app.broker.queues`). RabbitMQ serves
the
*largest* priority first, up to the queue's `x-max-priority`: a Celery app on an amqp:// broker turns
the number around as it publishes (`amqp_priority`, applied in `app.broker.celery_config`), so every sender
writes the same number on both brokers and both serve the same task first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from app.settings import Settings

PREPARE_TASK = "voice.prepare"  # cpu queue: the host half of a voice (tasks/voice.py)
SYNTH_TASK = "synth"  # gpu queue: one job (gpu_worker/worker/process.py); its task id is the job id
JOB_TOKENIZE_TASK = "job.tokenize"  # cpu queue, tasks/text.py: a text job's tokens, then its `synth`
SWEEP_TASK = "maintenance.sweep"  # cpu queue (tasks/maintenance.py)
BOOK_PARSE_TASK = "book.parse"  # cpu queue, tasks/books.py: read and plan a submitted book (bounded child)
BOOK_PLAN_TASK = "book.plan"  # cpu queue, tasks/books.py: start or resume a book
BOOK_TOKENIZE_TASK = "book.tokenize"  # cpu queue, tasks/books.py: segments' tokens -> their jobs, rung
BOOK_CHAPTER_TASK = "book.chapter"  # cpu queue: a chapter recorded ready (app.lifecycle.books)
BOOK_ASSEMBLE_TASK = "book.assemble"  # cpu queue, tasks/books.py: chapter files, M4B -> book succeeded

MAX_PRIORITY = 9  # job priority 0..9, larger goes first

PRIORITY_STEPS = tuple(range(MAX_PRIORITY + 1))  # kombu's Redis transport: one list per step


class TaskSender(Protocol):
    """What a producer needs from Celery (`Celery.send_task`)."""

    def send_task(self, name: str, args: Any = None, **options: Any) -> Any: ...


def broker_priority(priority: int) -> int:
    """Job priority (larger first) -> the broker priority (0 is served first; module docstring)."""
    return MAX_PRIORITY - priority


def amqp_priority(priority: int | None) -> int:
    """A broker priority (0 first; none counts as 0) -> RabbitMQ's (MAX_PRIORITY first)."""
    if priority is None:
        return MAX_PRIORITY
    return MAX_PRIORITY - max(0, min(int(priority), MAX_PRIORITY))


def send_prepare(sender: TaskSender, settings: Settings, voice_id: str, priority: int = 0) -> None:
    """Queue the host half of a voice on a CPU worker."""
    sender.send_task(PREPARE_TASK, args=[voice_id], queue=settings.queue_cpu,
                     priority=broker_priority(priority))


def tokenize_task_id(job_id: str) -> str:
    return f"tokenize-{job_id}"


def send_tokenize(sender: TaskSender, settings: Settings, job_id: str, priority: int) -> None:
    """Queue a text job's tokenization on a CPU worker; it sends the job's `synth` when done."""
    sender.send_task(JOB_TOKENIZE_TASK, args=[job_id], queue=settings.queue_cpu,
                     task_id=tokenize_task_id(job_id), priority=broker_priority(priority))


def send_synth(sender: TaskSender, settings: Settings, job_id: str, priority: int,
               queue: str | None = None) -> None:
    """Queue a job on the GPU workers: the shared gpu queue, or `queue` (one worker's own:
    `app.submission.routing`
    chooses); the task id is the job id (Flower and revocation address it)."""
    sender.send_task(SYNTH_TASK, args=[job_id], queue=queue or settings.queue_gpu, task_id=job_id,
                     priority=broker_priority(priority))


class _OnProducer:
    """A sender whose every task goes through one producer (one broker connection)."""

    def __init__(self, sender: TaskSender, producer: Any) -> None:
        self.sender, self.producer = sender, producer

    def send_task(self, name: str, args: Any = None, **options: Any) -> Any:
        return self.sender.send_task(name, args, producer=self.producer, **options)


@contextmanager
def one_connection(sender: TaskSender) -> Iterator[TaskSender]:
    """A round of many messages over one broker connection: a Celery app's producer, taken from its pool
    once (each plain `send_task` takes one and gives it back); any other sender is used as it is."""
    acquire = getattr(sender, "producer_or_acquire", None)
    if acquire is None:
        yield sender
        return
    with acquire() as producer:
        yield _OnProducer(sender, producer)


@contextmanager
def one_round(sender: TaskSender) -> Iterator[TaskSender]:
    """`one_connection`, or the sender's own round when it has one (`app.broker.publisher.Publisher`:
    RabbitMQ's confirms awaited once for the round, which then raises as it ends if one is missing)."""
    own = getattr(sender, "round", None)
    if own is None:
        with one_connection(sender) as one:
            yield one
        return
    with own() as one:
        yield one


def send_chapter(sender: TaskSender, settings: Settings, book_id: str, index: int) -> None:
    """Ring a chapter's `book.chapter` on a CPU worker: its segments have all settled (a doorbell: the
    task reads the database, so a lost or doubled one is harmless; the sweep rings a lost one again)."""
    sender.send_task(BOOK_CHAPTER_TASK, args=[book_id, index], queue=settings.queue_cpu)


def send_book_tokenize(sender: TaskSender, settings: Settings, book_id: str, keys: list[str],
                       priority: int) -> None:
    """Queue a group of a book's segments on a CPU worker (at the book's `priority`): the task speaks
    them, makes their jobs and rings them (`app.books.segment_jobs`)."""
    sender.send_task(BOOK_TOKENIZE_TASK, args=[book_id, list(keys)], queue=settings.queue_cpu,
                     priority=broker_priority(priority))


def send_assemble(sender: TaskSender, settings: Settings, book_id: str) -> None:
    """Queue a book's assembly on a CPU worker, once its last chapter is checked (the task reads the
    book's status: one that comes after the book was assembled finds it succeeded and does nothing)."""
    sender.send_task(BOOK_ASSEMBLE_TASK, args=[book_id], queue=settings.queue_cpu)
