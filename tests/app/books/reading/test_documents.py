"""HTML, PDF and DOCX books: chapters, text, metadata, and the same refusals as an EPUB's."""

import io
import zipfile

import pytest

from app.books.reading.parse import parse_book, sniff_format
from app.books.reading.pdf import parse_pdf
from app.books.reading.source import BookLimits
from app.books.reading.webpage import parse_html
from app.books.reading.word import parse_docx
from app.errors import BadInput
from tests.app.books.conftest import make_docx, make_pdf

LINE = "It was a long road that ran from the sea to the hills and on and on, while"

PAGE = b"""<!DOCTYPE html>
<html lang="en-GB"><head><title>The Long Road</title>
<meta name="author" content="A.  Walker"><meta name="description" content="A walk &amp; a talk.">
<style>p { color: red }</style><script>var notRead = "x";</script></head>
<body><nav><a href="/">Home</a></nav>
<h1>The Long Road</h1>
<h2>One</h2><p>It was a long road &mdash; the longest.</p><p>Nobody <em>knew</em> where it ended.</p>
<h2>Two</h2><p>Morning came.</p><h3>A scene</h3><p>The birds sang.</p>
<form><button>Buy</button></form>
</body></html>"""


def test_html_chapters_come_from_its_headings_and_only_its_text_is_read():
    book = parse_html(PAGE)
    assert (book.title, book.author, book.language, book.description) == (
        "The Long Road", "A. Walker", "en-gb", "A walk & a talk.")
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("One", ("It was a long road \u2014 the longest.", "Nobody knew where it ended.")),
        ("Two", ("Morning came.", "A scene", "The birds sang.")),
    ]
    assert sniff_format(PAGE) == "html" and parse_book(PAGE).chapters == book.chapters
    declared = b'<!DOCTYPE html [<!ENTITY e "boom">]><html><body><h1>A</h1><p>&e; text</p></body></html>'
    with pytest.raises(BadInput, match="declares a DTD subset or an entity"):
        parse_html(declared)


def test_pdf_chapters_follow_its_outline_and_paragraphs_are_rejoined():
    pdf = make_pdf(
        [["The Long Road", "by A. Walker"], ["Chapter One", LINE, "nobody knew where it ended.",
                                             "The second para-", "graph is short."],
         ["More of chapter one."], ["Chapter Two", "Morning came."]],
        outline=[("Chapter One", 1), ("Chapter Two", 3)],
        info={"/Title": "The Long Road", "/Author": "A. Walker", "/Subject": "A walk."})
    book = parse_pdf(pdf)
    assert (book.title, book.author, book.description) == ("The Long Road", "A. Walker", "A walk.")
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("The Long Road", ("The Long Road", "by A. Walker")),  # front matter before the first entry
        ("Chapter One", (LINE + " nobody knew where it ended.", "The second paragraph is short.",
                         "More of chapter one.")),
        ("Chapter Two", ("Morning came.",)),  # the title's own line is not read twice
    ]
    assert sniff_format(pdf) == "pdf" and parse_book(pdf, filename="x.pdf").chapters == book.chapters


def test_a_pdf_without_an_outline_finds_its_chapter_headings_as_text_does():
    pdf = make_pdf([["Chapter 1", LINE + "."], ["Chapter 2", "The end of it all, at last, for now."]])
    book = parse_pdf(pdf)
    assert [c.title for c in book.chapters] == ["Chapter 1", "Chapter 2"]


def test_pdfs_that_cannot_be_read_are_refused_with_the_reason():
    with pytest.raises(BadInput, match="no text layer"):
        parse_pdf(make_pdf([[], []]))
    with pytest.raises(BadInput, match="encrypted with a password"):
        parse_pdf(make_pdf([["Chapter 1", "Secret."]], password="hunter2"))
    opens = parse_pdf(make_pdf([["Chapter 1", LINE + "."]], password=""))  # permissions only: it opens
    assert opens.chapters[0].title == "Chapter 1"
    with pytest.raises(BadInput, match="not a readable PDF|not a PDF"):
        parse_pdf(b"%PDF-1.4\n1 0 obj garbage")
    with pytest.raises(BadInput, match="has 3 pages; the limit is 2"):
        parse_pdf(make_pdf([["a"], ["b"], ["c"]]), limits=BookLimits(max_pdf_pages=2))


def test_docx_chapters_come_from_heading_styles_and_metadata_from_core_properties():
    data = make_docx(
        [("Title", "The Long Road"), ("Heading 1", "One"), ("", "It was a long road."), ("", ""),
         ("", "Nobody knew."), ("Heading 1", "Two"), ("Heading 2", "A scene"), ("", "Morning came.")],
        core={"author": "A. Walker", "subject": "A walk.", "language": "en-GB"})
    book = parse_docx(data)
    assert (book.title, book.author, book.language, book.description) == (
        "The Long Road", "A. Walker", "en-gb", "A walk.")
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("One", ("It was a long road.", "Nobody knew.")), ("Two", ("A scene", "Morning came."))]
    assert sniff_format(data) == "docx" and parse_book(data).chapters == book.chapters


def _with_part(docx: bytes, name: str, content: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(docx)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info, content if info.filename == name else src.read(info))
    return out.getvalue()


def test_docx_refusals_match_the_epubs():
    data = make_docx([("Heading 1", "One"), ("", "Text.")])
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        document = z.read("word/document.xml")
    entity = document.replace(b"?>", b'?><!DOCTYPE w:document [<!ENTITY x "boom">]>', 1)
    with pytest.raises(BadInput, match="declares a DTD or an entity"):
        parse_docx(_with_part(data, "word/document.xml", entity))
    utf16 = entity.decode("utf-8").replace('encoding="UTF-8"', 'encoding="UTF-16"').encode("utf-16")
    with pytest.raises(BadInput, match="declares a DTD or an entity"):
        parse_docx(_with_part(data, "word/document.xml", utf16))
    bomb = _with_part(data, "word/document.xml", document + b" " * (8 * 1024 * 1024))
    with pytest.raises(BadInput, match="DOCX file 'word/document.xml' is compressed .*zip bomb"):
        parse_docx(bomb)
    with pytest.raises(BadInput, match="not a valid DOCX: the zip container is broken"):
        parse_docx(b"PK\x03\x04 not really")
