"""What a client asked for when it submitted a book, kept beside the upload until a CPU worker reads it.

    BookOptions       how the book renders (format, M4B, MP3s, timing, loudness, seed, priority)
    Submission        the options and the request's own fields (title, language, chapters ...);
                      `check()` is everything the API decides without reading the book
    BookRequest       a submission with its voice, lexicon and cast: what `accept_book` takes
    SubmittedFiles    where the upload and its companions lie in the book's folder

The API stores the upload as it arrives (`source`), the request as `request.json`, and a lexicon or
cast sent with it as they came (`lexicon`, `cast`): none of them is parsed in the API. A CPU worker
reads them in a bounded child process (`app.books.intake_child`, run by `app.books.intake`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.books.planning.select import parse_chapters
from app.books.reading.parse import FORMATS, check_file_type
from app.books.reading.publication import check_publication
from app.books.reading.source import (
    DEFAULT_LIMITS,
    BookLimits,
    PublicationFields,
    check_language_tag,
    check_xml_text,
)
from app.books.writing.encoding import DEFAULT_KBPS, Encoding
from app.books.writing.loudness import DEFAULT_TARGET_LUFS
from app.broker import wire
from app.errors import BadInput
from app.quality.report import GateMode
from app.speech import MAX_SEED, OutputFormat

_SERIES_PART_RE = re.compile(r"[^\s#]{1,20}")
DEFAULT_SEED = 0
DEFAULT_PREVIEW_S = 20.0
PREVIEW_PRIORITY = 5  # a preview's segments overtake a rendering book's (0) and wait behind urgent jobs
MAX_PREVIEW_S = 300.0  # a fixed seed: the same book rendered again has the same keys, so it resumes


@dataclass(frozen=True)
class BookOptions:
    output_format: str = OutputFormat.FLAC
    m4b: bool = True
    mp3: bool = False  # an MP3 per chapter too (ID3-tagged), beside the chapter files
    timed: bool = False  # subtitles: each cue's speech at its start time
    epub3: bool = False  # a read-along EPUB 3 (text, chapter audio, Media Overlays) beside the M4B
    target_lufs: float | None = DEFAULT_TARGET_LUFS  # None: chapters are measured, not normalised
    seed: int = DEFAULT_SEED
    priority: int = 0  # job priority of the segments (0..9, larger first); 0 yields to every other job
    bitrate_kbps: int = DEFAULT_KBPS  # the M4B's AAC (and the read-along EPUB's),
    # `app.books.writing.encoding`
    mp3_bitrate_kbps: int = DEFAULT_KBPS
    sample_rate: int | None = None  # of the M4B and MP3s; None: the render's own (24 kHz)
    series: str | None = None  # for the tags and metadata.json (Audiobookshelf): the series' name
    series_part: str | None = None  # and the book's place in it: "1", "2.5", "3a"
    preview_s: float | None = None  # a preview: the first chapter chosen, cut to about this many seconds
    quality: str = GateMode.ON  # the quality gate: on, report (never render again) or off (not heard)

    @property
    def encoding(self) -> Encoding:
        return Encoding(self.bitrate_kbps, self.mp3_bitrate_kbps, self.sample_rate)

    def check(self) -> None:
        if self.output_format not in tuple(OutputFormat):
            raise BadInput(f"book format {self.output_format!r} is not one of "
                           f"{[f.value for f in OutputFormat]} (the M4B comes with either)")
        if isinstance(self.priority, bool) or not 0 <= self.priority <= wire.MAX_PRIORITY:
            raise BadInput(f"priority must be an integer 0..{wire.MAX_PRIORITY}")
        if isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise BadInput("seed must be an integer 0..2**63-1")
        if self.target_lufs is not None and not -70.0 <= self.target_lufs <= -5.0:
            raise BadInput("target loudness must be between -70 and -5 LUFS")
        self.encoding.check()
        if self.series is not None and not 0 < len(self.series.strip()) <= 500:
            raise BadInput("series must be 1 to 500 characters")
        if self.series_part is not None and not _SERIES_PART_RE.fullmatch(self.series_part):
            raise BadInput(f"series_part {self.series_part[:40]!r} must be 1 to 20 characters without spaces "
                           "or '#' (e.g. 1, 2.5, 3a): Audiobookshelf reads it after a '#'")
        if self.preview_s is not None and not 1.0 <= self.preview_s <= MAX_PREVIEW_S:
            raise BadInput(f"a preview is 1 to {MAX_PREVIEW_S:g} seconds long")
        if self.series_part is not None and self.series is None:
            raise BadInput("series_part needs a series")
        if self.quality not in tuple(GateMode):
            raise BadInput(f"quality {str(self.quality)[:40]!r} is not one of {[m.value for m in GateMode]}: "
                           "on (hear, render failures again, report), report (hear and report only) or off")


def target_lufs_field(text: str | None) -> float | None:
    """A target loudness as a form or the CLI gives it: absent or empty is the default, "off" (or "none")
    turns normalisation off, anything else is a number of LUFS."""
    if text is None or not text.strip():
        return DEFAULT_TARGET_LUFS
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise BadInput(f"target loudness must be a number of LUFS or 'off', not {text!r}") from None


@dataclass(frozen=True)
class Submission:
    """A book request without its files. Fields left None come from the book itself."""

    options: BookOptions = field(default_factory=BookOptions)
    filename: str | None = None
    book_format: str | None = None  # None: sniffed from the upload's first bytes and its name
    title: str | None = None
    author: str | None = None
    language: str | None = None
    narrator: str | None = None
    description: str | None = None
    publisher: str | None = None  # these four for the tags and metadata.json
    # (`app.books.reading.publication`)
    year: str | None = None
    isbn: str | None = None
    genres: list[str] | None = None
    chapters: str | None = None  # "3-7,12" (`app.books.planning.select`)
    base_dir: str | None = None  # CLI `--local` only: the folder a manifest's audio files are read from

    def check(self, limits: BookLimits = DEFAULT_LIMITS) -> None:
        """What can be refused without reading the book: options, format name, field lengths, the
        language tag's spelling and the chapter selection's."""
        self.options.check()
        for name, text in self._texts():
            check_xml_text(text, name)
        if self.options.epub3 and self.book_format == "manifest":
            raise BadInput("a manifest of tokens or audio has no text to read along; epub3 needs a text book")
        if self.book_format is not None and self.book_format not in FORMATS:
            raise BadInput(f"book format {self.book_format!r} is not one of {', '.join(FORMATS)}")
        if self.book_format is None:  # the file's name chooses the reader: one there is
            check_file_type(self.filename)
        for what, value, limit in (("title", self.title, limits.max_title_chars),
                                   ("author", self.author, limits.max_author_chars),
                                   ("narrator", self.narrator, limits.max_author_chars),
                                   ("description", self.description, limits.max_description_chars),
                                   ("file name", self.filename, 1000)):
            if value is not None and len(value) > limit:
                raise BadInput(f"the {what} is {len(value)} characters; the limit is {limit}")
        check_publication(publisher=self.publisher, year=self.year, isbn=self.isbn, genres=self.genres)
        if self.language is not None:
            check_language_tag(self.language)
        if self.chapters is not None:
            parse_chapters(self.chapters, limits.max_chapters)  # its spelling; the book's count comes later

    def _texts(self) -> list[tuple[str, str]]:
        """(field, value) of every text the request gives that a book's files or tags may carry."""
        given: list[tuple[str, str | None]] = [
            (name, getattr(self, name))
            for name in ("title", "author", "narrator", "description", "publisher", "year", "isbn",
                         "language", "chapters")]
        given += [("series", self.options.series), ("series_part", self.options.series_part),
                  ("file name", self.filename)]
        given += [("genres", genre) for genre in self.genres or ()]
        return [(name, value) for name, value in given if isinstance(value, str)]

    @property
    def publication(self) -> PublicationFields:
        return PublicationFields(self.publisher, self.year, self.isbn,
                                 None if self.genres is None else tuple(self.genres))

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Submission:
        data: dict[str, Any] = json.loads(text)
        return cls(**{**data, "options": BookOptions(**data["options"])})


