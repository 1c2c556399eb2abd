"""What a read-along EPUB shows: each chapter's text as the book gives it, cut where its spoken segments
are cut, so that each piece of text can be highlighted while its segment plays.

    readalong_text(source, plan) -> [ChapterText]   in the reading child (`app.books.intake_child`), which has
                                                    the book's own text; stored as readalong.json
    load_text(data) -> [ChapterText]                 what the EPUB writer (`app.books.writing.readalong_epub`)
    reads back

A segment's text is the *normalised* text ("Doctor" for "Dr.", "twelve" for "12"); what the reader sees is
the paragraph as written (cast markup removed). The two are matched word by word (difflib over the words'
lower-cased forms): each segment's first word is found in the paragraph and the paragraph is cut just
before it, so the pieces of a paragraph are in order, cover it whole, and each names the segments it
shows. A segment that matches nothing visible (its cut falls on the previous one's) shares the piece
before it. The chapter title is the chapter's heading; a subtitle chapter speaks no title, so its heading
names no segment. Not done here: the XHTML of an EPUB source itself (every source gets the same plain
headings and paragraphs).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.books.planning.cast import VoiceState, split_runs
from app.books.planning.plan import BookPlan, PlanChapter
from app.books.reading.source import SourceBook, SourceChapter
from app.errors import BadInput

_WORD_RE = re.compile(r"\w+")
MAX_ALIGNED_WORDS = 5000  # longer paragraphs are cut in proportion to their segments' lengths

Piece = tuple[str, tuple[int, ...]]  # (text as shown, indices in its chapter of the segments it shows)


@dataclass(frozen=True)
class Block:
    tag: str  # "h1" (the chapter's title) or "p"
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ChapterText:
    title: str
    blocks: tuple[Block, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "blocks": [[b.tag, [[t, list(s)] for t, s in b.pieces]]
                                                for b in self.blocks]}


@dataclass(frozen=True)
class ReadAlong:
    """What the EPUB writer needs besides the audio: the shown text of each chapter, and for an EPUB
    source whose XHTML could be annotated, its own documents (`app.books.planning.readalong_source`: the
    description and
    the skeleton zip); without them the EPUB holds plain documents made from `texts`."""

    texts: tuple[ChapterText, ...]
    source: dict[str, Any] | None = None
    skeleton: Path | None = None


def load_text(data: Any) -> list[ChapterText]:
    """readalong.json's list (written by `readalong_text`'s caller) -> chapters."""
    return [ChapterText(c["title"], tuple(Block(tag, tuple((t, tuple(s)) for t, s in pieces))
                                           for tag, pieces in c["blocks"])) for c in data]


def readalong_text(source: SourceBook, plan: BookPlan) -> list[ChapterText]:
    """The shown text of every planned chapter, cut at its segments; BadInput for a book without text."""
    return [_chapter_text(own, chapter) for own, chapter in planned_sources(source, plan)]


def planned_sources(source: SourceBook, plan: BookPlan) -> list[tuple[SourceChapter, PlanChapter]]:
    """Each planned chapter with the source chapter it was planned from (a source chapter with nothing to
    say has no plan chapter); BadInput for a book without text."""
    if any(c.items for c in source.chapters):
        raise BadInput("a manifest of tokens or audio has no text to read along; epub3 needs a text book")
    out = []
    sources = iter(source.chapters)
    for chapter in plan.chapters:
        own = next((s for s in sources if _matches(s, chapter)), None)
        if own is None:  # cannot happen for a plan made from this source; refuse rather than misalign
            raise BadInput(f"chapter {chapter.index + 1} of the plan has no source text")
        out.append((own, chapter))
    return out


def _matches(source: SourceChapter, chapter: PlanChapter) -> bool:
    return source.title == chapter.title and all(s.paragraph < len(source.paragraphs)
                                                 for s in chapter.segments)


def _chapter_text(source: SourceChapter, chapter: PlanChapter) -> ChapterText:
    by_paragraph: dict[int, list[int]] = {}
    for i, segment in enumerate(chapter.segments):
        by_paragraph.setdefault(segment.paragraph, []).append(i)
    blocks = [_block("h1", " ".join(source.title.split()), by_paragraph.get(-1, []), chapter)]
    for p, paragraph in enumerate(source.paragraphs):
        shown = " ".join(" ".join(text for _, text in split_runs(paragraph, VoiceState())).split())
        blocks.append(_block("p", shown, by_paragraph.get(p, []), chapter))
    return ChapterText(chapter.title, tuple(b for b in blocks if b.pieces))


def _block(tag: str, shown: str, segments: list[int], chapter: PlanChapter) -> Block:
    spoken = [chapter.segments[i].text for i in segments]
    if not shown:
        shown = " ".join(spoken)
    if not segments:
        return Block(tag, ((shown, ()),) if shown else ())
    cuts = split_like(shown, spoken)
    pieces: list[tuple[str, list[int]]] = []
    for i, (start, end) in zip(segments, zip(cuts, [*cuts[1:], len(shown)], strict=True), strict=True):
        text = shown[start:end].strip()
        if text or not pieces:
            pieces.append((text, [i]))
        else:
            pieces[-1][1].append(i)  # nothing of its own to show: highlighted with the piece before
    if not pieces[0][0] and len(pieces) > 1:  # the first segment showed nothing: it shares the next one's
        pieces[1] = (pieces[1][0], pieces[0][1] + pieces[1][1])
        pieces = pieces[1:]
    return Block(tag, tuple((t, tuple(s)) for t, s in pieces))


def split_like(shown: str, spoken: Sequence[str]) -> list[int]:
    """Where in `shown` each of the `spoken` pieces (its normalised text, in order) starts: a cut before
    the word that matches each piece's first word, non-decreasing, the first at 0."""
    shown_words = [(m.start(), m.group().lower()) for m in _WORD_RE.finditer(shown)]
    firsts: list[int] = []
    words: list[str] = []
    for text in spoken:
        firsts.append(len(words))
        words += [w.lower() for w in _WORD_RE.findall(text)]
    if not shown_words or len(words) > MAX_ALIGNED_WORDS or len(shown_words) > MAX_ALIGNED_WORDS:
        return _proportional(shown, spoken)
    matcher = difflib.SequenceMatcher(None, words, [w for _, w in shown_words], autojunk=False)
    blocks = matcher.get_opcodes()
    cuts = [0]
    for first in firsts[1:]:
        at = _mapped(blocks, first, len(shown_words))
        start = shown_words[at][0] if at < len(shown_words) else len(shown)
        space = shown.rfind(" ", cuts[-1], start)  # an opening quote or bracket goes with its word
        cuts.append(max(cuts[-1], space + 1 if space >= 0 else start))
    return cuts


def _mapped(opcodes: Sequence[tuple[str, int, int, int, int]], word: int, shown_count: int) -> int:
    """The index among the shown words of spoken word `word` (the start of an unequal run for one in it)."""
    for tag, i1, i2, j1, _ in opcodes:
        if i1 <= word < i2:
            return j1 + (word - i1) if tag == "equal" else j1
    return shown_count


def _proportional(shown: str, spoken: Sequence[str]) -> list[int]:
    total = sum(len(t) for t in spoken) or 1
    cuts, done = [0], 0
    for text in spoken[:-1]:
        done += len(text)
        at = round(len(shown) * done / total)
        space = shown.find(" ", at)
        cuts.append(max(cuts[-1], space + 1 if space >= 0 else len(shown)))
    return cuts
