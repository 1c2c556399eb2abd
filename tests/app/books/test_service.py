"""Book submission, status and cancel (app.books.service) and the /v1/books routes, on both databases and
real Redis; no workers: what would be enqueued is recorded, or sent to queues nobody consumes, and the
book is read here as a CPU worker's `book.parse` reads it (the reading child process is the real one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.api.main import create_app
from app.books.files import load_plan
from app.books.service import BookOptions, cancel_book, make_segment_job, submit_book
from app.books.status import book_status
from app.context import Context
from app.db import queries
from app.db.models import Book, BookStatus, JobStatus, Segment
from app.errors import BadInput
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.support.audio import wav_bytes
from tests.support.books import RecordingSender, book_request, post_and_read, read_in, read_now


def submit(ctx: Context, session, data: bytes, sender=None, **kw) -> str:
    """Submit a book and read it; a book that reading refuses raises BadInput with the book's reason."""
    kw.setdefault("reference_bytes", wav_bytes())
    sender = sender or RecordingSender()
    book_id = submit_book(ctx=replace(ctx, sender=sender), session=session, data=data, request=book_request(
        **kw))
    if read_now(ctx=ctx, session=session, book_id=book_id, sender=sender) == "failed":
        raise BadInput(queries.require_book(session=session, book_id=book_id).error or "")
    return book_id


def manifest(*chapters: list[list[int]]) -> bytes:
    return json.dumps({"title": "T", "chapters": [
        {"title": f"C{i}", "segments": [{"tokens": t} for t in segs]}
        for i, segs in enumerate(chapters)]}).encode()


