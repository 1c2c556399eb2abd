"""A read-along EPUB 3: the book's text, its chapter audio and a Media Overlay per content document, in
one zip that EPUB readers with Media Overlays (Thorium, Readest, BookFusion, Apple Books) play while
highlighting each segment as it is spoken.

    book.epub
      mimetype                          stored first, uncompressed (OCF)
      META-INF/container.xml
      OEBPS/package.opf                 metadata (title, author, narrator, language, publisher, year,
                                        ISBN, subjects, media:duration per overlay and in all,
                                        media:active-class), manifest (each chapter
                                        document with its media-overlay), spine
      OEBPS/nav.xhtml                   table of contents
      OEBPS/style.css                   the active class's highlight
      OEBPS/text/chapter-001.xhtml ...  `app.books.writing.overlay.content_document`
      OEBPS/smil/chapter-001.smil ...   `app.books.writing.overlay.overlay_document`
      OEBPS/audio/chapter-001.m4a ...   AAC in MP4 (`app.books.writing.assemble.write_m4a`)
      OEBPS/images/cover.jpg|png        the cover, when the book has one

`write_epub3` is given the chapters as assembled (their timings are chapters.json's) and the M4A of
each; `app.books.writing.output` decides when it must be written again.
"""

from __future__ import annotations

import shutil
import uuid
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lxml import etree

from app.books.planning.readalong import ChapterText
from app.books.reading.publication import Publication
from app.books.writing.assemble import ChapterAudio
from app.books.writing.overlay import (
    ACTIVE_CLASS,
    EPUB_OPS,
    XHTML,
    clock,
    content_document,
    overlay_document,
    overlay_seconds,
    serialize,
)
from app.storage.artifacts import atomic_path

OPF = "http://www.idpf.org/2007/opf"
DC = "http://purl.org/dc/elements/1.1/"
CONTAINER = "urn:oasis:names:tc:opendocument:xmlns:container"
_COVER_NAMES = {"image/jpeg": "cover.jpg", "image/png": "cover.png"}
STYLE = (f".{ACTIVE_CLASS} {{ background-color: #fde68a; color: inherit; }}\n"
         "h1 { margin: 1em 0; }\np { margin: 0 0 0.8em 0; line-height: 1.5; }\n")


@dataclass(frozen=True)
class EpubMeta:
    title: str
    author: str
    language: str
    identifier: str  # the plan's key: the same book, the same identifier
    narrator: str = ""
    description: str = ""
    publication: Publication = Publication()  # dc:publisher, dc:date (the year), an ISBN, dc:subjects


def write_epub3(out: Path, *, meta: EpubMeta, texts: Sequence[ChapterText], chapters: Sequence[ChapterAudio],
                audio: Sequence[Path], cover: bytes | None = None, cover_type: str | None = None) -> None:
    """The EPUB at `out` (atomically); `texts`, `chapters` and `audio` are the same chapters in order."""
    if not len(texts) == len(chapters) == len(audio):
        raise ValueError("a read-along EPUB needs the text and the audio of the same chapters")
    entries: list[tuple[str, bytes | Path]] = []  # audio as files: copied into the zip in blocks
    for n, (text, chapter, m4a) in enumerate(zip(texts, chapters, audio, strict=True), start=1):
        xhtml, ids = content_document(text, language=meta.language, stylesheet="../style.css")
        smil = overlay_document(chapter, ids, text_href=f"../text/chapter-{n:03d}.xhtml",
                                audio_href=f"../audio/chapter-{n:03d}.m4a")
        entries += [(f"text/chapter-{n:03d}.xhtml", xhtml), (f"smil/chapter-{n:03d}.smil", smil),
                    (f"audio/chapter-{n:03d}.m4a", m4a)]
    cover_name = _COVER_NAMES.get(cover_type or "") if cover else None
    if cover and cover_name:
        entries.append((f"images/{cover_name}", cover))
    links = [(t.title, f"text/chapter-{n:03d}.xhtml") for n, t in enumerate(texts, start=1)]
    entries += [("nav.xhtml", nav_document(meta, links)), ("style.css", STYLE.encode()),
                ("package.opf", _package(meta, chapters, cover_name))]
    write_zip(out, "OEBPS/package.opf", [(f"OEBPS/{name}", data) for name, data in entries])


def write_zip(out: Path, opf_path: str, entries: Sequence[tuple[str, bytes | Path]],
              skeleton: Path | None = None) -> None:
    """The OCF zip at `out` (atomically): mimetype first and stored, the container naming `opf_path`, the
    entries (a Path is copied in blocks, stored: audio is compressed already), then every entry of the
    zip `skeleton`."""
    with atomic_path(out) as tmp, zipfile.ZipFile(tmp, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), b"application/epub+zip", compress_type=zipfile.ZIP_STORED)
        z.writestr("META-INF/container.xml", _container(opf_path), compress_type=zipfile.ZIP_DEFLATED)
        for name, data in entries:
            if isinstance(data, Path):
                z.write(data, name, compress_type=zipfile.ZIP_STORED)
            else:
                kind = zipfile.ZIP_STORED if name.endswith((".jpg", ".png")) else zipfile.ZIP_DEFLATED
                z.writestr(name, data, compress_type=kind)
        if skeleton is not None:
            with zipfile.ZipFile(skeleton) as src:
                for info in src.infolist():
                    with src.open(info) as handle, z.open(info.filename, "w") as dst:
                        shutil.copyfileobj(handle, dst, 1 << 20)


