"""A read-along chapter's content document (XHTML) and its Media Overlay (SMIL), from the chapter's shown
text (`app.books.planning.readalong`) and the timings of its assembled audio (the ones chapters.json gives).

    clips(chapter)                 -> [(begin, end)] per segment, seconds: segment i's clip runs from its
                                      start (0 for the first) to the next one's start (the chapter's end
                                      for the last), so a chapter's clips cover its audio end to end, in
                                      order, and each holds its segment's speech and the pause after it
    content_document(text, ...)    -> (XHTML bytes, {segment index: element id})
    overlay_document(...)          -> SMIL bytes: a <par> per segment, pointing at its element and clip

Starts are rounded to the millisecond, as chapters.json rounds them, so the two agree exactly. XML is
built with lxml's element tree (never as strings), so any text of the book is escaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lxml import etree

from app.books.planning.readalong import ChapterText
from app.books.writing.assemble import ChapterAudio

XHTML = "http://www.w3.org/1999/xhtml"
EPUB_OPS = "http://www.idpf.org/2007/ops"
SMIL = "http://www.w3.org/ns/SMIL"
ACTIVE_CLASS = "-epub-media-overlay-active"
SECTION_ID = "chapter"  # the content document's <section>, which the overlay's <seq> refers to
_XML = "{http://www.w3.org/XML/1998/namespace}"


def clips(chapter: ChapterAudio) -> list[tuple[float, float]]:
    bounds = [0.0, *(round(s.start, 3) for s in chapter.segments[1:]), round(chapter.duration, 3)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def clock(seconds: float) -> str:
    """A SMIL full clock value, to the millisecond: 1:02:03.456."""
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    return f"{hours}:{minutes:02d}:{ms // 1000:02d}.{ms % 1000:03d}"


def serialize(root: etree._Element, *, doctype: str | None = None) -> bytes:
    out: bytes = etree.tostring(root, xml_declaration=True, encoding="utf-8", doctype=doctype)
    return out


def content_document(text: ChapterText, *, language: str, stylesheet: str) -> tuple[bytes, dict[int, str]]:
    """The chapter's XHTML: its title as <h1>, its paragraphs as <p>, each piece that shows segments in a
    <span id="s{n}"> (n: the first of them, from 1). Returns the document and each segment's element id."""
    html = etree.Element(f"{{{XHTML}}}html", nsmap={None: XHTML, "epub": EPUB_OPS})
    html.set("lang", language)
    html.set(f"{_XML}lang", language)
    head = etree.SubElement(html, f"{{{XHTML}}}head")
    etree.SubElement(head, f"{{{XHTML}}}title").text = text.title
    etree.SubElement(head, f"{{{XHTML}}}link", rel="stylesheet", type="text/css", href=stylesheet)
    body = etree.SubElement(html, f"{{{XHTML}}}body")
    section = etree.SubElement(body, f"{{{XHTML}}}section", id=SECTION_ID)
    section.set(f"{{{EPUB_OPS}}}type", "chapter")
    ids: dict[int, str] = {}
    for block in text.blocks:
        element = etree.SubElement(section, f"{{{XHTML}}}{block.tag}")
        last: etree._Element | None = None
        for i, (shown, segments) in enumerate(block.pieces):
            gap = " " if i else ""
            if not segments:
                _append_text(element, last, gap + shown)
                continue
            if gap:
                _append_text(element, last, gap)
            last = etree.SubElement(element, f"{{{XHTML}}}span", id=f"s{segments[0] + 1}")
            last.text = shown
            ids.update(dict.fromkeys(segments, last.get("id", "")))
    return serialize(html, doctype="<!DOCTYPE html>"), ids


def _append_text(parent: etree._Element, last: etree._Element | None, text: str) -> None:
    if last is None:
        parent.text = (parent.text or "") + text
    else:
        last.tail = (last.tail or "") + text


def overlay_document(chapter: ChapterAudio, ids: Mapping[int, str], *, text_href: str,
                     audio_href: str) -> bytes:
    """The chapter's SMIL: one <seq> for the document, one <par> per segment in order."""
    return smil_document(f"{text_href}#{SECTION_ID}", [(f"{text_href}#{ids[i]}", audio_href, begin, end)
                                                       for i, (begin, end) in enumerate(clips(chapter))])


def smil_document(textref: str, pars: Sequence[tuple[str, str, float, float]]) -> bytes:
    """A SMIL of one <seq> (the content document `textref`) with a <par> per (text src, audio src, clip
    begin, clip end), in order."""
    smil = etree.Element(f"{{{SMIL}}}smil", nsmap={None: SMIL, "epub": EPUB_OPS}, version="3.0")
    body = etree.SubElement(smil, f"{{{SMIL}}}body")
    seq = etree.SubElement(body, f"{{{SMIL}}}seq", id="seq1")
    seq.set(f"{{{EPUB_OPS}}}textref", textref)
    for i, (text, audio, begin, end) in enumerate(pars):
        par = etree.SubElement(seq, f"{{{SMIL}}}par", id=f"par{i + 1}")
        etree.SubElement(par, f"{{{SMIL}}}text", src=text)
        etree.SubElement(par, f"{{{SMIL}}}audio", src=audio, clipBegin=clock(begin), clipEnd=clock(end))
    return serialize(smil)


def overlay_seconds(chapters: Sequence[ChapterAudio]) -> list[float]:
    """Each overlay's duration (its clips' sum: the chapter's length to the millisecond)."""
    return [clips(c)[-1][1] if c.segments else 0.0 for c in chapters]
