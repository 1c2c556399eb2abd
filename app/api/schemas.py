"""Request and response bodies of the HTTP API (pydantic), built from the ORM rows.

Responses are explicit models, never ORM objects: the published schema (/openapi.json) is the
contract, and a column added to a table does not leak out by accident. Here the shared fields, voices and
jobs; the books' bodies are `app.api.schemas_books`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema

from app.broker.wire import MAX_PRIORITY
from app.errors import BadTokens
from app.speech import OutputFormat
from app.storable import unstorable

if TYPE_CHECKING:  # annotations only: a client command does not load SQLAlchemy and Alembic for them
    from app.db.models import Job, Voice

SEED_MAX = 2**63 - 1
AFTER = "a cursor from the previous page's X-Next-Cursor header: the rows older than that page's last"
# The output format as a request field, its schema inline (an enum $ref would not resolve inside the
# request bodies the routes publish by hand for their multipart alternative).
OutputFormatField = Annotated[OutputFormat, WithJsonSchema({"type": "string", "enum": list(OutputFormat)})]


def _storable(value: str) -> str:
    if (why := unstorable(value)) is not None:
        raise ValueError(why)  # a validation error whose loc names the field (a batch item's alone)
    return value


# A client string that reaches a row or a query: no NUL, no lone surrogate (`app.storable`).
StorableStr = Annotated[str, AfterValidator(_storable)]


class Problem(BaseModel):
    """Every error response: the error class and why."""

    error: str = Field(description="error kind, e.g. BadAudio, BadTokens, NotFound, Conflict")
    reason: str


class VoiceOut(BaseModel):
    id: str = Field(description="sha256 of the normalised 24 kHz reference")
    name: str | None = Field(default=None, description="its unique name, usable wherever the id is")
    status: str = Field(description="pending | preparing | ready | failed")
    created_at: datetime
    prepare_started_at: datetime | None
    prepared_at: datetime | None
    prepare_ms: float | None = Field(description="host-half preparation time of the last success")
    feature_nbytes: int | None
    prepare_attempts: int
    uses: int = Field(description="jobs submitted with this voice")
    error: str | None
    notes: list[str] = Field(default_factory=list, description="what normalising the reference changed: "
                             "cut to its first 6 s, padded with silence, scaled down to full scale")

    @classmethod
    def of(cls, voice: Voice) -> VoiceOut:
        return cls(id=voice.id, name=voice.name, status=voice.status, created_at=voice.created_at,
                   prepare_started_at=voice.prepare_started_at, prepared_at=voice.prepared_at,
                   prepare_ms=voice.prepare_ms, feature_nbytes=voice.feature_nbytes,
                   prepare_attempts=voice.prepare_attempts, uses=voice.uses, error=voice.error,
                   notes=(voice.reference_notes or "").splitlines())


class VoicePatch(BaseModel):
    """PATCH /v1/voices/{id}: what may change on a stored voice."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(description="a unique name (null: none); then usable wherever the id is")


class JobRequest(BaseModel):
    """POST /v1/jobs as JSON: speech tokens, or text (then a CPU worker makes the tokens through the
    guide voice). To upload the reference instead of naming a voice, use multipart."""

    model_config = ConfigDict(extra="forbid")

    voice_id: StorableStr = Field(min_length=1, max_length=64,
                          description="a voice from POST /v1/voices: its id, name or a unique id prefix")
    tokens: list[StrictInt] | None = Field(None, min_length=1,
                                           description="speech token ids, 25 per second of audio")
    text: StorableStr | None = Field(None, min_length=1,
                                     description="instead of tokens: text to speak; paragraphs "
                             "separated by a blank line; longer texts are books (POST /v1/books)")
    language: StorableStr | None = Field(None, min_length=2, max_length=32,
                                         description="the text's language tag (default en), e.g. en-GB, de")
    seed: StrictInt | None = Field(None, ge=0, le=SEED_MAX, description="random when omitted")
    output_format: OutputFormatField = OutputFormat.WAV
    priority: StrictInt = Field(0, ge=0, le=MAX_PRIORITY, description="0..9, higher runs first")
    idempotency_key: StorableStr | None = Field(
        None, min_length=1, max_length=128, description="resubmitting with the same key returns the same job")


class Progress(BaseModel):
    frames_done: int = Field(description="mel frames decoded so far (2 per token)")
    frames_total: int
    fraction: float


