"""Every Redis key name wavefarm uses, and the id shapes allowed inside them.

Ids are checked before they become part of a key or a file name, so a client
string can never address another key or path.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from app.errors import BadInput, NotFound

PREFIX = "wf"
FEATURE_VERSION = 1  # of the stored host features (app.voices.features): bump when any feature's maths
# changes,
# and entries written by older builds are no longer read (their keys differ)

GUIDE_SPEECH_VERSION = 1  # of the stored guide speech (app.text.guide_speech)

_VOICE_ID = re.compile(r"[0-9a-f]{64}")


def check_voice_id(voice_id: str) -> str:
    """A voice id is a lowercase sha256 hex digest."""
    if not isinstance(voice_id, str) or not _VOICE_ID.fullmatch(voice_id):
        raise ValueError(f"not a voice id (sha256 hex): {voice_id!r}")
    return voice_id


def check_job_id(job_id: str) -> str:
    """A job id is a canonical (lowercase, hyphenated) UUID string."""
    try:
        canonical = str(uuid.UUID(job_id))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a job id (uuid): {job_id!r}") from exc
    if canonical != job_id:
        raise ValueError(f"not a canonical job id: {job_id!r}")
    return job_id


def known_id(value: str, check: Callable[[str], str], what: str) -> str:
    """`value` if `check` accepts it; NotFound ("no <what> <value>") otherwise: a malformed id names
    nothing, so to a client it is an unknown one."""
    try:
        return check(value)
    except ValueError as exc:
        raise NotFound(f"no {what} {value}") from exc


ID_PREFIX = re.compile(r"[0-9a-f][0-9a-f-]{3,35}")  # of a job or book id: what the CLI prints is 8 hex digits


def one_by_prefix(found: list[str], ref: str, what: str) -> str | None:
    """The one id of `found` (the ids beginning with `ref`), None for none; BadInput naming the
    candidates when several begin with it."""
    if len(found) > 1:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise BadInput(f"{what} {ref!r} is ambiguous: it begins {len(found)} {what} ids ({shown}); "
                       "give more of the id")
    return found[0] if found else None


def feature_key(voice_id: str) -> str:
    """Prepared host features of a voice (safetensors bytes, with a TTL)."""
    return f"{PREFIX}:feat:v{FEATURE_VERSION}:{check_voice_id(voice_id)}"


def guide_speech_key(job_id: str) -> str:
    """A text job's guide-voice speech (safetensors bytes, with a TTL), from the CPU worker that spoke it
    to the GPU worker that tokenizes it (`app.text.guide_speech`); deleted once the tokens are stored."""
    return f"{PREFIX}:guide:v{GUIDE_SPEECH_VERSION}:{check_job_id(job_id)}"


def job_phase_key(job_id: str) -> str:
    """A text job's phase before it has tokens (a hash: phase, speak_ms, tokenize_ms, segments), for its
    status (`app.api.schemas.JobOut`); with the guide speech's TTL."""
    return f"{PREFIX}:phase:{check_job_id(job_id)}"


def prepare_claim_key(voice_id: str) -> str:
    """Set while a `voice.prepare` for the voice is queued, so N submissions enqueue it once."""
    return f"{PREFIX}:prep:queued:{check_voice_id(voice_id)}"


def speech_listeners_key(job_id: str) -> str:
    """The speech requests streaming a job now (a set of request ids, `app.api.speech_listeners`)."""
    return f"{PREFIX}:speech:listeners:{check_job_id(job_id)}"


def speech_owned_key(job_id: str) -> str:
    """Present when a speech request created the job: only such a job may a speech disconnect cancel."""
    return f"{PREFIX}:speech:owned:{check_job_id(job_id)}"


def cancel_key(job_id: str) -> str:
    """Present when a job has been cancelled; the GPU worker polls it between steps."""
    return f"{PREFIX}:cancel:{check_job_id(job_id)}"


def sweep_sent_key(queue: str) -> str:
    """Set for one maintenance period by the CPU worker that sent the periodic `maintenance.sweep` to
    `queue`: the other workers on that queue skip their turn (one sweep per period for the cluster)."""
    return f"{PREFIX}:sweep:sent:{queue}"


# In each Redis database `wavefarm demo` uses (app.dev.services): which demo (host and folder) uses it, so
# that a demo's leftovers are told from another stack's keys; and, for a minute after the claim, the same
# as a lease, so that two demos starting at once do not both take a database before their workers connect.
DEMO_OWNER_KEY = f"{PREFIX}:demo:owner"
DEMO_LEASE_KEY = f"{PREFIX}:demo:lease"

# Counter groups: each is one hash whose fields are the counted outcomes.
COUNTER_PREP_PATH = "prep_path"  # fields: app.db.models.PrepPath values
COUNTER_PREPARE = "prepare"  # fields: prepared, noop, failed, retried
COUNTER_QUALITY = "quality"  # fields: "<check>:<verdict>", app.quality.report's CHECKS x VERDICTS
COUNTER_SWEEP = "sweep"  # fields: app.reconcile.report.SWEEP_FINDINGS (what a sweep found and put back)


def counter_key(group: str) -> str:
    if not re.fullmatch(r"[a-z_]+", group):
        raise ValueError(f"bad counter group {group!r}")
    return f"{PREFIX}:count:{group}"
