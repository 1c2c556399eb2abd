"""A job's audio while it renders: the GPU worker writes 16-bit PCM WAV beside the output's final name
(`.<id>.wav.<random>.part`) and renames it into place when done; `PcmTail` opens that file once and
keeps reading the same inode, so the rename changes nothing for it. `stream_job` turns the growing PCM
into a requested format (`app.api.speech_codec`) and yields it as it comes.

The job's state is read from the database between reads. Before the first audio, a job that ends
without any raises `JobEnded` and one that writes none within the bound raises `NoFirstAudio` (its job
cancelled), which the route answers as errors. After it, the status line has gone: a job that fails or
is cancelled is logged and the stream is cut (the connection closes before the chunked body's end, so a
client sees an incomplete transfer, never a short file that looks whole). A consumer that goes away (a
client that disconnects closes the generator) leaves its job, which cancels it when nobody else holds it
(`app.api.speech_listeners`), unless it had ended.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import anyio
from fastapi.concurrency import run_in_threadpool

from app.api.deps import ApiContext
from app.api.speech_codec import Encoder
from app.db import queries
from app.db.models import DONE_JOB_STATUSES, JobStatus
from app.errors import Conflict, WavefarmError
from app.storage.artifacts import ArtifactStore
from app.submission import jobs

if TYPE_CHECKING:  # it imports cancel_unfinished from here
    from app.api.speech_listeners import Listener

log = logging.getLogger(__name__)

POLL_S = 0.1
READ_MAX = 1 << 20


class JobEnded(WavefarmError):
    """The job ended without audio to finish the stream: `status` failed or cancelled, or succeeded with
    its audio gone."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


class NoFirstAudio(WavefarmError):
    """The job wrote no audio within the bound (it has been cancelled); `claimed`: a GPU worker had
    taken it (it was preparing its voice or running), else it was still queued."""

    def __init__(self, message: str, claimed: bool) -> None:
        super().__init__(message)
        self.claimed = claimed


class StreamCut(WavefarmError):
    """The job ended badly after its audio had started: the response is cut (raised out of the body)."""


class PcmTail:
    """The PCM samples of a job's WAV output as they are written (whole samples only)."""

    def __init__(self, artifacts: ArtifactStore, job_id: str) -> None:
        self.final: Path = artifacts.output_path(job_id, "wav")
        self.handle: BinaryIO | None = None
        self.data_at: int | None = None  # offset of the data chunk's first sample

    def _open(self) -> None:
        parts = sorted(self.final.parent.glob(f".{self.final.name}.*.part"))
        for path in [*parts, self.final]:
            try:
                self.handle = open(path, "rb")  # noqa: SIM115 - held across reads, closed by close()
                return
            except FileNotFoundError:
                continue

    def _find_data(self) -> None:
        assert self.handle is not None
        self.handle.seek(0)
        head = self.handle.read(4096)
        at = 12  # RIFF, size, WAVE; then chunks: id, size, body
        while at + 8 <= len(head):
            chunk, size = head[at:at + 4], struct.unpack("<I", head[at + 4:at + 8])[0]
            if chunk == b"data":
                self.data_at = at + 8
                self.handle.seek(self.data_at)
                return
            at += 8 + size + (size & 1)

    def read(self) -> bytes:
        """New samples since the last read (b"" when none yet)."""
        if self.handle is None:
            self._open()
        if self.handle is not None and self.data_at is None:
            self._find_data()
        if self.handle is None or self.data_at is None:
            return b""
        data = self.handle.read(READ_MAX)
        odd = len(data) & 1
        if odd:
            self.handle.seek(-1, 1)
        return data[:len(data) - odd]

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def _status(ctx: ApiContext, job_id: str) -> tuple[str, str | None]:
    with ctx.session() as s:
        job = queries.require_job(session=s, job_id=job_id)
        return job.status, job.error


