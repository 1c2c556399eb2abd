"""A whole book's outputs in one folder, reusing every chapter file whose inputs have not changed.

    out_dir/chapter-001.flac (+ .json)  ...  book.m4b (+ .json)  chapters.json  chapters.vtt
            chapter-001.mp3 (+ .json) ...        with mp3=True
            book.epub (+ .json), readalong/chapter-001.m4a (+ .json) ...   with a read-along text
            metadata.json, cover.jpg|png                                  for Audiobookshelf

Each chapter file has a sidecar naming its *recipe* - the sha256 of its segments' content keys and
pauses and of the assembly options - and the segment timings. The sidecar is removed before the
audio is replaced and written after it, so after a crash at any point a file is either described
correctly or re-assembled. Re-running after an interruption, or after an edit to one paragraph,
re-assembles only the chapters whose recipe changed; the M4B (and each MP3) is re-encoded only when
its chapters, a title, the tags or the cover changed; so is each read-along chapter's M4A, and the
EPUB is written again only when one of them, its text or its metadata changed. Files of chapters that
no longer exist are removed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import soundfile as sf

from app.books.files import chapter_file_name
from app.books.planning.plan import BookPlan, PlanChapter, canonical_json
from app.books.planning.readalong import ChapterText, ReadAlong
from app.books.writing.assemble import (
    BookTags,
    ChapterAudio,
    SegmentTiming,
    assemble_chapter,
    write_m4a,
    write_m4b,
    write_mp3,
)
from app.books.writing.encoding import DEFAULT_ENCODING, Encoding
from app.books.writing.index import write_index
from app.books.writing.loudness import DEFAULT_TARGET_LUFS, FADE_MS, Loudness
from app.books.writing.readalong_epub import EpubMeta, write_epub3
from app.books.writing.readalong_epub_source import write_source_epub3
from app.books.writing.shelf import write_shelf_files
from app.speech import SAMPLE_RATE, OutputFormat
from app.storage.artifacts import write_text

_CHAPTER_FILE_RE = re.compile(r"chapter-\d{3,}\.(wav|flac|mp3)(\.json)?")


@dataclass(frozen=True)
class BookAudio:
    chapters: tuple[ChapterAudio, ...]
    m4b: Path | None
    mp3s: tuple[Path, ...]
    index_json: Path
    index_vtt: Path
    reused: tuple[int, ...]  # chapter indices taken as they were
    m4b_reused: bool
    mp3s_reused: tuple[int, ...] = ()
    epub: Path | None = None
    epub_reused: bool = False
    m4as_reused: tuple[int, ...] = ()


def chapter_recipe(chapter: PlanChapter, *, fmt: str, sample_rate: int, target_lufs: float | None,
                   timed: bool = False) -> str:
    recipe: dict[str, Any] = {
        "v": 2, "segments": [[s.key, s.pause_after_ms] for s in chapter.segments],
        "fmt": fmt, "sample_rate": sample_rate, "target_lufs": target_lufs, "fade_ms": FADE_MS}
    if timed:
        recipe["timed"] = [s.start_ms for s in chapter.segments]
    return hashlib.sha256(canonical_json(recipe)).hexdigest()


def render_chapter(chapter: PlanChapter, audio: Mapping[str, Path], out_dir: Path, *, fmt: str,
                   sample_rate: int = SAMPLE_RATE,
                   target_lufs: float | None = DEFAULT_TARGET_LUFS, timed: bool = False) -> ChapterAudio:
    """Assemble one chapter file from its rendered segments, with the sidecar that lets `assemble_book`
    reuse it while its inputs stay the same."""
    path = out_dir / chapter_file_name(chapter.index, fmt)
    recipe = chapter_recipe(chapter, fmt=fmt, sample_rate=sample_rate, target_lufs=target_lufs, timed=timed)
    _sidecar(path).unlink(missing_ok=True)
    done = assemble_chapter(chapter, audio, path, fmt=fmt, sample_rate=sample_rate, target_lufs=target_lufs,
                            timed=timed)
    write_text(_sidecar(path), json.dumps(_describe(done, recipe)))
    return done


@dataclass(frozen=True)
class BookOutput:
    """What a book's folder holds and how it is encoded: the chapter files' format, rate and loudness,
    the M4B, the MP3s, cue timing, the cover, the notes in chapters.json, and a read-along text (each
    chapter's shown text, `app.books.planning.readalong`) for an EPUB 3."""

    fmt: str = OutputFormat.FLAC
    sample_rate: int = SAMPLE_RATE
    target_lufs: float | None = DEFAULT_TARGET_LUFS
    m4b: bool = True
    mp3: bool = False
    timed: bool = False
    cover: bytes | None = None
    cover_type: str | None = None
    readalong: ReadAlong | Sequence[ChapterText] | None = None
    notes: Sequence[str] = ()
    encoding: Encoding = DEFAULT_ENCODING


def assemble_book(plan: BookPlan, audio: Mapping[str, Path], out_dir: Path, *,
                  output: BookOutput = BookOutput()) -> BookAudio:
    """Chapter files, the M4B and the index for `plan`; `audio` maps segment keys to rendered files.
    With a read-along text a read-along EPUB 3 too. The M4B, the MP3s and the EPUB's audio are encoded
    as `output.encoding` says (recorded in chapters.json)."""
    fmt, sample_rate, target_lufs, timed = output.fmt, output.sample_rate, output.target_lufs, output.timed
    cover, cover_type, encoding, notes = output.cover, output.cover_type, output.encoding, output.notes
    out_dir.mkdir(parents=True, exist_ok=True)
    chapters, reused = [], []
    for chapter in plan.chapters:
        path = out_dir / chapter_file_name(chapter.index, fmt)
        recipe = chapter_recipe(chapter, fmt=fmt, sample_rate=sample_rate, target_lufs=target_lufs,
                                timed=timed)
        done = _reuse_chapter(chapter, path, recipe)
        if done is None:
            done = render_chapter(chapter, audio, out_dir, fmt=fmt, sample_rate=sample_rate,
                                  target_lufs=target_lufs, timed=timed)
        else:
            reused.append(chapter.index)
        chapters.append(done)
    tags = BookTags(plan.title, plan.author, plan.narrator, plan.description, tuple(notes), plan.series,
                    plan.series_part, plan.language, plan.publication)
    book, m4b_reused = None, False
    if output.m4b:
        book = out_dir / "book.m4b"
        m4b_reused = _write_m4b_once(tags, chapters, book, cover=cover, cover_type=cover_type,
                                     encoding=encoding)
    mp3s: list[Path] = []
    mp3s_reused: list[int] = []
    for done in chapters if output.mp3 else []:
        path = out_dir / chapter_file_name(done.index, "mp3")
        if _write_mp3_once(tags, done, path, tracks=len(chapters), cover=cover, cover_type=cover_type,
                           encoding=encoding):
            mp3s_reused.append(done.index)
        mp3s.append(path)
    index_json, index_vtt = out_dir / "chapters.json", out_dir / "chapters.vtt"
    described = output.m4b or output.mp3 or output.readalong
    index = write_index(chapters, index_json, index_vtt, title=plan.title, author=plan.author, notes=notes,
                        encoding=encoding.describe(sample_rate, mp3=output.mp3) if described else None)
    write_shelf_files(out_dir, plan, index, cover=cover, cover_type=cover_type)
    _remove_stale(out_dir, {c.path.name for c in chapters} | {p.name for p in mp3s})
    epub, epub_reused, m4as_reused = None, False, tuple[int, ...]()
    if output.readalong is not None:
        epub = out_dir / "book.epub"
        readalong = output.readalong
        if not isinstance(readalong, ReadAlong):
            readalong = ReadAlong(tuple(readalong))
        epub_reused, m4as_reused = _write_epub_once(plan, readalong, chapters, epub, cover=cover,
                                                    cover_type=cover_type, encoding=encoding)
    return BookAudio(tuple(chapters), book, tuple(mp3s), index_json, index_vtt, tuple(reused), m4b_reused,
                     tuple(mp3s_reused), epub, epub_reused, m4as_reused)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _describe(chapter: ChapterAudio, recipe: str) -> dict[str, Any]:
    return {"recipe": recipe, "sample_rate": chapter.sample_rate, "samples": chapter.samples,
            "segments": [[s.key, s.text, s.start, s.end] for s in chapter.segments],
            "loudness": chapter.loudness.as_dict(digits=None) if chapter.loudness else None}


def _reuse_chapter(chapter: PlanChapter, path: Path, recipe: str) -> ChapterAudio | None:
    """The finished chapter file at `path` if its sidecar names the same recipe, else None."""
    try:
        described = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        frames = sf.info(str(path)).frames
        if (described["recipe"], described["samples"]) != (recipe, frames):
            return None
        segments = tuple(SegmentTiming(k, text, start, end) for k, text, start, end in described["segments"])
        rate = int(described["sample_rate"])
        return ChapterAudio(chapter.index, chapter.title, path, rate, frames, segments,
                            _loudness(described.get("loudness")))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError):  # missing, unreadable, not audio
        return None


