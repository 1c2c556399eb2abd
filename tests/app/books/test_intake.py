"""A book's way in (app.books.intake): accepted without being read, read by a bounded child process,
planned or refused with the reason; on both databases and real Redis, the child process real."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.books.files import book_dir, load_plan
from app.books.reading.source import BookLimits
from app.books.service import BookOptions, cancel, submit_book
from app.context import Context
from app.db import queries
from app.db.models import BookStatus, Segment
from app.errors import BadInput, NotFound
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.support.audio import wav_bytes
from tests.support.books import RecordingSender, book_request, read_now, submit_and_read
from tests.support.hostile import (
    deep_json,
    deep_outline_pdf,
    deep_yaml,
    docx_bad_crc,
    docx_declaring,
    inflating_pdf,
    many_patterns,
    shared_stream_pdf,
    timed_subtitles,
)


def test_a_book_is_accepted_unread_then_read_and_planned_by_the_worker(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    sender = RecordingSender()
    book_id = submit_book(ctx=replace(ctx, sender=sender), session=session, data=MARKDOWN_BOOK.encode(),
                          request=book_request(filename="lighthouse.md", reference_bytes=wav_bytes()))
    book = queries.require_book(session=session, book_id=book_id)
    assert (book.status, book.title, book.segments_total) == (BookStatus.PARSING, "lighthouse", 0)
    assert sender.names() == ["voice.prepare", "book.parse"]
    assert (book_dir(artifacts, book_id) / "source").read_bytes() == MARKDOWN_BOOK.encode()

    assert read_now(ctx=ctx, session=session, book_id=book_id,
                    sender=sender) == "planned"
    book = queries.require_book(session=session, book_id=book_id)
    assert (book.status, book.title, book.author) == (BookStatus.QUEUED, "The Lighthouse Keeper", "Ada Quill")
    assert book.parse_attempts == 1 and book.plan_key == load_plan(artifacts, book_id).key
    assert sender.names()[-1] == "book.plan"
    assert not (book_dir(artifacts, book_id) / "source").exists()  # read: the upload is gone, the plan stays
    assert read_now(ctx=ctx, session=session, book_id=book_id) == "skipped"  # a duplicate message


def test_a_book_that_cannot_be_read_fails_with_the_reason_and_leaves_no_files(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    book_id, outcome = submit_and_read(ctx=ctx, session=session, data=b"\x00\x01binary" * 100,
                                       filename="b.txt",
                                       reference_bytes=wav_bytes())
    book = queries.require_book(session=session, book_id=book_id)
    assert outcome == "failed" and book.status == BookStatus.FAILED
    assert "looks like binary data" in (book.error or "")
    assert not book_dir(artifacts, book_id).exists()


def _read(ctx: Context, session: Session, data: bytes, **kw: object) -> tuple[str, str | None]:
    """Submit and read a book; (its status, its error)."""
    kw.setdefault("reference_bytes", wav_bytes())
    book_id, _ = submit_and_read(ctx=ctx, session=session, data=data, **kw)
    book = queries.require_book(session=session, book_id=book_id)
    if book.status == BookStatus.FAILED:
        assert not book_dir(ctx.artifacts, book_id).exists()  # a refused book leaves no files
    return book.status, book.error


@pytest.mark.parametrize("fmt", ["vtt", "srt"])
def test_a_timed_cue_past_the_span_limit_is_refused_naming_the_cue(
        ctx, fmt: str, settings: Settings, session: Session, store: FeatureStore,
        artifacts: ArtifactStore) -> None:
    data = timed_subtitles(fmt, 99_999)
    status, error = _read(ctx, session, data, filename=f"s.{fmt}",
                          options=BookOptions(timed=True))
    assert status == BookStatus.FAILED
    assert "cue 2 ('Much later.') starts at 99999:00:00, past the timed span limit of 48:00:00" in error
    untimed, _ = _read(ctx, session, data, filename=f"s.{fmt}")
    assert untimed == BookStatus.QUEUED  # without timing the cues' times change nothing


@pytest.mark.parametrize("name, data, reason", [
    ("overflowing hour", lambda: timed_subtitles("srt", 10**15), "not a valid SRT file"),
    ("PDF outline 20,000 deep", lambda: deep_outline_pdf(20_000), "Maximum outline depth reached"),
    ("DOCX DTD in UTF-32", lambda: docx_declaring(encoding="utf-32"), "declares a DTD or an entity"),
    ("DOCX DTD in a .bin part", lambda: docx_declaring(encoding="utf-16", part="word/media/a.bin"),
     "'word/media/a.bin' declares a DTD"),
    ("DOCX with a bad CRC", lambda: docx_bad_crc("word/styles.xml"), "Bad CRC-32 for file 'word/styles.xml'"),
])
def test_each_class_of_broken_file_fails_its_book_with_the_reason(
        ctx, name: str, data: Any, reason: str, settings: Settings, session: Session, store: FeatureStore,
        artifacts: ArtifactStore) -> None:
    fmt = {"overflowing hour": "srt", "PDF outline 20,000 deep": "pdf"}.get(name, "docx")
    status, error = _read(ctx, session, data(), filename=f"b.{fmt}")
    assert status == BookStatus.FAILED and reason in (error or ""), error


@pytest.mark.parametrize("what, data", [("lexicon", deep_json()), ("lexicon", deep_yaml()),
                                        ("cast", deep_json(2000)), ("cast", deep_yaml(20_000))])
def test_a_cast_or_lexicon_nested_too_deeply_fails_the_book_with_the_reason(
        ctx, what: str, data: bytes, settings: Settings, session: Session, store: FeatureStore,
        artifacts: ArtifactStore) -> None:
    status, error = _read(ctx, session, MARKDOWN_BOOK.encode(), filename="b.md",
                          **{what: data})
    assert status == BookStatus.FAILED and f"the {what} is nested too deeply" in (error or "")


@pytest.mark.parametrize("hostile", ["inflating", "shared stream"])
def test_a_pdf_that_takes_too_long_to_read_is_stopped_at_the_cpu_limit(
        ctx, hostile: str, settings: Settings, session: Session, store: FeatureStore,
        artifacts: ArtifactStore) -> None:
    """The 26 MB content stream took 24 minutes in the API; here the child stops at its CPU limit (2 s
    in this test; WAVEFARM_BOOK_PARSE_CPU_S, 120 s by default)."""
    data = inflating_pdf(3) if hostile == "inflating" else shared_stream_pdf(2000, 0.05)
    tight = settings.model_copy(update={"book_parse_cpu_s": 2})
    status, error = _read(replace(ctx, settings=tight), session, data, filename="b.pdf")
    assert status == BookStatus.FAILED
    assert "reading the book took more than 2 s of CPU (WAVEFARM_BOOK_PARSE_CPU_S)" in (error or "")


def test_a_reader_past_its_wall_clock_limit_is_killed_with_everything_it_started(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    tight = settings.model_copy(update={"book_parse_timeout_s": 1.0})
    status, error = _read(replace(ctx, settings=tight), session, inflating_pdf(3), filename="b.pdf")
    assert status == BookStatus.FAILED
    assert "reading the book took longer than 1 s (WAVEFARM_BOOK_PARSE_TIMEOUT_S)" in (error or "")


def test_a_book_needing_more_memory_than_the_limit_fails_with_the_limit(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    tight = settings.model_copy(update={"book_parse_memory_mb": 256})
    text = b"The sea.\n" * 1_600_000  # 15 MB, under the size limit: a list of lines bigger than the rest
    status, error = _read(replace(ctx, settings=tight), session, text, filename="b.txt")
    assert status == BookStatus.FAILED
    assert "256 MB" in (error or "") and "memory" in (error or "").replace("MEMORY", "memory"), error


def test_lexicon_patterns_are_bounded_in_number_and_in_time_over_the_whole_book(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    status, error = _read(ctx, session, MARKDOWN_BOOK.encode(), filename="b.md",
                          lexicon=many_patterns(2000))
    assert status == BookStatus.FAILED and "2000 patterns; the limit is 256" in (error or "")
    # Each of these backtracks for about a millisecond on each sentence: far under the limit per
    # pattern and sentence, far over a budget of 0.3 s over the whole book.
    slow = json.dumps({"patterns": [{"match": f"(a|aa)+c{i}", "say": "x"} for i in range(200)]}).encode()
    book = "# B\n\n## One\n\n" + "\n\n".join(f"{'a' * 22} word{i}." for i in range(60))
    tight = settings.model_copy(update={"lexicon_budget_s": 0.3})
    status, error = _read(replace(ctx, settings=tight), session, book.encode(), filename="b.md", lexicon=slow)
    assert status == BookStatus.FAILED
    assert "the lexicon's patterns took more than 0.3 s in all on this book" in (error or "")


def test_a_subtitle_book_of_thousands_of_cues_is_planned_on_both_databases(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    """6,000 segments: one INSERT of them all passed SQLite's 32,766 variables (6 columns a row)."""
    cues = "".join(f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}.000 --> "
                   f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}.500\nLine {i}.\n\n" for i in range(6000))
    status, error = _read(ctx, session, f"WEBVTT\n\n{cues}".encode(), filename="s.vtt")
    assert (status, error) == (BookStatus.QUEUED, None)
    assert session.scalar(select(func.count()).select_from(Segment)) == 6000


