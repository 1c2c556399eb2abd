"""Who holds a speech job: a disconnect cancels a job only when nobody else wants its audio.

Two `POST /v1/audio/speech` with the same body and `Idempotency-Key` share one job, and a job first
submitted through `/v1/jobs` (or a batch, or the CLI) may be named by a speech request's key too. So a
speech request that leaves (its client disconnected, or it gave up waiting for the first audio) cancels
its job only when the job is its own alone:
- without an idempotency key nobody else can hold the job: leaving cancels it;
- with one, every speech request streaming the job is a member of a Redis set (`app.storage.feature_store`,
shared by
  every API process), and the job is cancelled by the last member to leave, and only when a speech
  request created it (a marker its creator sets). A job that existed before (a `/v1/jobs` submission's)
  is never cancelled by a speech disconnect.

Whether this request created the job is judged by looking the key up before submitting: a `/v1/jobs`
submission with the same key that wins an insert race in the same instant counts as the speech
request's (the only gap left). Redis unavailable: nothing is cancelled (the job renders; logged).
"""

from __future__ import annotations

import logging
import uuid

import redis

from app.api.deps import ApiContext
from app.api.speech_stream import cancel_unfinished

log = logging.getLogger(__name__)


class Listener:
    """One speech request's hold on its job: `join` when it starts waiting, `leave` when it ends."""

    def __init__(self, ctx: ApiContext, job_id: str, *, keyed: bool, created: bool) -> None:
        self.ctx, self.job_id, self.keyed, self.created = ctx, job_id, keyed, created
        self.id = uuid.uuid4().hex
        self.joined = self.left = False

    def join(self) -> None:
        if not self.keyed:
            return  # the job is this request's alone
        try:
            self.ctx.store.join_listeners(self.job_id, self.id, owned=self.created,
                                          ttl_s=self.ctx.settings.visibility_timeout_s)
            self.joined = True
        except redis.RedisError as exc:
            log.warning("job %s: its speech listener is not counted (Redis: %s); it will not be cancelled "
                        "when this client leaves", self.job_id, exc)

    def leave(self, why: str = "its speech client went away", *, cancel: bool = True) -> bool:
        """Leave (once); True when this cancelled the job (it was unfinished and nobody else held it)."""
        if self.left:
            return False
        self.left = True
        last = not self.keyed
        if self.joined:
            try:
                last = self.ctx.store.leave_listeners(self.job_id, self.id)
            except redis.RedisError as exc:
                log.warning("job %s: its speech listener could not leave (Redis: %s); not cancelled",
                            self.job_id, exc)
        if not (cancel and last):
            if cancel:
                log.info("job %s: %s; not cancelled (another client holds it, or no speech request "
                         "created it)", self.job_id, why)
            return False
        return cancel_unfinished(self.ctx, self.job_id, why)
