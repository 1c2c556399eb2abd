"""An EPUB's table of contents -> (path in the zip, fragment or None, title) per entry, in reading order:
from the EPUB 3 navigation document (`<nav epub:type="toc">`) or the EPUB 2 NCX. Reads documents already
taken out of the zip and decoded (`app.books.reading.epub`); opens no file.
"""

from __future__ import annotations

import posixpath
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from urllib.parse import unquote

TocEntry = tuple[str, str | None, str]  # (path in the zip, fragment or None, title)


def split_href(base: str, target: str) -> tuple[str, str | None]:
    """A link in the document at `base` -> (the path it names in the zip, its fragment or None)."""
    path, _, fragment = unquote(target).partition("#")
    return posixpath.normpath(posixpath.join(posixpath.dirname(base), path)), fragment or None


def nav_entries(nav_path: str, xhtml: str) -> list[TocEntry]:
    """The titled links of the navigation document at `nav_path` inside its toc `<nav>`."""
    parser = _NavParser()
    parser.feed(xhtml)
    return [(*split_href(nav_path, target), title) for target, title in parser.entries if title]


def ncx_entries(ncx_path: str, ncx: ET.Element, namespace: str) -> list[TocEntry]:
    """The titled navPoints of the NCX at `ncx_path` (`namespace`: the NCX's XML namespace)."""
    ns = {"ncx": namespace}
    entries: list[TocEntry] = []
    for point in ncx.iter(f"{{{namespace}}}navPoint"):  # document order == reading order
        label = point.find("ncx:navLabel/ncx:text", ns)
        content = point.find("ncx:content", ns)
        if label is not None and content is not None and content.get("src"):
            title = " ".join((label.text or "").split())
            entries.append((*split_href(ncx_path, content.get("src", "")), title))
    return [e for e in entries if e[2]]


class _NavParser(HTMLParser):
    """Collects (href, text) of the links inside `<nav epub:type="toc">`, in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.entries: list[tuple[str, str]] = []
        self._nav_depth = 0
        self._link: list[str] | None = None
        self._target = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "nav":
            in_toc = self._nav_depth > 0 or "toc" in (a.get("epub:type") or "").split()
            self._nav_depth += 1 if in_toc else 0
        elif tag == "a" and self._nav_depth and a.get("href"):
            self._link, self._target = [], a.get("href") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav" and self._nav_depth:
            self._nav_depth -= 1
        elif tag == "a" and self._link is not None:
            self.entries.append((self._target, " ".join("".join(self._link).split())))
            self._link = None

    def handle_data(self, data: str) -> None:
        if self._link is not None:
            self._link.append(data)
