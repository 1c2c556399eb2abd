"""`SourceBook` -> `BookPlan`: chapters -> segments, each with a content key.

A segment's key is the sha256 of what decides its audio and nothing else:
    (kind, content, voice id, source options)
where content is the normalised text as said (kind "text", after the pronunciation lexicon,
`app.books.planning.lexicon`), the speech tokens ("tokens"), or the source audio file's sha256 ("audio"), and
source options are the caller's render options (seed, model ...) plus, for text, the guide voice's
identity (`app.text.guide_voice.identity`). Position, chapter, title and pauses are not in it, so
re-rendering a book reuses every finished segment, an edit to one paragraph (or to one lexicon entry)
changes only the keys of the segments it changes, and a repeated sentence is rendered once. Pauses live
on the segments and in the plan's own `key`, which names the assembled output.

The plan is plain data; `to_dict` gives JSON for Celery and the database.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from app.books.planning.cast import NARRATOR, VoiceState, check_cast, split_runs
from app.books.planning.lexicon import EMPTY, Budget, Lexicon
from app.books.reading.publication import Publication, publication_from_dict
from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, SourceChapter
from app.errors import BadInput
from app.speech import TOKEN_RATE
from app.text.segment import (
    DEFAULT_OPTIONS,
    SegmentOptions,
    TextSegment,
    segment_chapter,
    segment_cue,
    segment_paragraph,
)

KEY_VERSION = 1  # bump when a change here or in normalisation should re-render every book
Kind = Literal["text", "tokens", "audio"]
_VOICE_ID_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PlanSegment:
    key: str
    kind: Kind
    text: str  # normalised text to speak ("" for tokens and audio)
    tokens: tuple[int, ...] | None  # kind "tokens"
    audio: str | None  # kind "audio": path relative to the manifest
    est_tokens: int
    pause_after_ms: int
    paragraph: int  # index in the source chapter (-1: the spoken title; items: the item's index)
    say: str = ""  # kind "text": what the guide voice says (after the lexicon), when it is not `text`
    voice: str = ""  # the voice id, when it is not the book's (a cast member's line,
    # `app.books.planning.cast`)
    start_ms: int = -1  # subtitles: where its cue starts on the chapter's timeline (-1: no cue starts here)

    @property
    def spoken(self) -> str:
        return self.say or self.text


@dataclass(frozen=True)
class PlanChapter:
    index: int
    title: str
    segments: tuple[PlanSegment, ...]


@dataclass(frozen=True)
class BookPlan:
    title: str
    author: str
    language: str
    voice_id: str
    chapters: tuple[PlanChapter, ...]
    key: str  # changes when anything the assembled book depends on changes
    narrator: str = ""  # the players' tags; not spoken, not in any segment's key
    description: str = ""
    cast: dict[str, str] = field(default_factory=dict)  # folded voice name -> voice id, as the book uses
    series: str = ""  # the players' and Audiobookshelf's series and the book's place in it; not spoken
    series_part: str = ""
    publication: Publication = Publication()  # publisher, year, ISBN, genres: the tags; not spoken

    def voice_of(self, segment: PlanSegment) -> str:
        return segment.voice or self.voice_id

    def voices(self) -> list[str]:
        """Every voice the book speaks in, the book's own first."""
        return list(dict.fromkeys([self.voice_id, *(s.voice for _, s in self.segments() if s.voice)]))

    def segments(self) -> Iterator[tuple[PlanChapter, PlanSegment]]:
        for chapter in self.chapters:
            for segment in chapter.segments:
                yield chapter, segment

    def unique_keys(self) -> list[str]:
        """Every distinct segment key once, in reading order: the render work list."""
        return list(dict.fromkeys(s.key for _, s in self.segments()))

    @property
    def est_seconds(self) -> float:
        return sum(s.est_tokens for _, s in self.segments()) / TOKEN_RATE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BookPlan:
        """Inverse of `to_dict` (after a JSON round trip: lists back to tuples)."""
        chapters = tuple(
            PlanChapter(c["index"], c["title"], tuple(
                PlanSegment(**{**s, "tokens": None if s["tokens"] is None else tuple(s["tokens"])})
                for s in c["segments"]))
            for c in data["chapters"])
        return cls(data["title"], data["author"], data["language"], data["voice_id"], chapters, data["key"],
                   data.get("narrator", ""), data.get("description", ""), dict(data.get("cast", {})),
                   data.get("series", ""), data.get("series_part", ""),
                   publication_from_dict(data.get("publication") or {}))


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def segment_key(*, kind: Kind, content: str | list[int], voice_id: str, options: Mapping[str, Any]) -> str:
    payload = {"v": KEY_VERSION, "kind": kind, "content": content, "voice": voice_id,
               "options": dict(options)}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def plan_book(book: SourceBook, *, voice_id: str, render_options: Mapping[str, Any] | None = None,
              guide_options: Mapping[str, Any] | None = None, options: SegmentOptions = DEFAULT_OPTIONS,
              limits: BookLimits = DEFAULT_LIMITS, lexicon: Lexicon = EMPTY,
              cast: Mapping[str, str] | None = None, lexicon_budget: Budget | None = None) -> BookPlan:
    """Plan every chapter. `render_options` go into every key, `guide_options` into text keys; the
    lexicon changes what text segments say (and so their keys), not what they show, its patterns within
    `lexicon_budget` over the whole book; `cast` maps the voice names of the text's markup (folded,
    `app.books.planning.cast`) to voice ids."""
    budget = lexicon_budget or Budget()
    if not _VOICE_ID_RE.fullmatch(voice_id):
        raise BadInput(f"voice id {voice_id!r} is not a sha256 hex digest")
    voices = _Voices(voice_id, dict(cast or {}))
    common = dict(render_options or {})
    text_options = {**common, "guide": dict(guide_options or {}), "language": book.language}
    chapters: list[PlanChapter] = []
    count = 0
    for source in book.chapters:
        segments = (_items(source, voice_id, common, options) if source.items
                    else _text(source, book.language, voices, text_options, options, lexicon, budget,
                               where=f"chapter {len(chapters) + 1}"))
        count += len(segments)
        if count > limits.max_segments:
            raise BadInput(f"the book makes more than {limits.max_segments} segments; split it")
        if segments:
            chapters.append(PlanChapter(len(chapters), source.title, tuple(segments)))
    check_cast(voices.used, voices.cast)
    if not chapters:
        raise BadInput("the book has nothing to speak after normalisation")
    book_key = hashlib.sha256(canonical_json({
        "v": KEY_VERSION, "title": book.title, "author": book.author, "narrator": book.narrator,
        "description": book.description,
        "chapters": [[c.title, [[s.key, s.pause_after_ms] for s in c.segments]] for c in chapters],
    })).hexdigest()
    return BookPlan(book.title, book.author, book.language, voice_id, tuple(chapters), book_key,
                    book.narrator, book.description, {n: voices.cast[n] for n in sorted(voices.used)},
                    publication=book.publication)


