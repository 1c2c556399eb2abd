"""The chapter index of an assembled book: JSON, and WebVTT with one cue per segment.

Chapters are on the book's timeline (the M4B's), segments both on their chapter file's timeline
(`start`, `end`) and on the book's (`book_start`, `book_end`); times in seconds, to the millisecond.
`duration` is the book's length with its pauses (the M4B's); `notes` say how the audio was made when it
is not the real model's (dummy weights, the stand-in tokenizer); `encoding` what the M4B (and the
read-along EPUB's audio) and the MP3s were encoded with (`app.books.writing.encoding`). Each chapter carries
its measured loudness as written (`integrated_lufs`, `true_peak_dbtp`, and the `gain_db` normalisation
applied; null for silence).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.books.writing.assemble import ChapterAudio
from app.storage.artifacts import write_text


def chapter_index(chapters: Sequence[ChapterAudio], *, title: str, author: str,
                  notes: Sequence[str] = (), encoding: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Chapters on the book's timeline; segments on their chapter file's and on the book's timeline."""
    out, offset = [], 0.0
    for chapter in chapters:
        out.append({"index": chapter.index, "title": chapter.title, "file": chapter.path.name,
                    "start": round(offset, 3), "end": round(offset + chapter.duration, 3),
                    "loudness": chapter.loudness.as_dict() if chapter.loudness else None,
                    "segments": [{"key": s.key, "text": s.text,
                                  "start": round(s.start, 3), "end": round(s.end, 3),
                                  "book_start": round(offset + s.start, 3),
                                  "book_end": round(offset + s.end, 3)} for s in chapter.segments]})
        offset += chapter.duration
    return {"title": title, "author": author, "duration": round(offset, 3), "notes": list(notes),
            "encoding": dict(encoding or {}), "chapters": out}


def webvtt(index: Mapping[str, Any]) -> str:
    """The index as WebVTT: one cue per segment on the book's timeline, a NOTE per chapter with its
    title as the book gives it (a heading's "Chapter 1: Arrival" is not prefixed again)."""
    lines = ["WEBVTT", ""]
    for chapter in index["chapters"]:
        lines += [f"NOTE {_vtt_text(chapter['title'])}", ""]
        for j, seg in enumerate(chapter["segments"]):
            text = seg["text"] or f"({chapter['title']}, segment {j + 1})"
            lines += [f"c{chapter['index'] + 1}-s{j + 1}",
                      f"{_vtt_time(seg['book_start'])} --> {_vtt_time(seg['book_end'])}", _vtt_text(text), ""]
    return "\n".join(lines)


def write_index(chapters: Sequence[ChapterAudio], json_path: Path, vtt_path: Path, *, title: str,
                author: str, notes: Sequence[str] = (),
                encoding: Mapping[str, Any] | None = None) -> dict[str, Any]:
    index = chapter_index(chapters, title=title, author=author, notes=notes, encoding=encoding)
    write_text(json_path, json.dumps(index, ensure_ascii=False, indent=1))
    write_text(vtt_path, webvtt(index))
    return index


def _vtt_time(seconds: float) -> str:
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    return f"{hours:02d}:{minutes:02d}:{ms // 1000:02d}.{ms % 1000:03d}"


def _vtt_text(text: str) -> str:
    return " ".join(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").split())
