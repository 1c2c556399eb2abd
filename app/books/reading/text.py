"""Plain text and Markdown -> `SourceBook`.

- Plain text: paragraphs are separated by blank lines (or, in a file without any blank line, are
  single lines); a short paragraph such as "Chapter 3", "CHAPTER IV. The Storm", "Prologue" starts a
  chapter.
- Markdown: chapters at headings (with one `#` title and several `##`, the `##` ones; otherwise the
  top level used); front matter `title:`/`author:`; code blocks, images, HTML and link targets are
  dropped, emphasis is unwrapped.
Paragraph text stays raw here: normalisation is `app.text.normalise`'s job. The PDF reader reads a PDF
without an outline as plain text through `parse_text`.
"""

from __future__ import annotations

import re

from app.books.reading.source import (
    DEFAULT_LIMITS,
    BookLimits,
    SourceBook,
    SourceChapter,
    decode_text,
    finish_book,
)

_CHAPTER_LINE_RE = re.compile(
    r"^(chapter|part|book|prologue|epilogue|preface|foreword|introduction|afterword)\b[^\n]{0,70}$",
    re.IGNORECASE)


def paragraphs_of(text: str) -> list[str]:
    """Blank-line separated paragraphs, lines joined; a file without blank lines: one per line."""
    blocks = re.split(r"\n\s*\n", text) if re.search(r"\n\s*\n", text) else text.split("\n")
    return [" ".join(line.strip() for line in block.split("\n") if line.strip()) for block in blocks
            if block.strip()]


def parse_text(data: bytes, *, title: str | None = None, author: str | None = None,
               language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    paragraphs = paragraphs_of(decode_text(data, limits))
    book_title = title or "Untitled"
    if not title and paragraphs and len(paragraphs[0]) <= 80 and not _CHAPTER_LINE_RE.match(paragraphs[0]):
        book_title = paragraphs.pop(0)  # a short first line is the title, not text to read twice
    chapters: list[SourceChapter] = []
    current_title, current = book_title, list[str]()
    for paragraph in paragraphs:
        if _CHAPTER_LINE_RE.match(paragraph):
            chapters.append(SourceChapter(current_title, tuple(current)))
            current_title, current = paragraph, []
        else:
            current.append(paragraph)
    chapters.append(SourceChapter(current_title, tuple(current)))
    return finish_book(SourceBook(
        chapters=tuple(chapters), title=book_title, author=author or "",
        language=language or "en"), limits=limits)


# --- Markdown ------------------------------------------------------------------------------------

_FRONT_MATTER_RE = re.compile(r"\A---\n(.*?)\n---\n", re.DOTALL)
_FENCE_RE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.DOTALL | re.MULTILINE)
_ATX_RE = re.compile(r"^(#{1,6})\s+(.{0,500}?)\s*#*\s*$")
_SETEXT_RE = re.compile(r"^([^\n]+)\n(=+|-+)[ \t]*$", re.MULTILINE)
# Each pattern stops at the next bracket, delimiter or newline, so a file full of unclosed brackets or
# delimiters costs linear time, never quadratic.
_INLINE_STEPS = (
    (re.compile(r"!\[[^\[\]\n]{0,500}\]\([^()\n]{0,2000}\)"), ""),  # images
    (re.compile(r"\[([^\[\]\n]{0,500})\]\([^()\n]{0,2000}\)"), r"\1"),  # links keep their text
    (re.compile(r"\[([^\[\]\n]{0,500})\]\[[^\[\]\n]{0,200}\]"), r"\1"),
    (re.compile(r"^[ \t]*\[[^\[\]\n]{1,200}\]:[ \t]*\S+.*$", re.MULTILINE), ""),  # link definitions
    (re.compile(r"</?[A-Za-z][^<>\n]{0,2000}>"), ""),  # inline HTML
    (re.compile(r"^[ \t]*([-*_])([ \t]*\1){2,}[ \t]*$", re.MULTILINE), ""),  # rules
    (re.compile(r"^[ \t]{0,3}(?:>[ \t]?)+", re.MULTILINE), ""),  # block quotes
    (re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])[ \t]+", re.MULTILINE), "\n\n"),  # list items: own paragraphs
    (re.compile(r"\*\*([^*\n]{1,400})\*\*|__([^_\n]{1,400})__"), r"\1\2"),  # strong
    (re.compile(r"\*([^*\n]{1,400})\*|(?<!\w)_([^_\n]{1,400})_(?!\w)|`([^`\n]{1,400})`"), r"\1\2\3"),
)


def _drop_comments(text: str) -> str:
    """Remove <!-- ... --> (an unclosed one runs to the end); str.find keeps it linear."""
    out, pos = [], 0
    while (start := text.find("<!--", pos)) >= 0:
        out.append(text[pos:start])
        end = text.find("-->", start + 4)
        pos = len(text) if end < 0 else end + 3
    out.append(text[pos:])
    return "".join(out)


def parse_markdown(data: bytes, *, title: str | None = None, author: str | None = None,
                   language: str | None = None, limits: BookLimits = DEFAULT_LIMITS) -> SourceBook:
    text = decode_text(data, limits)
    meta: dict[str, str] = {}
    front = _FRONT_MATTER_RE.match(text)
    if front:
        for line in front.group(1).split("\n"):
            key, _, value = line.partition(":")
            meta[key.strip().lower()] = value.strip().strip("\"'")
        text = text[front.end():]
    text = _FENCE_RE.sub("", _drop_comments(text))
    text = _SETEXT_RE.sub(lambda m: ("# " if m.group(2)[0] == "=" else "## ") + m.group(1), text)
    blocks = _markdown_blocks(text)
    levels = [level for level, _ in blocks if level]
    book_title = title or meta.get("title") or ""
    chapter_level = min(levels) if levels else 0
    if levels.count(1) == 1 and 2 in levels:  # one "# Title" over "## Chapter"s
        chapter_level = 2
        book_title = book_title or next(t for lv, t in blocks if lv == 1)
    chapters: list[SourceChapter] = []
    current_title, current = book_title or "Untitled", list[str]()
    for level, content in blocks:
        if level and level <= chapter_level:
            if level == chapter_level:
                chapters.append(SourceChapter(current_title, tuple(current)))
                current_title, current = content, []
            continue  # the book title line itself
        current.extend(paragraphs_of(_inline(content)) if not level else [content])
    chapters.append(SourceChapter(current_title, tuple(current)))
    return finish_book(SourceBook(
        chapters=tuple(chapters), title=book_title or chapters[0].title,
        author=author or meta.get("author", ""),
        language=language or meta.get("lang", meta.get("language", "en")), narrator=meta.get("narrator", ""),
        description=meta.get("description", "")), limits=limits)


def _markdown_blocks(text: str) -> list[tuple[int, str]]:
    """-> [(heading level or 0, heading text or a chunk of body lines)] in order."""
    blocks: list[tuple[int, str]] = []
    body: list[str] = []
    for line in text.split("\n"):
        heading = _ATX_RE.match(line)
        if heading:
            if body:
                blocks.append((0, "\n".join(body)))
                body = []
            blocks.append((len(heading.group(1)), _inline(heading.group(2)).strip()))
        else:
            body.append(line)
    if body:
        blocks.append((0, "\n".join(body)))
    return blocks


def _inline(text: str) -> str:
    for pattern, repl in _INLINE_STEPS:
        text = pattern.sub(repl, text)
    return text