def test_a_refused_submission_leaves_no_folder_behind(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    books = artifacts.root / "books"
    before = sorted(books.iterdir()) if books.is_dir() else []
    with pytest.raises(NotFound):
        submit_book(ctx=replace(ctx, sender=RecordingSender()), session=session, data=MARKDOWN_BOOK.encode(),
                    request=book_request(filename="b.md", voice_id="0" * 64))
    with pytest.raises(BadInput, match="larger than"):
        submit_book(ctx=replace(ctx, sender=RecordingSender()), session=session, data=b"x" * 2000,
                    request=book_request(filename="b.txt", reference_bytes=wav_bytes()),
                    limits=BookLimits(max_epub_bytes=1000))
    assert (sorted(books.iterdir()) if books.is_dir() else []) == before


def test_a_book_cancelled_while_it_is_read_stops_its_reader(
        ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore) -> None:
    sender = RecordingSender()
    book_id = submit_book(ctx=replace(ctx, sender=sender), session=session, data=inflating_pdf(3),
                          request=book_request(filename="b.pdf", reference_bytes=wav_bytes()))
    outcome: list[str] = []
    reader = threading.Thread(target=lambda: outcome.append(read_now(ctx=ctx, session=session,
                                                                     book_id=book_id,
        sender=sender)))
    with ctx.sessions() as other:
        reader.start()
        while not (book_dir(artifacts, book_id) / "parse-job.json").exists():
            time.sleep(0.05)
        cancel(ctx=ctx, session=other, book_id=book_id)
    reader.join(timeout=120)
    assert outcome == ["stopped"]
    assert queries.require_book(session=session, book_id=book_id).status == BookStatus.CANCELLED
    assert not book_dir(artifacts, book_id).exists()
