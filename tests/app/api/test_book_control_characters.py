"""Control characters in a book's metadata (issue 42, item 5): every text field a client sets that a book's
files or tags carry is refused at submission with a 422 naming the field, on both databases and for the
form and the JSON body alike; before, `A\\x01Title` with epub3 was answered 202 and failed the book at
assembly ("All strings must be XML compatible"). A book's own metadata is cleaned instead
(tests/app/books/writing/test_readalong_epub.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.app.api.helpers import upload_voice

BOOK = b"# One\n\nIt was a night.\n"
FIELDS = ["title", "author", "narrator", "description", "publisher", "series", "genres", "year", "isbn",
          "language", "chapters"]


@pytest.mark.parametrize("bad", ["\x01", "\x08"])  # not whitespace: \x0c and \x1f in a genre are spaces
@pytest.mark.parametrize("field", FIELDS)
def test_a_control_character_in_any_metadata_field_is_a_422_naming_it(client: TestClient, reference: bytes,
                                                                      field: str, bad: str) -> None:
    voice = upload_voice(client, reference).json()["id"]
    data = {"voice_id": voice, "epub3": "true", field: f"A{bad}Title"}
    answer = client.post("/v1/books", data=data, files={"book": ("b.md", BOOK)})
    assert answer.status_code == 422, answer.text
    assert field in answer.json()["reason"], answer.text
    assert client.get("/v1/books").json() == []  # nothing was accepted


def test_a_control_character_in_series_part_is_a_422_naming_it(client: TestClient, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    part = client.post("/v1/books", data={"voice_id": voice, "series": "Tales", "series_part": "2\x01"},
                       files={"book": ("b.md", BOOK)})
    assert part.status_code == 422 and "series_part" in part.json()["reason"], part.text


def test_a_json_book_with_a_control_character_in_a_field_is_a_422_naming_it(client: TestClient,
                                                                           reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    manifest = {"title": "T", "chapters": [{"title": "C", "segments": [{"tokens": [1, 2, 3]}]}]}
    for field in ("publisher", "series", "narrator", "description"):
        answer = client.post("/v1/books", json={"voice_id": voice, "manifest": manifest, field: "A\x02B"})
        assert answer.status_code == 422 and field in answer.json()["reason"], (field, answer.text)
    genres = client.post("/v1/books", json={"voice_id": voice, "manifest": manifest, "genres": ["A\x02B"]})
    assert genres.status_code == 422 and "genres" in genres.json()["reason"], genres.text


def test_tabs_and_line_breaks_are_not_control_characters_here(client: TestClient, reference: bytes) -> None:
    voice = upload_voice(client, reference).json()["id"]
    answer = client.post("/v1/books", data={"voice_id": voice, "title": "A\tTitle",
                                            "description": "One line.\r\nAnother."},
                         files={"book": ("b.md", BOOK)})
    assert answer.status_code == 202, answer.text
