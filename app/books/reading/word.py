"""DOCX (Word) -> `SourceBook`: chapters at headings, read with python-docx.

- Chapters at paragraphs styled "Heading 1" (with one "Heading 1" over several "Heading 2", the
  "Heading 2"s, as in Markdown); a "Title" paragraph is the book's title. Tables, headers, footers and
  comments are not read.
- Title, author, description and language from the document's core properties (title, author,
  subject, language); for the tags, an ISBN from its identifier (when the check digit holds) and genres
  from its category (separated by commas, '/' or ';'). Core properties hold no publisher or publication
  date (`created` is the file's, not the book's).
- Safety, as for an EPUB: the zip is checked from its central directory before anything is inflated
  (`app.books.reading.safezip`: entries, sizes, ratios); every part is then read (a bad CRC refuses the
  document), and a part that declares a DTD or an entity, whatever its name and encoding, refuses it;
  python-docx's parser never resolves entities either.
"""

from __future__ import annotations

import io
import re

from app.books.reading.blocks import chapters_at_headings
from app.books.reading.publication import Publication, genres_of, isbn_of, split_genre_list
from app.books.reading.safezip import SafeArchive
from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, finish_book
from app.errors import BadInput

_DECLARATION_RE = re.compile(rb"<\s*!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_HEADING_RE = re.compile(r"heading\s*([1-6])", re.IGNORECASE)


def parse_docx(data: bytes, *, title: str | None = None, author: str | None = None,
               language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    archive = SafeArchive(data, limits, kind="DOCX")
    for name in archive.zip.namelist():  # every part, whatever its name: each is read (and CRC-checked)
        if declares_dtd(archive.read(name)):
            raise BadInput(f"the DOCX part {name!r} declares a DTD or an entity; refused (nothing is "
                           "expanded)")
    try:
        document = docx.Document(io.BytesIO(data))
    except (PackageNotFoundError, KeyError, ValueError) as exc:
        raise BadInput(f"not a readable DOCX: {type(exc).__name__}: {str(exc)[:200]}") from exc
    blocks: list[tuple[int, str]] = []
    book_title = ""
    for paragraph in document.paragraphs:
        text = " ".join(paragraph.text.split())
        if not text:
            continue
        style = (paragraph.style.name if paragraph.style is not None else "") or ""
        if style.lower() == "title" and not book_title:
            book_title = text
            continue
        heading = _HEADING_RE.fullmatch(style.strip())
        blocks.append((int(heading.group(1)) if heading else 0, text))
    core = document.core_properties
    book_title = title or book_title or " ".join((core.title or "").split())
    return finish_book(SourceBook(
        chapters=tuple(chapters_at_headings(blocks, book_title)), title=book_title or "Untitled",
        author=author or " ".join((core.author or "").split()),
        language=language or (core.language or "").strip() or "en",
        description=" ".join((core.subject or "").split()),
        publication=Publication(isbn=isbn_of(core.identifier or "", "isbn"),
                                genres=genres_of(split_genre_list(core.category or "")))), limits=limits)


_ENCODINGS = ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


def declares_dtd(content: bytes) -> bool:
    """A DOCTYPE or ENTITY declaration in a part, in any encoding the XML parser behind python-docx
    (libxml2) reads: found in the bytes as each of them, and asked of libxml2 itself (with entities and
    DTDs off), so neither a part's name nor its encoding hides one."""
    for encoding in _ENCODINGS:
        if _DECLARATION_RE.search(content.decode(encoding, errors="ignore").encode("utf-8", "ignore")):
            return True
    return _libxml2_sees_dtd(content)


def _libxml2_sees_dtd(content: bytes) -> bool:
    from lxml import etree

    parser = etree.XMLParser(resolve_entities=False, load_dtd=False, no_network=True, huge_tree=False)
    try:
        root = etree.fromstring(content, parser)
    except (etree.XMLSyntaxError, ValueError):
        return False  # not XML that libxml2 reads: python-docx cannot read it either
    info = root.getroottree().docinfo
    return bool(info.doctype) or info.internalDTD is not None or info.externalDTD is not None
