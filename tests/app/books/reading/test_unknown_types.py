"""An RTF document is refused by the reader whatever its name (read as text, its control words would
become the title and the words); a name with an extension no reader takes is refused at submission."""

from __future__ import annotations

import pytest

from app.books.reading.parse import check_file_type, parse_book
from app.errors import BadInput


def test_an_rtf_named_as_text_is_refused_with_the_readable_types() -> None:
    with pytest.raises(BadInput, match=r"an RTF document, which wavefarm does not read; save it as one of"):
        parse_book(b"{\\rtf1\\ansi{\\fonttbl\\f0 Times;}\\f0 Chapter one. Hello.}", filename="novel.txt")


@pytest.mark.parametrize("name", ["novel.txt", "novel.MD", "README", None, "a.epub", "b.json"])
def test_the_readers_extensions_and_no_extension_pass(name: str | None) -> None:
    check_file_type(name)


@pytest.mark.parametrize("name", ["novel.rtf", "novel.odt", "novel.doc", "scan.djvu"])
def test_other_extensions_are_refused(name: str) -> None:
    with pytest.raises(BadInput, match="is not a book wavefarm reads"):
        check_file_type(name)
