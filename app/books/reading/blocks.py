"""What the markup readers share: collecting an HTML document's text block by block, and cutting a run
of (heading level, text) blocks into chapters. Used by `app.books.reading.epub` (XHTML chapters),
`app.books.reading.webpage` (HTML) and `app.books.reading.word` (DOCX headings), which import nothing of each
other.
"""

from __future__ import annotations

from html.parser import HTMLParser

from app.books.reading.source import SourceChapter


class BlockText(HTMLParser):
    """Text collected between block boundaries: a subclass calls `flush()` where a block ends and gets
    each non-empty block's whitespace-collapsed text in `emit`. Text inside a skipped element (`skip()`
    ... `unskip()`) is dropped; text inside <title> goes to `title`."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self._buffer: list[str] = []
        self._skip = 0
        self._in_title = False

    def skip(self, *, title: bool = False) -> None:
        self._skip += 1
        self._in_title = title

    def unskip(self) -> None:
        self._skip = max(0, self._skip - 1)
        self._in_title = False

    @property
    def skipping(self) -> bool:
        return bool(self._skip)

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skip:
            self._buffer.append(data)

    def close(self) -> None:
        super().close()
        self.flush()

    def flush(self) -> None:
        text = " ".join("".join(self._buffer).split())
        self._buffer = []
        if text:
            self.emit(text)

    def emit(self, text: str) -> None:
        raise NotImplementedError


def chapters_at_headings(blocks: list[tuple[int, str]], book_title: str) -> list[SourceChapter]:
    """(heading level or 0, text) blocks -> chapters at the chapter level: with exactly one level-1
    heading over level-2 ones, level 2 (the level-1 heading is the book's title); else the top level used.
    Text before the first chapter heading is a chapter titled by the book (dropped by `finish_book` when
    empty); deeper headings are read as paragraphs."""
    levels = [level for level, _ in blocks if level]
    chapter_level = min(levels) if levels else 0
    if levels.count(1) == 1 and 2 in levels:
        chapter_level = 2
    chapters: list[SourceChapter] = []
    current_title, current = book_title or "Untitled", list[str]()
    for level, text in blocks:
        if level and level < chapter_level:
            continue  # the book's title heading
        if level and level == chapter_level:
            chapters.append(SourceChapter(current_title, tuple(current)))
            current_title, current = text, []
        else:
            current.append(text)
    chapters.append(SourceChapter(current_title, tuple(current)))
    return chapters