def _loudness(described: dict[str, Any] | None) -> Loudness | None:
    if not described:
        return None
    def db(name: str) -> float:
        value = described.get(name)
        return -math.inf if value is None else float(value)
    return Loudness(db("integrated_lufs"), db("true_peak_dbtp"), float(described.get("gain_db") or 0.0))


def _encoded_recipe(tags: BookTags, chapters: list[ChapterAudio], cover: bytes | None,
                    cover_type: str | None, **more: Any) -> str:
    return hashlib.sha256(canonical_json({
        "v": 2, "tags": asdict(tags), "cover_type": cover_type,
        "cover": hashlib.sha256(cover).hexdigest() if cover else None,
        "chapters": [[c.title, json.loads(_sidecar(c.path).read_text(encoding="utf-8"))["recipe"]]
                     for c in chapters], **more,
    })).hexdigest()


def _up_to_date(path: Path, recipe: str) -> bool:
    try:
        described = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        return path.is_file() and described.get("recipe") == recipe
    except (OSError, ValueError):
        return False


def _write_m4b_once(tags: BookTags, chapters: list[ChapterAudio], book: Path, *, cover: bytes | None,
                    cover_type: str | None, encoding: Encoding) -> bool:
    """Encode the M4B unless the one there was made from the same chapters, metadata and encoding."""
    aac = [encoding.bitrate_kbps, encoding.sample_rate]
    recipe = _encoded_recipe(tags, chapters, cover, cover_type, **_encoded_as(aac))
    if _up_to_date(book, recipe):
        return True
    _sidecar(book).unlink(missing_ok=True)
    write_m4b(chapters, book, tags=tags, cover=cover, cover_type=cover_type,
              bitrate=encoding.bitrate_kbps * 1000, sample_rate=encoding.sample_rate)
    write_text(_sidecar(book), json.dumps({"recipe": recipe}))
    return False