class Timings(BaseModel):
    submitted_at: datetime
    started_at: datetime | None
    first_audio_at: datetime | None
    finished_at: datetime | None
    queued_ms: float | None = Field(description="submitted -> started (this attempt)")
    first_audio_ms: float | None = Field(description="started -> first decoded audio")
    run_ms: float | None = Field(description="started -> finished")
    speak_ms: float | None = Field(None, description="a text job: its guide voice on the CPU worker "
                                   "(GET /v1/jobs/{id} only)")
    tokenize_ms: float | None = Field(None, description="a text job: its S3 tokenization on the GPU worker, "
                                      "waiting for a batch included (GET /v1/jobs/{id} only)")


class JobOut(BaseModel):
    id: str
    voice_id: str
    status: str = Field(description="queued | preparing | running | succeeded | failed | cancelled")
    kind: str = Field(description="tokens | text (spoken by the guide voice on a CPU worker, then tokenized "
                      "on the GPU worker before it is rendered)")
    phase: str | None = Field(None, description="a queued text job without its tokens (GET /v1/jobs/{id} "
                              "only): speaking (the guide voice, CPU worker) | tokenizing (S3 tokenizer, "
                              "GPU worker)")
    n_tokens: int = Field(description="0 for a text job until it is tokenized")
    text: str | None = Field(description="a text job's text")
    language: str | None
    notes: list[str] = Field(description="what the client should know about how the audio was made, "
                             "e.g. dummy weights (noise) or the stand-in tokenizer")
    seed: int
    output_format: str
    priority: int
    idempotency_key: str | None
    progress: Progress
    timings: Timings
    prep_path: str | None = Field(description="how the voice was installed: prepared_ahead, inline, ...")
    attempts: int
    error: str | None
    audio_url: str | None = Field(description="set once the job succeeded")

    @classmethod
    def of(cls, job: Job, phase: dict[str, str] | None = None) -> JobOut:
        """`phase`: the text job's phase record (`FeatureStore.phase`), when it was read."""
        total = job.frames_total or 0
        out = cls(
            id=job.id, voice_id=job.voice_id, status=job.status, kind=job.kind, phase=None,
            n_tokens=job.n_tokens, text=job.text, language=job.language, notes=list(job.notes or []),
            seed=job.seed, output_format=job.output_format, priority=job.priority,
            idempotency_key=job.idempotency_key,
            progress=Progress(frames_done=job.frames_done, frames_total=total,
                              fraction=round(job.frames_done / total, 4) if total else 0.0),
            timings=Timings(
                submitted_at=job.submitted_at, started_at=job.started_at, first_audio_at=job.first_audio_at,
                finished_at=job.finished_at, queued_ms=_ms(job.submitted_at, job.started_at),
                first_audio_ms=_ms(job.started_at, job.first_audio_at),
                run_ms=_ms(job.started_at, job.finished_at), speak_ms=None, tokenize_ms=None),
            prep_path=job.prep_path, attempts=job.attempts, error=job.error,
            audio_url=f"/v1/jobs/{job.id}/audio" if job.status == "succeeded" else None,
        )
        if phase is not None and job.kind == "text":
            if job.n_tokens == 0 and job.status == "queued":
                out.phase = "tokenizing" if phase.get("phase") == "tokenizing" else "speaking"
            out.timings.speak_ms = _float(phase.get("speak_ms"))
            out.timings.tokenize_ms = _float(phase.get("tokenize_ms"))
        return out


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    checks: dict[str, str] = Field(description="component -> 'ok' or the failure")
    dummy_weights_workers: int | None = Field(default=None, description=(
        "live GPU workers running dummy weights (no model folder: their audio is noise); None: unknown"))


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds() * 1000.0, 1)


def parse_tokens(data: bytes | str) -> list[Any]:
    """A tokens file or form field: a JSON list of ids, or an object with a "tokens" list.

    Only the shape is checked here; ranges and types are app.speech.check_tokens' job."""
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: [[[[...]]]]
        raise BadTokens(f"tokens are not JSON: {type(exc).__name__}") from exc
    if isinstance(parsed, dict):
        parsed = parsed.get("tokens")
    if not isinstance(parsed, list):
        raise BadTokens('tokens must be a JSON list of integers, or {"tokens": [...]}')
    return parsed


def problem(error: str, reason: str) -> dict[str, Any]:
    return Problem(error=error, reason=reason).model_dump()
