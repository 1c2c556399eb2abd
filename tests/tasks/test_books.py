"""Book tasks in process, on both databases: the GPU worker's part is played by finishing the segment jobs
with audio files; messages go to a real broker on queues nobody consumes."""

from __future__ import annotations

import base64
import json

import av
import mutagen.id3
import mutagen.mp4
import numpy as np
import pytest
import soundfile as sf
from celery import Celery

import tasks.books as books
from app import lifecycle
from app.books.files import output_dir
from app.books.service import BookOptions, submit_book
from app.books.status import book_status
from app.context import Context
from app.db import queries
from app.db.models import BookStatus, JobKind, JobStatus
from app.errors import BadInput
from app.s3 import StandInTokenizer
from app.speech import VOCAB_SIZE
from app.text.guide_speech import GuideSpeech
from app.text.tokens import STAND_IN_NOTE
from gpu_worker.worker.guide import TokenizeLane, tokenize_text_job
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.app.helpers import queued
from tests.support.audio import wav_bytes
from tests.support.books import book_request


def tokenize_live_jobs(ctx: Context, book_id: str) -> None:
    with ctx.sessions() as session:
        live = [s.job_id for s in queries.book_segment_states(session=session, book_id=book_id)
                if s.live and s.job_id]
    lane = TokenizeLane(StandInTokenizer())
    try:
        for job_id in live:
            assert tokenize_text_job(ctx, lane, job_id) == "ready"
    finally:
        lane.close()


def manifest_book(chapters: list[list[int]]) -> bytes:
    return json.dumps({"title": "Tokens", "author": "T", "chapters": [
        {"title": f"Part {i + 1}", "segments": [{"tokens": [7 * n % VOCAB_SIZE] * n} for n in sizes]}
        for i, sizes in enumerate(chapters)]}).encode()


def submit(ctx: Context, celery: Celery, data: bytes, **kw) -> str:
    """Submit a book and run its `book.parse` here (the reading child process is the real one); a book
    that reading refuses raises BadInput with the book's reason, as the API's status would show it."""
    with ctx.sessions() as session:
        book_id = submit_book(ctx=ctx, session=session, data=data, request=book_request(
            reference_bytes=wav_bytes(), **kw))
    if books.parse(book_id, ctx) == "failed":
        with ctx.sessions() as session:
            raise BadInput(queries.require_book(session=session, book_id=book_id).error or "")
    return book_id


def render_live_jobs(ctx: Context, book_id: str) -> int:
    """Play the GPU worker: every live segment job is tokenized from its guide speech if it is a text
    segment's (as the GPU worker's lane does), then gets 960 samples of sine per token and succeeds."""
    tokenize_live_jobs(ctx, book_id)
    with ctx.sessions() as session:
        states = queries.book_segment_states(session=session, book_id=book_id)
        done = 0
        for s in states:
            if s.live and s.job_id:
                job = queries.require_job(session=session, job_id=s.job_id)
                relpath = ctx.artifacts.output_relpath(job.id, job.output_format)
                t = np.arange(job.n_tokens * 960) / 24000
                sf.write(ctx.artifacts.path(relpath), 0.3 * np.sin(2 * np.pi * 220 * t), 24000,
                         format=job.output_format.upper())
                assert lifecycle.finish(session=session, job_id=job.id, status=JobStatus.SUCCEEDED,
                                          output_path=relpath)
                done += 1
        session.commit()
    return done


