"""Text jobs' tokens on the GPU worker: the guide speech a CPU worker stored (`job.tokenize`), S3-tokenized
here, many segments per forward, before the job is claimed; then the job decodes as a tokens job does.

    TokenizeLane(tokenizer, device=...)    one thread that owns the tokenizer (on CUDA its work runs on a
                                           stream of its own, so decode steps are not held up);
                                           `tokenize(logmels)` from any synth task's thread blocks for the
                                           tokens of each segment. What waits while a forward runs goes
                                           into the next one: the segments of every waiting request,
                                           sorted by length, padded with their lengths (`Tokenizer.batch`:
                                           each one's tokens are those it gets alone), at most
                                           `max_frames` padded log-mel frames per forward
    tokenize_text_job(ctx, lane, job_id)   a text job's tokens from its stored speech, stored once (the
                                           job's row or the artifact root) before any attempt is claimed,
                                           so a redelivered job is not tokenized twice; its speech is
                                           deleted then. Speech that is not there (expired, evicted, or
                                           not spoken yet) leaves the job to `job.tokenize`, which the
                                           reconciler sends again when it is due.

Dummy weights (no model folder) tokenize with the stand-in (`app.s3.StandInTokenizer`) through the same
lane, and the job's notes say so.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import JobStatus
from app.db.session import session_scope
from app.errors import WavefarmError
from app.s3 import StandInTokenizer, Tokenizer
from app.speech import check_tokens
from app.submission import jobs
from app.text.guide_speech import GuideSpeech
from app.text.tokens import STAND_IN_NOTE

log = logging.getLogger(__name__)

MAX_BATCH_FRAMES = 32_000  # 320 s of speech per forward: about 40 segments of a book's length


@dataclass
class _Request:
    logmels: list[Tensor]
    done: Future[list[list[int]]] = field(default_factory=Future)


def length_groups(frames: Sequence[int], max_frames: int) -> list[list[int]]:
    """Indices of `frames`, shortest first, in groups whose padded size (rows x longest) is at most
    `max_frames` (a longer segment goes alone): little padding, bounded memory."""
    groups: list[list[int]] = []
    for i in sorted(range(len(frames)), key=frames.__getitem__):
        if groups and (len(groups[-1]) + 1) * frames[i] <= max_frames:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class TokenizeLane:
    def __init__(self, tokenizer: Tokenizer, *, device: torch.device | str = "cpu",
                 max_frames: int = MAX_BATCH_FRAMES) -> None:
        self.tokenizer = tokenizer
        self.stand_in = isinstance(tokenizer, StandInTokenizer)
        self.max_frames = max_frames
        device = torch.device(device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats: Counter[str] = Counter()  # forwards, segments, log-mel frames, requests
        self.busy_s = 0.0  # time spent in forwards (and their copies to the host)
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="wavefarm-tokenize", daemon=True)
        self._thread.start()

    def tokenize(self, logmels: Sequence[Tensor]) -> list[list[int]]:
        """Each segment's tokens ([128, T] log-mel each in, ceil(T / 4) ids each out); the tokenizer's
        error if it refused them."""
        request = _Request(list(logmels))
        self._queue.put(request)
        return request.done.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            requests = [first]
            with contextlib.suppress(queue.Empty):  # all that queued while the last forward ran
                while (more := self._queue.get_nowait()) is not None:
                    requests.append(more)
                self._queue.put(None)  # closing: the loop ends after serving these
            self._serve(requests)

    def _serve(self, requests: list[_Request]) -> None:
        try:
            results = self._forward([mel for r in requests for mel in r.logmels])
        except Exception as exc:  # one request's bad input must not fail the others: each alone
            if len(requests) > 1:
                for request in requests:
                    self._serve([request])
                return
            requests[0].done.set_exception(exc)
            return
        for request in requests:
            request.done.set_result(results[: len(request.logmels)])
            results = results[len(request.logmels):]
        self.stats["requests"] += len(requests)

    def _forward(self, logmels: list[Tensor]) -> list[list[int]]:
        started = time.perf_counter()
        out: list[list[int]] = [[] for _ in logmels]
        frames = [mel.size(-1) for mel in logmels]
        context = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with context:
            for group in length_groups(frames, self.max_frames):
                tokens = self.tokenizer.batch([logmels[i] for i in group])
                for i, row in zip(group, tokens, strict=True):
                    out[i] = [int(t) for t in row.tolist()]  # to the host: syncs this stream only
                self.stats["forwards"] += 1
        self.stats["segments"] += len(logmels)
        self.stats["frames"] += sum(frames)
        self.busy_s += time.perf_counter() - started
        return out


def tokenize_text_job(ctx: Context, lane: TokenizeLane, job_id: str) -> str:
    """'ready' (the job has its tokens, or is no text job), 'missing' (its speech is not stored), 'stopped'
    (not queued any more) or 'failed' (its speech could not be tokenized: the job failed with the
    reason)."""
    with session_scope(ctx.sessions) as session:
        job = queries.get_job(session=session, job_id=job_id)
        if job is None or queries.is_tokenized(job):
            return "ready"
        if job.status != JobStatus.QUEUED:
            ctx.store.delete_guide_speech(job_id)  # cancelled while it was spoken
            return "stopped"
    data = ctx.store.get_guide_speech(job_id)
    if data is None:
        log.info("synth %s: no guide speech stored; job.tokenize stores it", job_id)
        return "missing"
    started = time.perf_counter()
    try:
        speech = GuideSpeech.decode(data, max_tokens=ctx.settings.max_tokens)
        per_segment = lane.tokenize(speech.logmels())
        tokens = check_tokens([t for segment in per_segment for t in segment],
                              max_tokens=ctx.settings.max_tokens, where="the text's speech")
    except (ValueError, WavefarmError, RuntimeError) as exc:
        with session_scope(ctx.sessions) as session:
            lifecycle.finish(session=session, job_id=job_id, status=JobStatus.FAILED,
                             error=f"tokenize: {exc}")
        ctx.store.delete_guide_speech(job_id)
        log.warning("synth %s: tokenize: %s: %s", job_id, type(exc).__name__, exc)
        return "failed"
    with session_scope(ctx.sessions) as session:
        stored = jobs.store_tokens(session=session, artifacts=ctx.artifacts, job_id=job_id, tokens=tokens)
        if stored and lane.stand_in:
            queries.add_job_note(session=session, job_id=job_id, note=STAND_IN_NOTE)
    ctx.store.delete_guide_speech(job_id)
    took = time.perf_counter() - started
    ctx.store.note_phase(job_id, {"phase": "tokenized", "tokenize_ms": round(took * 1000, 1),
                                  "segments": len(per_segment)})
    log.info("synth %s: %d tokens from %d segments of guide speech in %.3f s", job_id, len(tokens),
             len(per_segment), took)
    return "ready" if stored else "stopped"
