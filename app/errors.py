"""The error tree. Interfaces map these to responses; everything else is a bug.

WavefarmError
 +-- BadInput            the client sent something we refuse (HTTP 4xx)
 |    +-- BadAudio       unreadable, empty, non-finite, too many channels, too long ...
 |    +-- BadTokens      out of range, wrong type, empty, too many
 +-- NotFound            an id that does not exist (HTTP 404)
 |    +-- Gone           it existed, but its file has been removed (HTTP 410)
 +-- Conflict            the request does not fit the state it finds: a job that already finished,
 |                       audio of a job that has not succeeded (HTTP 409)
 +-- FeaturesMissing     a voice's prepared features are not in the feature store
 +-- ModelLoadError      a model folder that cannot be loaded (names the file)
 +-- EngineFailure       the engine failed one job (the engine itself goes on)
"""


class WavefarmError(Exception):
    """Base of every error wavefarm raises on purpose."""


class BadInput(WavefarmError):
    """The client's input is refused; the message says why."""


class BadAudio(BadInput):
    """Reference or source audio that cannot be used."""


class BadTokens(BadInput):
    """Speech tokens that cannot be decoded."""


class NotFound(WavefarmError):
    """No such job, voice or book."""


class Gone(NotFound):
    """The thing existed, but its file has been removed (an output after its retention)."""


class Conflict(WavefarmError):
    """The request is well formed but does not fit the current state; the message says what it found."""


class FeaturesMissing(WavefarmError):
    """The feature store has no entry for a voice (never prepared, expired or evicted)."""


class ModelLoadError(WavefarmError):
    """A model folder is missing a file or holds something unsupported; names the file."""


class EngineFailure(WavefarmError):
    """The engine failed one job; other jobs go on."""


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line only (a library's error can run to pages), or its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