@dataclass(frozen=True)
class BookRequest:
    """A book request with its voice and companions, as the API's body, the CLI or a script gives it
    (the book's bytes apart: they are streamed, never held here). A lexicon or cast is a JSON/YAML file's
    bytes or data parsed already (a JSON request's), read by the child that reads the book."""

    submission: Submission = field(default_factory=Submission)
    voice_id: str | None = None  # a stored voice (id, name or id prefix); or
    reference_bytes: bytes | None = None  # reference audio to make the voice from
    lexicon: bytes | Mapping[str, Any] | None = None  # `app.books.planning.lexicon`
    cast: bytes | Mapping[str, Any] | None = None  # `app.books.planning.cast`

    @property
    def lexicon_bytes(self) -> bytes | None:
        return _as_bytes(self.lexicon)

    @property
    def cast_bytes(self) -> bytes | None:
        return _as_bytes(self.cast)


def _as_bytes(data: bytes | Mapping[str, Any] | None) -> bytes | None:
    """A lexicon or cast as bytes (parsed data, from a JSON request, as JSON): read by the child."""
    if data is None or isinstance(data, bytes):
        return data
    return json.dumps(dict(data)).encode()


@dataclass(frozen=True)
class SubmittedFiles:
    """A submitted book's inputs in its folder (books/<id>/), as the API stored them."""

    folder: Path

    @property
    def source(self) -> Path:
        return self.folder / "source"

    @property
    def request(self) -> Path:
        return self.folder / "request.json"

    @property
    def lexicon(self) -> Path:
        return self.folder / "lexicon"

    @property
    def cast(self) -> Path:
        return self.folder / "cast"

    def remove_inputs(self) -> None:
        """The upload and its companions, once read (the request stays: it says what was asked)."""
        for path in (self.source, self.lexicon, self.cast):
            path.unlink(missing_ok=True)
