"""The read-along EPUB of an EPUB source keeps the book's own files; this takes their active content out, so
that a reader that runs scripts has none to run (issue 42).

    PARSER                  how the book's XHTML and SVG are read: XML, no entities, no DTD, no network,
                            elements with lxml.html's methods (the sanitizer needs them)
    clean_document(root)    an XHTML or SVG document, in place: lxml's own HTML sanitizer
                            (`lxml_html_clean.Cleaner`: <script>, on* handlers, javascript: links, forms,
                            iframes, embeds and objects, <base>, comments), then what it leaves to others:
                            scripts and handlers in any namespace (SVG's), script URLs in any attribute
                            that holds a URL (xlink:href, SVG animations' values), elements whose
                            resource is remote
                            (<img>, <link>, <audio>, <video>, <source>, <track>, SVG <image> and <use>)
                            and <meta http-equiv> (a refresh can load anything)
    clean_css(text)         a stylesheet: remote @imports and url()s, expression(), -moz-binding, behavior
    dropped(media_type, path)  whether a manifest item is left out of the package: a script file
    properties(declared, root)  a document's manifest properties after cleaning: `scripted` and
                            `remote-resources` gone, `svg` and `mathml` as the document now is

The documents stay XML: the sanitizer works on the parsed tree (its XHTML namespace taken off for it and
put back after), and the caller serialises the tree as XML. A hyperlink (<a href="https://...">) stays: a
reader follows it only when it is tapped, and it loads nothing by itself. A document that cannot be read
as XML is not cleaned here: the caller then makes plain documents of its own
(`app.books.planning.readalong_source`).
"""

from __future__ import annotations

import re

from lxml import etree
from lxml.html import XHTMLParser, html_to_xhtml
from lxml_html_clean import Cleaner

PARSER = XHTMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)
SCRIPT_TYPES = {"application/javascript", "text/javascript", "application/ecmascript", "text/ecmascript",
                "application/x-javascript", "module"}
_RESOURCE_ATTRS = {"img": ("src",), "link": ("href",), "audio": ("src",), "video": ("src", "poster"),
                   "source": ("src",), "track": ("src",), "image": ("href",), "use": ("href",),
                   "feImage": ("href",)}
_REQUIRED = {"img", "link", "source", "track", "image", "use", "feImage"}  # nothing without it
# Attributes whose value a reader may load or follow as a URL (SVG animations' to/from/values/by set one):
# a script URL is taken out of these, not out of text such as an alt or a title
_URL_ATTRS = {"href", "src", "action", "formaction", "data", "poster", "cite", "background", "longdesc",
              "codebase", "code", "usemap", "archive", "content", "to", "from", "values", "by", "srcset"}
_SCRIPT_ELEMENTS = {"script", "handler", "listener"}  # HTML's and SVG's; XML Events' listener
_SCRIPT_URL = re.compile(r"(java|vb|live)script:|mocha:|data:(text/html|[^,;]*xml|[^,;]*javascript)")
_SPACE = re.compile(r"[\x00-\x20\x7f]+")
_CSS_IMPORT = re.compile(r"@import\s+(url\(\s*)?['\"]?\s*([a-z][a-z0-9+.-]*:|//)[^;]*;?", re.IGNORECASE)
_CSS_SCRIPT = re.compile(r"expression\s*\(|-moz-binding|behavior\s*:|javascript:", re.IGNORECASE)
_CSS_URL = re.compile(r"url\(\s*(['\"]?)\s*([a-z][a-z0-9+.-]*:|//)[^)]*\)", re.IGNORECASE)


class _Cleaner(Cleaner):
    """lxml's sanitizer with a book's own stylesheets kept: it drops every <link rel=stylesheet> unless
    this says the element is allowed, and a stylesheet in the book's own folder loads nothing remote."""

    def allow_element(self, el: etree._Element) -> bool:
        href = el.get("href") or ""
        return el.tag == "link" and not _remote(href) and not _scripted(href)


_CLEANER = _Cleaner(scripts=True, javascript=True, comments=True, style=False, inline_style=False,
                    links=False, meta=False, page_structure=False, processing_instructions=True,
                    embedded=True, frames=True, forms=True, annoying_tags=True, remove_unknown_tags=False,
                    safe_attrs_only=False)