def cancel_unfinished(ctx: ApiContext, job_id: str, why: str = "its speech client went away") -> bool:
    """Cancel the job its last listener left, unless it has ended; True when it is cancelled."""
    with ctx.session() as s:
        try:
            jobs.cancel_job(ctx=ctx, session=s, job_id=job_id)
            log.info("job %s: %s; cancelled", job_id, why)
            return True
        except Conflict:
            return False  # ended meanwhile


async def first_audio(ctx: ApiContext, tail: PcmTail, listener: Listener,
                      gone: Callable[[], Awaitable[bool]]) -> bytes | None:
    """Waits for the job's first samples, at most `settings.speech_first_audio_timeout_s`; None (the
    listener left: the job cancelled unless another client holds it) when `gone()` says the client left
    meanwhile. JobEnded when the job ends without any audio; NoFirstAudio when none came within the
    bound (the job cancelled unless another client holds it)."""
    job_id, bound_s = listener.job_id, ctx.settings.speech_first_audio_timeout_s
    deadline = time.monotonic() + bound_s
    while True:
        if await gone():
            tail.close()
            await run_in_threadpool(listener.leave)
            return None
        status, error = await run_in_threadpool(_status, ctx, job_id)
        chunk = await run_in_threadpool(tail.read)
        if chunk:
            return chunk
        if status in DONE_JOB_STATUSES and status != JobStatus.SUCCEEDED:
            raise JobEnded(f"job {job_id} {status}: {error or 'no reason recorded'}", status)
        if status == JobStatus.SUCCEEDED:
            chunk = await run_in_threadpool(tail.read)
            if chunk:
                return chunk
            raise JobEnded(f"job {job_id} succeeded but its audio is gone", status)
        if time.monotonic() > deadline and (late := await _give_up(ctx, listener, status, bound_s)):
            raise late
        await asyncio.sleep(POLL_S)


async def _give_up(ctx: ApiContext, listener: Listener, status: str, bound_s: float) -> NoFirstAudio | None:
    """Leave a job that wrote no audio within the bound (cancelled unless another client holds it): the
    error that says why; None when the job ended meanwhile (the next poll answers with what it left)."""
    job_id = listener.job_id
    await run_in_threadpool(listener.leave, "its speech request gave up waiting for audio")
    now = (await run_in_threadpool(_status, ctx, job_id))[0]
    if now in DONE_JOB_STATUSES and now != JobStatus.CANCELLED:
        return None
    claimed = status != JobStatus.QUEUED
    why = (f"job {job_id} was taken by a GPU worker ({status}) but wrote no audio within {bound_s:g} s"
           if claimed else f"no GPU worker took job {job_id} within {bound_s:g} s (is one running?)")
    what = "the job is cancelled" if now == JobStatus.CANCELLED else "the job goes on for its other clients"
    return NoFirstAudio(f"{why}; {what}", claimed)


async def stream_job(ctx: ApiContext, tail: PcmTail, listener: Listener, encoder: Encoder,
                     first: bytes) -> AsyncIterator[bytes]:
    """The job's audio in the encoder's format, from `first` (what `first_audio` returned) to its end."""
    job_id, ended = listener.job_id, False
    try:
        yield encoder.feed(first)
        while True:
            status, error = await run_in_threadpool(_status, ctx, job_id)
            while chunk := await run_in_threadpool(tail.read):
                if out := encoder.feed(chunk):
                    yield out
            if status == JobStatus.SUCCEEDED:
                ended = True
                yield encoder.finish()
                return
            if status in DONE_JOB_STATUSES:
                ended = True
                log.warning("job %s %s after its audio had started streaming (%s): the response is cut",
                            job_id, status, error or "no reason recorded")
                raise StreamCut(f"job {job_id} {status} while streaming: {error or 'no reason recorded'}")
            await asyncio.sleep(POLL_S)
    finally:
        tail.close()
        # The client went away unless it ended: this runs inside a cancelled scope, so shield the leave.
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(partial(listener.leave, cancel=not ended))
