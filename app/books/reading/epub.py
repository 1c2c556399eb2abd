"""EPUB 2/3 -> `SourceBook`: chapters in spine order, titled from the table of contents.

The table of contents is the EPUB 3 navigation document (`nav.xhtml`, `<nav epub:type="toc">`) or,
failing that, the EPUB 2 `toc.ncx`. Every TOC entry starts a chapter: at its file, or at the element
its `#fragment` names inside a file. Spine documents without an entry continue the chapter before
them (front matter before the first entry becomes chapters titled by the document's `<title>`).
Cover image (JPEG/PNG) and dc:title, dc:creator, dc:language are read from the package document, and
for the tags dc:publisher, the year of dc:date, an ISBN dc:identifier (its opf:scheme, an `urn:isbn:` or
`isbn:` prefix, or an EPUB 3 `identifier-type` refinement; one whose check digit fails is left out) and
dc:subject as genres (`app.books.reading.publication`).

The zip goes through `app.books.reading.safezip` (zip bombs refused before inflating). The XML files
(container, package document, NCX, encryption.xml) are parsed by `defusedxml` after expat has decoded them, so
in any encoding and anywhere in the file: an entity declaration, an external reference or a DTD internal
subset is refused (nothing is ever expanded); a bare `<!DOCTYPE ncx PUBLIC ...>`, which EPUB 2 NCX files
carry, is accepted and its DTD never loaded. XHTML goes through html.parser (lenient, knows only HTML's own
named entities, never a declared one).
Not supported: DRM-encrypted books, fixed-layout text in images, reading text from SVG.
"""

from __future__ import annotations

import posixpath
import re
import xml.etree.ElementTree as ET
from urllib.parse import unquote

import defusedxml
import defusedxml.ElementTree as SafeET

from app.books.reading.blocks import BlockText
from app.books.reading.epub_toc import TocEntry, nav_entries, ncx_entries
from app.books.reading.publication import opf_publication
from app.books.reading.safezip import SafeArchive
from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, SourceChapter, finish_book
from app.errors import BadInput

NS = {"c": "urn:oasis:names:tc:opendocument:xmlns:container", "opf": "http://www.idpf.org/2007/opf",
      "dc": "http://purl.org/dc/elements/1.1/", "ncx": "http://www.daisy.org/z3986/2005/ncx/"}
_BLOCKS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "blockquote", "section", "article",
           "br", "tr", "dd", "dt", "figcaption", "pre", "aside", "header", "footer", "hr", "table"}
_SKIPPED = {"script", "style", "head", "title", "rt", "rp", "svg", "math", "nav", "template"}
_COVER_TYPES = {"image/jpeg", "image/png"}

