"""The pronunciation lexicon: what it replaces, what it refuses, and that a changed entry changes exactly
the keys of the segments whose said text changes."""

import json
from pathlib import Path

import numpy as np
import pytest

from app.books.planning.lexicon import EMPTY, Budget, load_lexicon, parse_lexicon
from app.books.planning.plan import plan_book
from app.books.reading.text import parse_markdown
from app.errors import BadInput
from app.text.guide_voice import GuideOptions, speak
from tests.app.books.conftest import MARKDOWN_BOOK

VOICE = "ab" * 32
LEXICON = """
words:
  Hermione: her my oh nee
  Nguyen: {phonemes: "w'In"}
  Doctor Watson: the good doctor
  Doctor: Doc
patterns:
  - {match: '\\bQ(\\d)\\b', say: 'quarter \\1'}
"""


def test_words_phrases_and_patterns_are_said_as_the_lexicon_says():
    lexicon = parse_lexicon(LEXICON)
    assert lexicon.apply("HERMIONE met doctor   watson, then a Doctor.") == (
        "her my oh nee met the good doctor, then a Doc."  # the longest phrase first, any case
    )
    assert lexicon.apply("Nguyen sold Q3 figures") == "[[w'In]] sold quarter 3 figures"
    assert lexicon.apply("Hermiones and Doctors") == "Hermiones and Doctors"  # whole words only
    # A replacement is never matched again: "Doc" from "Doctor" does not become anything else.
    chained = parse_lexicon({"words": {"Doctor": "Doc", "Doc": "Document"}})
    assert chained.apply("Doctor Doc") == "Doc Document"
    assert EMPTY.apply("a [[b]] c") == "a ((b)) c"  # book text cannot make a phoneme span


@pytest.mark.parametrize("text", ["[[h@'loU]]", "[[[[h@'loU]]]]", "[[[h@'loU]]]", "[ [h@'loU] ]", "x[[[[[y"])
def test_no_nesting_of_brackets_in_the_text_makes_a_phoneme_span(text: str) -> None:
    """`[[[[x]]]]` once became `[[x]]` (one replace pass): a phoneme span the book's text built itself."""
    lexicon = parse_lexicon({"words": {"Nguyen": {"phonemes": "w'In"}, "hello": "hel low [[x]]"},
                             "patterns": [{"match": r"(\[+\w)", "say": r"[\1"}]})
    for lex in (EMPTY, lexicon):
        said = lex.apply(f"{text} hello Nguyen")
        assert said.count("[[") == said.count("]]") == (1 if lex else 0), said
        assert "[[" not in said.replace("[[w'In]]", ""), said


def test_patterns_are_limited_in_number_and_share_one_time_budget_per_book() -> None:
    with pytest.raises(BadInput, match="300 patterns; the limit is 256"):
        parse_lexicon({"patterns": [{"match": f"w{i}", "say": "x"} for i in range(300)]})
    slow = parse_lexicon({"patterns": [{"match": f"(a|aa)+c{i}", "say": "x"} for i in range(50)]})
    budget = Budget(0.05)
    with pytest.raises(BadInput, match="took more than 0.05 s in all on this book"):
        for _ in range(1000):  # each call well under PATTERN_TIMEOUT_S; together over the budget
            slow.apply("a" * 22 + " b", budget)


def test_a_book_lexicon_lies_over_the_default(tmp_path: Path):
    default_file = tmp_path / "default.json"
    default_file.write_text(json.dumps({"words": {"Hermione": "her mine", "Ron": "Ronald"}}))
    default = load_lexicon(default_file)
    book = parse_lexicon({"words": {"hermione": "her my oh nee"}})
    merged = book.over(default)
    assert merged.apply("Hermione and Ron") == "her my oh nee and Ronald"
    assert load_lexicon(None) is EMPTY
    with pytest.raises(BadInput, match="cannot be read"):
        load_lexicon(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("words: [a, b]", "'words' must be a mapping"),
        ("{not json", "neither JSON nor YAML"),
        ("voices: {}", "must be an object with 'words'"),
        ("words: {x: {phonemes: 'a]]b'}}", "espeak-ng mnemonics without brackets"),
        ("words: {x: 5}", "must map to a respelling"),
        ("patterns: [{match: '(unclosed', say: x}]", "pattern 1 .* is not usable"),
        ("patterns: [{match: '(a)', say: '\\2'}]", "pattern 1 .* is not usable"),
        ("patterns: [{match: a}]", "pattern 1 must be"),
        ("patterns: [{match: a, say: '[[x]]'}]", "says brackets"),
        (json.dumps({"words": {f"w{i}": "x" for i in range(10_001)}}), "10001 entries"),
        ("words:\n  a: " + "x" * (1024 * 1024), "bytes; the limit"),
        (b"\xff\xfe\x00", "not UTF-8"),
    ],
)
def test_a_bad_lexicon_is_refused_with_the_reason(data, reason):
    with pytest.raises(BadInput, match=reason):
        parse_lexicon(data)


def test_a_pattern_that_backtracks_forever_is_refused_not_left_running():
    lexicon = parse_lexicon({"patterns": [{"match": "(a|aa)+$", "say": "x"}]})
    with pytest.raises(BadInput, match="took over 0.1 s"):
        lexicon.apply("a" * 30_000 + "!")


def test_changing_one_entry_re_keys_only_the_segments_it_changes():
    book = parse_markdown(MARKDOWN_BOOK.encode())
    plain = plan_book(book, voice_id=VOICE)
    first = plan_book(book, voice_id=VOICE, lexicon=parse_lexicon({"words": {"Watson": "Wotson"}}))
    second = plan_book(book, voice_id=VOICE, lexicon=parse_lexicon({"words": {"Watson": "Whatsun"}}))
    pairs = list(zip(plain.segments(), first.segments(), second.segments(), strict=True))
    changed = [i for i, (a, b, _) in enumerate(pairs) if a[1].key != b[1].key]
    assert len(changed) == 1  # the one sentence that names Watson
    (_, segment), _, (_, again) = pairs[changed[0]]
    assert "Watson" in segment.text and "Wotson" in pairs[changed[0]][1][1].spoken
    assert again.key != pairs[changed[0]][1][1].key  # a new respelling: a new key, so it renders again
    assert pairs[changed[0]][1][1].text == segment.text  # shown (chapters.json, WebVTT) as written
    assert [b[1].key for i, (_, b, _) in enumerate(pairs) if i != changed[0]] == [
        a[1].key for i, (a, _, _) in enumerate(pairs) if i != changed[0]
    ]


def test_phonemes_reach_the_guide_voice_as_phonemes():
    """espeak-ng reads [[...]] as phoneme mnemonics: "Nguyen" said through the lexicon sounds like the
    word "win" (w'In), not like espeak-ng's guess at the spelling, nor like the brackets read aloud."""
    options = GuideOptions()
    said = parse_lexicon({"words": {"Nguyen": {"phonemes": "w'In"}}}).apply("Hello Nguyen there")
    as_phonemes = speak(said, options)
    as_word = speak("Hello win there", options)
    spelled = speak("Hello Nguyen there", options)
    literal = speak(EMPTY.apply("Hello [[w'In]] there"), options)
    assert abs(len(as_phonemes) - len(as_word)) < 0.02 * len(as_word)
    assert abs(len(spelled) - len(as_word)) > 0.05 * len(as_word) or not np.allclose(
        spelled[: len(as_word)], as_word[: len(spelled)], atol=1e-3
    )
    assert abs(len(literal) - len(as_word)) > 0.05 * len(as_word)