def test_a_token_book_renders_chapters_assembles_an_m4b_and_resumes_with_nothing_to_render(
        ctx: Context, celery: Celery) -> None:
    data = manifest_book([[30, 40], [25], [50, 30, 30]])  # the thrice repeated 30 renders once
    book_id = submit(ctx, celery, data, options=BookOptions(output_format="wav"))
    assert books.plan(book_id, ctx) == 4
    assert books.check_chapter(book_id, 0, ctx) == "waiting"
    assert render_live_jobs(ctx, book_id) == 4
    assert [books.check_chapter(book_id, i, ctx) for i in range(3)] == ["assembled"] * 3
    assert books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    assert view.book.status == BookStatus.SUCCEEDED and view.segments_done == view.segments_total == 5
    # (each chapter counts its own distinct segments: the repeated 30 counts in two chapters)
    assert view.audio_seconds == pytest.approx((30 + 40 + 25 + 50 + 30) / 25)
    assert {"book.m4b", "chapters.json", "chapters.vtt", "chapter-001.wav"} <= set(view.files)
    with av.open(str(output_dir(ctx.artifacts, book_id) / "book.m4b")) as box:
        assert [c["metadata"]["title"] for c in box.chapters()] == ["Part 1", "Part 2", "Part 3"]
    index = json.loads((output_dir(ctx.artifacts, book_id) / "chapters.json").read_text())
    for chapter, entry in zip(view.chapters, index["chapters"], strict=True):  # the default -20 LUFS
        assert chapter.loudness_lufs == pytest.approx(-20.0, abs=0.2)
        assert chapter.true_peak_dbtp is not None and chapter.true_peak_dbtp <= -1.0 + 0.01
        assert entry["loudness"]["integrated_lufs"] == pytest.approx(chapter.loudness_lufs, abs=0.01)

    again = submit(ctx, celery, data, options=BookOptions(output_format="wav"))
    assert books.plan(again, ctx) == 0  # every segment is reused
    edited = submit(ctx, celery, manifest_book([[30, 41], [25], [50, 30, 30]]),
                    options=BookOptions(output_format="wav"))
    assert books.plan(edited, ctx) == 1  # only the changed segment


def test_a_book_with_mp3s_gets_one_tagged_mp3_per_chapter_and_its_narrator_in_every_file(
        ctx: Context, celery: Celery) -> None:
    data = manifest_book([[30], [25, 20]])
    book_id = submit(ctx, celery, data, options=BookOptions(mp3=True), narrator="Ben Narrow",
                     description="Two parts.")
    books.plan(book_id, ctx)
    render_live_jobs(ctx, book_id)
    assert [books.check_chapter(book_id, i, ctx) for i in range(2)] == ["assembled"] * 2
    assert books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    assert view.book.mp3 and {"chapter-001.mp3", "chapter-002.mp3", "book.m4b"} <= set(view.files)
    out = output_dir(ctx.artifacts, book_id)
    for n, title in ((1, "Part 1"), (2, "Part 2")):
        tags = mutagen.id3.ID3(out / f"chapter-00{n}.mp3")
        assert (str(tags["TIT2"]), str(tags["TRCK"]), str(tags["TCOM"])) == (title, f"{n}/2", "Ben Narrow")
        assert str(tags["TALB"]) == "Tokens" and tags.getall("COMM")[0].text == ["Two parts."]
    m4b = mutagen.mp4.MP4(out / "book.m4b").tags
    assert m4b["\xa9wrt"] == ["Ben Narrow"] and m4b["desc"] == ["Two parts."]


def test_chosen_chapters_render_alone_and_a_later_whole_render_reuses_their_segments(
        ctx: Context, celery: Celery) -> None:
    data = manifest_book([[30, 40], [25], [50, 31], [26]])
    some = submit(ctx, celery, data, chapters="2-3", options=BookOptions(output_format="wav"))
    assert books.plan(some, ctx) == 3  # chapter 2's 25, chapter 3's 50 and 31
    assert render_live_jobs(ctx, some) == 3
    assert [books.check_chapter(some, i, ctx) for i in range(2)] == ["assembled"] * 2
    assert books.assemble(some, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=some)
    assert view.book.chapters_selected == "2-3" and [c.title for c in view.chapters] == ["Part 2", "Part 3"]
    assert view.audio_seconds == pytest.approx((25 + 50 + 31) / 25)
    with av.open(str(output_dir(ctx.artifacts, some) / "book.m4b")) as box:
        assert [c["metadata"]["title"] for c in box.chapters()] == ["Part 2", "Part 3"]
    whole = submit(ctx, celery, data, options=BookOptions(output_format="wav"))
    assert books.plan(whole, ctx) == 3  # only chapters 1 and 4 are new: 30, 40 and 26
    with ctx.sessions() as session:
        assert queries.require_book(session=session, book_id=whole).chapters_selected is None


@pytest.mark.parametrize(("chapters", "says"), [
    ("5", "the book has 4 chapters, so there is no chapter 5"), ("0-2", "counted from 1"),
    ("3-1", "runs backwards"), ("two", "'two' is not a number"), ("", "give numbers and ranges")])