def parse_epub(data: bytes, *, title: str | None = None, author: str | None = None,
               language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    archive = SafeArchive(data, limits)
    opf_path = _rootfile(_xml(archive.read("META-INF/container.xml"), "container.xml"))
    opf = _xml(archive.read(opf_path), opf_path)
    base = posixpath.dirname(opf_path)
    items = {i.get("id"): i for i in opf.iterfind("opf:manifest/opf:item", NS) if i.get("id")}
    href = {k: posixpath.normpath(posixpath.join(base, unquote(i.get("href", "")))) for k, i in items.items()}
    spine_el = opf.find("opf:spine", NS)
    if spine_el is None:
        raise BadInput(f"EPUB package {opf_path} has no spine (reading order)")
    readable = {k for k, i in items.items() if "html" in (i.get("media-type") or "")}  # not SVG pages
    spine = list(dict.fromkeys(href[r.get("idref")] for r in spine_el.iterfind("opf:itemref", NS)
                               if r.get("idref") in readable and r.get("linear", "yes") != "no"))
    _refuse_drm(archive, spine)
    toc = _nav_toc(archive, items, href) or _ncx_toc(archive, spine_el.get("toc"), href)
    chapters = _chapters(archive, spine, toc)
    cover, cover_type = _cover(archive, opf, items, href)
    return finish_book(SourceBook(
        chapters=tuple(chapters), title=title or _dc(opf, "title") or "Untitled",
        author=author or _author(opf), language=language or _dc(opf, "language") or "en", cover=cover,
        cover_type=cover_type, narrator=_narrator(opf), description=_description(opf),
        publication=opf_publication(opf)), limits=limits)


class _NoDtdParser(SafeET.DefusedXMLParser):
    """defusedxml's parser (no entity declarations, no external references), refusing a DTD internal
    subset too: a DOCTYPE may name its DTD (EPUB 2 NCX files do) but never declare anything."""

    def __init__(self) -> None:
        super().__init__(target=ET.TreeBuilder())
        self.parser.StartDoctypeDeclHandler = self._refuse_subset

    @staticmethod
    def _refuse_subset(name: str, sysid: str | None, pubid: str | None, has_internal_subset: bool) -> None:
        if has_internal_subset:
            raise defusedxml.DTDForbidden(name, sysid, pubid)


def _xml(content: bytes, name: str) -> ET.Element:
    parser = _NoDtdParser()
    try:
        parser.feed(content)
        root: ET.Element = parser.close()
        return root
    except defusedxml.DefusedXmlException as exc:
        raise BadInput(f"EPUB file {name!r} declares XML entities or a DTD ({type(exc).__name__}); "
                       "refused") from exc
    except ET.ParseError as exc:
        raise BadInput(f"not a valid EPUB: {name!r} is not well-formed XML ({exc})") from exc


_XML_ENCODING_RE = re.compile(rb"""^\s*<\?xml[^>]{0,200}encoding=["']([A-Za-z0-9._-]{1,40})["']""")


def _decode(content: bytes) -> str:
    """XHTML bytes -> str in the encoding its XML declaration names (UTF-8 when none or unknown)."""
    declared = _XML_ENCODING_RE.match(content)
    encoding = declared.group(1).decode() if declared else "utf-8"
    try:
        return content.decode(encoding, "replace")
    except LookupError:
        return content.decode("utf-8", "replace")


def _refuse_drm(archive: SafeArchive, spine: list[str]) -> None:
    """Encrypted content documents cannot be read (font obfuscation alone is fine and common)."""
    if not archive.has("META-INF/encryption.xml"):
        return
    root = _xml(archive.read("META-INF/encryption.xml"), "META-INF/encryption.xml")
    encrypted = {posixpath.normpath(unquote(ref.get("URI", ""))) for ref in root.iter()
                 if ref.tag.endswith("CipherReference")}
    if encrypted & set(spine):
        raise BadInput("the EPUB is DRM-protected (its chapters are encrypted); send a DRM-free book")


def _rootfile(container: ET.Element) -> str:
    root = container.find("c:rootfiles/c:rootfile", NS)
    if root is None or not root.get("full-path"):
        raise BadInput("not a valid EPUB: META-INF/container.xml names no package document")
    return posixpath.normpath(unquote(root.get("full-path", "")))


def _dc(opf: ET.Element, name: str) -> str:
    el = opf.find(f"opf:metadata/dc:{name}", NS)
    return " ".join((el.text or "").split()) if el is not None else ""


def _people(opf: ET.Element, *tags: str) -> list[tuple[str, str]]:
    """(MARC relator code, name) of each dc:<tag>, in order: EPUB 2's opf:role attribute or EPUB 3's
    <meta refines="#id" property="role">; "" when none is given."""
    refined = {(m.get("refines") or "").lstrip("#"): (m.text or "").strip().lower()
               for m in opf.iterfind("opf:metadata/opf:meta", NS) if m.get("property") == "role"}
    people = []
    for tag in tags:
        for el in opf.iterfind(f"opf:metadata/dc:{tag}", NS):
            role = el.get(f"{{{NS['opf']}}}role") or refined.get(el.get("id") or "", "")
            people.append((role.strip().lower(), " ".join((el.text or "").split())))
    return [(role, name) for role, name in people if name]


def _author(opf: ET.Element) -> str:
    """The first dc:creator not marked as another role (a narrator, an illustrator ...)."""
    creators = _people(opf, "creator")
    return next((name for role, name in creators if role in ("", "aut")), creators[0][1] if creators else "")


def _narrator(opf: ET.Element) -> str:
    return ", ".join(dict.fromkeys(name for role, name in _people(opf, "creator", "contributor")
                                   if role == "nrt"))


def _description(opf: ET.Element) -> str:
    """dc:description as plain text: publishers often put escaped HTML in it."""
    el = opf.find("opf:metadata/dc:description", NS)
    if el is None or not (el.text or "").strip():
        return ""
    parser = _TextParser()
    parser.feed(el.text or "")
    parser.close()
    return "\n".join(text for kind, text in parser.events if kind == "para")


# --- table of contents (`app.books.reading.epub_toc` reads the documents) ------------------------

def _nav_toc(archive: SafeArchive, items: dict, href: dict) -> list[TocEntry]:
    nav_id = next((k for k, i in items.items() if "nav" in i.get("properties", "").split()), None)
    if nav_id is None:
        return []
    return nav_entries(href[nav_id], _decode(archive.read(href[nav_id])))


def _ncx_toc(archive: SafeArchive, toc_id: str | None, href: dict) -> list[TocEntry]:
    if not toc_id or toc_id not in href:
        return []
    return ncx_entries(href[toc_id], _xml(archive.read(href[toc_id]), href[toc_id]), NS["ncx"])


# --- content documents ---------------------------------------------------------------------------

class _TextParser(BlockText):
    """XHTML -> events: ("anchor", id) where an element with an id starts, ("para", text) per block."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED:
            self.skip(title=tag == "title")
            return
        if tag in _BLOCKS:
            self.flush()
        anchor = dict(attrs).get("id") or (dict(attrs).get("name") if tag == "a" else None)
        if anchor and not self.skipping:
            self.flush()
            self.events.append(("anchor", anchor))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _SKIPPED:
            self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self.unskip()
        elif tag in _BLOCKS:
            self.flush()

    def emit(self, text: str) -> None:
        self.events.append(("para", text))


def _chapters(archive: SafeArchive, spine: list[str], toc: list[TocEntry]) -> list[SourceChapter]:
    by_doc: dict[str, list[tuple[str | None, str]]] = {}
    for path, fragment, title in toc:
        by_doc.setdefault(path, []).append((fragment, title))
    chapters: list[tuple[str, list[str]]] = []
    for path in spine:
        parser = _TextParser()
        parser.feed(_decode(archive.read(path)))
        parser.close()
        entries = by_doc.get(path, [])
        anchors = {value for kind, value in parser.events if kind == "anchor"}
        starts = {f: t for f, t in entries if f and f in anchors}
        whole = next((t for f, t in entries if f is None or f not in anchors), None)
        if whole is not None or not chapters:
            chapters.append((whole or " ".join(parser.title.split()) or "Front matter", []))
        for kind, value in parser.events:
            if kind == "anchor" and value in starts:
                chapters.append((starts.pop(value), []))
            elif kind == "para":
                chapters[-1][1].append(value)
    return [SourceChapter(title, tuple(_drop_heading(title, paras))) for title, paras in chapters]


def _drop_heading(title: str, paragraphs: list[str]) -> list[str]:
    """The chapter's own heading is usually its first paragraph(s); the title is spoken already."""
    key = re.sub(r"\W+", " ", title).strip().lower()
    while paragraphs and (found := re.sub(r"\W+", " ", paragraphs[0]).strip().lower()) and found in key:
        paragraphs = paragraphs[1:]
    return paragraphs


def _cover(archive: SafeArchive, opf: ET.Element, items: dict, href: dict) -> tuple[bytes | None, str | None]:
    cover_id = next((k for k, i in items.items() if "cover-image" in i.get("properties", "").split()), None)
    if cover_id is None:
        meta = next((m for m in opf.iterfind("opf:metadata/opf:meta", NS) if m.get("name") == "cover"), None)
        cover_id = meta.get("content") if meta is not None else None
    item = items.get(cover_id)
    if item is None or item.get("media-type") not in _COVER_TYPES:
        return None, None
    return archive.read(href[cover_id]), item.get("media-type")
