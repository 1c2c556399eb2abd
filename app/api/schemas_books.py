"""The book bodies of the HTTP API (pydantic): the JSON request with an inline manifest, and a book's
progress as answered, built from `app.books.status`'s view. The shared fields are `app.api.schemas`'."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema

from app.api.schemas import SEED_MAX, OutputFormatField, StorableStr
from app.books.writing.loudness import DEFAULT_TARGET_LUFS
from app.broker.wire import MAX_PRIORITY
from app.quality.report import GateMode
from app.speech import OutputFormat

if TYPE_CHECKING:  # annotations only: a client command does not load SQLAlchemy and Alembic for them
    from app.books.status import BookStatusView


QUALITY_HELP = ("the quality gate: on (hear each segment, render a failing one again, report), report (hear "
                "and report only, never render again) or off (not heard)")


# Its schema inline, as OutputFormatField's (an enum $ref would not resolve in the published form body).
GateModeField = Annotated[GateMode, WithJsonSchema({"type": "string", "enum": [m.value for m in GateMode]})]


class BookRequest(BaseModel):
    """POST /v1/books as JSON: a manifest of speech tokens inline. Text and EPUB books: multipart."""

    model_config = ConfigDict(extra="forbid")

    voice_id: StorableStr = Field(min_length=1, max_length=64,
                                  description="a voice's id, name or unique id prefix")
    manifest: dict[str, Any] = Field(description='{"title", "chapters": [{"title", "segments": '
                                                 '[{"tokens": [...]}]}]}')
    output_format: OutputFormatField = OutputFormat.FLAC
    m4b: bool = True
    mp3: bool = Field(False, description="an MP3 per chapter too, with ID3 tags")
    timed: bool = Field(False, description="subtitle books: each cue's speech at its start time")
    epub3: bool = Field(False, description="a read-along EPUB 3 (a manifest has no text: refused)")
    bitrate_kbps: StrictInt = Field(64, description="the M4B's AAC bitrate, kbit/s "
                                                                "(app.books.writing.encoding)")
    mp3_bitrate_kbps: StrictInt = Field(64, description="the MP3s' constant bitrate, kbit/s")
    sample_rate: StrictInt | None = Field(None, description="of the M4B and MP3s; null: the render's own")
    series: str | None = Field(None, max_length=500, description="for the tags and metadata.json")
    series_part: str | None = Field(None, max_length=20, description="the book's place in it: 1, 2.5 ...")
    preview_s: float | None = Field(None, description="a preview: the first chosen chapter's first seconds")
    narrator: str | None = Field(None, max_length=500, description="for the tags; default: the manifest's")
    publisher: str | None = Field(None, description="for the tags and metadata.json (Audiobookshelf)")
    year: StrictInt | str | None = Field(None, description="publication year, 4 digits (the tags' date)")
    isbn: str | None = Field(None, description="ISBN-10 or ISBN-13, hyphens allowed; its check digit is "
                             "checked")
    genres: list[str] | None = Field(None, description="genres (none: 'Audiobook' in the genre tag); each "
                                     "without '/' or ';'")
    description: str | None = Field(None, max_length=10_000, description="for the tags")
    lexicon: dict[str, Any] | None = Field(None, description='pronunciation: {"words": {...}, "patterns": '
                                           '[...]} (docs/BOOKS.md)')
    cast: dict[str, str] | None = Field(None, description="voices for the names the text's markup uses: "
                                        "name -> voice id (a manifest book has no markup)")
    target_lufs: float | None = Field(DEFAULT_TARGET_LUFS, ge=-70, le=-5,
                                      description="chapter loudness (LUFS); null: measured, not normalised")
    seed: StrictInt = Field(0, ge=0, le=SEED_MAX,
                            description="fixed by default, so rendering the book again resumes it")
    priority: StrictInt = Field(0, ge=0, le=MAX_PRIORITY,
                                description="of the segment jobs; 0 (default) yields to every other job")
    chapters: str | None = Field(None, min_length=1, max_length=1000,
                                 description="render only these chapters, counted from 1: e.g. 3-7,12")
    quality: GateModeField = Field(GateMode.ON, description=QUALITY_HELP)


class ChapterOut(BaseModel):
    index: int
    title: str
    segments_total: int
    segments_done: int
    audio_seconds: float = Field(description="speech rendered so far")
    est_seconds: float = Field(description="planned speech (an estimate until rendered)")
    eta_s: float | None
    seconds: float | None = Field(description="length of the assembled chapter file")
    loudness_lufs: float | None = Field(description="integrated loudness of the assembled file (ITU-R "
                                        "BS.1770-4), after normalisation")
    true_peak_dbtp: float | None = Field(description="its true peak (oversampled to 192 kHz)")
    file_url: str | None


class BookOut(BaseModel):
    id: str
    voice_id: str
    status: str = Field(description="parsing (stored, a CPU worker reads it) | queued | rendering | "
                        "assembling | succeeded | failed | cancelled")
    title: str
    author: str
    narrator: str = Field(description="for the players' tags (composer)")
    series: str = Field("", description="for the tags and metadata.json (Audiobookshelf)")
    series_part: str = Field("", description="the book's place in its series")
    publisher: str = Field("", description="for the tags and metadata.json (Audiobookshelf)")
    year: str = Field("", description="publication year (the tags' date)")
    isbn: str = Field("", description="digits only (an ISBN-10 may end in X)")
    genres: list[str] = Field(default_factory=list, description="the genre tag's, joined by ';'")
    description: str
    cast: dict[str, str] = Field(description="the voices the text's markup names (folded name -> voice id)")
    language: str
    output_format: str
    m4b: bool
    mp3: bool
    timed: bool
    epub3: bool = Field(description="a read-along EPUB 3 (book.epub) beside the M4B")
    bitrate_kbps: int = Field(description="the M4B's (and the read-along EPUB's) AAC bitrate, kbit/s")
    mp3_bitrate_kbps: int = Field(description="the MP3s' constant bitrate, kbit/s")
    sample_rate: int | None = Field(description="of the M4B and MP3s; null: the render's own (24000)")
    target_lufs: float | None = Field(description="chapter loudness target (LUFS); null: measured only")
    priority: int
    quality: str = Field("on", description=QUALITY_HELP)
    chapters_selected: str | None = Field(description="the chapters of the source this render holds "
                                          "(e.g. 3-7,12); null: all of them")
    segments_total: int = Field(description="distinct segments (a repeated sentence renders once)")
    segments_done: int
    audio_seconds: float = Field(description="speech rendered so far: the segments' own audio, without the "
                                 "pauses between them (so shorter than `seconds`)")
    seconds: float | None = Field(description="the book's length with its pauses, as the M4B and "
                                  "chapters.json give it; null until every chapter is assembled")
    notes: list[str] = Field(description="how the audio was made, when not by the real model (dummy "
                             "weights, the stand-in tokenizer): such audio is not speech")
    est_seconds: float
    eta_s: float | None
    submitted_at: datetime
    parse_lane: str = Field("quick", description="quick (a first reading, within a small budget) or long "
                            "(read again with the full limits, a few such books at a time)")
    parse_wait_s: float = Field(0.0, description="seconds it waited for its reading to begin (so far)")
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    chapters: list[ChapterOut]
    files: dict[str, str] = Field(description="file name -> download URL")

    @classmethod
    def of(cls, view: BookStatusView) -> BookOut:
        b = view.book
        base = f"/v1/books/{b.id}/files/"
        chapters = [ChapterOut(index=c.index, title=c.title, segments_total=c.segments_total,
                               segments_done=c.segments_done, audio_seconds=round(c.audio_seconds, 2),
                               est_seconds=round(c.est_seconds, 2), eta_s=c.eta_s, seconds=c.seconds,
                               loudness_lufs=c.loudness_lufs, true_peak_dbtp=c.true_peak_dbtp,
                               file_url=base + c.file if c.file else None) for c in view.chapters]
        return cls(id=b.id, voice_id=b.voice_id, status=b.status, title=b.title, author=b.author,
                   narrator=view.narrator, description=view.description, cast=view.cast,
                   series=view.series, series_part=view.series_part,
                   publisher=view.publication.publisher, year=view.publication.year,
                   isbn=view.publication.isbn, genres=list(view.publication.genres),
                   language=b.language, output_format=b.output_format, m4b=b.m4b, mp3=b.mp3, timed=b.timed,
                   epub3=b.epub3, bitrate_kbps=b.bitrate_kbps, mp3_bitrate_kbps=b.mp3_bitrate_kbps,
                   sample_rate=b.sample_rate,
                   target_lufs=b.target_lufs, priority=b.priority, quality=b.quality,
                   chapters_selected=b.chapters_selected, segments_total=view.segments_total,
                   segments_done=view.segments_done,
                   audio_seconds=round(view.audio_seconds, 2), seconds=view.seconds, notes=view.notes,
                   est_seconds=round(b.est_seconds, 2),
                   eta_s=view.eta_s, submitted_at=b.submitted_at, parse_lane=b.parse_lane,
                   parse_wait_s=view.parse_wait_s, started_at=b.started_at,
                   finished_at=b.finished_at, error=b.error, chapters=chapters,
                   files={name: base + name for name in view.files})
