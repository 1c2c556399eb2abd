"""What every book reader produces and shares: `SourceBook`, the limits on client input, and the two
steps each reader ends with (decoding a text file, finishing a book: empty chapters dropped, limits and
language checked).

The readers (`parse` for text and Markdown, `epub`, `webpage`, `pdf`, `word`, `subtitles`, `manifest`)
import this module (and the markup readers `blocks`) and nothing of each other, except that a PDF
without an outline is read as plain text (`pdf` calls `parse.parse_text`); `parse.parse_book` picks
one by format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from app.books.reading.publication import Publication, check_isbn, check_year, clean_genres
from app.errors import BadInput
from app.speech import TOKEN_RATE

_BINARY_CONTROL_SHARE = 0.001  # more C0 control characters than this is not a text file
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0e-\x1f]")
# What XML 1.0 cannot hold (its Char production): the C0 controls but tab, line feed and carriage return,
# lone surrogates, U+FFFE and U+FFFF. A book's metadata and text end up in XML (the read-along EPUB's
# documents and package, the players' tags), so none of them may carry one: a request's fields are
# refused with the field's name (`check_xml_text`), a book's own are cleaned as it is read (`xml_text`).
_NOT_XML_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_LANGUAGE_RE = re.compile(r"[a-z]{2,3}(-[a-z0-9]{1,8}){0,3}")  # BCP 47, lower-cased


@dataclass(frozen=True)
class BookLimits:
    """What a client may send; the service passes values from its settings."""

    max_text_bytes: int = 16 * 1024 * 1024  # plain text, Markdown and manifests (War and Peace is 3.3 MB)
    max_epub_bytes: int = 64 * 1024 * 1024
    max_paragraph_chars: int = 100_000
    max_title_chars: int = 500  # a book's or a chapter's title (they are stored, shown and spoken)
    max_author_chars: int = 500  # the narrator too
    max_description_chars: int = 10_000
    max_chapters: int = 2_000
    max_segments: int = 200_000
    max_segment_tokens: int = TOKEN_RATE * 600  # a manifest item of at most 10 minutes
    max_audio_bytes: int = 200 * 1024 * 1024  # a manifest's source audio file (CLI only)
    max_pdf_pages: int = 5_000
    epub_max_entries: int = 10_000  # these four bound a DOCX's zip too
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
    starts_ms: tuple[int, ...] = ()  # subtitles: each paragraph is one cue, starting here; one segment each


@dataclass(frozen=True)
class SourceBook:
    title: str
    author: str
    language: str  # BCP 47 tag, lower case: "en", "en-gb", "de", "pt-br" ...
    chapters: tuple[SourceChapter, ...]
    cover: bytes | None = None
    cover_type: str | None = None  # "image/jpeg" or "image/png"
    narrator: str = ""  # for the players' tags (M4B, MP3); not spoken
    description: str = ""  # plain text, one paragraph per line
    publication: Publication = Publication()  # publisher, year, ISBN, genres: the tags; not spoken


@dataclass(frozen=True)
class PublicationFields:
    """What a request gives of a book's publication, each None where the book's own stands."""

    publisher: str | None = None
    year: str | None = None
    isbn: str | None = None
    genres: tuple[str, ...] | None = None

    def over(self, own: Publication) -> Publication:
        """`own` with the given fields in its place (checked: BadInput with the reason)."""
        return Publication(
            publisher=own.publisher if self.publisher is None else clean_line(self.publisher),
            year=own.year if self.year is None else check_year(self.year),
            isbn=own.isbn if self.isbn is None else check_isbn(self.isbn),
            genres=own.genres if self.genres is None else clean_genres(self.genres))


def with_metadata(book: SourceBook, *, narrator: str | None = None, description: str | None = None,
                  publication: PublicationFields | None = None,
                  limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    """The book with a narrator, description and publication details given by the request in place of
    its own."""
    if narrator is not None:
        book = replace(book, narrator=clean_line(narrator))
    if description is not None:
        book = replace(book, description=clean_description(description))
    if publication is not None:
        book = replace(book, publication=publication.over(book.publication))
    _check_length("the narrator", book.narrator, limits.max_author_chars)
    _check_length("the description", book.description, limits.max_description_chars)
    _check_length("the publisher", book.publication.publisher, limits.max_author_chars)
    return book


def xml_text(text: str) -> str:
    """`text` without the characters no XML document can hold (`_NOT_XML_RE`)."""
    return _NOT_XML_RE.sub("", text)


def check_xml_text(value: str, field: str) -> str:
    """`value`, or BadInput naming `field` and the first character no book file could hold."""
    found = _NOT_XML_RE.search(value)
    if found is not None:
        raise BadInput(f"{field} contains U+{ord(found.group()):04X} at position {found.start()}: a control "
                       "character (or a lone surrogate) that no EPUB, tag or metadata file can hold")
    return value


def clean_line(text: str) -> str:
    return " ".join(xml_text(text).split())


def clean_description(text: str) -> str:
    """Whitespace collapsed within lines, blank lines dropped: a description as players show it."""
    return "\n".join(line for line in (clean_line(raw) for raw in text.splitlines()) if line)


def decode_text(data: bytes, limits: BookLimits, what: str = "book") -> str:
    """Bytes of a text file -> str, refusing empty, over-size, binary and non-UTF-8 input."""
    if not data or not data.strip():
        raise BadInput(f"the {what} is empty")
    if len(data) > limits.max_text_bytes:
        raise BadInput(f"the {what} is {len(data)} bytes; the limit is {limits.max_text_bytes}")
    try:
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            text = data.decode("utf-16")
        else:
            text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(f"the {what} is not UTF-8 text (byte {exc.start} is invalid); "
                       "send UTF-8, Markdown or an EPUB") from exc
    controls = len(_CONTROL_RE.findall(text))
    if "\x00" in text or controls > _BINARY_CONTROL_SHARE * len(text):
        raise BadInput(f"the {what} looks like binary data, not text ({controls} control characters)")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def finish_book(book: SourceBook, *, limits: BookLimits) -> SourceBook:
    """A reader's book as it leaves the reader: empty chapters dropped, what XML cannot hold taken out (a
    text file may carry a few control characters), the language tag checked (empty: en), and the limits
    every reader shares checked."""
    chapters = [replace(c, title=xml_text(c.title), paragraphs=tuple(xml_text(p) for p in c.paragraphs))
                for c in book.chapters]
    title, author = xml_text(book.title), xml_text(book.author)
    kept = [c for c in chapters if c.paragraphs or c.items]
    for chapter in kept:
        if chapter.starts_ms and len(chapter.starts_ms) != len(chapter.paragraphs):
            raise ValueError("a chapter of cues has a start for each cue")
    if not any(c.paragraphs or c.items for c in kept):
        raise BadInput("the book has no text to read")
    if len(kept) > limits.max_chapters:
        raise BadInput(f"the book has {len(kept)} chapters; the limit is {limits.max_chapters}")
    _check_length("the book's title", title, limits.max_title_chars)
    _check_length("the book's author", author, limits.max_author_chars)
    for ci, chapter in enumerate(kept):
        _check_length(f"the title of chapter {ci + 1}", chapter.title, limits.max_title_chars)
        for pi, paragraph in enumerate(chapter.paragraphs):
            if len(paragraph) > limits.max_paragraph_chars:
                raise BadInput(f"paragraph {pi + 1} of chapter {ci + 1} ({chapter.title!r}) is "
                               f"{len(paragraph)} characters; the limit is {limits.max_paragraph_chars}")
    language = check_language_tag(book.language or "en")
    finished = replace(book, title=title.strip() or "Untitled", author=author.strip(), language=language,
                       chapters=tuple(kept), publication=_xml_publication(book.publication))
    return with_metadata(finished, narrator=book.narrator, description=book.description, limits=limits)


def _xml_publication(own: Publication) -> Publication:
    return replace(own, publisher=xml_text(own.publisher), genres=tuple(xml_text(g) for g in own.genres))


def check_language_tag(language: str) -> str:
    """A BCP 47 tag as a book or the request gives it -> lower case with hyphens; BadInput if it is not
    one (its spelling only: whether a guide voice speaks it is `app.text.guide_voice`'s question)."""
    tag = language.strip().lower().replace("_", "-")
    if not _LANGUAGE_RE.fullmatch(tag):
        raise BadInput(f"language {tag[:40]!r} is not a language tag such as 'en' or 'pt-br'")
    return tag


def _check_length(what: str, text: str, limit: int) -> None:
    """Refuse an over-long title or author, quoting only its start (it may be megabytes)."""
    text = text.strip()
    if len(text) > limit:
        raise BadInput(f"{what} is {len(text)} characters ({text[:40]!r}...); the limit is {limit}")
