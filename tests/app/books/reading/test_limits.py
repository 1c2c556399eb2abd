"""What a book may not carry: XML entities or DTD subsets in an EPUB's package files (wherever they are,
in any encoding), and titles or authors past their length limits in every format."""

from __future__ import annotations

import json

import pytest

from app.books.reading.epub import parse_epub
from app.books.reading.manifest import parse_manifest
from app.books.reading.text import parse_markdown, parse_text
from app.errors import BadInput
from tests.app.books.conftest import make_epub, read_entry, replace_entry

OPF = "OEBPS/content.opf"
LONG = "x" * 600  # titles and authors may have 500 characters


def _entity_opf(comment_bytes: int, entity_chars: int = 10_000, refs: int = 95) -> str:
    """The test EPUB's package document with a long comment, then an internal DTD subset declaring an
    entity that its dc:title uses `refs` times (the shape of the 6.1 MB upload that made a 760 MiB title)."""
    opf = read_entry(make_epub(), OPF).decode()
    head, body = opf.split("?>", 1)
    subset = f'<!DOCTYPE package [<!ENTITY a "{"A" * entity_chars}">]>'
    body = body.replace("<dc:title>The Clockmaker Tales</dc:title>", f"<dc:title>{'&a;' * refs}</dc:title>")
    return f"{head}?><!-- {'c' * comment_bytes} -->\n{subset}{body}"


def test_an_entity_declared_after_a_70_kb_comment_is_refused() -> None:
    epub = replace_entry(make_epub(), OPF, _entity_opf(70_000).encode())
    with pytest.raises(BadInput, match="content.opf' declares XML entities"):
        parse_epub(epub)


def test_an_entity_declared_in_a_utf16_package_document_is_refused() -> None:
    opf = _entity_opf(10).replace('<?xml version="1.0"?>', '<?xml version="1.0" encoding="utf-16"?>')
    assert opf.startswith('<?xml version="1.0" encoding="utf-16"?>')
    epub = replace_entry(make_epub(), OPF, opf.encode("utf-16"))
    with pytest.raises(BadInput, match="content.opf' declares XML entities"):
        parse_epub(epub)


def test_a_dtd_internal_subset_without_entities_is_refused_too() -> None:
    opf = read_entry(make_epub(), OPF).decode().replace(
        "?>", '?><!DOCTYPE package [<!ATTLIST package unique-identifier CDATA "x">]>', 1)
    with pytest.raises(BadInput, match="content.opf' declares XML entities or a DTD"):
        parse_epub(replace_entry(make_epub(), OPF, opf.encode()))


def test_an_epub2_ncx_naming_its_public_dtd_is_still_read() -> None:
    epub = make_epub(nav=False)
    ncx = read_entry(epub, "OEBPS/toc.ncx").decode().replace(
        "?>", '?><!DOCTYPE ncx PUBLIC "-//NISO//DTD ncx 2005-1//EN" '
              '"http://www.daisy.org/z3986/2005/ncx-2005-1.dtd">', 1)
    book = parse_epub(replace_entry(epub, "OEBPS/toc.ncx", ncx.encode()))
    assert [c.title for c in book.chapters][1:] == ["Chapter One: Dusk", "Chapter Two: Dawn",
                                                     "Chapter Three: Noon"]


def test_an_over_long_epub_title_author_or_chapter_title_is_refused() -> None:
    opf = read_entry(make_epub(), OPF).decode()
    for old, what in (("The Clockmaker Tales</dc:title>", "the book's title"),
                      ("Ida North</dc:creator>", "the book's author")):
        long_opf = opf.replace(old, LONG + old[old.index("<"):])
        with pytest.raises(BadInput, match=f"{what} is {len(LONG)} characters .*the limit is 500"):
            parse_epub(replace_entry(make_epub(), OPF, long_opf.encode()))
    toc = [("zz_first.xhtml", LONG), ("aa_second.xhtml#c2", "Two")]
    with pytest.raises(BadInput, match=f"the title of chapter 2 is {len(LONG)} characters"):
        parse_epub(make_epub(toc=toc))


def test_titles_of_text_markdown_and_manifests_have_the_same_limits() -> None:
    with pytest.raises(BadInput, match="the book's title is"):
        parse_text(b"Some text to read.", title=LONG)
    with pytest.raises(BadInput, match="the book's title is"):
        parse_markdown(f"---\ntitle: {LONG}\n---\nSome text.\n".encode())
    with pytest.raises(BadInput, match="the book's author is"):
        parse_markdown(b"Some text.", author=LONG)
    chapter = {"title": LONG, "segments": [{"tokens": [1, 2, 3]}]}
    with pytest.raises(BadInput, match="the title of chapter 1 is"):
        parse_manifest(json.dumps({"chapters": [chapter]}).encode())
    with pytest.raises(BadInput, match="the book's title is"):
        parse_manifest(json.dumps({"title": LONG, "chapters": [{**chapter, "title": "One"}]}).encode())


def test_titles_at_the_limit_are_kept() -> None:
    title = "t" * 500
    assert parse_text(b"Some text to read.", title=title).title == title
