"""The read-along EPUB 3 of an EPUB source: the book's own files (its spine documents with each segment
wrapped, as `app.books.planning.readalong_source` left them in the skeleton zip), a new package document in
the place of the book's, and beside it wavefarm/: a SMIL per content document that speaks, the chapter audio,
the highlight's stylesheet and, for a book without an EPUB 3 navigation document, one made from its chapters.

    write_source_epub3(out, meta=, described=, skeleton=, chapters=, audio=, titles=)

A content document's SMIL holds a <par> per segment shown in it, in reading order; a chapter that runs
over two documents has its pars in both, and a document holding two chapters points at both chapters'
audio. The clips are `app.books.writing.overlay.clips`, as for plain documents. The package keeps the book's
manifest and spine (a content document that speaks gets its `media-overlay`), and its own metadata: the
book's title, author, language, narrator and description, as for plain documents.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lxml import etree

from app.books.writing.assemble import ChapterAudio
from app.books.writing.overlay import clips, serialize, smil_document
from app.books.writing.readalong_epub import OPF, STYLE, EpubMeta, nav_document, package_element, write_zip

DIR = "wavefarm"
_COVER_TYPES = ("image/jpeg", "image/png", "image/gif", "image/svg+xml", "image/webp")


def write_source_epub3(out: Path, *, meta: EpubMeta, described: dict[str, Any], skeleton: Path,
                       chapters: Sequence[ChapterAudio], audio: Sequence[Path],
                       titles: Sequence[str]) -> None:
    base = posixpath.dirname(described["opf"])
    own = posixpath.join(base, DIR)
    audio_paths = [posixpath.join(own, f"audio/chapter-{n:03d}.m4a") for n in range(1, len(audio) + 1)]
    entries: list[tuple[str, bytes | Path]] = list(zip(audio_paths, audio, strict=True))
    overlays: list[tuple[str, str, float]] = []  # (document path, overlay id, seconds)
    spans = [clips(c) for c in chapters]
    for n, doc in enumerate(described["docs"], start=1):
        if not doc["pars"]:
            continue
        smil_path = posixpath.join(own, f"smil/doc-{n:03d}.smil")
        here = posixpath.dirname(smil_path)
        text = posixpath.relpath(doc["href"], here)
        pars = [(f"{text}#{el_id}", posixpath.relpath(audio_paths[c], here), *spans[c][s])
                for c, s, el_id in doc["pars"]]
        entries.append((smil_path, smil_document(f"{text}#{doc['body']}", pars)))
        overlays.append((doc["href"], f"wf-mo{n:03d}", sum(end - begin for *_, begin, end in pars)))
    entries.append((posixpath.join(own, "style.css"), STYLE.encode()))
    has_nav = any("nav" in item[3].split() for item in described["manifest"])
    if not has_nav:
        entries.append((posixpath.join(own, "nav.xhtml"), nav_document(meta, _links(described, titles, own))))
    package = package_element(meta, [(f"#{ident}", seconds) for _, ident, seconds in overlays])
    _manifest(package, described, base, {href: ident for href, ident, _ in overlays}, len(audio), has_nav)
    entries.append((described["opf"], serialize(package)))
    write_zip(out, described["opf"], entries, skeleton)


def _links(described: dict[str, Any], titles: Sequence[str], own: str) -> list[tuple[str, str]]:
    """Each chapter's title and where its first segment is shown, relative to wavefarm/."""
    first: dict[int, str] = {}
    for doc in described["docs"]:
        for c, _, el_id in doc["pars"]:
            first.setdefault(c, f"{posixpath.relpath(doc['href'], own)}#{el_id}")
    return [(titles[c], href) for c, href in sorted(first.items())]


def _manifest(package: etree._Element, described: dict[str, Any], base: str, overlay_of: dict[str, str],
              chapters: int, has_nav: bool) -> None:
    manifest = etree.SubElement(package, f"{{{OPF}}}manifest")

    def item(ident: str, href: str, media_type: str, properties: str = "", overlay: str = "") -> None:
        attrs = {"id": ident, "href": href, "media-type": media_type}
        el = etree.SubElement(manifest, f"{{{OPF}}}item", attrs)
        for name, value in (("properties", properties), ("media-overlay", overlay)):
            if value:
                el.set(name, value)

    for ident, href, media_type, properties in described["manifest"]:
        full = posixpath.normpath(posixpath.join(base, href))
        if ident == described.get("cover") and media_type in _COVER_TYPES:
            properties = " ".join(sorted({*properties.split(), "cover-image"}))
        item(ident, href, media_type, properties, overlay_of.get(full, ""))
    for ident in overlay_of.values():
        item(ident, f"{DIR}/smil/doc-{ident.removeprefix('wf-mo')}.smil", "application/smil+xml")
    for n in range(1, chapters + 1):
        item(f"wf-a{n:03d}", f"{DIR}/audio/chapter-{n:03d}.m4a", "audio/mp4")
    item("wf-css", f"{DIR}/style.css", "text/css")
    if not has_nav:
        item("wf-nav", f"{DIR}/nav.xhtml", "application/xhtml+xml", "nav")
    spine = etree.SubElement(package, f"{{{OPF}}}spine")
    for idref, linear in described["spine"]:
        ref = etree.SubElement(spine, f"{{{OPF}}}itemref", idref=idref)
        if linear == "no":
            ref.set("linear", "no")