def test_a_selection_the_book_cannot_meet_is_refused_and_leaves_nothing_to_render(
        ctx: Context, celery: Celery, chapters: str, says: str) -> None:
    """A malformed selection is refused at submission; one past the book's chapters once it is read
    (the book fails with the reason, its files removed)."""
    with pytest.raises(BadInput, match=says):
        submit(ctx, celery, manifest_book([[30], [25], [50], [26]]), chapters=chapters)
    with ctx.sessions() as session:
        assert [b.status for b in queries.list_books(session=session, limit=10)] in ([], [BookStatus.FAILED])
    assert not any((ctx.artifacts.root / "books").glob("*/*"))


def test_a_failed_segment_fails_the_book_with_its_reason_and_a_new_render_retries_it(
        ctx: Context, celery: Celery) -> None:
    book_id = submit(ctx, celery, manifest_book([[20, 21]]))
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        first = queries.book_segment_states(session=session, book_id=book_id)[0]
        lifecycle.finish(session=session, job_id=first.job_id, status=JobStatus.FAILED, error="boom")
        session.commit()
    assert books.check_chapter(book_id, 0, ctx) == "failed"
    with ctx.sessions() as session:
        book = queries.require_book(session=session, book_id=book_id)
    assert book.status == BookStatus.FAILED and "boom" in book.error
    retry = submit(ctx, celery, manifest_book([[20, 21]]))
    assert books.plan(retry, ctx) == 1  # the failed one; the other is still queued from the first render


def test_text_segments_are_spoken_into_jobs_once_and_tokenized_on_the_gpu_worker(
        ctx: Context, celery: Celery, broker) -> None:
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    sent = books.plan(book_id, ctx)
    with ctx.sessions() as session:
        keys = [s.key for s in queries.book_segment_states(session=session, book_id=book_id)]
    assert sent == len(keys) > 3
    job = books.tokenize(book_id, [keys[0]], ctx)[0]
    assert books.tokenize(book_id, [keys[0]], ctx)[0] == job  # a redelivery reuses the job
    stored = GuideSpeech.decode(ctx.store.get_guide_speech(job) or b"", max_tokens=ctx.settings.max_tokens)
    with ctx.sessions() as session:
        row = queries.require_job(session=session, job_id=job)
        segment = queries.get_segment(session=session, key=keys[0])
        assert (row.kind, row.n_tokens, row.language) == (JobKind.TEXT, 0, "en") and segment.jobs_created == 1
        assert segment.n_tokens == sum(stored.token_counts()) > 10  # known before any tokenizer ran
        assert queries.segment_state(session=session, key=keys[0]).n_tokens == segment.n_tokens
    synths = [m for m in queued(broker, ctx.settings.queue_gpu) if m["args"] == [job]]
    assert [m["task"] for m in synths] == ["synth", "synth"]  # at once, and again on the redelivery
    tokenize_live_jobs(ctx, book_id)  # the GPU worker's part
    with ctx.sessions() as session:
        row = queries.require_job(session=session, job_id=job)
        assert row.n_tokens == segment.n_tokens and row.notes == [STAND_IN_NOTE]
    assert row.tokens == StandInTokenizer()(stored.logmels()[0])[0].tolist()  # as tokenized alone


VOICED_BOOK = b"""# Crossing

## One

The ferry left at dawn. {Alice}"I see gulls," she said.

{voice: Alice}
They were loud.
"""


def test_a_cast_members_lines_render_in_their_voice_and_recasting_renders_only_them(
        ctx: Context, celery: Celery) -> None:
    from app.voices.service import register_voice

    with ctx.sessions() as session:
        alice, _ = register_voice(ctx=ctx, session=session, reference_bytes=wav_bytes(freq=330.0))
        other, _ = register_voice(ctx=ctx, session=session, reference_bytes=wav_bytes(freq=440.0))
    book_id = submit(ctx, celery, VOICED_BOOK, filename="b.md", cast=f"Alice: {alice}".encode())
    assert books.plan(book_id, ctx) == 5  # title, narration, Alice's quotation, "she said", her passage
    plan = output_plan(ctx, book_id)
    narrator = plan.voice_id
    by_text = {s.text: s for _, s in plan.segments()}
    jobs = {}
    for text, segment in by_text.items():
        job_id = books.tokenize(book_id, [segment.key], ctx)[0]
        with ctx.sessions() as session:
            jobs[text] = queries.require_job(session=session, job_id=job_id).voice_id
    assert jobs == {"One": narrator, "The ferry left at dawn.": narrator, "I see gulls": alice,
                    "she said.": narrator, "They were loud.": alice}
    with ctx.sessions() as session:  # the segments' rows name their voice too
        assert {queries.get_segment(session=session, key=s.key).voice_id for s in by_text.values()} == {
            narrator, alice}
    render_live_jobs(ctx, book_id)
    assert books.check_chapter(book_id, 0, ctx) == "assembled" and books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    assert view.cast == {"alice": alice}

    recast = submit(ctx, celery, VOICED_BOOK, filename="b.md", cast=f"Alice: {other}".encode())
    assert books.plan(recast, ctx) == 2  # only Alice's two lines render again
    with pytest.raises(BadInput, match="the cast does not map: 'alice'"):
        submit(ctx, celery, VOICED_BOOK, filename="b.md")
    with pytest.raises(BadInput, match=f"the cast names voices that are not stored: {'0' * 64}"):
        submit(ctx, celery, VOICED_BOOK, filename="b.md", cast=f'Alice: "{"0" * 64}"'.encode())