def _container(opf_path: str) -> bytes:
    root = etree.Element(f"{{{CONTAINER}}}container", nsmap={None: CONTAINER}, version="1.0")
    files = etree.SubElement(root, f"{{{CONTAINER}}}rootfiles")
    etree.SubElement(files, f"{{{CONTAINER}}}rootfile", {"full-path": opf_path,
                                                         "media-type": "application/oebps-package+xml"})
    return serialize(root)


def nav_document(meta: EpubMeta, links: Sequence[tuple[str, str]]) -> bytes:
    """A navigation document: the book's title and a table of contents of (title, href) links."""
    html = etree.Element(f"{{{XHTML}}}html", nsmap={None: XHTML, "epub": EPUB_OPS}, lang=meta.language)
    head = etree.SubElement(html, f"{{{XHTML}}}head")
    etree.SubElement(head, f"{{{XHTML}}}title").text = meta.title
    nav = etree.SubElement(etree.SubElement(html, f"{{{XHTML}}}body"), f"{{{XHTML}}}nav", id="toc")
    nav.set(f"{{{EPUB_OPS}}}type", "toc")
    etree.SubElement(nav, f"{{{XHTML}}}h1").text = meta.title
    ol = etree.SubElement(nav, f"{{{XHTML}}}ol")
    for n, (title, href) in enumerate(links, start=1):
        link = etree.SubElement(etree.SubElement(ol, f"{{{XHTML}}}li"), f"{{{XHTML}}}a", href=href)
        link.text = title or f"Chapter {n}"
    return serialize(html, doctype="<!DOCTYPE html>")


def _package(meta: EpubMeta, chapters: Sequence[ChapterAudio], cover_name: str | None) -> bytes:
    package = package_element(meta, [(f"#mo{n:03d}", s) for n, s in enumerate(overlay_seconds(chapters), 1)])
    _manifest(package, len(chapters), cover_name)
    return serialize(package)


def package_element(meta: EpubMeta, overlays: Sequence[tuple[str, float]]) -> etree._Element:
    """<package> with its metadata: the book's, and each overlay's duration (`#id`, seconds) and the
    total's, the active class and the narrator; the caller adds the manifest and the spine."""
    package = etree.Element(f"{{{OPF}}}package", nsmap={None: OPF}, version="3.0",
                            attrib={"unique-identifier": "uid"})
    metadata = etree.SubElement(package, f"{{{OPF}}}metadata", nsmap={"dc": DC})

    def dc(name: str, text: str, **attrs: str) -> None:
        etree.SubElement(metadata, f"{{{DC}}}{name}", attrs).text = text

    def meta_el(prop: str, text: str, refines: str | None = None, **attrs: str) -> None:
        el = etree.SubElement(metadata, f"{{{OPF}}}meta", property=prop, **attrs)
        if refines:
            el.set("refines", refines)
        el.text = text

    dc("identifier", f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'wavefarm:' + meta.identifier)}", id="uid")
    dc("title", meta.title)
    dc("language", meta.language)
    if meta.author:
        dc("creator", meta.author, id="author")
        meta_el("role", "aut", "#author", scheme="marc:relators")
    if meta.narrator:
        dc("contributor", meta.narrator, id="narrator")
        meta_el("role", "nrt", "#narrator", scheme="marc:relators")
        meta_el("media:narrator", meta.narrator)
    if meta.description:
        dc("description", meta.description)
    _publication(dc, meta.publication)
    meta_el("dcterms:modified", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    for ref, seconds in overlays:
        meta_el("media:duration", clock(seconds), ref)
    meta_el("media:duration", clock(sum(round(s, 3) for _, s in overlays)))
    meta_el("media:active-class", ACTIVE_CLASS)
    return package


def _publication(dc: Callable[..., None], publication: Publication) -> None:
    if publication.isbn:
        dc("identifier", f"urn:isbn:{publication.isbn}", id="isbn")
    if publication.publisher:
        dc("publisher", publication.publisher)
    if publication.year:
        dc("date", publication.year)
    for genre in publication.genres:
        dc("subject", genre)


def _manifest(package: etree._Element, count: int, cover_name: str | None) -> None:
    manifest = etree.SubElement(package, f"{{{OPF}}}manifest")

    def item(id_: str, href: str, media_type: str, **more: str) -> None:
        attrs = {"id": id_, "href": href, "media-type": media_type, **more}
        etree.SubElement(manifest, f"{{{OPF}}}item", attrs)

    item("nav", "nav.xhtml", "application/xhtml+xml", properties="nav")
    item("css", "style.css", "text/css")
    for n in range(1, count + 1):
        item(f"c{n:03d}", f"text/chapter-{n:03d}.xhtml", "application/xhtml+xml",
             **{"media-overlay": f"mo{n:03d}"})
        item(f"mo{n:03d}", f"smil/chapter-{n:03d}.smil", "application/smil+xml")
        item(f"a{n:03d}", f"audio/chapter-{n:03d}.m4a", "audio/mp4")
    if cover_name:
        item("cover", f"images/{cover_name}", "image/jpeg" if cover_name.endswith("jpg") else "image/png",
             properties="cover-image")
    spine = etree.SubElement(package, f"{{{OPF}}}spine")
    for n in range(1, count + 1):
        etree.SubElement(spine, f"{{{OPF}}}itemref", idref=f"c{n:03d}")