def test_submit_plans_the_book_stores_it_and_queues_the_voice_and_the_plan_once(
        ctx, settings: Settings, session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    sender = RecordingSender()
    book_id = submit(ctx, session, MARKDOWN_BOOK.encode(), sender=sender,
                     filename="b.md", options=BookOptions(priority=2))
    assert [(name, opts["queue"]) for name, _, opts in sender.sent] == [
        ("voice.prepare", settings.queue_cpu), ("book.parse", settings.queue_cpu),
        ("book.plan", settings.queue_cpu)]
    book = queries.require_book(session=session, book_id=book_id)
    assert (book.status, book.title, book.author, book.priority) == ("queued", "The Lighthouse Keeper",
                                                                       "Ada Quill", 2)
    plan = load_plan(artifacts, book_id)
    assert plan.key == book.plan_key and [c.title for c in plan.chapters] == [
        "Chapter 1: The Storm", "Chapter 2: The Ship", "Chapter 3: Morning"]
    chapters = queries.list_chapters(session=session, book_id=book_id)
    assert [c.segments_total for c in chapters] == [len(c.segments) for c in plan.chapters]
    view = book_status(session=session, artifacts=artifacts, book_id=book_id)
    assert (view.segments_done, view.audio_seconds, view.files) == (0, 0.0, [])
    assert view.segments_total == len(plan.unique_keys())

    again = submit(ctx, session, MARKDOWN_BOOK.encode(), sender=sender,
                   filename="b.md")
    assert again != book_id  # a second render of the same book shares every segment row
    assert session.scalar(select(func.count()).select_from(Segment)) == len(plan.unique_keys())


def test_a_cast_voice_is_prepared_once_for_the_book_and_an_unknown_one_is_refused(
        ctx, settings: Settings, session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    from app.voices.service import register_voice

    sender = RecordingSender()
    alice, _ = register_voice(ctx=replace(ctx, sender=sender), session=session,
                              reference_bytes=wav_bytes(freq=330.0))
    book = b"# B\n\n## One\n\n{Alice}\"Hello.\" {voice: alice} Again. {Alice}\"And again.\""
    for _ in range(2):  # two renders of the book: still one preparation per voice
        submit(ctx, session, book, sender=sender, filename="b.md",
               cast=f"Alice: {alice}".encode())
    prepared = [args[0] for name, args, _ in sender.sent if name == "voice.prepare"]
    assert sorted(prepared) == sorted(set(prepared)) and alice in prepared and len(prepared) == 2
    with pytest.raises(BadInput, match=f"the cast names voices that are not stored: {'f' * 64}"):
        submit(ctx, session, book, filename="b.md", cast={"Alice": "f" * 64})


def test_the_books_lexicon_over_the_services_default_changes_what_its_segments_say(
        ctx, settings: Settings, session, store: FeatureStore, artifacts: ArtifactStore, tmp_path) -> None:
    default = tmp_path / "lexicon.yaml"
    default.write_text("words:\n  Watson: Wotson\n  Smith: Smythe\n")
    with_default = settings.model_copy(update={"lexicon": default})
    plain = load_plan(artifacts, submit(ctx, session, MARKDOWN_BOOK.encode(),
                                        filename="b.md"))
    book_id = submit(replace(ctx, settings=with_default), session, MARKDOWN_BOOK.encode(), filename="b.md",
                     lexicon=b'{"words": {"Watson": "Whatsun"}}')
    said = {s.text: s.spoken for _, s in load_plan(artifacts, book_id).segments()}
    assert any("Whatsun" in v for v in said.values()) and not any("Wotson" in v for v in said.values())
    assert any("Smythe" in v for v in said.values())  # the default's entry the book did not override
    changed = [s.text for (_, s), (_, p) in zip(load_plan(artifacts, book_id).segments(), plain.segments(),
                                                strict=True) if s.key != p.key]
    assert len(changed) == 2 and all("Watson" in t or "Smith" in t for t in changed)
    with pytest.raises(BadInput, match="the lexicon must be an object"):
        submit(ctx, session, MARKDOWN_BOOK.encode(), filename="b.md", lexicon=b"[1]")


@pytest.mark.parametrize(("data", "kw", "reason"), [
    (b"", {}, "the book is empty"),
    (b"Title\n\nSome text.", {"options": BookOptions(output_format="mp3")}, "book format"),
    (b"Title\n\nSome text.", {"options": BookOptions(priority=12)}, "priority"),
    (b"Title\n\nSome text.", {"language": "not a tag"}, "is not a language tag"),
    (b"Title\n\nSome text.", {"chapters": "3-1"}, "runs backwards"),
])
def test_what_needs_no_reading_is_refused_at_submission_before_anything_is_stored(
        ctx, settings, session, store, artifacts, data: bytes, kw: dict, reason: str) -> None:
    sender = RecordingSender()
    with pytest.raises(BadInput, match=reason):
        submit_book(ctx=replace(ctx, sender=sender), session=session, data=data, request=book_request(
            reference_bytes=wav_bytes(), **kw))
    assert session.scalar(select(func.count()).select_from(Book)) == 0
    assert not [name for name, _, _ in sender.sent if name.startswith("book.")]
    assert not any((artifacts.root / "books").glob("*"))


@pytest.mark.parametrize(("data", "kw", "reason"), [
    (b"\x00\x01\x02" * 100, {"filename": "b.txt"}, "binary"),
    (b'{"chapters": []}', {}, "non-empty 'chapters'"),
    (manifest([[1, 2, 99999]]), {}, "not an integer in 0..6560"),
    (b"Title\n\nSome text.", {"language": "xx-yy"}, "no guide voice"),
])
def test_a_book_refused_once_read_fails_with_the_reason_and_nothing_is_planned(
        ctx, settings, session, store, artifacts, data: bytes, kw: dict, reason: str) -> None:
    sender = RecordingSender()
    with pytest.raises(BadInput, match=reason):
        submit(ctx, session, data, sender=sender, **kw)
    book = session.scalars(select(Book)).one()
    assert book.status == BookStatus.FAILED and reason in (book.error or "") and book.segments_total == 0
    assert not [name for name, _, _ in sender.sent if name == "book.plan"]
    assert not any((artifacts.root / "books").glob("*"))


def test_cancel_stops_the_books_live_segment_jobs_but_not_one_another_live_book_needs(
        ctx, settings, session, store, artifacts) -> None:
    data = manifest([[5] * 30, [6] * 40])
    first = submit(ctx, session, data)
    second = submit(ctx, session, manifest([[5] * 30]))
    book = queries.require_book(session=session, book_id=first)
    jobs = {}
    for key in load_plan(artifacts, first).unique_keys():
        jobs[key], created = make_segment_job(session=session, artifacts=artifacts, book=book, key=key,
                                              content=[1] * 25, replacing=None)
        assert created
    session.commit()
    again, created = make_segment_job(session=session, artifacts=artifacts, book=book, key=key,
                                      content=[1] * 25, replacing=None)
    assert (again, created) == (jobs[key], False)  # another render linked it first
    assert cancel_book(session=session, store=store, book_id=first, cancel_ttl_s=60)
    statuses = {k: queries.require_job(session=session, job_id=j).status for k, j in jobs.items()}
    shared = load_plan(artifacts, second).unique_keys()[0]
    assert statuses[shared] == JobStatus.QUEUED  # the second book still wants it
    assert [s for k, s in statuses.items() if k != shared] == [JobStatus.CANCELLED]
    assert store.is_cancelled(jobs[key]) and not store.is_cancelled(jobs[shared])
    assert queries.require_book(session=session, book_id=first).status == BookStatus.CANCELLED
    assert not cancel_book(session=session, store=store, book_id=first, cancel_ttl_s=60)


# The API -----------------------------------------------------------------------------------------

@pytest.fixture
def client(settings: Settings, feature_redis) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def test_api_takes_a_book_upload_and_an_inline_manifest_and_reports_progress(client: TestClient) -> None:
    r = client.post("/v1/books", files={"book": ("b.md", MARKDOWN_BOOK.encode()),
                                        "reference": ("r.wav", wav_bytes())}, data={"output_format": "wav"})
    assert r.status_code == 202, r.text
    book = r.json()
    assert r.headers["location"] == f"/v1/books/{book['id']}"
    assert (book["status"], book["title"], book["chapters"]) == ("parsing", "b", [])  # not read yet
    read_in(client.app.state.ctx, book["id"])
    book = client.get(f"/v1/books/{book['id']}").json()
    assert book["status"] == "queued" and len(book["chapters"]) == 3 and book["segments_done"] == 0
    assert book["title"] == "The Lighthouse Keeper"
    assert [b["id"] for b in client.get("/v1/books").json()] == [book["id"]]
    inline = {"title": "M", "chapters": [{"segments": [{"tokens": [1, 2]}]}]}
    r = post_and_read(client, json={"voice_id": book["voice_id"], "manifest": inline})
    assert r.status_code == 202 and r.book["segments_total"] == 1
    missing = client.get(f"/v1/books/{book['id']}/files/book.m4b")
    assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
    assert client.get(f"/v1/books/{book['id']}/files/..%2Fplan.json").status_code == 404
    assert client.post(f"/v1/books/{book['id']}/cancel").json()["status"] == "cancelled"
    assert client.post(f"/v1/books/{book['id']}/cancel").json()["status"] == "cancelled"  # idempotent


def test_api_renders_the_chapters_a_form_or_a_manifest_selects(client: TestClient) -> None:
    r = post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode()),
                                     "reference": ("r.wav", wav_bytes())}, data={"chapters": "1,3"})
    assert r.status_code == 202, r.text
    book = r.book
    assert book["chapters_selected"] == "1,3" and len(book["chapters"]) == 2
    whole = post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode())},
                          data={"voice_id": book["voice_id"]}).book
    assert whole["chapters_selected"] is None
    assert [c["title"] for c in book["chapters"]] == [whole["chapters"][i]["title"] for i in (0, 2)]
    inline = {"title": "M", "chapters": [{"segments": [{"tokens": [1, 2]}]}, {"segments": [{"tokens": [3]}]}]}
    r = post_and_read(client, json={"voice_id": book["voice_id"], "manifest": inline, "chapters": "2"})
    assert r.book["segments_total"] == 1 and r.book["chapters_selected"] == "2"
    refused = post_and_read(client, json={"voice_id": book["voice_id"], "manifest": inline, "chapters": "3"})
    assert refused.book["status"] == "failed" and "the book has 2 chapters" in refused.book["error"]
    malformed = client.post("/v1/books", json={"voice_id": book["voice_id"], "manifest": inline,
                                               "chapters": "2-1"})
    assert malformed.status_code == 422 and "runs backwards" in malformed.json()["reason"]