SUBTITLES = b"""1
00:00:02,000 --> 00:00:03,000
Where is everyone?

2
00:00:30,000 --> 00:00:31,000
They left at dawn.
"""


def test_a_timed_subtitle_book_places_each_cue_at_its_start(ctx: Context, celery: Celery) -> None:
    book_id = submit(ctx, celery, SUBTITLES, filename="film.srt", options=BookOptions(timed=True, m4b=False))
    assert books.plan(book_id, ctx) == 2
    for _, segment in output_plan(ctx, book_id).segments():
        books.tokenize(book_id, [segment.key], ctx)
    render_live_jobs(ctx, book_id)
    assert books.check_chapter(book_id, 0, ctx) == "assembled" and books.assemble(book_id, ctx) == "succeeded"
    index = json.loads((output_dir(ctx.artifacts, book_id) / "chapters.json").read_text())
    starts = [s["start"] for s in index["chapters"][0]["segments"]]
    assert starts == [2.0, 30.0]
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    assert view.book.timed and view.chapters[0].seconds > 30.0


def test_an_epub3_book_is_read_planned_and_assembled_into_a_read_along_epub(ctx: Context,
                                                                           celery: Celery) -> None:
    """The reading child writes the shown text (readalong.json); book.assemble writes book.epub from it."""
    import zipfile

    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md", options=BookOptions(epub3=True))
    books.plan(book_id, ctx)
    for _, segment in output_plan(ctx, book_id).segments():
        books.tokenize(book_id, [segment.key], ctx)
    render_live_jobs(ctx, book_id)
    assert [books.check_chapter(book_id, i, ctx) for i in range(3)] == ["assembled"] * 3
    assert books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    assert view.book.epub3 and {"book.epub", "book.m4b"} <= set(view.files)
    with zipfile.ZipFile(output_dir(ctx.artifacts, book_id) / "book.epub") as z:
        assert "Dr. Watson arrived at 7:30" in z.read("OEBPS/text/chapter-003.xhtml").decode()
        assert len([n for n in z.namelist() if n.endswith(".smil")]) == 3
    from tests.app.books.conftest import make_epub

    own = submit(ctx, celery, make_epub(), filename="tales.epub", options=BookOptions(epub3=True))
    books.plan(own, ctx)
    for _, segment in output_plan(ctx, own).segments():
        books.tokenize(own, [segment.key], ctx)
    render_live_jobs(ctx, own)
    assert all(books.check_chapter(own, i, ctx) == "assembled" for i in range(4))
    assert books.assemble(own, ctx) == "succeeded"
    with zipfile.ZipFile(output_dir(ctx.artifacts, own) / "book.epub") as z:  # the book's own XHTML
        first = z.read("OEBPS/text/zz_first.xhtml").decode()
        assert '<span id="wf-2-2">It began at dusk.</span>' in first and "<script" not in first
    for named in ({"book_format": "manifest"}, {"filename": "tokens.json"}):  # refused before or by reading
        with pytest.raises(BadInput, match="no text to read along"):
            submit(ctx, celery, manifest_book([[30]]), options=BookOptions(epub3=True), **named)


