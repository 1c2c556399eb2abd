"""A book's quality gate chosen at submission (issue 46): `quality` on, report or off, through the form
and the JSON body of POST /v1/books, the CLI's `--quality` and its local client; an unknown mode is
refused with the modes it may be. On both databases and real Redis; no workers (what hold_chapter does
with each mode: tests/tasks/test_book_quality.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.api.local import LocalClient
from app.api.main import create_app
from app.books.submission import BookOptions
from app.db import queries
from app.errors import BadInput
from app.settings import Settings
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.support.audio import wav_bytes
from tests.support.books import post_and_read

INLINE = {"title": "M", "chapters": [{"segments": [{"tokens": [1, 2]}]}]}


@pytest.fixture
def client(settings: Settings, feature_redis) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def test_the_gate_is_on_unless_a_form_or_a_json_book_asks_for_report_or_off(client: TestClient) -> None:
    def form(**data):
        return post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode()),
                                            "reference": ("r.wav", wav_bytes())}, data=data)

    default = form()
    assert default.status_code == 202 and default.book["quality"] == "on"
    report = form(quality="report")
    assert report.status_code == 202, report.text
    assert report.book["quality"] == "report"
    assert client.get(f"/v1/books/{report.book['id']}/quality").json()["mode"] == "report"
    voice = default.book["voice_id"]
    off = post_and_read(client, json={"voice_id": voice, "manifest": INLINE, "quality": "off"})
    assert off.status_code == 202 and off.book["quality"] == "off"
    answer = client.get(f"/v1/books/{off.book['id']}/quality").json()
    assert answer["mode"] == "off" and answer["notes"] == [
        "the quality gate was off for this book: its segments were not heard"]
    assert [b["quality"] for b in client.get("/v1/books").json()] == ["off", "report", "on"]


def test_an_unknown_gate_is_refused_with_the_modes_it_may_be(client: TestClient) -> None:
    upload = {"book": ("b.md", MARKDOWN_BOOK.encode()), "reference": ("r.wav", wav_bytes())}
    refused = client.post("/v1/books", data={"quality": "strict"}, files=upload)
    assert refused.status_code == 422
    assert "quality 'strict' is not one of ['on', 'report', 'off']" in refused.json()["reason"]
    as_json = client.post("/v1/books", json={"voice_id": "0" * 64, "manifest": INLINE, "quality": "Off"})
    assert as_json.status_code == 422
    assert "quality" in as_json.text and "'on', 'report' or 'off'" in as_json.text
    assert client.get("/v1/books").json() == []  # nothing was stored
    with pytest.raises(BadInput, match="is not one of"):
        BookOptions(quality="loose").check()


def test_the_cli_flag_reaches_the_request_and_the_local_client_stores_it(
        settings: Settings, feature_redis, tmp_path) -> None:
    from app.cli import build_parser
    from app.cli.books import _form

    def args(*extra: str):
        return build_parser().parse_args(["book", "render", "novel.md", "--voice", "0" * 64, *extra])

    assert _form(args("--quality", "report"))["quality"] == "report"
    assert "quality" not in _form(args())  # the server's default: on
    with pytest.raises(SystemExit):  # argparse names the choices
        args("--quality", "strict")
    local = LocalClient(settings)
    try:
        voice = local.add_voice(wav_bytes())["id"]
        book = local.submit_book(MARKDOWN_BOOK.encode(), "b.md", voice, _form(args("--quality", "off")),
                                 tmp_path)
        assert book["quality"] == "off"
        with local.ctx.session() as session:
            assert queries.require_book(session=session, book_id=book["id"]).quality == "off"
    finally:
        local.ctx.close()
