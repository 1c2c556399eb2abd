"""Several voices in one book: the markup, the cast, and keys that follow each line's voice."""

import pytest

from app.books.planning.cast import VoiceState, parse_cast, split_runs
from app.books.planning.plan import plan_book
from app.books.reading.text import parse_markdown, parse_text
from app.errors import BadInput

NARRATOR = "ab" * 32
ALICE = "a1" * 32
BOB = "b0" * 32
ZED = "ee" * 32

BOOK = b"""\
# The Crossing

## One

The ferry left at dawn.

{voice: Alice}
I watched the gulls. They were loud.

{Bob}\xe2\x80\x9cTickets, please,\xe2\x80\x9d said the man. I had none.

{/voice}
The sea was grey.

## Two

{bob}"Last call!" The bell rang.
"""


def test_markup_splits_a_paragraph_into_voiced_runs_and_passages_carry_over():
    state = VoiceState()
    assert split_runs("The ferry left. {voice: Alice} I watched.", state) == [
        ("narrator", "The ferry left."),
        ("alice", "I watched."),
    ]
    assert split_runs('{Bob}"Tickets," said the man. {BOB} \u201cNow.\u201d', state) == [
        ("bob", '"Tickets,"'),
        ("alice", "said the man."),
        ("bob", "\u201cNow.\u201d"),
    ]
    assert state.passage == "alice"  # the passage goes on into the next paragraph
    assert split_runs("Still Alice. {voice: Narrator} The sea. {/voice} Grey.", state) == [
        ("alice", "Still Alice."),
        ("narrator", "The sea. Grey."),
    ]
    assert split_runs("A set {x, y} of braces, and {} too.", VoiceState()) == [
        ("narrator", "A set {x, y} of braces, and {} too.")
    ]  # not tags: text
    with pytest.raises(BadInput, match=r"'\{Bob\}' must come right before a quotation"):
        split_runs("{Bob} Tickets, said the man.", VoiceState())


def test_each_line_gets_its_voice_and_only_a_recast_characters_keys_change():
    book = parse_markdown(BOOK)
    plan = plan_book(book, voice_id=NARRATOR, cast={"alice": ALICE, "bob": BOB})
    lines = [(s.text, plan.voice_of(s)) for _, s in plan.segments()]
    assert lines == [
        ("One", NARRATOR),  # the spoken title
        ("The ferry left at dawn.", NARRATOR),
        ("I watched the gulls.", ALICE),
        ("They were loud.", ALICE),
        ("Tickets, please", BOB),  # normalised: the quotation marks are not spoken
        ("said the man.", ALICE),
        ("I had none.", ALICE),
        ("The sea was grey.", NARRATOR),
        ("Two", NARRATOR),
        ("Last call!", BOB),
        ("The bell rang.", NARRATOR),
    ]
    assert plan.voices() == [NARRATOR, ALICE, BOB] and plan.cast == {"alice": ALICE, "bob": BOB}
    # The quotation that the paragraph goes on after ends with a comma: a clause's pause, not a paragraph's.
    pause = {s.text: s.pause_after_ms for _, s in plan.segments()}
    assert (
        pause["Tickets, please"] < pause["Last call!"] < pause["They were loud."]
    )  # clause < sentence < paragraph
    assert pause["One"] == pause["They were loud."]  # a title is followed by a paragraph's pause
    recast = plan_book(book, voice_id=NARRATOR, cast={"alice": ALICE, "bob": ZED})
    changed = {
        a.text for (_, a), (_, b) in zip(plan.segments(), recast.segments(), strict=True) if a.key != b.key
    }
    assert changed == {"Tickets, please", "Last call!"}  # Bob's lines, and nothing else
    plain = plan_book(parse_text(b"T\n\nThe ferry left at dawn."), voice_id=NARRATOR)
    assert plain.chapters[0].segments[-1].voice == ""  # a book without markup is the narrator's alone


def test_a_name_the_cast_lacks_refuses_the_book_with_every_such_name_and_where():
    with pytest.raises(BadInput) as refused:
        plan_book(parse_markdown(BOOK), voice_id=NARRATOR, cast={"alice": ALICE})
    assert "'bob' (chapter 1, paragraph 3)" in str(refused.value) and "the cast has alice" in str(
        refused.value
    )
    with pytest.raises(BadInput, match="'alice' .*'bob'"):
        plan_book(parse_markdown(BOOK), voice_id=NARRATOR)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("[a, b]", "must map names to voices"),
        ("Alice: not-an-id", "must be a stored voice's id"),
        ("narrator: " + ALICE, "'narrator' is the book's own voice"),
        ("'9lives': " + ALICE, "is not a name"),
        (f"Alice: {ALICE}\nALICE: {BOB}", "names 'ALICE' twice"),
        ("{bad json", "neither JSON nor YAML"),
        ("Alice: " + "1" * 64, "quote it: YAML read it as a number"),
    ],
)
def test_a_bad_cast_is_refused_with_the_reason(data, reason):
    with pytest.raises(BadInput, match=reason):
        parse_cast(data)


def test_a_cast_names_voices_by_id_or_for_the_cli_by_reference_file():
    assert parse_cast(f'{{"Alice": "{ALICE}", "Old  Bob": "{BOB}"}}') == {"alice": ALICE, "old bob": BOB}
    assert parse_cast("Alice: voices/alice.wav", allow_files=True) == {"alice": "voices/alice.wav"}
    assert parse_cast("") == {}