def test_api_normalises_chapters_to_minus_20_lufs_unless_told_otherwise(client: TestClient) -> None:
    def form(**data):
        return client.post("/v1/books", files={"book": ("b.md", MARKDOWN_BOOK.encode()),
                                               "reference": ("r.wav", wav_bytes())}, data=data)
    assert form().json()["target_lufs"] == -20.0
    assert form(target_lufs="-16.5").json()["target_lufs"] == -16.5
    off = form(target_lufs="off").json()
    assert off["target_lufs"] is None
    bad = form(target_lufs="loud")
    assert bad.status_code == 422 and "a number of LUFS or 'off'" in bad.json()["reason"]
    assert form(target_lufs="-3").status_code == 422  # outside -70..-5
    inline = {"title": "M", "chapters": [{"segments": [{"tokens": [1, 2]}]}]}
    as_json = client.post("/v1/books", json={"voice_id": off["voice_id"], "manifest": inline})
    assert as_json.json()["target_lufs"] == -20.0
    measured_only = client.post("/v1/books", json={"voice_id": off["voice_id"], "manifest": inline,
                                                   "target_lufs": None})
    assert measured_only.status_code == 202 and measured_only.json()["target_lufs"] is None


def test_api_takes_a_narrator_a_description_mp3s_and_a_lexicon(client: TestClient) -> None:
    def form(files=None, **data):
        files = {"book": ("b.md", MARKDOWN_BOOK.encode()), "reference": ("r.wav", wav_bytes()),
                 **(files or {})}
        return post_and_read(client, files=files, data=data)
    off = form().book
    inline = {"title": "M", "chapters": [{"segments": [{"tokens": [1, 2]}]}]}
    tagged = form(mp3="true", narrator="Ben Narrow", description="Three tales.").book
    assert tagged["mp3"] is True and form().book["mp3"] is False
    assert form(epub3="true").book["epub3"] is True and off["epub3"] is False
    preview = form(preview_s="3", chapters="3").book
    assert preview["status"] == "queued"
    assert [c["title"] for c in preview["chapters"]] == ["Chapter 3: Morning"]
    assert 0 < preview["segments_total"] < 3  # the title, and the next segment if it fits 3 s
    assert form(preview_s="0.5").status_code == 422
    shelved = form(series="The Lamps", series_part="2").book
    assert (shelved["series"], shelved["series_part"]) == ("The Lamps", "2")
    assert form(series_part="2").status_code == 422
    published = post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode())},
                              data={"voice_id": off["voice_id"], "publisher": "Owl Press", "year": "2021",
                                    "isbn": "978-0-306-40615-7",
                                    "genres": ["Fantasy, Adventure", "Fantasy"]}).book  # two fields
    assert (published["publisher"], published["year"], published["isbn"]) == ("Owl Press", "2021",
                                                                               "9780306406157")
    assert published["genres"] == ["Fantasy", "Adventure"] and off["genres"] == [] and off["isbn"] == ""
    for field, value, reason in (("isbn", "978-0-306-40615-8", "check digit does not match"),
                                 ("year", "19", "four digits"), ("genres", "Horror/Fantasy", "holds '/'")):
        refused = form(**{field: value})
        assert refused.status_code == 422 and reason in refused.json()["reason"], refused.json()
    acx = form(mp3_bitrate_kbps="192", sample_rate="44100").book
    assert (acx["mp3_bitrate_kbps"], acx["sample_rate"], acx["bitrate_kbps"]) == (192, 44100, 64)
    assert (off["sample_rate"], off["mp3_bitrate_kbps"]) == (None, 64)
    refused = form(mp3_bitrate_kbps="192")  # an MP3 at 24 kHz (MPEG-2) takes at most 160 kbit/s
    assert refused.status_code == 422 and "at most 160 kbit/s" in refused.json()["reason"]
    assert (tagged["narrator"], tagged["description"]) == ("Ben Narrow", "Three tales.")
    lexicon = form(files={"lexicon": ("l.yaml", b"words: [oops]")})
    assert lexicon.status_code == 202 and lexicon.book["status"] == "failed"
    assert "'words' must be a mapping" in lexicon.book["error"]
    as_text = post_and_read(client, files={"book": ("b.md", MARKDOWN_BOOK.encode())},
                            data={"voice_id": off["voice_id"], "lexicon": "words: {Watson: Wotson}"})
    assert as_text.book["status"] == "queued", as_text.book
    in_json = post_and_read(client, json={"voice_id": off["voice_id"], "manifest": inline,
                                          "lexicon": {"words": {"x": {"phonemes": "[["}}}})
    assert in_json.book["status"] == "failed" and "without brackets" in in_json.book["error"]
    dated = post_and_read(client, json={"voice_id": off["voice_id"], "manifest": inline, "year": 1999,
                                        "genres": ["Drama"], "isbn": "0-306-40615-2"})
    assert (dated.book["year"], dated.book["genres"], dated.book["isbn"]) == ("1999", ["Drama"], "0306406152")
    late = client.post("/v1/books", json={"voice_id": off["voice_id"], "manifest": inline, "year": 3000})
    assert late.status_code == 422 and "1000 to 2100" in late.json()["reason"]
    voiced = b"# B\n\n## One\n\n{Ann}\"Hello,\" she said."
    cast_file = ("cast.yaml", f"Ann: {off['voice_id']}")
    cast = post_and_read(client, files={"book": ("b.md", voiced), "cast": cast_file},
                         data={"voice_id": tagged["voice_id"]})
    assert cast.book["status"] == "queued", cast.book
    assert cast.book["cast"] == {"ann": off["voice_id"]}
    uncast = post_and_read(client, files={"book": ("b.md", voiced)}, data={"voice_id": off["voice_id"]})
    assert "the cast does not map: 'ann'" in uncast.book["error"]


