"""English normalisation examples; sentence and segment bounds; configurable pauses."""

import pytest

from app.text.normalise import normalise
from app.text.segment import (
    SegmentOptions,
    estimate_tokens,
    segment_chapter,
    segment_paragraph,
    split_sentences,
)


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("I have 3 cats.", "I have three cats."),
        (
            "It had 1,234,567 pages.",
            "It had one million two hundred thirty-four thousand five hundred sixty-seven pages.",
        ),
        ("The 1st, 2nd, 3rd, 11th and 21st.", "The first, second, third, eleventh and twenty-first."),
        (
            "In 1066 and 1905 and 2005 and 2024.",
            "In ten sixty-six and nineteen oh five and two thousand five and twenty twenty-four.",
        ),
        ("The 1980s and the '60s.", "The nineteen eighties and the sixties."),
        ("Pi is 3.14, or -0.5 less.", "Pi is three point one four, or minus zero point five less."),
        ("It cost $12.50.", "It cost twelve dollars and fifty cents."),
        (
            "Only $1 or £5 or €0.99 or $0.01.",
            "Only one dollar or five pounds or ninety-nine cents or one cent.",
        ),
        ("A $2.5 million deal.", "A two point five million dollars deal."),
        (
            "Up 50% at 7:30 and 9:05 and 10:00.",
            "Up fifty percent at seven thirty and nine oh five and ten o'clock.",
        ),
        ("Mr. and Mrs. Smith met Dr. Watson.", "Mister and Missus Smith met Doctor Watson."),
        (
            "He lived at 221 Baker St. Then he left.",
            "He lived at two hundred twenty-one Baker Street. Then he left.",
        ),
        (
            "St. Paul walked up Elm Dr. to see Prof. Lee.",
            "Saint Paul walked up Elm Drive to see Professor Lee.",
        ),
        (
            "Fruit, e.g. apples, i.e. food, etc. are fine.",
            "Fruit, for example apples, that is food, et cetera are fine.",
        ),
        ("Bread, milk, etc. Then home.", "Bread, milk, et cetera. Then home."),
        ("Chapter IV and No. 7.", "Chapter four and number seven."),
        ("“Wait…” she said — “no!!!” (quietly)", "Wait, she said, no! quietly"),
        ("Tom & Jerry  *laughed*   ...", "Tom and Jerry laughed."),
        ("J. R. R. Tolkien wrote it.", "J R R Tolkien wrote it."),
        ("Agent 007.", "Agent zero zero seven."),
        (
            "World War II ended in 1945, said Henry VIII's ghost.",
            "World War two ended in nineteen forty-five, said Henry the eighth's ghost.",
        ),
        (
            "Louis XIV met Elizabeth II. Then I left.",
            "Louis the fourteenth met Elizabeth the second. Then I left.",
        ),
        (
            "Add 1/2 a cup, then 3/4, then 2/3, and/or more.",
            "Add one half a cup, then three quarters, then two thirds, and or more.",
        ),
        (
            "It's the #1 hit. Vol. 3, pp. 45-67.",
            "It's the number one hit. Volume three, pages forty-five to sixty-seven.",
        ),
        ("See Fig. 2 in Jan. Then 2 lbs. of tea.", "See Figure two in January. Then two pounds of tea."),
        (
            "Wind N.N.E., force 7, backing S.W. later. A gale from the WSW. It came from the N.E.",
            "Wind north-north-east, force seven, backing south-west later. A gale from the west-south-west. "
            "It came from the north-east.",
        ),
    ],
)
def test_english_normalisation(raw, spoken):
    assert normalise(raw) == spoken


def test_other_languages_pass_through_unnormalised():
    assert normalise("Er  hat 3 Katzen,\u00a0Dr. Müller.", "de") == "Er hat 3 Katzen, Dr. Müller."
    assert split_sentences("Es ist spät. Wir gehen! Ja?", "de") == ["Es ist spät.", "Wir gehen!", "Ja?"]
    assert split_sentences("你好。今天很好！", "zh") == ["你好。", "今天很好！"]


def test_abbreviations_and_initials_do_not_end_sentences():
    text = normalise("Mr. Smith met Dr. Jones at 3 p.m. on Friday. J. K. Rowling was there, e.g. in row 5.")
    assert split_sentences(text) == [
        "Mister Smith met Doctor Jones at three P M on Friday.",
        "J K Rowling was there, for example in row five.",
    ]


def test_estimate_is_25_tokens_per_second_at_15_characters_per_second():
    assert estimate_tokens("x" * 15) == 25
    assert estimate_tokens("x" * 30, SegmentOptions(chars_per_second=10)) == 75
    assert estimate_tokens("") == 1


@pytest.mark.parametrize(
    "paragraph",
    [
        "This is a sentence, with clauses; and more clauses: and words. " * 40,
        "word " * 3000,  # no punctuation at all
        "x" * 5000,  # one giant "word"
        "Short. " * 200,
    ],
)
def test_every_segment_is_within_the_token_bound_and_no_text_is_lost(paragraph):
    options = SegmentOptions(max_tokens=100)
    segments = segment_paragraph(paragraph, 0, options=options)
    assert segments and all(s.est_tokens <= 100 for s in segments)
    assert all(len(s.text) <= options.max_chars for s in segments)
    assert "".join("".join(s.text.split()) for s in segments) == "".join(normalise(paragraph).split())


def test_pauses_between_clauses_sentences_paragraphs_and_chapters_are_configurable():
    options = SegmentOptions(
        max_tokens=45, clause_pause_ms=11, sentence_pause_ms=22, paragraph_pause_ms=33, chapter_pause_ms=44
    )
    long_sentence = "One two three four five, six seven eight nine ten, eleven twelve thirteen."
    segments = segment_chapter("Chapter 1", [f"First. {long_sentence}", "Last one."], options=options)
    assert [(s.paragraph, s.pause_after_ms) for s in segments] == [
        (-1, 33),  # the spoken title
        (0, 22),  # "First."
        (0, 11),
        (0, 11),
        (0, 33),  # the long sentence cut at its commas; ends the paragraph
        (1, 44),  # the chapter's last segment
    ]
    assert segments[0].text == "Chapter one"
    assert [s.text for s in segments[2:5]] == [
        "One two three four five,",
        "six seven eight nine ten,",
        "eleven twelve thirteen.",
    ]


def test_titles_are_not_spoken_when_turned_off():
    segments = segment_chapter("Chapter 1", ["Hello."], options=SegmentOptions(speak_titles=False))
    assert [s.text for s in segments] == ["Hello."]


def test_empty_paragraphs_make_no_segments():
    assert segment_paragraph(" ... ", 0) == []
    assert segment_chapter("", []) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "hostile",
    [
        "1" * 99_000,
        "x" * 99_000,
        ",;" * 49_000,
        "*_" * 49_000,
        "a" + " " * 99_000 + "b",
        "." * 99_000,
        "Dr." * 33_000,
        "( " * 49_000,
        "<a" * 49_000,
        "9%" * 49_000,
    ],
)
def test_hostile_paragraphs_normalise_in_linear_time(hostile):
    # Each of these took minutes with a backtracking pattern; linear patterns take well under a second.
    segments = segment_paragraph(hostile, 0)
    assert all(s.est_tokens <= SegmentOptions().max_tokens for s in segments)
