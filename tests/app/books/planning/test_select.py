"""Chapter selection (`app.books.planning.select`): "3-7,12" and its refusals, and the spelling a book
keeps."""

import pytest

from app.books.planning.select import describe, parse_chapters
from app.errors import BadInput


@pytest.mark.parametrize(("spec", "indices", "kept"), [
    ("3-7,12", (2, 3, 4, 5, 6, 11), "3-7,12"),
    ("12, 3 - 7", (2, 3, 4, 5, 6, 11), "3-7,12"),  # any order, spaces
    ("1,2,3,5", (0, 1, 2, 4), "1-3,5"),
    ("4-6,5-8,8", (3, 4, 5, 6, 7), "4-8"),  # overlaps count once
    ("12", (11,), "12"),
    ("1-12", tuple(range(12)), "1-12"),
])
def test_a_selection_names_chapters_counted_from_one(spec: str, indices: tuple[int, ...], kept: str) -> None:
    assert parse_chapters(spec, 12) == indices
    assert describe(indices) == kept
    assert parse_chapters(kept, 12) == indices


@pytest.mark.parametrize(("spec", "says"), [
    ("13", "the book has 12 chapters, so there is no chapter 13"),
    ("3-20", "no chapter 20"), ("0", "counted from 1"), ("7-3", "the range 7-3 runs backwards"),
    ("3-", "'3-' is not a number or a range"), ("1,,2", "'' is not a number"), ("-2", "'-2' is not"),
    ("1.5", "'1.5' is not"), ("  ", "give numbers and ranges"), ("1," * 600, "too long"),
])
def test_a_bad_selection_says_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        parse_chapters(spec, 12)


def test_a_one_chapter_book_is_named_in_the_singular() -> None:
    with pytest.raises(BadInput, match="the book has 1 chapter, so"):
        parse_chapters("2", 1)