def test_api_takes_html_pdf_and_docx_books(client: TestClient) -> None:
    from tests.app.books.conftest import make_docx, make_pdf

    page = b"<html><body><h1>One</h1><p>Some text here.</p><h1>Two</h1><p>More.</p></body></html>"
    books = {"b.html": page,
             "b.pdf": make_pdf([["Chapter 1", "Some text here, on a line of its own, long enough."],
                                ["Chapter 2", "More text here, on a line of its own, long enough."]]),
             "b.docx": make_docx([("Heading 1", "One"), ("", "Some text here."), ("Heading 1", "Two"),
                                  ("", "More.")])}
    for name, data in books.items():
        r = post_and_read(client, files={"book": (name, data), "reference": ("r.wav", wav_bytes())})
        assert r.status_code == 202, (name, r.text)
        assert len(r.book["chapters"]) == 2, name
    broken = post_and_read(client, files={"book": ("b.pdf", b"%PDF-1.4 nothing"),
                                          "reference": ("r.wav", wav_bytes())})
    assert broken.book["status"] == "failed" and "PDF" in broken.book["error"]


def test_api_refuses_what_it_can_at_once_and_a_bad_book_once_read_with_the_reason(
        client: TestClient) -> None:
    ref = ("r.wav", wav_bytes())
    r = post_and_read(client, files={"book": ("b.txt", b"\x00" * 500), "reference": ref})
    assert r.status_code == 202 and r.book["status"] == "failed" and "binary" in r.book["error"]
    audio_manifest = b'{"chapters": [{"segments": [{"audio": "x.wav"}]}]}'
    r = post_and_read(client, files={"book": ("b.json", audio_manifest), "reference": ref})
    assert "tokens" in r.book["error"]
    r = client.post("/v1/books", files={"book": ("b.md", b"# A\n\ntext")}, data={"voice_id": "0" * 64})
    assert r.status_code == 404
    r = client.post("/v1/books", files={"book": ("b.md", b""), "reference": ref})
    assert r.status_code == 422 and "empty" in r.json()["reason"]
    r = client.post("/v1/books", files={"book": ("b.md", b"x"), "reference": ref}, data={"language": "12"})
    assert r.status_code == 422 and "not a language tag" in r.json()["reason"]
    assert client.post("/v1/books", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
    assert client.get("/v1/books/not-a-uuid").status_code == 404
