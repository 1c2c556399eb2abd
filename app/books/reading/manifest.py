"""A JSON book manifest -> `SourceBook` whose chapters hold speech-token or source-audio items.

    {"title": "...", "author": "...", "language": "en",
     "chapters": [{"title": "One", "segments": [{"tokens": [12, 873, ...]}, {"audio": "one/002.flac"}]}]}

Two forms. Over the API (`base_dir=None`) a segment carries its speech tokens inline and nothing
else: a client never names a file on the server. From the CLI (`base_dir` = the manifest's folder)
a segment may instead name a source audio file to re-voice, by a relative path that must stay inside
that folder (no absolute paths, no `..` escape, symlinks resolved); the file's sha256 is recorded so
a plan's keys follow the audio's content, not its name. Unknown keys are refused, not ignored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from app.books.reading.source import (
    DEFAULT_LIMITS,
    BookLimits,
    SourceBook,
    SourceChapter,
    SourceItem,
    decode_text,
    finish_book,
)
from app.errors import BadInput, BadTokens
from app.speech import check_tokens

_BOOK_KEYS = {"title", "author", "narrator", "description", "language", "chapters", "format", "version"}
_CHAPTER_KEYS = {"title", "segments"}
_SEGMENT_KEYS = {"tokens", "audio"}


def parse_manifest(data: bytes, *, limits: BookLimits = DEFAULT_LIMITS,
                   base_dir: Path | None = None) -> SourceBook:
    try:
        doc = json.loads(decode_text(data, limits, what="manifest"))
    except json.JSONDecodeError as exc:
        raise BadInput(f"the manifest is not valid JSON: {exc.msg} at line {exc.lineno} "
                       f"column {exc.colno}") from exc
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, arrays nested 100000 deep
        raise BadInput(f"the manifest is not acceptable JSON: {type(exc).__name__}") from exc
    if not isinstance(doc, dict):
        raise BadInput("the manifest must be a JSON object with a 'chapters' list")
    _no_unknown(doc, _BOOK_KEYS, "the manifest")
    if doc.get("version", 1) != 1:
        raise BadInput(f"manifest version {doc.get('version')!r} is not supported (1 is)")
    chapters_in = doc.get("chapters")
    if not isinstance(chapters_in, list) or not chapters_in:
        raise BadInput("the manifest needs a non-empty 'chapters' list")
    if len(chapters_in) > limits.max_chapters:
        raise BadInput(f"the manifest has {len(chapters_in)} chapters; the limit is {limits.max_chapters}")
    chapters = [_chapter(c, i, limits, base_dir) for i, c in enumerate(chapters_in)]
    count = sum(len(c.items) for c in chapters)
    if count > limits.max_segments:
        raise BadInput(f"the manifest has {count} segments; the limit is {limits.max_segments}")
    return finish_book(SourceBook(
        chapters=tuple(chapters), title=_text(doc, "title", "Untitled"), author=_text(doc, "author", ""),
        language=_text(doc, "language", "en"), narrator=_text(doc, "narrator", ""),
        description=_text(doc, "description", "")), limits=limits)


def _chapter(raw: Any, index: int, limits: BookLimits, base_dir: Path | None) -> SourceChapter:
    where = f"chapter {index + 1}"
    if not isinstance(raw, dict):
        raise BadInput(f"{where} of the manifest is not an object")
    _no_unknown(raw, _CHAPTER_KEYS, where)
    segments = raw.get("segments")
    if not isinstance(segments, list) or not segments:
        raise BadInput(f"{where} needs a non-empty 'segments' list")
    items = tuple(_item(s, f"segment {j + 1} of {where}", limits, base_dir) for j, s in enumerate(segments))
    return SourceChapter(title=_text(raw, "title", f"Chapter {index + 1}"), items=items)


def _item(raw: Any, where: str, limits: BookLimits, base_dir: Path | None) -> SourceItem:
    if not isinstance(raw, dict):
        raise BadInput(f"{where} is not an object")
    _no_unknown(raw, _SEGMENT_KEYS, where)
    if ("tokens" in raw) == ("audio" in raw):
        raise BadInput(f"{where} needs exactly one of 'tokens' or 'audio'")
    if "tokens" in raw:
        return SourceItem(tokens=tuple(check_tokens(_token_list(raw["tokens"], where),
                                                    max_tokens=limits.max_segment_tokens, where=where)))
    if base_dir is None:
        raise BadInput(f"{where} names an audio file; manifests sent over the API carry speech tokens "
                       "inline only ('tokens')")
    path, digest = _audio_file(raw["audio"], where, base_dir, limits)
    return SourceItem(audio=path, audio_sha256=digest)


def _token_list(value: Any, where: str) -> list[Any]:
    """A JSON value that must be a list (a JSON object is iterable too, and is refused here)."""
    if not isinstance(value, list):
        raise BadTokens(f"{where}: 'tokens' must be a non-empty list of integers")
    return value


def _audio_file(value: Any, where: str, base_dir: Path, limits: BookLimits) -> tuple[str, str]:
    if not isinstance(value, str) or not value.strip():
        raise BadInput(f"{where}: 'audio' must be a relative file path")
    posix = PurePosixPath(value)
    if posix.is_absolute() or PureWindowsPath(value).is_absolute() or PureWindowsPath(value).drive \
            or ".." in posix.parts or "\\" in value:
        raise BadInput(f"{where}: audio path {value!r} must be relative to the manifest, without '..'")
    root = base_dir.resolve()
    path = (root / posix).resolve()
    if not path.is_relative_to(root):
        raise BadInput(f"{where}: audio path {value!r} leads outside the manifest's folder")
    if not path.is_file():
        raise BadInput(f"{where}: audio file {value!r} does not exist")
    size = path.stat().st_size
    if size > limits.max_audio_bytes:
        raise BadInput(f"{where}: audio file {value!r} is {size} bytes; "
                       f"the limit is {limits.max_audio_bytes}")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return posix.as_posix(), digest.hexdigest()


def _no_unknown(obj: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise BadInput(f"{where} has unknown keys {unknown}; allowed: {sorted(known)}")


def _text(obj: dict, key: str, default: str) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise BadInput(f"manifest field {key!r} must be a string")
    return value.strip() or default
