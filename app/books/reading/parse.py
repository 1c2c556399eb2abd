"""Book files -> `SourceBook`: plain text, Markdown, EPUB, HTML, PDF, DOCX, or a JSON manifest of speech
tokens.

`parse_book` picks the reader by `fmt` or sniffs it; the readers refuse with `BadInput` and a reason:
empty or binary input, non-UTF-8 text, over-size files or paragraphs, too many chapters, broken or
bomb-like EPUBs (`app.books.reading.epub`) and DOCX files (`app.books.reading.word`), PDFs without a text
layer (`app.books.reading.pdf`), malformed manifests (`app.books.reading.manifest`); HTML is
`app.books.reading.webpage`. What every reader shares (decoding text, the limits, finishing a book) is in
`app.books.reading.source`.

Plain text and Markdown are `app.books.reading.text`. Language is not detected: callers pass it (EPUBs
declare it), English by default.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.books.reading.epub import parse_epub
from app.books.reading.manifest import parse_manifest
from app.books.reading.pdf import parse_pdf
from app.books.reading.source import (
    DEFAULT_LIMITS,
    BookLimits,
    SourceBook,
)
from app.books.reading.subtitles import parse_subtitles
from app.books.reading.text import parse_markdown, parse_text
from app.books.reading.webpage import parse_html
from app.books.reading.word import parse_docx
from app.errors import BadInput

_HTML_START_RE = re.compile(rb"\s*<(!doctype html|html)[\s>]", re.IGNORECASE)
FORMATS = ("text", "markdown", "epub", "html", "pdf", "docx", "srt", "vtt", "manifest")
# The file names each reader takes; another extension is refused at submission (a file without one is text).
SUFFIXES = (".txt", ".text", ".md", ".markdown", ".epub", ".html", ".htm", ".xhtml", ".pdf", ".docx", ".srt",
            ".vtt", ".json")


def check_file_type(filename: str | None) -> None:
    """BadInput, with the supported extensions, for a file name whose extension no reader takes (an .rtf
    would otherwise be read as plain text, its control words as the title)."""
    suffix = Path(filename).suffix.lower() if filename else ""
    if suffix and suffix not in SUFFIXES:
        raise BadInput(f"a {suffix} file is not a book wavefarm reads; it reads {', '.join(SUFFIXES)} "
                       f"(or name the format: book_format, one of {', '.join(FORMATS)})")


def parse_book(data: bytes, *, fmt: str | None = None, filename: str | None = None, title: str | None = None,
               author: str | None = None, language: str | None = None, limits: BookLimits = DEFAULT_LIMITS,
               base_dir: Path | None = None) -> SourceBook:
    """Any supported book file -> SourceBook. `base_dir` (CLI only) lets a manifest name audio files."""
    fmt = fmt or sniff_format(data, filename)
    if fmt == "epub":
        return parse_epub(data, title=title, author=author, language=language, limits=limits)
    if fmt == "html":
        return parse_html(data, title=title, author=author, language=language, limits=limits)
    if fmt == "pdf":
        return parse_pdf(data, title=title, author=author, language=language, limits=limits)
    if fmt in ("srt", "vtt"):
        return parse_subtitles(data, fmt=fmt, title=title, author=author, language=language, limits=limits)
    if fmt == "docx":
        return parse_docx(data, title=title, author=author, language=language, limits=limits)
    if fmt == "manifest":
        return parse_manifest(data, limits=limits, base_dir=base_dir)
    if fmt == "markdown":
        return parse_markdown(data, title=title, author=author, language=language, limits=limits)
    if fmt == "text":
        return parse_text(data, title=title, author=author, language=language, limits=limits)
    raise BadInput(f"book format {fmt!r} is not one of {', '.join(FORMATS)}")


def sniff_format(data: bytes, filename: str | None = None) -> str:
    suffix = Path(filename).suffix.lower() if filename else ""
    if data.lstrip(b"\xef\xbb\xbf")[:5] == b"{\\rtf":  # whatever its name: control words are not text
        raise BadInput(f"the book is an RTF document, which wavefarm does not read; save it as one of "
                       f"{', '.join(SUFFIXES)}")
    if data[:5] == b"%PDF-" or suffix == ".pdf":
        return "pdf"
    if suffix == ".docx" or (data[:4] == b"PK\x03\x04" and b"word/document.xml" in data[:65536]):
        return "docx"
    if data[:4] == b"PK\x03\x04" or suffix == ".epub":
        return "epub"
    if suffix in (".html", ".htm", ".xhtml") or _HTML_START_RE.match(data[:1024]):
        return "html"
    if suffix == ".srt":
        return "srt"
    if suffix == ".vtt" or data.lstrip(b"\xef\xbb\xbf")[:6] == b"WEBVTT":
        return "vtt"
    if suffix in (".md", ".markdown"):
        return "markdown"
    if suffix == ".json" or data.lstrip()[:1] == b"{":
        return "manifest"
    return "text"


# --- plain text ----------------------------------------------------------------------------------
