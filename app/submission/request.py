"""A job request: `JobRequest`, what an interface asks for (built once from an HTTP body or form, a CLI
command or a script), and its checks without the database (`check_request`), which give the `Request`
that defines the job. Storing it, routing it and sending its messages are `app.submission.jobs`'s.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.broker import wire
from app.errors import BadInput, BadTokens
from app.settings import Settings
from app.speech import MAX_SEED, OutputFormat, check_tokens
from app.text.tokens import check_text, text_job_tokens

IDEMPOTENCY_KEY_MAX = 128


@dataclass(frozen=True)
class JobRequest:
    """One job as a client asks for it, unchecked: speech `tokens` or `text` (in `language`), in a voice
    (`voice_id`: an id, a name or an id prefix; or `reference_bytes`, audio to make the voice from)."""

    tokens: Iterable[int] | None = None
    text: str | None = None
    language: str | None = None
    voice_id: str | None = None
    reference_bytes: bytes | None = None
    seed: int | None = None  # None: a random one
    output_format: str = "wav"
    priority: int = 0
    idempotency_key: str | None = None

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> JobRequest:
        """The request an HTTP body or form gave as parsed fields (absent ones at their defaults)."""
        return cls(tokens=fields.get("tokens"), text=fields.get("text"), language=fields.get("language"),
                   voice_id=fields.get("voice_id"), reference_bytes=fields.get("reference_bytes"),
                   seed=fields.get("seed"), output_format=str(fields.get("output_format") or "wav"),
                   priority=fields.get("priority", 0), idempotency_key=fields.get("idempotency_key"))


@dataclass(frozen=True)
class Request:
    """What defines a job, as a request asked for it (seed None: any seed was fine), checked."""

    tokens: list[int] | None  # None: a text job
    text: str | None
    language: str | None
    seed: int | None
    output_format: str
    priority: int
    idempotency_key: str | None = None


OUTPUT_FORMATS = frozenset(f.value for f in OutputFormat)  # a set, not `tuple(OutputFormat)` at each check


def check_request(*, settings: Settings, request: JobRequest) -> tuple[Request, int]:
    """A job request's fields checked, without the database: (the request, the seed to use). Raises
    BadTokens or BadInput."""
    tokens, text, language = request.tokens, request.text, request.language
    if tokens is None and text is None:
        raise BadTokens("tokens are missing (send tokens, or text)")
    if tokens is not None and text is not None:
        raise BadInput("give exactly one of tokens or text")
    token_list = None if tokens is None else check_tokens(tokens, max_tokens=settings.max_tokens)
    if text is not None:
        language = language or "en"
        check_text(text, language, max_tokens=text_job_tokens(settings))
    elif language is not None:
        raise BadInput("language goes with text; tokens have no language")
    checked = Request(tokens=token_list, text=text, language=language, seed=request.seed,
                      output_format=request.output_format, priority=request.priority,
                      idempotency_key=request.idempotency_key)
    chosen_seed = check_options(seed=request.seed, output_format=request.output_format,
                                priority=request.priority)
    _check_idempotency_key(request.idempotency_key)
    return checked, chosen_seed


def check_options(*, seed: int | None, output_format: str, priority: int) -> int:
    """Refuse options outside their ranges (BadInput); returns the seed to use (random when None)."""
    if not isinstance(output_format, str) or output_format not in OUTPUT_FORMATS:
        raise BadInput(f"output format {output_format!r} is not one of {[f.value for f in OutputFormat]}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= wire.MAX_PRIORITY:
        raise BadInput(f"priority must be an integer 0..{wire.MAX_PRIORITY}")
    if seed is None:
        return secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise BadInput("seed must be an integer 0..2**63-1")
    return seed


def _check_idempotency_key(key: str | None) -> None:
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= IDEMPOTENCY_KEY_MAX):
        raise BadInput(f"idempotency key must be a string of 1..{IDEMPOTENCY_KEY_MAX} characters")
