"""The read-along EPUB of a hostile EPUB source (issue 42, item 4): the book's own documents are kept, but
nothing in them can run or load from elsewhere: no script (HTML's, SVG's, a script file), no on* handler,
no javascript: link, no remote stylesheet, image, iframe or @import, no form; a scripted page outside the
spine is cleaned too, and the package declares nothing `scripted`. EPUBCheck still finds no error, and
every segment still has its element."""

from __future__ import annotations

import zipfile

from lxml import etree

from tests.app.books.conftest import make_epub, replace_entry
from tests.app.books.writing.test_readalong_epub import build, epubcheck, overlays

EVIL = "evil.example"  # every remote resource points here; the one hyperlink kept goes to example.org
SVG = ('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" width="10" '
       'height="10" onload="alert(1)"><script>alert(2)</script><a xlink:href="javascript:alert(3)">'
       f'<rect width="5" height="5"/></a><image xlink:href="https://{EVIL}/i.png" width="5" height="5"/>'
       '<set attributeName="fill" to="javascript:alert(4)"/></svg>')
HEAD = (f'<link rel="stylesheet" type="text/css" href="https://{EVIL}/x.css"/>'
        '<link rel="stylesheet" type="text/css" href="../style/book.css"/>'
        f'<script src="../js/app.js"></script><base href="https://{EVIL}/"/>'
        '<meta http-equiv="refresh" content="0;url=javascript:alert(1)"/>')
BODY = ('<h1 onclick="alert(1)">Chapter One</h1>'
        '<p onmouseover="steal()">It began at <a href="javascript:alert(1)">dusk</a>.</p>'
        f'<p><img src="https://{EVIL}/track.png" alt="x"/><img src="../images/pic.svg" alt="pic"/></p>'
        f'<iframe src="https://{EVIL}/"></iframe><form action="https://{EVIL}/"><p><input type="text" '
        'name="q"/><button>Go</button></p></form>' + SVG
        + f'<p style="background: url(https://{EVIL}/bg.png)">The clocks all stopped&#8212;every one.</p>'
        '<p><a href="https://example.org/" title="JavaScript: the good parts">A link</a> and more.</p>'
        '<script>document.write("x")</script>')
EXTRA = ('<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml">'
         '<head><title>More</title><script>alert(5)</script></head>'
         '<body><p onload="x()">More to read.</p></body></html>')
CSS = (f'@import url("https://{EVIL}/a.css");\n'
       f"p {{ background: url('https://{EVIL}/b.png'); color: #333 }}\n")
PICTURE = ('<?xml version="1.0" encoding="utf-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="4" '
           'height="4" onload="alert(6)"><script>alert(7)</script><rect width="4" height="4"/></svg>')
MANIFEST = ('<item id="extra" href="text/extra.xhtml" media-type="application/xhtml+xml" '
            'properties="scripted"/>'
            '<item id="js" href="js/app.js" media-type="application/javascript"/>'
            '<item id="css" href="style/book.css" media-type="text/css"/>'
            '<item id="pic" href="images/pic.svg" media-type="image/svg+xml"/>')


def hostile_epub() -> bytes:
    chapter = ('<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/'
               f'xhtml"><head><title>one</title>{HEAD}</head><body>{BODY}</body></html>')
    extra = {"OEBPS/text/extra.xhtml": EXTRA, "OEBPS/js/app.js": b"x()", "OEBPS/style/book.css": CSS,
             "OEBPS/images/pic.svg": PICTURE}
    book = make_epub(manifest_extra=MANIFEST, extra=extra)
    return replace_entry(book, "OEBPS/text/zz_first.xhtml", chapter.encode())


def test_a_hostile_epubs_read_along_copy_holds_no_active_content_and_stays_valid(tmp_path):
    plan, _, out = build("epub", tmp_path, data=hostile_epub())
    assert [m for m in epubcheck(out.epub) if m["severity"] in ("FATAL", "ERROR")] == []
    with zipfile.ZipFile(out.epub) as z:
        names = z.namelist()
        entries = {n: z.read(n) for n in names if not n.endswith(".m4a")}
    assert not [n for n in names if n.endswith(".js")]
    assert not [n for n, data in entries.items() if EVIL.encode() in data]
    for name, data in entries.items():
        if not name.endswith((".xhtml", ".svg", ".opf")):
            continue
        root = etree.fromstring(data)
        for el in root.iter(etree.Element):
            assert etree.QName(el).localname not in ("script", "iframe", "form", "input", "button",
                                                     "base"), name
            for attr, value in el.attrib.items():
                assert not etree.QName(attr).localname.lower().startswith("on"), (name, attr)
                if etree.QName(attr).localname != "title":  # text, not a URL: a book may name JavaScript
                    assert "javascript:" not in value.replace(" ", "").lower(), (name, attr, value)
                if etree.QName(attr).localname == "properties":
                    assert not {"scripted", "remote-resources"} & set(value.split()), (name, value)
    chapter = next(data for n, data in entries.items() if n.endswith("zz_first.xhtml")).decode()
    assert "It began at" in chapter and "dusk" in chapter and 'href="https://example.org/"' in chapter
    assert 'title="JavaScript: the good parts"' in chapter
    assert 'href="../style/book.css"' in chapter  # the book's own stylesheet stays
    assert "none" in next(data for n, data in entries.items() if n.endswith("book.css")).decode()
    assert "More to read." in next(data for n, data in entries.items() if n.endswith("extra.xhtml")).decode()
    with zipfile.ZipFile(out.epub) as z:  # every segment still has its element
        pars = [par for found in overlays(out.epub).values() for par in found]
        ids = {doc: {el.get("id") for el in etree.fromstring(z.read(doc)).iter()} for doc, *_ in pars}
    assert len(pars) == sum(len(c.segments) for c in plan.chapters)
    assert all(fragment in ids[doc] for doc, fragment, *_ in pars)
