"""Voice names and id prefixes: PATCH /v1/voices/{id} names a voice (unique), and the name, the id or a
unique id prefix then finds it wherever a voice is taken; an ambiguous prefix is refused with candidates."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.db import queries
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from tests.app.api.helpers import submit, upload_voice


def test_a_named_voice_is_found_by_name_id_and_prefix_and_jobs_take_the_name(client: TestClient,
                                                                            reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    named = client.patch(f"/v1/voices/{voice_id[:8]}", json={"name": "Ada"})
    assert named.status_code == 200 and named.json()["name"] == "Ada"
    for ref in ("Ada", voice_id, voice_id[:8]):
        got = client.get(f"/v1/voices/{ref}")
        assert got.status_code == 200 and got.json()["id"] == voice_id, ref
    assert client.get("/v1/voices").json()[0]["name"] == "Ada"
    job = submit(client, "Ada")
    assert job.status_code == 202 and job.json()["voice_id"] == voice_id
    assert client.get("/v1/voices/Bob").status_code == 404


def test_a_name_is_unique_checked_and_can_be_removed(client: TestClient, reference: bytes,
                                                     settings: Settings) -> None:
    first = upload_voice(client, reference).json()["id"]
    other = "f" * 64
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:  # a second voice row (no file needed to name it)
        queries.get_or_create_voice(session=s, voice_id=other, reference_path="references/x.wav")
    engine.dispose()
    assert client.patch(f"/v1/voices/{first}", json={"name": "Ada"}).status_code == 200
    taken = client.patch(f"/v1/voices/{other}", json={"name": "Ada"})
    assert taken.status_code == 409 and "taken" in taken.json()["reason"]
    for bad in ("", "1abc", "a/b", "x" * 65, "a" * 64):
        refused = client.patch(f"/v1/voices/{other}", json={"name": bad})
        assert refused.status_code == 422 and refused.json()["reason"], bad
    assert client.patch(f"/v1/voices/{first}", json={"name": None}).json()["name"] is None
    assert client.patch(f"/v1/voices/{other}", json={"name": "Ada"}).status_code == 200


def test_an_ambiguous_prefix_is_refused_with_the_candidates(client: TestClient, settings: Settings) -> None:
    ids = ["abcd" + "0" * 60, "abcd" + "1" * 60]
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        for voice_id in ids:
            queries.get_or_create_voice(session=s, voice_id=voice_id, reference_path="references/x.wav")
    engine.dispose()
    ambiguous = client.get("/v1/voices/abcd")
    assert ambiguous.status_code == 422
    assert all(v[:12] in ambiguous.json()["reason"] for v in ids)
    assert client.get("/v1/voices/abcd1").json()["id"] == ids[1]
    assert client.get("/v1/voices/abc").status_code == 404  # shorter than a prefix may be


def test_a_book_takes_the_voices_name(client: TestClient, reference: bytes) -> None:
    from tests.app.books.conftest import MARKDOWN_BOOK
    from tests.support.books import post_and_read

    voice_id = upload_voice(client, reference).json()["id"]
    assert client.patch(f"/v1/voices/{voice_id}", json={"name": "Ada"}).status_code == 200
    posted = post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode())}, data={"voice_id": "Ada"})
    assert posted.status_code == 202, posted.text
    assert posted.book["voice_id"] == voice_id and posted.book["status"] == "queued", posted.book
    unknown = client.post("/v1/books", files={"book": ("b.md", MARKDOWN_BOOK.encode())},
                          data={"voice_id": "Bob"})
    assert unknown.status_code == 404 and "no voice 'Bob'" in unknown.json()["reason"]


def _voice_rows(settings: Settings, *ids: str) -> None:
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:  # voice rows (no file needed to name them)
        for voice_id in ids:
            queries.get_or_create_voice(session=s, voice_id=voice_id, reference_path="references/x.wav")
    engine.dispose()


def test_a_name_can_never_shadow_another_voices_id_prefix(client: TestClient, settings: Settings) -> None:
    a, b = "abcdef12" + "3" * 56, "9" * 64
    _voice_rows(settings, a, b)
    for spelt in (a[:8], a[:8].upper(), "Dead", "cafe"):  # hex digits only: a prefix, now or later
        refused = client.patch(f"/v1/voices/{b}", json={"name": spelt})
        assert refused.status_code == 422 and "prefix" in refused.json()["reason"], spelt
    assert client.get(f"/v1/voices/{a[:8]}").json()["id"] == a
    assert client.patch(f"/v1/voices/{b}", json={"name": "abc"}).status_code == 200  # too short to be one
    assert client.patch(f"/v1/voices/{b}", json={"name": "Deadwood"}).status_code == 200


def test_a_stored_name_that_spells_a_prefix_loses_to_the_id(client: TestClient, settings: Settings) -> None:
    """A hex name stored before the rule (written straight to the row) no longer takes the prefix over."""
    a, b = "abcdef12" + "3" * 56, "9" * 64
    _voice_rows(settings, a, b)
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:
        queries.set_voice_name(session=s, voice_id=b, name=a[:8])
    engine.dispose()
    assert client.get(f"/v1/voices/{a[:8]}").json()["id"] == a


def test_names_are_compared_after_nfkc_and_case_folding_and_mixed_scripts_are_refused(
        client: TestClient, settings: Settings) -> None:
    a, b = "1" * 64, "2" * 64
    _voice_rows(settings, a, b)
    assert client.patch(f"/v1/voices/{a}", json={"name": "Ada"}).status_code == 200
    for same in ("ada", "ADA", "\uff21\uff44\uff41", "Ada "):  # fullwidth ＡＤＡ is Ada after NFKC
        taken = client.patch(f"/v1/voices/{b}", json={"name": same})
        assert taken.status_code == 409 and "Ada" in taken.json()["reason"], same
    mixed = client.patch(f"/v1/voices/{b}", json={"name": "\u0410da"})  # Cyrillic А, then Latin da
    assert mixed.status_code == 422 and "Cyrillic" in mixed.json()["reason"]
    assert client.patch(f"/v1/voices/{b}", json={"name": "\u0410\u043d\u044f"}).status_code == 200  # Аня
    assert client.patch(f"/v1/voices/{a}", json={"name": "ADA"}).status_code == 200  # its own name, recased


def test_a_name_finds_its_voice_whatever_its_case_or_width(client: TestClient, settings: Settings) -> None:
    a = "1" * 64
    _voice_rows(settings, a)
    assert client.patch(f"/v1/voices/{a}", json={"name": "Ada"}).status_code == 200
    for same in ("Ada", "ada", "ADA", "\uff21\uff44\uff41"):  # one name after NFKC and case folding
        assert client.get(f"/v1/voices/{same}").json()["id"] == a, same
    assert client.get("/v1/voices/Ava").status_code == 404


def test_a_name_is_found_in_any_case_and_a_miss_suggests_the_nearest_names(client: TestClient,
                                                                         settings: Settings) -> None:
    ids = ["a" * 63 + "1", "a" * 63 + "2", "a" * 63 + "3"]
    _voice_rows(settings, *ids)
    for voice_id, name in zip(ids, ("Adelaide", "Adeline", "Zoe"), strict=True):
        assert client.patch(f"/v1/voices/{voice_id}", json={"name": name}).status_code == 200
    assert client.get("/v1/voices/ADELAIDE").json()["id"] == ids[0]
    assert client.get("/v1/voices/ｚｏｅ").json()["id"] == ids[2]  # NFKC: full-width letters
    missed = client.get("/v1/voices/adelaid")
    assert missed.status_code == 404
    assert missed.json()["reason"].endswith("; did you mean 'Adelaide' or 'Adeline'?"), missed.json()
    far = client.get("/v1/voices/Bartholomew")
    assert far.status_code == 404 and "did you mean" not in far.json()["reason"]


def test_a_book_file_of_a_type_no_reader_takes_is_refused_at_submission(client: TestClient,
                                                                        reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    refused = client.post("/v1/books", files={"book": ("novel.rtf", b"{\\rtf1\\ansi Hello.}")},
                          data={"voice_id": voice_id})
    assert refused.status_code == 422, refused.text
    assert "a .rtf file is not a book wavefarm reads; it reads .txt, " in refused.json()["reason"]
    assert client.get("/v1/books").json() == []  # nothing stored