def clean_document(root: etree._Element) -> None:
    """Take every script, handler, remote resource and form out of a parsed XHTML or SVG document."""
    if _local(root) == "html":
        _CLEANER(root)  # takes the XHTML namespace off its elements ...
        html_to_xhtml(root)  # ... and here it is put back
    doomed = [el for el in root.iter(etree.Element) if not _clean_element(el)]
    for el in doomed:
        if el.getparent() is not None:
            _drop(el)


def _clean_element(el: etree._Element) -> bool:
    """Clean one element's attributes (and a <style>'s text); False when the element must go whole."""
    name = _local(el)
    if name in _SCRIPT_ELEMENTS or name == "base" or (name == "meta" and el.get("http-equiv") is not None):
        return False
    for attr, value in list(el.attrib.items()):
        local = etree.QName(attr).localname.lower()
        if local.startswith("on") or (local in _URL_ATTRS and _scripted(value)):
            del el.attrib[attr]
    if any(_unsafe_resource(_attr(el, attr), required=i == 0 and name in _REQUIRED)
           for i, attr in enumerate(_RESOURCE_ATTRS.get(name, ()))):
        return False
    for attr in ("srcset", "imagesrcset"):
        if any(_remote(part.split()[0]) for part in (el.get(attr) or "").split(",") if part.split()):
            del el.attrib[attr]
    if el.get("style") is not None:
        el.set("style", clean_css(el.get("style", "")))
    if name == "style":
        el.text = clean_css(el.text or "")
    return True


def clean_css(text: str) -> str:
    """A stylesheet without remote imports, remote url()s (each becomes `none`, which loads nothing and
    parses where an image or a source may stand) or script hooks."""
    text = _CSS_IMPORT.sub("", text)
    text = _CSS_URL.sub(lambda m: "none" if not m.group(2).lower().startswith("data:") else m.group(0), text)
    return _CSS_SCRIPT.sub("", text)


def dropped(media_type: str, path: str) -> bool:
    """A manifest item the read-along package leaves out: a script file, by its type or its name."""
    return media_type.split(";")[0].strip().lower() in SCRIPT_TYPES or path.lower().endswith((".js", ".mjs"))


def properties(declared: str, root: etree._Element | None) -> str:
    """A manifest item's properties once its document is clean: nothing scripted or remote is left;
    `svg` and `mathml` say what it holds now (EPUBCheck requires both ways)."""
    props = set(declared.split()) - {"scripted", "remote-resources"}
    if root is not None:
        names = {_local(el) for el in root.iter(etree.Element)}
        props -= {"svg", "mathml"}
        own = _local(root)  # an SVG document is not declared `svg`: only XHTML holding SVG is
        props |= {p for p, name in (("svg", "svg"), ("mathml", "math")) if name in names and own != name}
    return " ".join(sorted(props))


def _local(el: etree._Element) -> str:
    return etree.QName(el).localname if isinstance(el.tag, str) else ""


def _attr(el: etree._Element, name: str) -> str | None:
    """An attribute by its local name, in no namespace or any (SVG's href may be xlink:href)."""
    for attr, value in el.attrib.items():
        if etree.QName(attr).localname == name:
            return str(value)
    return None


def _unsafe_resource(url: str | None, *, required: bool) -> bool:
    """A resource URL that loads from elsewhere or runs a script, or a required one that is empty (the
    sanitizer empties a javascript: URL)."""
    if url is None or not url.strip():
        return required
    return _remote(url) or _scripted(url)


def _remote(url: str) -> bool:
    """A URL that would be fetched from elsewhere: a scheme other than data:, or a network path (//)."""
    url = _SPACE.sub("", url).lower()
    if url.startswith("//"):
        return True
    scheme = re.match(r"[a-z][a-z0-9+.-]*:", url)
    return scheme is not None and not url.startswith("data:")


def _scripted(value: str) -> bool:
    return _SCRIPT_URL.match(_SPACE.sub("", value).lower()) is not None


def _drop(el: etree._Element) -> None:
    """Remove an element and what it holds, keeping the text after it."""
    parent = el.getparent()
    assert parent is not None
    if el.tail:
        previous = el.getprevious()
        if previous is not None:
            previous.tail = (previous.tail or "") + el.tail
        else:
            parent.text = (parent.text or "") + el.tail
    parent.remove(el)
