"""Several voices in one book: a cast (names -> stored voices) and the markup that names them in the text.

Markup, in plain text, Markdown and EPUB text alike (`docs/BOOKS.md`, "Several voices"):

    {voice: Alice}        the passage from here to the next switch (or the chapter's end) is Alice's
    {voice: narrator}     back to the book's own voice; `{/voice}` says the same
    {Bob}"Stop!" he said  the quotation right after the tag is Bob's; the rest of the passage keeps
                          its voice ("he said" is the narrator's, or the passage's voice)

Names are matched regardless of case and spacing; `narrator` is the book's voice (`--voice`). A name
the cast does not map refuses the book at submission, with every such name and where it first occurs.
Braces that do not look like a tag (`{` without a name and `}`) are text.

The cast maps names to voice ids: JSON or YAML, `{"Alice": "<64 hex>", ...}`. The CLI also takes a
reference audio file as a value and uploads it first (`app.cli.books`), so the service only ever sees ids.

`split_runs` turns one paragraph into (voice name, text) runs; the plan gives each run's segments the
voice's id, which is part of their content key: re-casting one character re-renders only their lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from app.errors import BadInput

NARRATOR = "narrator"
MAX_BYTES = 64 * 1024
MAX_VOICES = 64
MAX_NAME_CHARS = 80
_VOICE_ID_RE = re.compile(r"[0-9a-f]{64}")
_NAME = r"[^\W\d_][\w .'-]{0,79}?"  # a letter first; words, spaces, dots, apostrophes, hyphens
_TAG_RE = re.compile(
    rf"\{{\s*(?:(?P<close>/\s*voice)|voice\s*:\s*(?P<passage>{_NAME})|(?P<quote>{_NAME}))\s*\}}",
    re.IGNORECASE)
_QUOTES = {'"': '"', "\u201c": "\u201d", "\u201e": "\u201c", "\u00ab": "\u00bb", "\u2018": "\u2019", "'": "'"}


def fold(name: str) -> str:
    return " ".join(name.split()).casefold()


@dataclass
class VoiceState:
    """The passage voice, carried from one paragraph to the next within a chapter."""

    passage: str = NARRATOR


def split_runs(paragraph: str, state: VoiceState) -> list[tuple[str, str]]:
    """One paragraph -> [(folded voice name, text)] in order, markup removed; empty runs dropped.

    A `{Name}` tag not followed by an opening quote is refused (BadInput): it would name nothing."""
    runs: list[tuple[str, str]] = []
    pos = 0
    for tag in _TAG_RE.finditer(paragraph):
        if tag.start() < pos:
            continue  # inside a quotation already given to a voice
        runs.append((state.passage, paragraph[pos:tag.start()]))
        pos = tag.end()
        if tag.group("close"):
            state.passage = NARRATOR
        elif tag.group("passage"):
            state.passage = fold(tag.group("passage"))
        else:
            rest = paragraph[pos:]
            stripped = rest.lstrip()
            opening = stripped[:1]
            if opening in _QUOTES:
                start = pos + len(rest) - len(stripped)
                end = paragraph.find(_QUOTES[opening], start + 1)
                end = len(paragraph) if end < 0 else end + 1
                runs.append((fold(tag.group("quote")), paragraph[start:end]))
                pos = end
            else:
                raise BadInput(f"{tag.group(0)!r} must come right before a quotation "
                               f"({tag.group(0)}\"...\"); for a passage write "
                               f"{{voice: {tag.group('quote')}}}: "
                               f"...{paragraph[max(0, tag.start() - 30):tag.end() + 30]}...")
    runs.append((state.passage, paragraph[pos:]))
    merged: list[tuple[str, str]] = []
    for voice, text in runs:
        text = " ".join(text.split())
        if not text:
            continue
        if merged and merged[-1][0] == voice:
            merged[-1] = (voice, f"{merged[-1][1]} {text}")
        else:
            merged.append((voice, text))
    return merged


def parse_cast(data: bytes | str | Mapping[str, Any], *, allow_files: bool = False,
               what: str = "the cast") -> dict[str, str]:
    """JSON or YAML (or parsed data) -> {folded name: voice id} (or, with `allow_files`, a file path for
    the CLI to upload). BadInput with the reason."""
    doc = _load(data, what) if isinstance(data, (bytes, str)) else data
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise BadInput(f"{what} must map names to voices: {{\"Alice\": \"<voice id>\", ...}}")
    if len(doc) > MAX_VOICES:
        raise BadInput(f"{what} has {len(doc)} voices; the limit is {MAX_VOICES}")
    cast: dict[str, str] = {}
    for name, voice in doc.items():
        if not isinstance(name, str) or not re.fullmatch(_NAME, name.strip()) or len(name) > MAX_NAME_CHARS:
            raise BadInput(f"{what}: {str(name)[:40]!r} is not a name (a letter first, then letters, "
                           f"digits, spaces, . ' -; at most {MAX_NAME_CHARS} characters)")
        if fold(name) == NARRATOR:
            raise BadInput(f"{what}: 'narrator' is the book's own voice (--voice / voice_id), not a "
                           "cast entry")
        usable = isinstance(voice, str) and (_VOICE_ID_RE.fullmatch(voice) or (allow_files and voice.strip()))
        if not usable:
            hint = "; quote it: YAML read it as a number" if isinstance(voice, (int, float)) else ""
            raise BadInput(f"{what}: the voice of {name!r} must be a stored voice's id (64 hex digits)"
                           + (" or a reference audio file" if allow_files else "") + hint)
        if fold(name) in cast:
            raise BadInput(f"{what} names {name!r} twice")
        cast[fold(name)] = voice
    return cast


def _load(data: bytes | str, what: str) -> Any:
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_BYTES:
        raise BadInput(f"{what} is {len(raw)} bytes; the limit is {MAX_BYTES}")
    try:
        text = raw.decode("utf-8-sig")
        return json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except UnicodeDecodeError:
        raise BadInput(f"{what} is not UTF-8 text") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise BadInput(f"{what} is neither JSON nor YAML: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise BadInput(f"{what} is nested too deeply (a cast is one mapping of names to voices)") from None


def check_cast(used: Mapping[str, str], cast: Mapping[str, str]) -> None:
    """`used`: folded name -> where it first occurs; BadInput naming every one the cast lacks."""
    missing = [f"{name!r} ({where})" for name, where in used.items() if name not in cast]
    if missing:
        known = ", ".join(sorted(cast)) or "none"
        raise BadInput(f"the book names voices the cast does not map: {', '.join(missing)}; the cast has "
                       f"{known} (send a cast: --cast / the 'cast' field)")
