"""An EPUB source's own content documents for its read-along EPUB, made in the reading child
(`app.books.intake_child`): each spoken segment's text wrapped in a <span id> inside the book's own
paragraphs, everything else (styles, images, fonts, front matter, its navigation) kept, without its active
content: every XHTML and SVG document and stylesheet is cleaned and script files are left out
(`app.books.planning.readalong_clean`).

    own_documents(data, source, plan, limits, skeleton) -> description | None

writes `skeleton` (a zip of the book's manifest items, its spine documents annotated) and returns what the
EPUB writer (`app.books.writing.readalong_epub_source`) needs: the package's manifest and spine, and per
content document the (chapter, segment, element id) of each segment it shows. None when the book's XHTML is
not XML this module can read (HTML's named references such as &nbsp; are read as the characters they name, as
the EPUB reader reads them), or when a chapter's text cannot be found in it: the caller then makes plain
documents (`app.books.planning.readalong`).

How text is found: the paragraphs the EPUB reader gave (`app.books.reading.epub`) are matched in order to the
documents' innermost block elements (<p>, <li>, <h2> ...) by their text without whitespace; a block may
hold several paragraphs (a <br>, an anchor inside it). A paragraph found nowhere shares the element of
the segment before it. The chapter's spoken title points at the heading just before its text, if any.
Every document is checked for entity declarations and DTD subsets (defusedxml) before lxml reads it with
entities and DTDs off.
"""

from __future__ import annotations

import posixpath
import re
import zipfile
from dataclasses import dataclass, field
from html.entities import name2codepoint
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from lxml import etree

from app.books.planning.plan import BookPlan, PlanChapter
from app.books.planning.readalong import planned_sources, split_like
from app.books.planning.readalong_clean import PARSER, clean_css, clean_document, dropped, properties
from app.books.planning.span_wrap import SKIPPED, local, nonspace, visible, wrap_runs
from app.books.reading import epub
from app.books.reading.safezip import SafeArchive
from app.books.reading.source import BookLimits, SourceBook
from app.errors import BadInput

XHTML = "http://www.w3.org/1999/xhtml"
STYLE = "wavefarm/style.css"  # beside the package document: the active class's highlight
BLOCKS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "blockquote", "section", "article", "tr",
          "dd", "dt", "figcaption", "pre", "aside", "header", "footer", "table"}  # as
          # `app.books.reading.epub`'s
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
LOOKAHEAD = 200  # blocks searched for a paragraph before it is taken as not found
_DROPPED = {"application/smil+xml", "application/x-dtbncx+xml"}
_HTML_ENTITY_RE = re.compile(rb"&([A-Za-z][A-Za-z0-9]{1,31});")


@dataclass
class _Leaf:
    doc: int
    el: etree._Element
    text: str  # without whitespace
    paras: list[int] = field(default_factory=list)


@dataclass
class _Para:
    chapter: int
    text: str
    segments: list[int]  # indices in its chapter


def own_documents(data: bytes, source: SourceBook, plan: BookPlan, limits: BookLimits,
                  skeleton: Path) -> dict[str, Any] | None:
    archive = SafeArchive(data, limits)
    opf_path = epub._rootfile(epub._xml(archive.read("META-INF/container.xml"), "container.xml"))
    opf = epub._xml(archive.read(opf_path), opf_path)
    base = posixpath.dirname(opf_path)
    items = [i for i in opf.iterfind("opf:manifest/opf:item", epub.NS) if i.get("id") and i.get("href")]
    full: dict[str, str] = {i.get("id", ""): _resolve(base, i.get("href", "")) for i in items}
    kinds = {i.get("id", ""): i.get("media-type") or "" for i in items}
    spine_el = opf.find("opf:spine", epub.NS)
    spine = [(r.get("idref"), r.get("linear", "yes")) for r in (spine_el.iterfind("opf:itemref", epub.NS)
                                                                 if spine_el is not None else [])]
    docs = list(dict.fromkeys(full[i] for i, linear in spine if i in full and "html" in kinds[i]
                              and linear != "no"))
    parsed = {full[i]: _read(archive, full[i]) for i in full
              if _is_document(kinds[i]) and archive.has(full[i])}
    if any(t is None for t in parsed.values()) or any(path not in parsed for path in docs):
        return None
    for tree in parsed.values():
        clean_document(tree)  # before anything is matched: no script's text is taken for the book's
    trees = [parsed[path] for path in docs]
    pairs = planned_sources(source, plan)
    placed = _place(pairs, [t for t in trees if t is not None], plan)
    if placed is None:
        return None
    bodies = [_body_id(t) for t in trees if t is not None]
    kept = _manifest(archive, items, full, kinds, parsed)
    kept_paths = {_resolve(base, href): kind for _, href, kind, _ in kept}
    _write_skeleton(archive, skeleton, kept_paths, docs, parsed, base)
    kept_ids = {ident for ident, *_ in kept}
    return {"opf": opf_path, "manifest": kept,
            "spine": [[i, linear] for i, linear in spine if i in kept_ids],
            "cover": _cover_id(opf),
            "docs": [{"href": path, "body": body, "pars": pars}
                     for path, body, pars in zip(docs, bodies, placed, strict=True)]}


