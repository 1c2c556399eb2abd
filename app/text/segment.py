"""Text for the guide voice, normalised (`app.text.normalise`) and cut: sentences -> segments of bounded
length.

Segments are sized by an estimate, not by speaking: speech is 25 tokens/s and a reader says about
15 characters/s, so a segment's tokens are estimated from its characters (`estimate_tokens`).
A sentence over the bound is cut at clause punctuation, then between words, then hard.
Pauses (after a sentence, a clause cut, a paragraph, a chapter) are data on each segment: the
assembler inserts them, so changing a pause never changes what a segment says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from app.speech import TOKEN_RATE
from app.text.normalise import is_english, normalise


@dataclass(frozen=True)
class SegmentOptions:
    max_tokens: int = 400  # about 16 s of speech per segment
    chars_per_second: float = 15.0
    tokens_per_second: float = TOKEN_RATE
    clause_pause_ms: int = 120  # where a long sentence was cut
    sentence_pause_ms: int = 350
    paragraph_pause_ms: int = 900
    chapter_pause_ms: int = 2000
    speak_titles: bool = True  # the chapter title is the chapter's first segment

    @property
    def max_chars(self) -> int:
        return max(1, int(self.max_tokens / self.tokens_per_second * self.chars_per_second))


DEFAULT_OPTIONS = SegmentOptions()


@dataclass(frozen=True)
class TextSegment:
    text: str  # normalised
    est_tokens: int
    pause_after_ms: int
    paragraph: int  # index in the chapter's paragraphs; -1 for the spoken title


def estimate_tokens(text: str, options: SegmentOptions = DEFAULT_OPTIONS) -> int:
    return max(1, math.ceil(len(text) / options.chars_per_second * options.tokens_per_second))


_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])|(?<=[。！？])")
_ANY_SENTENCE_END_RE = re.compile(r"(?<=[.!?;])\s+|(?<=[。！？；])")
_CLAUSE_RE = re.compile(r"(?<=[,;:、，；：])\s*")


def split_sentences(text: str, language: str = "en") -> list[str]:
    pattern = _SENTENCE_END_RE if is_english(language) else _ANY_SENTENCE_END_RE
    return [s.strip() for s in pattern.split(text) if s.strip()]


def _cut(text: str, max_chars: int) -> list[str]:
    """Cut one over-long sentence into pieces of at most `max_chars`: clauses, then words, then hard."""
    pieces: list[str] = []
    for unit in _pack(_CLAUSE_RE.split(text), max_chars):
        if len(unit) <= max_chars:
            pieces.append(unit)
            continue
        for word_run in _pack(unit.split(" "), max_chars):
            pieces.extend(word_run[i:i + max_chars] for i in range(0, len(word_run), max_chars))
    return [p for p in pieces if p.strip()]


def _pack(parts: Iterable[str], max_chars: int) -> list[str]:
    """Greedily join consecutive parts with spaces while the result fits."""
    out: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if out and len(out[-1]) + 1 + len(part) <= max_chars:
            out[-1] = f"{out[-1]} {part}"
        else:
            out.append(part)
    return out


def segment_paragraph(paragraph: str, index: int, *, language: str = "en",
                      options: SegmentOptions = DEFAULT_OPTIONS) -> list[TextSegment]:
    """One paragraph -> its segments; the last one carries the paragraph pause."""
    segments: list[TextSegment] = []
    for sentence in split_sentences(normalise(paragraph, language), language):
        pieces = _cut(sentence, options.max_chars) if len(sentence) > options.max_chars else [sentence]
        for j, piece in enumerate(pieces):
            pause = options.sentence_pause_ms if j == len(pieces) - 1 else options.clause_pause_ms
            segments.append(TextSegment(piece, estimate_tokens(piece, options), pause, index))
    if segments:
        last = segments[-1]
        segments[-1] = TextSegment(last.text, last.est_tokens, options.paragraph_pause_ms, index)
    return segments


def segment_cue(text: str, index: int, *, language: str = "en",
                options: SegmentOptions = DEFAULT_OPTIONS) -> list[TextSegment]:
    """One subtitle cue -> one segment (several only when it is over the length limit, cut at clauses)."""
    spoken = " ".join(split_sentences(normalise(text, language), language))
    pieces = (_cut(spoken, options.max_chars) if len(spoken) > options.max_chars
              else [spoken] if spoken else [])
    return [TextSegment(piece, estimate_tokens(piece, options),
                        options.sentence_pause_ms if j == len(pieces) - 1 else options.clause_pause_ms, index)
            for j, piece in enumerate(pieces)]


def segment_chapter(title: str, paragraphs: Iterable[str], *, language: str = "en",
                    options: SegmentOptions = DEFAULT_OPTIONS) -> list[TextSegment]:
    """A chapter's paragraphs (raw text) -> segments; the last one carries the chapter pause."""
    segments: list[TextSegment] = []
    if options.speak_titles and title.strip():
        spoken = " ".join(split_sentences(normalise(title, language), language))
        for piece in _cut(spoken, options.max_chars):
            est = estimate_tokens(piece, options)
            segments.append(TextSegment(piece, est, options.paragraph_pause_ms, -1))
    for i, paragraph in enumerate(paragraphs):
        segments.extend(segment_paragraph(paragraph, i, language=language, options=options))
    if segments:
        last = segments[-1]
        segments[-1] = TextSegment(last.text, last.est_tokens, options.chapter_pause_ms, last.paragraph)
    return segments
