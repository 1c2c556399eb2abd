"""The web page at `/` (app.api.web) without a browser: the page, its files, the token rule. No
service is needed (a SQLite file; these routes touch neither the database nor Redis, and a refused /v1
call is refused before its handler runs). The page driven in a real browser: test_web_browser.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.api.main import create_app
from app.api.web import WEB
from app.db import upgrade
from app.settings import Settings
from tests.conftest import make_test_settings
from tests.support.runtime import RecordingSender


def _client(tmp_path: Path, token: str | None) -> Iterator[TestClient]:
    url = f"sqlite:///{tmp_path / 'web.sqlite'}"
    upgrade(url)
    settings: Settings = make_test_settings(database_url=url, artifact_root=tmp_path / "artifacts",
                                            api_token=SecretStr(token) if token is not None else None)
    with TestClient(create_app(settings, sender=RecordingSender())) as client:
        yield client


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    yield from _client(tmp_path, None)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[TestClient]:
    yield from _client(tmp_path, "s3cret")


def test_the_page_is_html_that_loads_its_own_scripts_and_style(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    scripts = re.findall(r'<script src="(/web/(\w+)\.js\?v=[0-9a-f]{12})" defer></script>', page)
    assert [name for _, name in scripts] == ["api", "cards", "app"], page[:600]  # in this order: each uses
    # what the ones before it declare
    style = re.search(r'<link rel="stylesheet" href="(/web/style\.css\?v=[0-9a-f]{12})">', page)
    assert style, page[:600]
    for form in ('id="book-form"', 'id="job-form"', 'id="token"', 'id="reference"', 'id="voice-id"'):
        assert form in page
    assert "$" not in page, "every template placeholder is filled"
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "nothing is loaded from another origin"
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for url in [url for url, _ in scripts] + [style.group(1)]:
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize(("name", "media"), [("api.js", "text/javascript"), ("cards.js", "text/javascript"),
                                             ("app.js", "text/javascript"), ("style.css", "text/css")])
def test_the_scripts_and_style_are_served_as_what_they_are(client: TestClient, name: str, media: str) -> None:
    r = client.get(f"/web/{name}")
    assert r.status_code == 200 and r.headers["content-type"].startswith(media)
    assert r.content == (WEB / name).read_bytes()
    assert "http://" not in r.text and "https://" not in r.text  # it names this server only


@pytest.mark.parametrize("name", ["index.html", "missing.js", "..%2Fweb.py", "..%2F..%2Fsettings.py"])
def test_no_other_file_is_served_from_the_web_folder(client: TestClient, name: str) -> None:
    r = client.get(f"/web/{name}")
    assert r.status_code == 404 and r.json()["error"] == "NotFound"


def test_the_page_is_not_part_of_the_published_api(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/web") for p in paths)


def test_with_a_token_the_page_is_public_says_it_needs_one_and_the_api_still_refuses(
        locked: TestClient) -> None:
    page = locked.get("/")
    assert page.status_code == 200 and 'data-token-required="true"' in page.text
    assert locked.get("/web/app.js").status_code == 200
    refused = locked.get("/v1/voices")
    assert refused.status_code == 401 and refused.json()["error"] == "Unauthorized"
    assert locked.get("/v1/voices", headers={"Authorization": "Bearer s3cret"}).json() == []


def test_without_a_token_the_page_says_none_is_needed(client: TestClient) -> None:
    assert 'data-token-required="false"' in client.get("/").text


def test_every_field_the_page_sends_with_a_book_is_on_its_form_and_one_the_api_takes() -> None:
    from app.api.routes_books import FORM_FIELDS

    script = (WEB / "app.js").read_text(encoding="utf-8")
    listed = re.search(r"function bookForm\(.*?for \(const name of \[(.*?)\]\)", script, re.S)
    assert listed, "bookForm's list of text fields"
    names = re.findall(r'"(\w+)"', listed.group(1))
    assert {"publisher", "year", "isbn", "genres", "series", "narrator"} <= set(names)
    form = re.search(r'<form id="book-form">(.*?)</form>', (WEB / "index.html").read_text(encoding="utf-8"),
                     re.S)
    assert form
    for name in names:
        assert f'name="{name}"' in form.group(1) and name in FORM_FIELDS, name


def test_the_book_forms_quality_select_offers_every_gate_mode_and_the_page_sends_it() -> None:
    from app.quality.report import GateMode

    form = re.search(r'<form id="book-form">(.*?)</form>', (WEB / "index.html").read_text(encoding="utf-8"),
                     re.S)
    assert form
    select = re.search(r'<select name="quality"[^>]*>(.*?)</select>', form.group(1), re.S)
    assert select, "the book form's quality select"
    assert re.findall(r'<option value="(\w+)"', select.group(1)) == [m.value for m in GateMode]
    listed = re.search(r"function bookForm\(.*?for \(const name of \[(.*?)\]\)",
                       (WEB / "app.js").read_text(encoding="utf-8"), re.S)
    assert listed and '"quality"' in listed.group(1)
