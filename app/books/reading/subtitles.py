"""Subtitles (SRT, WebVTT) -> `SourceBook`: one chapter, one segment per cue, each cue's start kept.

SRT is read with `srt`, WebVTT with `webvtt-py`. A cue's markup (<i>, <b>, positions) is dropped; a
WebVTT voice span (`<v Alice>`) becomes the cue's voice, as `{voice: Alice}` would (`app.books.planning.cast`:
the cast maps it). Each cue renders as one segment (a cue over the segment length limit is cut at
clauses), so a dubbing or an audio description follows the subtitles' lines.

With `timed` output (`BookOptions.timed`), the chapter file places each cue's speech at its start
time, silence filling the gaps; speech longer than its slot pushes the next cues later (the shift is
recorded in chapters.json as each segment's start), and is never cut or sped up.
"""

from __future__ import annotations

import io
import re
from datetime import timedelta

from app.books.reading.source import (
    DEFAULT_LIMITS,
    BookLimits,
    SourceBook,
    SourceChapter,
    decode_text,
    finish_book,
)
from app.errors import BadInput

_TAG_RE = re.compile(r"<[^>]*>|\{\\[^}]*\}")  # HTML-like tags and SSA override blocks such as {\an8}
_VTT_TIME_RE = re.compile(r"(?:(\d+):)?(\d{1,2}):(\d{2})\.(\d{3})")


def parse_subtitles(data: bytes, *, fmt: str, title: str | None = None, author: str | None = None,
                    language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    """`fmt` "srt" or "vtt" -> a one-chapter book of cues."""
    text = decode_text(data, limits, what="subtitle file")
    cues = _vtt(text) if fmt == "vtt" else _srt(text)
    cues = [(start, line) for start, line in cues if line]
    if not cues:
        raise BadInput("the subtitle file has no cues with text")
    if len(cues) > limits.max_segments:
        raise BadInput(f"the subtitle file has {len(cues)} cues; the limit is {limits.max_segments}")
    cues.sort(key=lambda c: c[0])
    chapter = SourceChapter(title or "Subtitles", tuple(line for _, line in cues),
                            starts_ms=tuple(start for start, _ in cues))
    return finish_book(SourceBook(
        chapters=(chapter,), title=title or "Subtitles", author=author or "",
        language=language or "en"), limits=limits)


def _srt(text: str) -> list[tuple[int, str]]:
    import srt

    try:
        return [(_ms(s.start), _clean(s.content)) for s in srt.parse(text)]
    except (srt.SRTParseError, ValueError, OverflowError) as exc:
        raise BadInput(f"not a valid SRT file: {str(exc)[:200]}") from exc


def _vtt(text: str) -> list[tuple[int, str]]:
    import webvtt
    from webvtt.errors import MalformedFileError

    try:
        captions = webvtt.from_buffer(io.StringIO(text))
    except (MalformedFileError, ValueError, IndexError, OverflowError) as exc:
        raise BadInput(f"not a valid WebVTT file: {str(exc)[:200]}") from exc
    out = []
    for caption in captions.captions:
        line = _clean(caption.text)
        voice = " ".join((caption.voice or "").split())
        if voice and line:
            line = f"{{voice: {voice}}} {line} {{/voice}}"
        out.append((_vtt_ms(caption.start), line))
    return out


def _clean(text: str) -> str:
    return " ".join(_TAG_RE.sub("", text).split())


def _ms(value: timedelta) -> int:
    return max(0, round(value.total_seconds() * 1000))


def _vtt_ms(stamp: str) -> int:
    match = _VTT_TIME_RE.fullmatch(stamp.strip())
    if match is None:
        raise BadInput(f"not a valid WebVTT time: {stamp[:40]!r}")
    hours, minutes, seconds, millis = (int(g or 0) for g in match.groups())
    return ((hours * 60 + minutes) * 60 + seconds) * 1000 + millis