def _write_mp3_once(tags: BookTags, chapter: ChapterAudio, path: Path, *, tracks: int, cover: bytes | None,
                    cover_type: str | None, encoding: Encoding) -> bool:
    """Encode the chapter's MP3 unless the one there was made from the same file, tags, track and
    encoding."""
    recipe = _encoded_recipe(tags, [chapter], cover, cover_type, track=[chapter.index + 1, tracks],
                             **_encoded_as([encoding.mp3_bitrate_kbps, encoding.sample_rate]))
    if _up_to_date(path, recipe):
        return True
    _sidecar(path).unlink(missing_ok=True)
    write_mp3(chapter, path, tags=tags, track=(chapter.index + 1, tracks), cover=cover,
              cover_type=cover_type, bitrate=encoding.mp3_bitrate_kbps * 1000,
              sample_rate=encoding.sample_rate)
    write_text(_sidecar(path), json.dumps({"recipe": recipe}))
    return False


def _encoded_as(settings: list[int | None]) -> dict[str, Any]:
    """The encoder settings in a recipe, left out at the defaults so files made before them are reused."""
    return {} if settings == [DEFAULT_ENCODING.bitrate_kbps, None] else {"encoder": settings}


def _write_epub_once(plan: BookPlan, readalong: ReadAlong, chapters: list[ChapterAudio],
                     epub: Path, *, cover: bytes | None, cover_type: str | None,
                     encoding: Encoding) -> tuple[bool, tuple[int, ...]]:
    """Each chapter's M4A unless the one there was made from the same chapter file, then the EPUB unless
    it was made from the same M4As, text and metadata. Returns (EPUB reused, M4As reused)."""
    folder = epub.parent / "readalong"
    m4as, reused = [], []
    for chapter in chapters:
        path = folder / f"chapter-{chapter.index + 1:03d}.m4a"
        recipe = _encoded_recipe(BookTags(""), [chapter], None, None, kind="m4a",
                                 **_encoded_as([encoding.bitrate_kbps, encoding.sample_rate]))
        if _up_to_date(path, recipe):
            reused.append(chapter.index)
        else:
            _sidecar(path).unlink(missing_ok=True)
            write_m4a(chapter, path, bitrate=encoding.bitrate_kbps * 1000, sample_rate=encoding.sample_rate)
            write_text(_sidecar(path), json.dumps({"recipe": recipe}))
        m4as.append(path)
    for path in folder.iterdir():  # M4As of chapters an earlier, longer version had
        if path.name.removesuffix(".json") not in {p.name for p in m4as}:
            path.unlink(missing_ok=True)
    meta = EpubMeta(plan.title, plan.author, plan.language, plan.key, plan.narrator, plan.description,
                    plan.publication)
    recipe = _encoded_recipe(BookTags(""), chapters, cover, cover_type, kind="epub3", meta=asdict(meta),
                             text=[t.to_dict() for t in readalong.texts], source=readalong.source)
    if _up_to_date(epub, recipe):
        return True, tuple(reused)
    _sidecar(epub).unlink(missing_ok=True)
    if readalong.source is not None and readalong.skeleton is not None:
        write_source_epub3(epub, meta=meta, described=readalong.source, skeleton=readalong.skeleton,
                           chapters=chapters, audio=m4as, titles=[t.title for t in readalong.texts])
    else:
        write_epub3(epub, meta=meta, texts=readalong.texts, chapters=chapters, audio=m4as, cover=cover,
                    cover_type=cover_type)
    write_text(_sidecar(epub), json.dumps({"recipe": recipe}))
    return False, tuple(reused)


def _remove_stale(out_dir: Path, current: set[str]) -> None:
    """Chapter files (and sidecars) left from an earlier, longer version of the book or another format."""
    for path in out_dir.iterdir():
        name = path.name.removesuffix(".json")
        if _CHAPTER_FILE_RE.fullmatch(path.name) and name not in current:
            path.unlink(missing_ok=True)
