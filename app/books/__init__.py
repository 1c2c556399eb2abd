"""Audiobooks, the pipeline-independent half: a book file in, chapter audio and an M4B out.

    parse        text, Markdown, EPUB or a JSON manifest -> `SourceBook` (chapters of paragraphs or items)
      epub         EPUB 2/3 reader (spine order, TOC titles, cover); safezip: its zip-bomb guards
      manifest     JSON manifest of speech tokens (API) or source audio files (CLI)
    text         English normalisation (numbers: `numbers`); sentence/paragraph segmentation with pauses
    plan         `SourceBook` -> `BookPlan` (chapters -> segments, each with a content key)
    guide_voice  espeak-ng speaks a segment's text at 16 kHz (the GPU worker tokenizes it)
    assemble     rendered segments -> chapter WAV/FLAC and one M4B with chapter markers
      index        the chapter index: JSON and WebVTT with segment timings
      output       `assemble_book`: all of it in one folder, reusing chapters whose inputs are unchanged

Languages: English text is normalised (numbers, ordinals, years, decimals, currency, common
abbreviations, punctuation). Text in any other language passes through unnormalised (Unicode and
whitespace clean-up only) and is split on sentence punctuation; the guide voice speaks it with the
espeak-ng voice named by the book's language.

Nothing here talks to Redis, the database, Celery or the GPU: `tasks/` adapts these functions.
Refusals of client input raise `app.errors.BadInput` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

SPEECH_VOCAB = 6561  # speech token ids 0..6560 (MODEL.md)
TOKENS_PER_SECOND = 25


@dataclass(frozen=True)
class BookLimits:
    """What a client may send; the service passes values from its settings."""

    max_text_bytes: int = 16 * 1024 * 1024  # plain text, Markdown and manifests (War and Peace is 3.3 MB)
    max_epub_bytes: int = 64 * 1024 * 1024
    max_paragraph_chars: int = 100_000
    max_chapters: int = 2_000
    max_segments: int = 200_000
    max_segment_tokens: int = 25 * 60 * 10  # a manifest item of at most 10 minutes
    max_audio_bytes: int = 200 * 1024 * 1024  # a manifest's source audio file (CLI only)
    epub_max_entries: int = 10_000
    epub_max_unpacked: int = 256 * 1024 * 1024  # all entries together, uncompressed
    epub_max_entry: int = 32 * 1024 * 1024
    epub_max_ratio: int = 100  # uncompressed / compressed, for entries over 1 MiB


DEFAULT_LIMITS = BookLimits()


@dataclass(frozen=True)
class SourceItem:
    """One manifest segment: speech tokens inline, or a source audio file to re-voice."""

    tokens: tuple[int, ...] | None = None
    audio: str | None = None  # path relative to the manifest, resolved inside its folder (CLI only)
    audio_sha256: str | None = None  # content of that file, so the plan key follows the audio


@dataclass(frozen=True)
class SourceChapter:
    title: str
    paragraphs: tuple[str, ...] = ()  # text books: raw paragraphs, not yet normalised
    items: tuple[SourceItem, ...] = ()  # manifests


@dataclass(frozen=True)
class SourceBook:
    title: str
    author: str
    language: str  # BCP 47 tag, lower case: "en", "en-gb", "de", "pt-br" ...
    chapters: tuple[SourceChapter, ...]
    cover: bytes | None = None
    cover_type: str | None = None  # "image/jpeg" or "image/png"