def _resolve(base: str, href: str) -> str:
    return posixpath.normpath(posixpath.join(base, unquote(href)))


def _is_document(media_type: str) -> bool:
    return media_type in ("application/xhtml+xml", "image/svg+xml") or "html" in media_type


def _manifest(archive: SafeArchive, items: list[Any], full: dict[str, str], kinds: dict[str, str],
              parsed: dict[str, Any]) -> list[list[str]]:
    """[id, href, media type, properties] of each item the new EPUB keeps: not the book's own overlays, nor
    an EPUB 2 NCX (EPUB 3 navigates by its navigation document, one is made for a book without), nor a
    script (`app.books.planning.readalong_clean`); a document's properties as it is once clean."""
    out = []
    for item in items:
        ident = item.get("id", "")
        path = full[ident]
        if kinds[ident] not in _DROPPED and not dropped(kinds[ident], path) and archive.has(path):
            props = properties(item.get("properties") or "", parsed.get(path))
            out.append([ident, item.get("href", ""), kinds[ident], props])
    return out


def _read(archive: SafeArchive, path: str) -> etree._Element | None:
    content = _HTML_ENTITY_RE.sub(_numeric, archive.read(path))
    try:
        epub._xml(content, path)  # refuses entity declarations and DTD subsets; XML that XML can read
        return etree.fromstring(content, PARSER)
    except (BadInput, etree.XMLSyntaxError):
        return None


def _numeric(m: re.Match[bytes]) -> bytes:
    """An HTML named character reference (&nbsp;, which XHTML books use without declaring it) as the
    numeric one XML reads: nothing is declared or expanded, the name is looked up in HTML's own table."""
    name = m.group(1).decode()
    if name in ("amp", "lt", "gt", "quot", "apos") or name not in name2codepoint:
        return m.group(0)
    return f"&#{name2codepoint[name]};".encode()


def _leaves(root: etree._Element, doc: int) -> list[_Leaf]:
    """The innermost block elements of a document, in order, outside skipped elements (script, nav ...)."""
    order = list(root.iter())
    inner: dict[etree._Element, bool] = {}  # has a block element inside
    for el in reversed(order):
        inner[el] = any(inner.get(c, False) or local(c) in BLOCKS for c in el)
    out, skipped = [], set()
    for el in order:
        parent = el.getparent()
        if local(el) in SKIPPED or (parent is not None and parent in skipped):
            skipped.add(el)
        elif local(el) in BLOCKS and not inner[el]:
            out.append(_Leaf(doc, el, nonspace(visible(el))))
    return out


def _place(pairs: list[tuple[Any, PlanChapter]], trees: list[etree._Element],
           plan: BookPlan) -> list[list[list[Any]]] | None:
    """Wrap every segment's text; per document its [chapter, segment, id] in order (None: not found)."""
    leaves = [leaf for d, tree in enumerate(trees) for leaf in _leaves(tree, d)]
    paras = [_Para(ci, text, [si for si, s in enumerate(ch.segments) if s.paragraph == p])
             for ci, (own, ch) in enumerate(pairs) for p, text in enumerate(own.paragraphs)]
    _match(paras, leaves)
    ids: dict[tuple[int, int], tuple[int, str]] = {}  # (chapter, segment) -> (block, element id)
    for n, leaf in enumerate(leaves):
        if leaf.paras:
            _wrap(n, leaf, [paras[i] for i in leaf.paras], pairs, ids)
    per_doc: list[list[list[Any]]] = [[] for _ in trees]
    for ci, (_, chapter) in enumerate(pairs):
        found = _fill(ci, chapter, ids, leaves)
        if found is None:
            return None
        for si, (n, el_id) in enumerate(found):
            per_doc[leaves[n].doc].append([ci, si, el_id])
    return per_doc


def _match(paras: list[_Para], leaves: list[_Leaf]) -> None:
    """Assign paragraphs, in order, to the blocks that hold their text (several to one block at most)."""
    i = j = 0
    while i < len(paras):
        want = nonspace(paras[i].text)
        found = next((k for k in range(j, min(j + LOOKAHEAD, len(leaves)))
                      if want and leaves[k].text.startswith(want)), None)
        if found is None:
            i += 1
            continue
        leaf, held = leaves[found], want
        leaf.paras.append(i)
        i += 1
        while i < len(paras) and held != leaf.text and leaf.text.startswith(held + nonspace(paras[i].text)):
            held += nonspace(paras[i].text)
            leaf.paras.append(i)
            i += 1
        j = found + 1