def preview_plan(plan: BookPlan, seconds: float) -> BookPlan:
    """The plan's first chapter cut to its first segments that fit `seconds` of estimated speech (at least
    one): a preview. Its segments keep their keys, so rendering the whole book later reuses them."""
    chapter = plan.chapters[0]
    kept: list[PlanSegment] = []
    for segment in chapter.segments:
        if kept and (sum(s.est_tokens for s in kept) + segment.est_tokens) / TOKEN_RATE > seconds:
            break
        kept.append(segment)
    key = hashlib.sha256(canonical_json({"preview_of": plan.key, "segments": len(kept)})).hexdigest()
    return replace(plan, chapters=(PlanChapter(0, chapter.title, tuple(kept)),), key=key)


@dataclass
class _Voices:
    book: str  # the book's own voice id (the narrator)
    cast: dict[str, str]  # folded name -> voice id
    used: dict[str, str] = field(default_factory=dict)  # folded name -> where it first occurs

    def id_of(self, name: str, where: str) -> str:
        """"" for the narrator (the book's voice), else the cast member's id (a missing one is recorded)."""
        if name == NARRATOR:
            return ""
        self.used.setdefault(name, where)
        voice = self.cast.get(name, "")
        return "" if voice == self.book else voice


def _text(source: SourceChapter, language: str, voices: _Voices, key_options: Mapping[str, Any],
          options: SegmentOptions, lexicon: Lexicon, budget: Budget, *, where: str) -> list[PlanSegment]:
    state = VoiceState()
    spoken: list[tuple[str, TextSegment]] = [  # the title: the narrator's, a paragraph's pause after it
        ("", replace(s, pause_after_ms=options.paragraph_pause_ms))
        for s in segment_chapter(source.title, (), language=language, options=options)
        if not source.starts_ms]  # subtitles start at their first cue, untitled
    starts: dict[int, int] = {}  # index in `spoken` -> its cue's start
    for i, paragraph in enumerate(source.paragraphs):
        runs = split_runs(paragraph, state)
        if source.starts_ms:
            starts[len(spoken)] = source.starts_ms[i]
        for j, (name, text) in enumerate(runs):
            voice = voices.id_of(name, f"{where}, paragraph {i + 1}")
            split = segment_cue if source.starts_ms else segment_paragraph
            pieces = split(text, i, language=language, options=options)
            if pieces and j < len(runs) - 1:  # the paragraph goes on in another voice: a sentence's pause,
                clause = text.rstrip("\"'”’» ").endswith((",", ";", ":"))  # a clause's after a comma
                pause = options.clause_pause_ms if clause else options.sentence_pause_ms
                pieces[-1] = replace(pieces[-1], pause_after_ms=pause)
            spoken += [(voice, p) for p in pieces]
    if spoken:
        voice, last = spoken[-1]
        spoken[-1] = (voice, replace(last, pause_after_ms=options.chapter_pause_ms))
    out = []
    for n, (voice, s) in enumerate(spoken):
        said = lexicon.apply(s.text, budget)
        key = segment_key(kind="text", content=said, voice_id=voice or voices.book, options=key_options)
        out.append(PlanSegment(key=key, kind="text", text=s.text, tokens=None, audio=None,
                               est_tokens=s.est_tokens, pause_after_ms=s.pause_after_ms,
                               paragraph=s.paragraph, say=said if said != s.text else "", voice=voice,
                               start_ms=starts.get(n, -1)))
    return out


def _items(source: SourceChapter, voice_id: str, key_options: Mapping[str, Any],
           options: SegmentOptions) -> list[PlanSegment]:
    """Manifest items are segments as given: no title is spoken, pauses are the sentence/chapter ones."""
    out: list[PlanSegment] = []
    last = len(source.items) - 1
    for i, item in enumerate(source.items):
        pause = options.chapter_pause_ms if i == last else options.sentence_pause_ms
        if item.tokens is not None:
            key = segment_key(kind="tokens", content=list(item.tokens), voice_id=voice_id,
                              options=key_options)
            out.append(PlanSegment(key, "tokens", "", item.tokens, None, len(item.tokens), pause, i))
        else:
            assert item.audio is not None and item.audio_sha256 is not None  # parse_manifest sets both
            key = segment_key(kind="audio", content=item.audio_sha256, voice_id=voice_id, options=key_options)
            # The length of source audio is not known until it is read; the estimate is a minimum.
            out.append(PlanSegment(key, "audio", "", None, item.audio, 1, pause, i))
    return out
