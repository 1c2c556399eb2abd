"""HTML -> `SourceBook`: chapters at headings, text from the blocks, with Python's lenient HTML parser.

Chapters as in Markdown: with one `<h1>` over several `<h2>`, the `<h2>`s; otherwise the top heading
level used. Title from `<title>` (else the `<h1>`), author and description from `<meta name="author">`
and `<meta name="description">`, language from `<html lang>`. Scripts, styles, navigation, forms and
figures' media are not read. The parser knows HTML's named character references and never a declared
entity (there is no DTD processing at all); a page whose DOCTYPE carries a subset or declares an
entity is refused, as an EPUB is.
"""

from __future__ import annotations

from app.books.reading.blocks import BlockText, chapters_at_headings
from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, decode_text, finish_book
from app.errors import BadInput

_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
_BLOCKS = {"p", "div", "li", "blockquote", "section", "article", "br", "tr", "dd", "dt", "figcaption", "pre",
           "aside", "header", "footer", "hr", "table", "main", "td", "th", *_HEADINGS}
_SKIPPED = {"script", "style", "head", "nav", "template", "noscript", "svg", "math", "form", "button",
            "select", "textarea", "iframe", "object", "audio", "video", "canvas"}


class _PageParser(BlockText):
    """Collects (heading level or 0, text) blocks in order, and the page's metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[tuple[int, str]] = []
        self.meta: dict[str, str] = {}
        self.language = ""
        self._level = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "html" and values.get("lang"):
            self.language = values["lang"]
        if tag == "meta" and values.get("name", "").lower() in ("author", "description"):
            self.meta[values["name"].lower()] = " ".join(values.get("content", "").split())
        if tag in _SKIPPED or tag == "title":
            self.skip(title=tag == "title")
            return
        if tag in _BLOCKS:
            self.flush()
            self._level = _HEADINGS.get(tag, 0)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _SKIPPED:
            self.handle_starttag(tag, attrs)

    def handle_decl(self, decl: str) -> None:
        if "[" in decl or "entity" in decl.lower():
            raise BadInput("the HTML page declares a DTD subset or an entity; refused (nothing is expanded)")

    def unknown_decl(self, data: str) -> None:
        if "entity" in data.lower():
            raise BadInput("the HTML page declares an entity; refused (nothing is expanded)")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED or tag == "title":
            self.unskip()
        elif tag in _BLOCKS:
            self.flush()

    def emit(self, text: str) -> None:
        self.blocks.append((self._level, text))
        self._level = 0

    def flush(self) -> None:
        super().flush()
        self._level = 0


def parse_html(data: bytes, *, title: str | None = None, author: str | None = None,
               language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    parser = _PageParser()
    parser.feed(decode_text(data, limits, what="HTML page"))
    parser.close()
    return finish_book(SourceBook(
        chapters=tuple(chapters_at_headings(parser.blocks, " ".join(parser.title.split()))),
        title=title or " ".join(parser.title.split()) or _first_heading(parser.blocks),
        author=author or parser.meta.get("author", ""), language=language or parser.language or "en",
        description=parser.meta.get("description", "")), limits=limits)


def _first_heading(blocks: list[tuple[int, str]]) -> str:
    return next((text for level, text in blocks if level), "")