def test_a_book_made_without_the_model_says_so_everywhere_and_labels_its_two_lengths(
        ctx: Context, celery: Celery) -> None:
    """The stand-in tokenizer's note (the GPU worker's lane) and its dummy-weights note reach the
    book: its status, chapters.json and the M4B's comment. Speech rendered is shorter than the M4B by
    exactly the pauses between segments: both figures are given, each named."""
    from app.db.models import Job
    from app.text.tokens import STAND_IN_NOTE
    from gpu_worker.worker.runtime import dummy_weights_note

    assert ctx.settings.model_dir is None
    book_id = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md",
                     description="Three short parts.")
    books.plan(book_id, ctx)
    plan = output_plan(ctx, book_id)
    for _, segment in plan.segments():
        books.tokenize(book_id, [segment.key], ctx)
    tokenize_live_jobs(ctx, book_id)  # the GPU worker's part: it tokenizes, then notes dummy weights
    with ctx.sessions() as session:  # on each job it claims
        for job in session.query(Job).filter(Job.status == JobStatus.QUEUED):
            queries.add_job_note(session=session, job_id=job.id, note=dummy_weights_note(ctx.settings))
        session.commit()
    render_live_jobs(ctx, book_id)
    assert [books.check_chapter(book_id, i, ctx) for i in range(3)] == ["assembled"] * 3
    assert books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=book_id)
    expected = [STAND_IN_NOTE, dummy_weights_note(ctx.settings)]
    assert view.notes == expected
    out = output_dir(ctx.artifacts, book_id)
    index = json.loads((out / "chapters.json").read_text())
    assert index["notes"] == expected
    comment = mutagen.mp4.MP4(out / "book.m4b").tags["\xa9cmt"][0]
    assert comment.splitlines() == ["Three short parts.", *(f"Note: {n}" for n in expected)]
    pauses = sum(s.pause_after_ms for _, s in plan.segments()) / 1000
    assert view.seconds == pytest.approx(index["duration"], abs=1e-3)
    assert view.seconds == pytest.approx(view.audio_seconds + pauses, abs=1e-3)


