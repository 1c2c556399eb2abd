"""A pronunciation lexicon: words, phrases or patterns -> what the guide voice says instead.

A lexicon file is JSON or YAML (`docs/BOOKS.md`, "Pronunciation"):

    words:                          # whole words or phrases, matched regardless of case
      Hermione: her my oh nee       # a respelling: said as written
      Nguyen: {phonemes: "w'In"}    # espeak-ng phoneme mnemonics, said as given
      Dr. Who: Doctor Who
    patterns:                       # regular expressions (the `regex` module, run with a time limit)
      - {match: '\bQ(\d)\b', say: 'quarter \1'}

Applied to each text segment after normalisation (numbers, abbreviations) and splitting, before the
guide voice speaks: the segment's content key is computed on the text as said, so changing an entry
re-renders exactly the segments whose said text changes. Words are tried longest first, then patterns
in order; a replacement is never matched again. The book's lexicon is laid over the service's default
one (`WAVEFARM_LEXICON`, a file): an entry of the book wins over the default's for the same word.

Phonemes go to espeak-ng inside `[[...]]`, and only a word entry's `{phonemes: ...}` puts them there:
every bracket in the book's text, in a respelling or in a pattern's output is read as a parenthesis,
so no nesting (`[[[[x]]]]`) or pattern can open a phoneme span. Patterns come from a client, so they are
bounded three ways: at most MAX_PATTERNS of them, each run with a time limit per segment
(PATTERN_TIMEOUT_S: one that backtracks catastrophically is refused), and all of them together within
a budget per book (`Budget`, `WAVEFARM_LEXICON_BUDGET_S`): many patterns that each stay under their own
limit cannot add up to minutes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex
import yaml

from app.errors import BadInput

MAX_BYTES = 1024 * 1024
MAX_ENTRIES = 10_000
MAX_PATTERNS = 256  # a real lexicon has a few patterns and many words
MAX_ENTRY_CHARS = 200  # a word, a phrase, a respelling, phonemes or a pattern
PATTERN_TIMEOUT_S = 0.1  # per pattern and segment (a sane pattern takes microseconds on a sentence)
DEFAULT_BUDGET_S = 10.0  # every pattern over every segment of one book (WAVEFARM_LEXICON_BUDGET_S)
_BRACKETS = str.maketrans("[]", "()")  # outside a phoneme entry, a bracket is read as a parenthesis
_PHONEMES_RE = regex.compile(r"[^\[\]\n]+")  # anything but brackets and newlines
_GROUP_REF_RE = regex.compile(r"\\(\d+)|\\g<(\w+)>")


@dataclass(frozen=True)
class Pattern:
    match: str
    say: str


@dataclass(frozen=True)
class Lexicon:
    words: Mapping[str, str] = field(default_factory=dict)  # lower-cased word or phrase -> said text
    patterns: tuple[Pattern, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.words or self.patterns)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the plan stores it); `from_dict` reads it back without checking again."""
        return {"words": dict(self.words), "patterns": [[p.match, p.say] for p in self.patterns]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Lexicon:
        if not data:
            return EMPTY
        return cls(dict(data.get("words", {})), tuple(Pattern(m, s) for m, s in data.get("patterns", [])))

    def over(self, default: Lexicon) -> Lexicon:
        """This lexicon laid over `default`: its words win, its patterns run first."""
        return Lexicon({**default.words, **self.words}, self.patterns + default.patterns)

    def apply(self, text: str, budget: Budget | None = None) -> str:
        """The text as the guide voice should say it; `budget` bounds the patterns' time over a book."""
        text = text.translate(_BRACKETS)
        if not self:
            return text
        budget = budget or Budget()
        pieces: list[tuple[str, bool]] = [(text, False)]  # (text, already replaced)
        if self.words:
            pieces = _split(pieces, _words_regex(tuple(sorted(self.words))),
                            lambda m: self.words[_fold(m.group(0))], None)
        for pattern in self.patterns:
            compiled = _pattern(pattern.match)
            pieces = _split(pieces, compiled, lambda m, p=pattern: m.expand(p.say).translate(_BRACKETS),
                            budget)
        return "".join(t for t, _ in pieces)


class Budget:
    """The time a book's lexicon patterns may take in all, over every segment (wall seconds)."""

    def __init__(self, seconds: float = DEFAULT_BUDGET_S) -> None:
        self.seconds = seconds
        self.left = seconds

    def timeout(self) -> float:
        """The limit for the next run of one pattern over one segment."""
        if self.left <= 0:
            raise self.exhausted()
        return min(PATTERN_TIMEOUT_S, self.left)

    def exhausted(self) -> BadInput:
        return BadInput(f"the lexicon's patterns took more than {self.seconds:g} s in all on this book (the "
                        "budget per book, WAVEFARM_LEXICON_BUDGET_S); use fewer or simpler patterns, or "
                        "word entries")


EMPTY = Lexicon()


def parse_lexicon(data: bytes | str | Mapping[str, Any], what: str = "the lexicon") -> Lexicon:
    """JSON or YAML (bytes or text), or already parsed data -> a checked Lexicon; BadInput with the reason."""
    if isinstance(data, (bytes, str)):
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > MAX_BYTES:
            raise BadInput(f"{what} is {len(raw)} bytes; the limit is {MAX_BYTES}")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise BadInput(f"{what} is not UTF-8 text") from None
        try:
            doc = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise BadInput(f"{what} is neither JSON nor YAML: {str(exc).splitlines()[0][:200]}") from None
        except RecursionError:
            raise BadInput(f"{what} is nested too deeply (a lexicon is two levels deep)") from None
    else:
        doc = data
    if doc is None:
        return EMPTY
    if not isinstance(doc, dict) or set(doc) - {"words", "patterns"}:
        raise BadInput(f"{what} must be an object with 'words' (a mapping) and/or 'patterns' (a list)")
    words = _check_words(doc.get("words") or {}, what)
    if isinstance(doc.get("patterns"), list) and len(doc["patterns"]) > MAX_PATTERNS:
        raise BadInput(f"{what} has {len(doc['patterns'])} patterns; the limit is {MAX_PATTERNS} (use word "
                       "entries for words and phrases)")
    patterns = _check_patterns(doc.get("patterns") or [], what)
    if len(words) + len(patterns) > MAX_ENTRIES:
        raise BadInput(f"{what} has {len(words) + len(patterns)} entries; the limit is {MAX_ENTRIES}")
    return Lexicon(words, patterns)


def load_lexicon(path: Path | None) -> Lexicon:
    """The service's default lexicon (`WAVEFARM_LEXICON`); EMPTY when none is configured."""
    if path is None:
        return EMPTY
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BadInput(f"the default lexicon {path} cannot be read: {exc.strerror}") from None
    return parse_lexicon(data, what=f"the default lexicon {path}")


def _check_words(words: Any, what: str) -> dict[str, str]:
    if not isinstance(words, dict):
        raise BadInput(f"{what}: 'words' must be a mapping of word -> respelling or {{phonemes: ...}}")
    out: dict[str, str] = {}
    for word, said in words.items():
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_ENTRY_CHARS:
            raise BadInput(f"{what}: {str(word)[:40]!r} is not a word or phrase of 1..{MAX_ENTRY_CHARS} "
                           "characters")
        if isinstance(said, dict) and set(said) == {"phonemes"}:
            phonemes = said["phonemes"]
            if not isinstance(phonemes, str) or not _PHONEMES_RE.fullmatch(phonemes.strip()) \
                    or len(phonemes) > MAX_ENTRY_CHARS:
                raise BadInput(f"{what}: the phonemes of {word!r} must be espeak-ng mnemonics without "
                               f"brackets, 1..{MAX_ENTRY_CHARS} characters")
            text = f"[[{phonemes.strip()}]]"
        elif isinstance(said, str) and said.strip() and len(said) <= MAX_ENTRY_CHARS:
            text = " ".join(said.translate(_BRACKETS).split())
        else:
            raise BadInput(f"{what}: {word!r} must map to a respelling (text) or {{phonemes: ...}}")
        out[_fold(word)] = text
    return out


def _check_patterns(patterns: Any, what: str) -> tuple[Pattern, ...]:
    if not isinstance(patterns, list):
        raise BadInput(f"{what}: 'patterns' must be a list of {{match: ..., say: ...}}")
    out = []
    for i, entry in enumerate(patterns):
        if not isinstance(entry, dict) or set(entry) != {"match", "say"} or not all(
                isinstance(entry[k], str) and 0 < len(entry[k]) <= MAX_ENTRY_CHARS for k in ("match", "say")):
            raise BadInput(f"{what}: pattern {i + 1} must be {{match: <regex>, say: <text>}}, each "
                           f"1..{MAX_ENTRY_CHARS} characters")
        try:
            compiled = _pattern(entry["match"])
            _check_groups(compiled, entry["say"])
        except (regex.error, IndexError) as exc:
            raise BadInput(f"{what}: pattern {i + 1} ({entry['match'][:40]!r}) is not usable: "
                           f"{exc}") from None
        if "[[" in entry["say"] or "]]" in entry["say"]:
            raise BadInput(f"{what}: pattern {i + 1} says brackets; use a word entry for phonemes")
        out.append(Pattern(entry["match"], entry["say"]))
    return tuple(out)


def _check_groups(compiled: regex.Pattern[str], say: str) -> None:
    """Every \\1 or \\g<name> in `say` names a group of the pattern (otherwise it would fail mid-book)."""
    for number, name in _GROUP_REF_RE.findall(say):
        ref = number or name
        known = int(ref) <= compiled.groups if ref.isdigit() else ref in compiled.groupindex
        if not known:
            raise IndexError(f"the replacement refers to group {ref}, which the pattern does not have")


def _fold(word: str) -> str:
    return " ".join(word.split()).casefold()


_WORDS_CACHE: dict[tuple[str, ...], regex.Pattern[str]] = {}


def _words_regex(words: tuple[str, ...]) -> regex.Pattern[str]:
    compiled = _WORDS_CACHE.get(words)
    if compiled is None:
        alternatives = sorted(words, key=len, reverse=True)  # longest first: "Dr. Who" before "Dr."
        body = "|".join(r"\s+".join(regex.escape(part) for part in w.split()) for w in alternatives)
        compiled = regex.compile(rf"(?<!\w)(?:{body})(?!\w)", regex.IGNORECASE | regex.V1)
        if len(_WORDS_CACHE) > 64:
            _WORDS_CACHE.clear()
        _WORDS_CACHE[words] = compiled
    return compiled


def _pattern(match: str) -> regex.Pattern[str]:
    return regex.compile(match, regex.V0)


def _split(pieces: Iterable[tuple[str, bool]], compiled: regex.Pattern[str], replace: Any,
           budget: Budget | None) -> list[tuple[str, bool]]:
    """Replace matches in the pieces not replaced yet; replacements are marked so nothing matches them.
    A client's pattern (`budget` given) runs with a time limit and spends from the book's budget."""
    out: list[tuple[str, bool]] = []
    for text, done in pieces:
        if done:
            out.append((text, True))
            continue
        pos = 0
        matches = list(compiled.finditer(text)) if budget is None else _timed(compiled, text, budget)
        for m in matches:
            if m.start() == m.end():
                continue
            out += [(text[pos:m.start()], False), (replace(m), True)]
            pos = m.end()
        out.append((text[pos:], False))
    return [(t, d) for t, d in out if t]


def _timed(compiled: regex.Pattern[str], text: str, budget: Budget) -> list[regex.Match[str]]:
    timeout = budget.timeout()
    start = time.perf_counter()
    try:
        return list(compiled.finditer(text, timeout=timeout))
    except TimeoutError:
        if timeout < PATTERN_TIMEOUT_S:
            raise budget.exhausted() from None
        raise BadInput(f"a lexicon pattern took over {PATTERN_TIMEOUT_S} s on one sentence "
                       f"({compiled.pattern[:40]!r}); simplify it") from None
    finally:
        budget.left -= time.perf_counter() - start
