"""PDF -> `SourceBook`: the text layer (pypdf), chapters from the outline, else from chapter headings.

- Chapters: the outline's top-level entries (or, when there is a single one over several below it, the
  entries below it), each running from its page to the next entry's; pages before the first entry are
  front matter. A PDF without an outline is read as plain text is (`app.books.reading.text.parse_text`): a
  short line such as "Chapter 3" starts a chapter.
- Paragraphs: a page's lines are joined; a line that ends a sentence and stops short of the page's
  usual line length ends a paragraph; a short line that ends no sentence (a heading) is a paragraph
  of its own; a word hyphenated across lines is joined. A chapter's first paragraph is dropped when it
  is the chapter's title (it is spoken as the title already).
- Title, author and description from the document information (Title, Author, Subject).
- Refused with the reason: not a PDF, broken, encrypted with a password (an empty user password, the
  "permissions only" kind, is opened), more than `BookLimits.max_pdf_pages` pages, no text layer
  (a scan: run OCR first). pypdf bounds what one stream may inflate to; the file size is bounded as
  an EPUB's is.
"""

from __future__ import annotations

import io
import re
from typing import Any

from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, SourceChapter, finish_book
from app.errors import BadInput

_SENTENCE_END = ('.', '!', '?', ':', '"', '\u201d', '\u2019', ')')
_HYPHENATED_RE = re.compile(r"(\w)-$")


def parse_pdf(data: bytes, *, title: str | None = None, author: str | None = None,
              language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, PyPdfError

    if len(data) > limits.max_epub_bytes:
        raise BadInput(f"the PDF is {len(data)} bytes; the limit is {limits.max_epub_bytes}")
    if not data.startswith(b"%PDF"):
        raise BadInput("not a PDF: the file does not start with %PDF")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise BadInput("the PDF is encrypted with a password; send one that opens without it")
        if len(reader.pages) > limits.max_pdf_pages:
            raise BadInput(f"the PDF has {len(reader.pages)} pages; the limit is {limits.max_pdf_pages}")
        texts = [page.extract_text() or "" for page in reader.pages]
        starts = _outline_starts(reader)
        info: Any = reader.metadata or {}
    except BadInput:
        raise
    except (PyPdfError, DependencyError, ValueError, KeyError, TypeError, IndexError, AttributeError,
            RecursionError, NotImplementedError, OverflowError) as exc:
        raise BadInput(f"not a readable PDF: {type(exc).__name__}: {str(exc)[:200]}") from exc
    if not any(t.strip() for t in texts):
        raise BadInput("the PDF has no text layer (a scanned book?): run OCR on it first")
    width = line_width(texts)
    pages = [paragraphs_of_page(text, width) for text in texts]
    book_title = title or _info(info, "/Title")
    book_author = author or _info(info, "/Author")
    description = _info(info, "/Subject")
    if not starts:
        from app.books.reading.text import parse_text  # a PDF without an outline reads as plain text does

        text = "\n\n".join(p for page in pages for p in page)
        book = parse_text(text.encode(), title=book_title or None, author=book_author, language=language,
                          limits=limits)
        return finish_book(SourceBook(
            chapters=book.chapters, title=book.title, author=book.author, language=book.language,
            description=description), limits=limits)
    chapters = [SourceChapter(book_title or "Front matter",
                              tuple(p for page in pages[:starts[0][0]] for p in page))]
    for i, (page, chapter_title) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(pages)
        body = [p for pg in pages[page:max(end, page + 1)] for p in pg]
        if body and _same(body[0], chapter_title):
            body = body[1:]
        chapters.append(SourceChapter(chapter_title, tuple(body)))
    return finish_book(SourceBook(
        chapters=tuple(chapters), title=book_title or "Untitled", author=book_author,
        language=language or "en", description=description), limits=limits)


def line_width(texts: list[str]) -> int:
    """The document's usual full line length: the 90th percentile of its lines' lengths (at least 40)."""
    lengths = sorted(len(" ".join(line.split())) for text in texts for line in text.splitlines()
                     if line.strip())
    return max(40, lengths[int(0.9 * (len(lengths) - 1))]) if lengths else 40


def paragraphs_of_page(text: str, width: int) -> list[str]:
    """A page's extracted lines -> paragraphs (see the module's notes); `width`: `line_width`'s."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    paragraphs: list[str] = []
    current = ""
    for line in lines:
        if not line:
            if current:
                paragraphs.append(current)
            current = ""
            continue
        heading = not line.endswith(_SENTENCE_END) and not line.endswith((",", ";", "-")) \
            and len(line) < 0.5 * width and len(line.split()) <= 10
        if heading:
            if current:
                paragraphs.append(current)
            paragraphs.append(line)
            current = ""
            continue
        if current and _HYPHENATED_RE.search(current):
            current = current[:-1] + line
        else:
            current = f"{current} {line}".strip()
        if line.endswith(_SENTENCE_END) and len(line) < 0.8 * width:
            paragraphs.append(current)
            current = ""
    if current:
        paragraphs.append(current)
    return paragraphs


def _outline_starts(reader: Any) -> list[tuple[int, str]]:
    """[(0-based page, title)] of the chapter-level outline entries, in page order."""
    outline = reader.outline or []
    top = [(entry, outline[i + 1] if i + 1 < len(outline) and isinstance(outline[i + 1], list) else [])
           for i, entry in enumerate(outline) if not isinstance(entry, list)]
    if len(top) == 1 and len([e for e in top[0][1] if not isinstance(e, list)]) > 1:
        top = [(e, []) for e in top[0][1] if not isinstance(e, list)]
    starts = []
    for entry, _ in top:
        page = reader.get_destination_page_number(entry)
        entry_title = " ".join(str(entry.title or "").split())
        if page is not None and page >= 0 and entry_title:
            starts.append((page, entry_title))
    return sorted(starts, key=lambda s: s[0])


def _same(a: str, b: str) -> bool:
    return re.sub(r"\W+", " ", a).strip().casefold() == re.sub(r"\W+", " ", b).strip().casefold()


def _info(info: Any, key: str) -> str:
    value = info.get(key) if hasattr(info, "get") else None
    return " ".join(str(value).split()) if value else ""
