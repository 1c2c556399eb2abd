"""Books built in the test: a 3-chapter Markdown book and small EPUBs written with zipfile."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest

MARKDOWN_BOOK = """\
---
title: The Lighthouse Keeper
author: Ada Quill
---
# The Lighthouse Keeper

## Chapter 1: The Storm

Mr. Smith climbed the 132 steps on the 3rd of May, 1895. The lamp cost $12.50.

It was *very* cold. He checked [the log](http://example.com/log) twice.

## Chapter 2: The Ship

- The first mate waved.
- The second mate did not.

```
print("code is not read aloud")
```

## Chapter 3: Morning

Dr. Watson arrived at 7:30, i.e. early. The end.
"""


def tiny_png() -> bytes:
    raw = b"".join(b"\x00" + bytes([200, 30, 30]) * 4 for _ in range(4))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _xhtml(title: str, body: str) -> str:
    return (
        f'<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n'
        f'<html xmlns="http://www.w3.org/1999/xhtml" xmlns:epub="http://www.idpf.org/2007/ops">'
        f"<head><title>{title}</title><style>p {{ margin: 0 }}</style></head><body>{body}</body></html>"
    )


# (file name, <title>, body). The file names and the manifest order differ from the reading order on
# purpose: chapters must follow the spine, and titles must come from the TOC, not the headings.
EPUB_DOCS = [
    ("titlepage.xhtml", "Title Page", "<p>The Clockmaker&nbsp;Tales</p><p>by Ida North</p>"),
    (
        "zz_first.xhtml",
        "one",
        '<h1>Chapter One</h1><p>It began at dusk.</p><script>var x = "no";</script>'
        "<p>The clocks all stopped&#8212;every one.</p>",
    ),
    (
        "aa_second.xhtml",
        "two",
        '<h1 id="c2">Chapter Two</h1><p>Morning came late.</p>'
        '<h2 id="c3">Chapter Three</h2><p>Then it was noon.</p>',
    ),
]
EPUB_TOC = [
    ("zz_first.xhtml", "Chapter One: Dusk"),
    ("aa_second.xhtml#c2", "Chapter Two: Dawn"),
    ("aa_second.xhtml#c3", "Chapter Three: Noon"),
]


def make_epub(
    *,
    nav: bool = True,
    ncx: bool = True,
    cover: bytes | None = None,
    docs=None,
    toc=None,
    extra: dict[str, bytes] | None = None,
    opf_extra: str = "",
    spine: list[int] | None = None,
    manifest_extra: str = "",
) -> bytes:
    docs = EPUB_DOCS if docs is None else docs
    toc = EPUB_TOC if toc is None else toc
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?><container version="1.0" '
            'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
            '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            "</rootfiles></container>",
        )
        for name, title, body in docs:
            z.writestr(f"OEBPS/text/{name}", _xhtml(title, body))
        items = [
            f'<item id="d{i}" href="text/{n}" media-type="application/xhtml+xml"/>'
            for i, (n, _, _) in reversed(list(enumerate(docs)))
        ]
        if nav:
            links = "".join(f'<li><a href="text/{h}">{t}</a></li>' for h, t in toc)
            z.writestr("OEBPS/nav.xhtml", _xhtml("Contents", f'<nav epub:type="toc"><ol>{links}</ol></nav>'))
            items.append(
                '<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>'
            )
        if ncx:
            points = "".join(
                f'<navPoint id="p{i}" playOrder="{i + 1}"><navLabel><text>{t}</text></navLabel>'
                f'<content src="text/{h}"/></navPoint>'
                for i, (h, t) in enumerate(toc)
            )
            z.writestr(
                "OEBPS/toc.ncx",
                '<?xml version="1.0"?><ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" '
                f'version="2005-1"><navMap>{points}</navMap></ncx>',
            )
            items.append('<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>')
        if cover is not None:
            z.writestr("OEBPS/cover.png", cover)
            items.append('<item id="cov" href="cover.png" media-type="image/png" properties="cover-image"/>')
        order = range(len(docs)) if spine is None else spine
        refs = "".join(f'<itemref idref="d{i}"/>' for i in order)
        z.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/">'
            "<dc:title>The Clockmaker Tales</dc:title><dc:creator>Ida North</dc:creator>"
            f"<dc:language>en-GB</dc:language>{opf_extra}</metadata>"
            f"<manifest>{''.join(items)}{manifest_extra}</manifest>"
            f"<spine{' toc=&quot;ncx&quot;' if ncx else ''}>{refs}</spine></package>".replace("&quot;", '"'),
        )
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return buf.getvalue()


def replace_entry(epub: bytes, name: str, data: bytes) -> bytes:
    """The EPUB with one entry's bytes replaced."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(epub)) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, data if info.filename == name else src.read(info))
    return buf.getvalue()


def read_entry(epub: bytes, name: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(epub)) as z:
        return z.read(name)


@pytest.fixture
def markdown_book() -> bytes:
    return MARKDOWN_BOOK.encode()


@pytest.fixture
def epub_book() -> bytes:
    return make_epub(cover=tiny_png())


def make_pdf(pages: list[list[str]], *, outline: list[tuple[str, int]] | None = None,
             info: dict[str, str] | None = None, password: str | None = None) -> bytes:
    """A PDF with a real text layer (Helvetica, one line per string), written by hand and then given an
    outline (title, 0-based page), document information and, optionally, a user password by pypdf."""
    from pypdf import PdfReader, PdfWriter

    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    objects = ["<< /Type /Catalog /Pages 2 0 R >>", ""]
    kids = []
    for lines in pages:
        ops = "BT /F1 11 Tf 72 740 Td 14 TL " + " ".join(f"({escape(line)}) Tj T*" for line in lines) + " ET"
        stream = ops.encode("latin-1")
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{ops}\nendstream")
        content = len(objects)
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {content} 0 R "
                       f"/Resources << /Font << /F1 FONT 0 R >> >> >>")
        kids.append(len(objects))
    objects.append("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    font = len(objects)
    objects = [o.replace("FONT", str(font)) for o in objects]
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(f'{k} 0 R' for k in kids)}] /Count {len(kids)} >>"
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(f"{i} 0 obj\n{body}\nendobj\n".encode("latin-1"))
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode())
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(out.getvalue())))
    for title, page in outline or []:
        writer.add_outline_item(title, page)
    if info:
        writer.add_metadata(info)
    if password is not None:
        writer.encrypt(password)
    final = io.BytesIO()
    writer.write(final)
    return final.getvalue()


def make_docx(blocks: list[tuple[str, str]], *, core: dict[str, str] | None = None) -> bytes:
    """A DOCX from (style, text) paragraphs ("Title", "Heading 1", "Heading 2", "" for body text)."""
    import docx

    document = docx.Document()
    for style, text in blocks:
        document.add_paragraph(text, style=style or None)
    for key, value in (core or {}).items():
        setattr(document.core_properties, key, value)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()
