"""Chapter selection: `--chapters 3-7,12` renders only those chapters of a book.

    parse_chapters("3-7,12", count)  -> (2, 3, 4, 5, 6, 11): 0-based, in book order, each once
    describe((2, 3, 4, 5, 6, 11))    -> "3-7,12": the selection as the book's record keeps it

Numbers are the book's chapters as the parser finds them, counted from 1 (`wavefarm book render
--chapters` and `POST /v1/books` field `chapters`). The rendered book holds the selected chapters in
order, numbered from 1 in its own files and M4B. Segments are keyed by content, not position
(`app.books.planning.plan`), so a later render of the whole book, or of other chapters, reuses every segment a
selection rendered.
"""

from __future__ import annotations

import re

from app.errors import BadInput

MAX_SPEC_CHARS = 1000
_PART_RE = re.compile(r"\s*(\d{1,6})\s*(?:-\s*(\d{1,6})\s*)?")


def parse_chapters(spec: str, count: int) -> tuple[int, ...]:
    """A selection such as "3-7,12" -> the 0-based indices of those chapters; BadInput, saying why, for
    a malformed part, a chapter 0, a range that runs backwards or a chapter the book does not have."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInput("chapters: give numbers and ranges such as 3-7,12")
    if len(spec) > MAX_SPEC_CHARS:
        raise BadInput(f"chapters: a selection of {len(spec)} characters is too long")
    chosen: set[int] = set()
    for part in spec.split(","):
        match = _PART_RE.fullmatch(part)
        if match is None:
            raise BadInput(f"chapters: {part.strip()!r} is not a number or a range such as 3-7")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if first < 1:
            raise BadInput("chapters are counted from 1")
        if last < first:
            raise BadInput(f"chapters: the range {first}-{last} runs backwards")
        if last > count:
            raise BadInput(f"chapters: the book has {count} chapter{'s' if count != 1 else ''}, "
                           f"so there is no chapter {last}")
        chosen.update(range(first - 1, last))
    return tuple(sorted(chosen))


def describe(indices: tuple[int, ...]) -> str:
    """0-based indices -> their shortest spelling, 1-based ("3-7,12")."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(_span(run))
        run = [i]
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0] + 1) if len(run) == 1 else f"{run[0] + 1}-{run[-1] + 1}"
