"""What `book preview` checks on the user's machine before it submits: the chapter asked for is one the
book has. The book is read here with the readers a CPU worker uses (`app.books.reading.parse`), so a
`--chapter 7` of a 3-chapter book fails at once with the count, not after an upload and a parse. A
manifest (tokens or audio files beside it) is left to the server, which reads its files."""

from __future__ import annotations

from pathlib import Path

from app.errors import BadInput


def check_preview_chapter(data: bytes, book: Path, chapter: int) -> None:
    from app.books.planning.select import parse_chapters
    from app.books.reading.parse import check_file_type, parse_book, sniff_format

    check_file_type(book.name)
    if chapter < 1:
        raise BadInput("--chapter counts from 1")
    if sniff_format(data, book.name) == "manifest":
        return
    source = parse_book(data, filename=book.name)
    parse_chapters(str(chapter), len(source.chapters))
