"""Which stored voice a speech request's `voice` means: OpenAI's built-in voice names (`alloy`, the SDK's
default, and the others) mapped by the operator (`WAVEFARM_OPENAI_VOICES='alloy=Ada,echo=bob'`), else
any id, name or id prefix as everywhere (`app.voices.names`; a stored voice named `alloy` works as is).

wavefarm has no voices of its own: a voice is a stored reference recording, so an OpenAI name that is
neither mapped nor stored is a 404 that says both ways to make it work.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.errors import NotFound
from app.voices import names

# The voice names OpenAI's speech API documents; clients send them as their defaults.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


def speech_voice_id(*, session: Session, ref: str, mapping: dict[str, str]) -> str:
    """The voice `ref` means: the operator's mapping first (an explicit choice), then a stored voice of
    that name; NotFound with the way to give an OpenAI name a voice. Any other `ref` is returned as it is,
    for the submission's usual look-up."""
    mapped = mapping.get(ref.strip().casefold())
    if mapped is not None:
        try:
            return names.find_voice_id(session=session, ref=mapped)
        except NotFound as exc:
            raise NotFound(f"voice {ref!r} is mapped to {mapped!r} (WAVEFARM_OPENAI_VOICES), which is no "
                           f"stored voice: {exc}") from exc
    if ref.strip().casefold() not in OPENAI_VOICES:
        return ref
    try:
        return names.find_voice_id(session=session, ref=ref)
    except NotFound as exc:
        name = ref.strip()
        raise NotFound(f"no voice {name!r}: OpenAI's voice names are not built in (a voice is a stored "
                       f"recording); name a stored voice {name!r} (PATCH /v1/voices/{{id}} "
                       f'{{"name": "{name}"}}) or map the name to one: '
                       f"WAVEFARM_OPENAI_VOICES='{name.casefold()}=<voice id or name>'") from exc