def _wrap(n: int, leaf: _Leaf, paras: list[_Para], pairs: list[tuple[Any, PlanChapter]],
          ids: dict[tuple[int, int], tuple[int, str]]) -> None:
    runs: list[tuple[int, int, str]] = []
    keys: list[tuple[int, int]] = []
    base = 0
    for para in paras:
        chapter = pairs[para.chapter][1]
        if para.segments:
            cuts = split_like(para.text, [chapter.segments[s].text for s in para.segments])
            marks = [base + len(nonspace(para.text[:c])) for c in cuts] + [base + len(nonspace(para.text))]
            for si, a, b in zip(para.segments, marks, marks[1:], strict=False):
                runs.append((a, b, f"wf-{para.chapter + 1}-{si + 1}"))
                keys.append((para.chapter, si))
        base += len(nonspace(para.text))
    for key, el_id in zip(keys, wrap_runs(leaf.el, runs, f"{{{XHTML}}}span"), strict=True):
        ids[key] = (n, el_id)


def _fill(ci: int, chapter: PlanChapter, ids: dict[tuple[int, int], tuple[int, str]],
          leaves: list[_Leaf]) -> list[tuple[int, str]] | None:
    """Every segment of the chapter with an element: a title its heading, the others their own or the
    one before (after, for the first). None when nothing of the chapter was found."""
    known = [ids.get((ci, si)) for si in range(len(chapter.segments))]
    first = next((k for k in known if k is not None), None)
    if first is None:
        return None
    heading = _heading_before(leaves, first)
    out: list[tuple[int, str]] = []
    for si, segment in enumerate(chapter.segments):
        got = known[si] or (heading if segment.paragraph < 0 and heading else None)
        out.append(got or (out[-1] if out else first))
    return out


def _heading_before(leaves: list[_Leaf], first: tuple[int, str]) -> tuple[int, str] | None:
    """The last heading with no paragraph of its own before block `first`, in the same document."""
    at = first[0]
    for k in range(at - 1, -1, -1):
        leaf = leaves[k]
        if leaf.doc != leaves[at].doc or leaf.paras:
            return None
        if local(leaf.el) in HEADINGS:
            if not leaf.el.get("id"):
                leaf.el.set("id", f"wf-h{k + 1}")
            return k, leaf.el.get("id", "")
    return None


def _body_id(tree: etree._Element) -> str:
    body = tree.find(f"{{{XHTML}}}body")
    if body is None:
        raise BadInput("an XHTML document of the EPUB has no <body>")
    if not body.get("id"):
        body.set("id", "wf-body")
    return body.get("id", "")


def _cover_id(opf: Any) -> str | None:
    meta = next((m for m in opf.iterfind("opf:metadata/opf:meta", epub.NS) if m.get("name") == "cover"), None)
    return meta.get("content") if meta is not None else None


def _write_skeleton(archive: SafeArchive, skeleton: Path, kept: dict[str, str], docs: list[str],
                    parsed: dict[str, Any], base: str) -> None:
    """The book's kept manifest items (path -> media type) as the new EPUB holds them: documents as
    cleaned (spine documents annotated, and linked to the highlight's stylesheet), stylesheets cleaned,
    the rest as they were."""
    with zipfile.ZipFile(skeleton, "w", zipfile.ZIP_DEFLATED) as z:
        for path, kind in sorted(kept.items()):
            if path in parsed:
                tree = parsed[path]
                if path in docs:
                    _link_style(tree, posixpath.relpath(posixpath.join(base, STYLE), posixpath.dirname(path)))
                html = etree.QName(tree).localname == "html"
                z.writestr(path, etree.tostring(tree, xml_declaration=True, encoding="utf-8",
                                                doctype="<!DOCTYPE html>" if html else None))
            elif kind == "text/css":
                z.writestr(path, _clean_stylesheet(archive.read(path)))
            else:
                z.writestr(path, archive.read(path))


def _clean_stylesheet(data: bytes) -> bytes:
    """A stylesheet cleaned, or as it was when there was nothing to clean (its encoding kept)."""
    text = data.decode("utf-8", "replace")
    cleaned = clean_css(text)
    return data if cleaned == text else cleaned.encode()


def _link_style(tree: etree._Element, href: str) -> None:
    head = tree.find(f"{{{XHTML}}}head")
    if head is not None:
        etree.SubElement(head, f"{{{XHTML}}}link", rel="stylesheet", type="text/css", href=href)