def test_a_preview_renders_one_chapters_first_seconds_first_and_the_whole_book_reuses_them(
        ctx: Context, celery: Celery) -> None:
    from app.books.submission import PREVIEW_PRIORITY

    options = BookOptions(preview_s=3.0, m4b=False, priority=PREVIEW_PRIORITY)
    preview = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md", chapters="3", options=options)
    cut = output_plan(ctx, preview)
    whole = output_plan(ctx, submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md"))
    third = whole.chapters[2].segments
    assert len(cut.chapters) == 1 and 0 < len(cut.chapters[0].segments) < len(third)
    assert [s.key for s in cut.chapters[0].segments] == [s.key for s in third[:len(cut.chapters[0].segments)]]
    kept = cut.chapters[0].segments
    assert sum(s.est_tokens for s in kept) / 25 <= 3.0 or len(kept) == 1  # whole segments, at least one
    sent = books.plan(preview, ctx)
    for _, segment in cut.segments():
        books.tokenize(preview, [segment.key], ctx)
    with ctx.sessions() as session:
        jobs = [queries.require_job(session=session, job_id=s.job_id)
                for s in queries.book_segment_states(session=session, book_id=preview)]
    assert sent == len(jobs) and {j.priority for j in jobs} == {PREVIEW_PRIORITY}  # ahead of books at 0
    render_live_jobs(ctx, preview)
    assert books.check_chapter(preview, 0, ctx) == "assembled" and books.assemble(preview, ctx) == "succeeded"
    with ctx.sessions() as session:
        view = book_status(session=session, artifacts=ctx.artifacts, book_id=preview)
    assert view.files == ["chapter-001.flac", "chapters.json", "chapters.vtt", "metadata.json"]
    later = submit(ctx, celery, MARKDOWN_BOOK.encode(), filename="book.md")
    assert books.plan(later, ctx) == len(whole.unique_keys()) - len(jobs)  # the preview's are reused


def output_plan(ctx: Context, book_id: str):
    from app.books.files import load_plan

    return load_plan(ctx.artifacts, book_id)


def test_a_cancelled_book_tokenizes_nothing_more_and_its_chapters_stop_waiting(ctx: Context,
                                                                                celery: Celery) -> None:
    from app.books.service import cancel_book

    book_id = submit(ctx, celery, b"Title\n\nOne sentence here. Another one there.", filename="b.txt")
    books.plan(book_id, ctx)
    with ctx.sessions() as session:
        key = queries.book_segment_states(session=session, book_id=book_id)[0].key
        assert cancel_book(session=session, store=ctx.store, book_id=book_id, cancel_ttl_s=60)
    with pytest.raises(books.BookStopped):
        books.tokenize(book_id, [key], ctx)
    assert books.check_chapter(book_id, 0, ctx) == "stopped"
    with ctx.sessions() as session:
        assert queries.segment_state(session=session, key=key).job_id is None


def test_chapters_are_sent_in_a_window_so_a_long_book_never_floods_the_gpu_queue(
        ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(books, "LOOKAHEAD_SEGMENTS", 2)
    book_id = submit(ctx, celery, manifest_book([[30, 40], [25], [50], [60]]))
    assert books.plan(book_id, ctx) == 2  # chapter 1 fills the window
    assert books.schedule(book_id, ctx) == 0
    assert render_live_jobs(ctx, book_id) == 2
    assert books.check_chapter(book_id, 0, ctx) == "assembled"  # ... and moves it: chapters 2 and 3
    with ctx.sessions() as session:
        chapters = queries.list_chapters(session=session, book_id=book_id)
    scheduled = [c.scheduled_at is not None for c in chapters]
    assert scheduled == [True, True, True, False]
    assert render_live_jobs(ctx, book_id) == 2
    assert [books.check_chapter(book_id, i, ctx) for i in (1, 2, 3)] == ["assembled", "assembled", "waiting"]
    assert render_live_jobs(ctx, book_id) == 1
    assert books.check_chapter(book_id, 3, ctx) == "assembled"
    assert books.assemble(book_id, ctx) == "succeeded"
    assert books.plan(book_id, ctx) == 0  # a redelivered book.plan of a finished book does nothing


def test_a_chapter_whose_sending_died_part_way_is_sent_again_by_the_sweep(ctx: Context,
                                                                         celery: Celery) -> None:
    """A CPU worker killed in book.plan (or book.chapter) after marking a chapter scheduled and before
    sending all of its segments: those segments have no job and nothing would ever make one. Found by
    scripts/long_book.py (a 300-chapter book stopped 12 segments short). The sweep sends book.plan again."""
    from datetime import timedelta

    import redis
    from sqlalchemy import delete, update

    from app.db.models import BookChapter, Job, Segment, utcnow
    from app.reconcile.sweep import sweep

    book_id = submit(ctx, celery, manifest_book([[30, 40, 41], [25]]))
    assert books.plan(book_id, ctx) == 4
    with ctx.sessions() as session:  # chapter 1's last two segments were never sent
        lost = queries.book_segment_states(session=session, book_id=book_id, chapter=0)[1:]
        session.execute(update(Segment).where(Segment.key.in_([s.key for s in lost])).values(job_id=None))
        session.execute(delete(Job).where(Job.id.in_([s.job_id for s in lost])))
        session.commit()
    broker = redis.Redis.from_url(ctx.settings.broker_url)

    def run():
        return sweep(ctx=ctx)

    try:
        assert run().chapters_resumed == []  # scheduled just now: book.plan may still be sending
        with ctx.sessions() as session:
            session.execute(update(BookChapter).values(
                scheduled_at=utcnow() - timedelta(seconds=ctx.settings.stuck_job_after_s + 5)))
            session.commit()
        assert run().chapters_resumed == [f"{book_id}/0"]
        assert run().chapters_resumed == []  # touched: not again until another period has passed
        assert books.plan(book_id, ctx) == 2  # what the re-sent book.plan does: the two, nothing else
        with ctx.sessions() as session:
            states = queries.book_segment_states(session=session, book_id=book_id)
        assert all(s.job_id for s in states)
    finally:
        broker.close()


def cpu_messages(broker, ctx: Context) -> list[tuple[str, list]]:
    """(task name, arguments) of the messages waiting on the cpu queue (sent without a priority)."""
    sent = [json.loads(raw) for raw in broker.lrange(ctx.settings.queue_cpu, 0, -1)]
    return sorted((m["headers"]["task"], json.loads(base64.b64decode(m["body"]))[0]) for m in sent)


def test_segments_are_sent_on_their_own_and_a_chapter_with_nothing_to_render_rings_its_book_chapter(
        ctx: Context, celery: Celery) -> None:
    """No chord and no polling: book.plan sends the segments alone; book.chapter is sent when a chapter is
    recorded ready, here by book.plan itself for a render whose every segment exists already."""
    import redis

    data = manifest_book([[30, 40], [25]])
    broker = redis.Redis.from_url(ctx.settings.broker_url)
    try:
        book_id = submit(ctx, celery, data)
        broker.delete(ctx.settings.queue_cpu)
        assert books.plan(book_id, ctx) == 3
        assert cpu_messages(broker, ctx) == []  # nothing waits on the segments
        assert render_live_jobs(ctx, book_id) == 3
        with ctx.sessions() as session:
            assert [c.ready_at is not None for c in queries.list_chapters(session=session, book_id=book_id)] \
                == [True, True]
        assert [books.check_chapter(book_id, i, ctx) for i in (0, 1)] == ["assembled"] * 2

        again = submit(ctx, celery, data)
        broker.delete(ctx.settings.queue_cpu)
        assert books.plan(again, ctx) == 0
        assert cpu_messages(broker, ctx) == [("book.chapter", [again, 0]), ("book.chapter", [again, 1])]
        assert books.plan(again, ctx) == 0  # redelivered: recorded once, rung once
        assert len(cpu_messages(broker, ctx)) == 2
    finally:
        broker.delete(ctx.settings.queue_cpu)
        broker.close()


def test_a_ready_chapter_whose_book_chapter_was_lost_is_sent_again_by_the_sweep_until_it_has_run(
        ctx: Context, celery: Celery) -> None:
    """The transaction that settles a chapter's last segment records it ready; its book.chapter, sent
    after the commit, can be lost (a broker away, a process killed, a job settled by a cancel through the
    API). The sweep sends it again, a period after the record or its last sending, until it has run."""
    from datetime import timedelta

    import redis
    from sqlalchemy import update

    from app.db.models import BookChapter, utcnow
    from app.reconcile.books import UNCHECKED_CHAPTER_AFTER_S
    from app.reconcile.sweep import sweep

    book_id = submit(ctx, celery, manifest_book([[30, 40], [25], [50]]))
    assert books.plan(book_id, ctx) == 4
    broker = redis.Redis.from_url(ctx.settings.broker_url)
    try:
        broker.delete(ctx.settings.queue_cpu)
        assert render_live_jobs(ctx, book_id) == 4  # finish_job: no doorbell, the record alone

        def run():
            return sweep(ctx=ctx)

        def age(*indices: int) -> None:
            past = utcnow() - timedelta(seconds=UNCHECKED_CHAPTER_AFTER_S + 5)
            with ctx.sessions() as session:
                session.execute(update(BookChapter).where(BookChapter.index.in_(indices))
                                .values(ready_at=past, rung_at=None))
                session.commit()

        assert run().chapters_resumed == []  # recorded just now: its doorbell may be on its way
        age(0, 2)
        report = run()
        assert report.chapters_resumed == [f"{book_id}/0", f"{book_id}/2"] and report.errors == []
        assert cpu_messages(broker, ctx) == [("book.chapter", [book_id, 0]), ("book.chapter", [book_id, 2])]
        assert run().chapters_resumed == []  # sent again: not before another period
        assert [books.check_chapter(book_id, i, ctx) for i in (0, 2)] == ["assembled"] * 2
        age(0, 1, 2)
        assert run().chapters_resumed == [f"{book_id}/1"]  # 0 and 2 were checked
    finally:
        broker.delete(ctx.settings.queue_cpu)
        broker.close()


def test_running_out_of_memory_fails_the_book_and_leaves_the_worker_serving(
        ctx: Context, celery: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery lets a MemoryError out of a task to end the worker process; a book task turns it into the
    book's failure (the tracer below is the one a worker runs, so the error would have reached it)."""
    book_id = submit(ctx, celery, manifest_book([[30, 40]]))

    def out_of_memory(book_id: str, ctx: Context) -> int:
        raise MemoryError("31.4 TiB")

    monkeypatch.setattr(books, "plan", out_of_memory)
    monkeypatch.setattr(books, "resources", lambda: ctx)  # the test's database, not the environment's
    outcome = books.plan_task.apply(args=[book_id])
    assert outcome.failed() and isinstance(outcome.result, books.BookStopped)
    with ctx.sessions() as session:
        book = queries.require_book(session=session, book_id=book_id)
    assert (book.status, book.error) == (BookStatus.FAILED, "book.plan: ran out of memory on the CPU worker")
