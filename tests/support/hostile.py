"""Hostile book files, one builder per class an attacker tried (issue 28), each small to send and costly
to read: the tests and `scripts/bench_intake.py` send them through the front door.

    timed_subtitles(fmt, hours)      one cue at `hours` (SRT or WebVTT)
    inflating_pdf(mb)                one page whose content stream inflates to `mb` MB of text operators
    shared_stream_pdf(pages)         `pages` pages that all show one large content stream
    deep_outline_pdf(depth)          an outline nested `depth` deep
    docx_declaring(...)              a DOCX one of whose parts declares a DTD (any name, any encoding)
    docx_bad_crc(part)               a DOCX with one part's CRC broken
    deep_json(depth), deep_yaml(depth)   a cast or lexicon nested `depth` deep
    many_patterns(n)                 a lexicon of `n` patterns
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib

from tests.app.books.conftest import make_docx


def timed_subtitles(fmt: str, hours: int) -> bytes:
    if fmt == "vtt":
        return (f"WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nFirst line.\n\n"
                f"{hours}:00:00.000 --> {hours}:00:01.000\nMuch later.\n").encode()
    return (f"1\n00:00:01,000 --> 00:00:02,000\nFirst line.\n\n"
            f"2\n{hours}:00:00,000 --> {hours}:00:01,000\nMuch later.\n").encode()


def _pdf(objects: list[bytes]) -> bytes:
    """A PDF of these objects (1-based ids, object 1 the catalog), with a correct cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def _flate_stream(content: bytes) -> bytes:
    packed = zlib.compress(content, 9)
    return b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream"


_FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def _text_ops(mb: float) -> bytes:
    line = b"(All work and no play makes a dull book.) Tj T* "
    return b"BT /F1 11 Tf 72 740 Td 14 TL " + line * int(mb * 1024 * 1024 / len(line)) + b"ET"


def inflating_pdf(mb: float = 26.0) -> bytes:
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R " \
           b"/Resources << /Font << /F1 5 0 R >> >> >>"
    return _pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>", page,
                 _flate_stream(_text_ops(mb)), _FONT])


def shared_stream_pdf(pages: int = 5000, mb: float = 0.5) -> bytes:
    """`pages` pages whose /Contents are all the same stream: small on disk, each page read in full."""
    first = 3 + 2  # objects 3 and 4 are the stream and the font; pages follow
    kids = b" ".join(b"%d 0 R" % (first + i) for i in range(pages))
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R " \
           b"/Resources << /Font << /F1 4 0 R >> >> >>"
    return _pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>"
                 % pages, _flate_stream(_text_ops(mb)), _FONT, *([page] * pages)])


def deep_outline_pdf(depth: int = 20_000) -> bytes:
    """One page with text and an outline whose every item has one child, `depth` levels down."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R /Outlines 6 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               _flate_stream(b"BT /F1 11 Tf 72 740 Td (A page of text.) Tj ET"), _FONT,
               b"<< /Type /Outlines /First 7 0 R /Last 7 0 R /Count 1 >>"]
    for level in range(depth):
        me, parent = 7 + level, 6 + level
        child = b" /First %d 0 R /Last %d 0 R /Count 1" % (me + 1, me + 1) if level + 1 < depth else b""
        objects.append(b"<< /Title (Level %d) /Parent %d 0 R /Dest [3 0 R /Fit]%s >>"
                       % (level, parent, child))
    return _pdf(objects)


def _rewrite_docx(docx: bytes, change: dict[str, bytes], *, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(docx)) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info, change.get(info.filename, src.read(info)))
        for name, data in (extra or {}).items():
            dst.writestr(name, data)
    return buf.getvalue()


_LAUGHS = ('<?xml version="1.0" encoding="{enc}"?>\n<!DOCTYPE lolz [<!ENTITY lol "lol">'
           '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>\n')


def docx_declaring(*, encoding: str = "utf-32", part: str = "word/document.xml") -> bytes:
    """A DOCX whose `part` (an existing one, or a new one with any name) starts with a DTD declaring
    entities, written in `encoding` (with its BOM where the codec writes one)."""
    plain = make_docx([("Heading 1", "One"), ("", "Some text.")])
    with zipfile.ZipFile(io.BytesIO(plain)) as z:
        original = z.read("word/document.xml").decode("utf-8") if part == "word/document.xml" else ""
    body = original.split("?>", 1)[1] if original else "<x>&lol2;</x>"
    declared = (_LAUGHS.format(enc=encoding.upper()) + body).encode(encoding)
    if part == "word/document.xml":
        return _rewrite_docx(plain, {part: declared})
    return _rewrite_docx(plain, {}, extra={part: declared})


def docx_bad_crc(part: str = "word/document.xml") -> bytes:
    """A DOCX whose `part` has a CRC-32 in its headers that does not match its bytes (stored, so the
    bytes are plain to find)."""
    plain = make_docx([("Heading 1", "One"), ("", "Some text.")])
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(plain)) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            content = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, content)
    data = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        offset = z.getinfo(part).header_offset
    name_len, extra_len = struct.unpack("<HH", data[offset + 26:offset + 30])  # the local header's own
    data[offset + 30 + name_len + extra_len + 10] ^= 0xFF  # a byte of the part changed, its CRC kept
    return bytes(data)


def deep_json(depth: int = 30_000) -> bytes:
    return ('{"words": ' + '{"a": ' * depth + '"b"' + "}" * depth + "}").encode()


def deep_yaml(depth: int = 30_000) -> bytes:
    return ("words: " + "[" * depth + "]" * depth + "\n").encode()


def many_patterns(n: int) -> bytes:
    return json.dumps({"patterns": [{"match": rf"\bw{i}(\d)\b", "say": rf"word {i} \1"} for i in range(n)]}
                      ).encode()
