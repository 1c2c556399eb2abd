"""POST /v1/jobs/batch's body and answer: a JSON array of job requests, or JSON lines, parsed item by
item, so that a malformed or invalid item is refused on its own; and the per-item results.

Bounds: the body is at most `settings.max_batch_bytes` (413, at the door: `app.api.limits`), a batch
holds 1 to `app.submission.batch.BATCH_MAX` items (413 over it), a body that is not an array or not JSON lines
is refused whole (422). What a job is and when one is refused is `app.submission.batch`'s and
`app.submission.jobs`'.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, Field, ValidationError

from app.api.schemas import JobRequest
from app.errors import BadInput, Conflict, Gone, NotFound, WavefarmError
from app.submission.batch import BATCH_MAX, Outcome

NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines")
# A refused item's status, as a single POST /v1/jobs would have answered it (`app.api.main` REFUSALS).
CODES: tuple[tuple[type[Exception], int, str | None], ...] = (
    (Gone, 410, "Gone"), (NotFound, 404, "NotFound"), (Conflict, 409, "Conflict"), (BadInput, 422, None))


class BatchItemOut(BaseModel):
    index: int = Field(description="the item's place in the request, from 0 (blank JSON lines skipped)")
    accepted: bool
    code: int = Field(description="what POST /v1/jobs would have answered: 202, or the refusal's 4xx "
                      "(503: the broker refused, the job was taken back; retry)")
    job_id: str | None = None
    status: str | None = Field(default=None, description="the job's status (queued when new)")
    existed: bool = Field(default=False, description="its idempotency key named a job already (this "
                          "batch's or an earlier request's)")
    error: str | None = Field(default=None, description="a refusal's kind: BadTokens, NotFound, ...")
    reason: str | None = None


class BatchOut(BaseModel):
    accepted: int
    refused: int
    results: list[BatchItemOut]


def _too_many(n: int) -> HTTPException:
    return HTTPException(413, detail=f"a batch holds at most {BATCH_MAX} jobs; this one has {n}: "
                                     "split it into several requests")


def parse_items(body: bytes, *, lines: bool) -> list[dict[str, Any] | WavefarmError]:
    """The body's items: each a `JobRequest`'s fields, or the refusal of a malformed or invalid one."""
    if lines:
        raw = [line for line in body.split(b"\n") if line.strip()]
        if len(raw) > BATCH_MAX:
            raise _too_many(len(raw))
        parsed: list[Any | WavefarmError] = [_json_line(n, line) for n, line in enumerate(raw)]
    else:
        try:
            whole = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BadInput(f"the body is not JSON ({type(exc).__name__}); send an array of job requests, "
                           "or JSON lines as application/x-ndjson") from exc
        if not isinstance(whole, list):
            raise BadInput("a batch is a JSON array of job requests (or JSON lines: application/x-ndjson)")
        if len(whole) > BATCH_MAX:
            raise _too_many(len(whole))
        parsed = whole
    if not parsed:
        raise BadInput(f"a batch holds 1 to {BATCH_MAX} jobs; this one is empty")
    return [item if isinstance(item, WavefarmError) else request_fields(item) for item in parsed]


def _json_line(n: int, line: bytes) -> Any:
    try:
        return json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return BadInput(f"item {n} is not a JSON line ({type(exc).__name__})")


def request_fields(item: Any) -> dict[str, Any] | WavefarmError:
    if not isinstance(item, dict):
        return BadInput("an item is a JSON object (a job request, as POST /v1/jobs takes)")
    try:
        return JobRequest.model_validate(item).model_dump()
    except ValidationError as exc:
        # Without the offending input (it may be huge); loc says where.
        return BadInput("; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                                  for e in exc.errors(include_url=False, include_input=False)))


def batch_out(outcomes: list[Outcome]) -> BatchOut:
    results = [_item_out(i, o) for i, o in enumerate(outcomes)]
    accepted = sum(r.accepted for r in results)
    return BatchOut(accepted=accepted, refused=len(results) - accepted, results=results)


def _item_out(index: int, outcome: Outcome) -> BatchItemOut:
    if outcome.error is None:
        return BatchItemOut(index=index, accepted=True, code=202, job_id=outcome.job_id,
                            status=outcome.status, existed=outcome.existed)
    exc = outcome.error
    for kind, code, name in CODES:
        if isinstance(exc, kind):
            return BatchItemOut(index=index, accepted=False, code=code, error=name or type(exc).__name__,
                                reason=str(exc))
    # Not a refusal: the broker could not take the job's message (it was taken back out).
    return BatchItemOut(index=index, accepted=False, code=503, error="Unavailable",
                        reason=f"the broker refused the job's message ({type(exc).__name__}); retry")
