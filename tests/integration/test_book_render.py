"""Books end to end on real services: PostgreSQL, Redis, the session's CPU worker (book.* tasks) and a
GPU worker subprocess (tiny preset, dummy weights, stand-in S3 tokens).

- a 3-chapter Markdown book and a small EPUB render to chapter files and an M4B whose chapters (count,
  order, titles, durations) match; the voice is prepared once and installed once;
- rendering an edited book again renders only the edited paragraph's segments;
- an interactive job submitted while a book renders finishes before the book's remaining segments;
- a GPU worker killed (SIGKILL) mid-book and restarted: the book completes (the maintenance sweep sends
  a message lost in the kill again), and only the segments that were in flight are rendered twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import av
import pytest
import soundfile as sf
from celery import Celery

from app.audio import load_reference
from app.books.files import output_dir
from app.books.service import BookOptions, submit_book
from app.books.status import book_status
from app.broker.celery_config import make_celery
from app.db import queries
from app.db.models import BookStatus, JobStatus
from app.dev import SAMPLES
from app.reconcile.sweep import run_sweep
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.storage.keys import COUNTER_PREP_PATH, COUNTER_PREPARE
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from tests.app.books.conftest import MARKDOWN_BOOK, make_epub, tiny_png
from tests.conftest import REPO, SESSION_TAG, settings_env
from tests.integration.conftest import WorkerProcess, start_gpu_worker
from tests.support.books import book_request
from tests.support.context import context_for

REFERENCE = (SAMPLES / "voice_a.wav").read_bytes()
SLOTS = 4


@pytest.fixture(scope="module")
def gpu_settings(worker_settings: Settings) -> Settings:
    # A short visibility timeout: a killed worker's in-flight messages come back within ~20 s. A long
    # prep wait (under the visibility timeout, as Settings require): segments wait for the CPU worker,
    # busy with book tasks too, rather than prepare inline.
    return worker_settings.model_copy(update={
        "model_preset": "tiny", "prep_wait_ms": 9_000, "micro_batch_size": 8, "worker_slots": SLOTS,
        "voice_cache_capacity": 2, "progress_interval_s": 0.2, "visibility_timeout_s": 10})


def start_book_gpu_worker(settings: Settings, logs: Path, n: int) -> WorkerProcess:
    return start_gpu_worker(settings, f"gpu-book-{n}-{SESSION_TAG}", logs)


@pytest.fixture(scope="module")
def gpu(gpu_settings: Settings, cpu_worker: str,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """A running GPU worker shared by the module's tests (starting one takes seconds); the list grows when
    a test kills it and starts another. All are stopped at the end."""
    workers = [start_book_gpu_worker(gpu_settings, tmp_path_factory.mktemp("gpu-book"), 0)]
    yield workers
    for worker in workers:
        worker.stop()
    for worker in workers:
        print(f"== {worker.nodename}\n{worker.tail()}")


@pytest.fixture
def env(gpu_settings: Settings, worker_sessions) -> Iterator[tuple[Settings, Celery, FeatureStore]]:
    store = FeatureStore.from_url(gpu_settings.feature_store_url, ttl_s=gpu_settings.feature_ttl_s)
    store.delete(load_reference(REFERENCE)[1])  # the voice is prepared by this test
    app = make_celery(gpu_settings)
    yield gpu_settings, app, store
    app.close()
    store.close()


def submit(env, sessions, data: bytes, **kw) -> str:
    settings, app, store = env
    with sessions() as session:
        return submit_book(ctx=context_for(settings, app, sessions=sessions, store=store), session=session,
                           data=data,
                           request=book_request(reference_bytes=REFERENCE, **kw))


def wait_book(settings: Settings, sessions, book_id: str, timeout: float = 420.0,
              sweep: Celery | None = None):
    """The book's final view. With `sweep` (a producer app), the maintenance sweep runs on the way, as the
    CPU workers' periodic one would (`tasks.schedule`), sending stranded jobs again after 20 s."""
    deadline = time.monotonic() + timeout
    sweep_settings = settings.model_copy(update={"stuck_job_after_s": 20.0})
    while True:
        with sessions() as session:
            view = book_status(session=session, artifacts=ArtifactStore(settings.artifact_root),
                               book_id=book_id)
        if view.book.status not in ("parsing", "queued", "rendering", "assembling"):
            return view
        assert time.monotonic() < deadline, f"book still {view.book.status}: {view.segments_done}/" \
                                            f"{view.segments_total}"
        if sweep is not None:
            sent = run_sweep(sweep_settings, sweep).jobs_requeued
            if sent:
                print(f"maintenance sweep sent again: {sent}")
        time.sleep(0.5)


def run_interactive(env, sessions, tokens: list[int], seed: int, priority: int):
    """An ordinary job submitted beside the book and waited for -> its row."""
    settings, app, store = env
    with sessions() as session:
        job_id = submit_job(ctx=context_for(settings, app, sessions=sessions, store=store), session=session,
                            request=JobRequest(
                                tokens=tokens, reference_bytes=REFERENCE, seed=seed, priority=priority))
    app.AsyncResult(job_id).get(timeout=300)
    with sessions() as session:
        return queries.require_job(session=session, job_id=job_id)


def segment_jobs(sessions, book_id: str) -> dict[str, object]:
    with sessions() as session:
        states = queries.book_segment_states(session=session, book_id=book_id)
        return {s.key: queries.require_job(session=session, job_id=s.job_id) for s in states if s.job_id}


def m4b_chapters(path: Path) -> list[tuple[str, float]]:
    with av.open(str(path)) as box:
        return [(c["metadata"]["title"], float((c["end"] - c["start"]) * c["time_base"]))
                for c in box.chapters()]


def check_outputs(settings: Settings, view, titles: list[str]) -> None:
    assert view.book.status == BookStatus.SUCCEEDED, view.book.error
    out = output_dir(ArtifactStore(settings.artifact_root), view.book.id)
    chapters = m4b_chapters(out / "book.m4b")
    assert [t for t, _ in chapters] == titles
    files = sorted(out.glob("chapter-*.flac"))
    assert len(files) == len(titles)
    for (_, seconds), file in zip(chapters, files, strict=True):
        assert seconds == pytest.approx(sf.info(str(file)).duration, abs=0.01)
    index = json.loads((out / "chapters.json").read_text())
    assert [c["title"] for c in index["chapters"]] == titles


@pytest.mark.timeout(900)
def test_markdown_and_epub_books_render_with_the_voice_prepared_once_and_an_edit_rerenders_its_segments(
        gpu, env, worker_sessions) -> None:
    settings, _, store = env
    prepared = store.count(COUNTER_PREPARE, "prepared")
    paths_before = store.counters(COUNTER_PREP_PATH)
    md = submit(env, worker_sessions, MARKDOWN_BOOK.encode(), filename="book.md")
    epub = submit(env, worker_sessions, make_epub(cover=tiny_png()), filename="book.epub")
    md_view, epub_view = wait_book(settings, worker_sessions, md), wait_book(settings, worker_sessions, epub)
    check_outputs(settings, md_view, ["Chapter 1: The Storm", "Chapter 2: The Ship", "Chapter 3: Morning"])
    check_outputs(settings, epub_view, ["Title Page", "Chapter One: Dusk", "Chapter Two: Dawn",
                                       "Chapter Three: Noon"])
    assert md_view.segments_done == md_view.segments_total and md_view.audio_seconds > 5

    # The voice: prepared once (on the CPU worker, or inline on the GPU worker when the CPU worker was
    # too slow for the prep wait on a loaded machine, never both), installed once on the GPU worker.
    after = store.counters(COUNTER_PREP_PATH)
    delta = {p: after.get(p, 0) - paths_before.get(p, 0) for p in after}
    inline = 1 if any(delta.get(p, 0) for p in ("inline", "failed", "unavailable", "queue_full")) else 0
    assert store.count(COUNTER_PREPARE, "prepared") - prepared + inline == 1, delta
    jobs = {**segment_jobs(worker_sessions, md), **segment_jobs(worker_sessions, epub)}
    assert sum(delta.values()) == len(jobs)
    assert sum(n for p, n in delta.items() if p != "already_installed") == 1, delta
    assert all(j.attempts == 1 and j.status == JobStatus.SUCCEEDED for j in jobs.values())

    # Edit one paragraph and render again: only that paragraph's segments are rendered.
    edited = MARKDOWN_BOOK.replace("It was *very* cold.", "It was bitterly cold.")
    again = submit(env, worker_sessions, edited.encode(), filename="book.md")
    view = wait_book(settings, worker_sessions, again)
    check_outputs(settings, view, ["Chapter 1: The Storm", "Chapter 2: The Ship", "Chapter 3: Morning"])
    new = {k: j for k, j in segment_jobs(worker_sessions, again).items() if k not in jobs}
    assert len(new) == 1 and all(j.status == JobStatus.SUCCEEDED for j in new.values())


VOICED_BOOK = """# Two Voices

## One

The ferry left at dawn, and the gulls followed it out of the harbour.

{Mara}"Do you see the island yet?" she asked. The captain shook his head.

{voice: Mara}
Not yet. I waited at the rail until the fog lifted. Then the cliffs came out of the grey.
"""


@pytest.mark.timeout(900)
def test_a_book_in_two_voices_prepares_each_once_and_decodes_their_lines_together(
        gpu, env, worker_sessions) -> None:
    """A narrator and a cast member: each voice prepared once and installed once, each line's job in its
    voice, and lines of both voices in flight in the engine at the same time (its batched steps)."""
    settings, app, store = env
    mara_reference = (SAMPLES / "voice_b.wav").read_bytes()
    store.delete(load_reference(mara_reference)[1])  # prepared by this test too
    with worker_sessions() as session:
        from app.voices.service import register_voice

        mara, _ = register_voice(ctx=context_for(settings, app, sessions=worker_sessions, store=store),
                                 session=session,
                                 reference_bytes=mara_reference)
    book = submit(env, worker_sessions, VOICED_BOOK.encode(), filename="voices.md", cast={"Mara": mara})
    view = wait_book(settings, worker_sessions, book)
    check_outputs(settings, view, ["One"])
    assert view.cast == {"mara": mara}
    jobs = segment_jobs(worker_sessions, book)
    narrator = load_reference(REFERENCE)[1]
    voices = {j.voice_id for j in jobs.values()}
    assert voices == {narrator, mara}
    lines = {j.voice_id: sum(1 for k in jobs.values() if k.voice_id == j.voice_id) for j in jobs.values()}
    assert lines[mara] >= 4 and lines[narrator] >= 3
    # One install per voice at most: Mara's is new; the narrator's may still be installed from the
    # module's earlier tests (the GPU worker is shared and keeps two voices).
    installs = {v: [j.prep_path for j in jobs.values()
                    if j.voice_id == v and j.prep_path != "already_installed"] for v in voices}
    assert len(installs[mara]) == 1 and len(installs[narrator]) <= 1, installs
    spans = {v: [(j.started_at, j.finished_at) for j in jobs.values() if j.voice_id == v] for v in voices}
    overlap = any(a0 < b1 and b0 < a1 for a0, a1 in spans[narrator] for b0, b1 in spans[mara])
    assert overlap, spans  # SLOTS=4 and both voices' lines queued together: they share engine steps


def token_manifest(chapters: int, segments: int, tokens: int, salt: int) -> bytes:
    return json.dumps({"title": f"Tokens {salt}", "chapters": [
        {"title": f"Part {c + 1}", "segments": [
            {"tokens": [(salt * 7919 + c * 1009 + s * 31 + i) % VOCAB_SIZE for i in range(tokens)]}
            for s in range(segments)]} for c in range(chapters)]}).encode()


@pytest.mark.timeout(900)
def test_an_interactive_job_overtakes_a_rendering_book_and_a_killed_gpu_worker_loses_only_in_flight_segments(
        gpu, env, worker_sessions, gpu_settings, tmp_path) -> None:
    settings = env[0]
    book = submit(env, worker_sessions, token_manifest(2, 12, 150, salt=int(time.time())),
                  options=BookOptions(priority=0))
    started = time.monotonic()
    while sum(j.status == JobStatus.SUCCEEDED for j in segment_jobs(worker_sessions, book).values()) < 2:
        assert time.monotonic() - started < 300
        time.sleep(0.2)

    # An interactive job (priority 5) submitted now runs before the book's queued segments.
    job = run_interactive(env, worker_sessions, [5] * 150, seed=1, priority=5)
    segs = segment_jobs(worker_sessions, book).values()
    overtaken = [j for j in segs if j.started_at is None or j.started_at > job.started_at]
    jumped = [j for j in segs if j.started_at and job.submitted_at < j.started_at < job.started_at]
    assert len(overtaken) >= 4, "the book had segments left"
    assert len(jumped) <= SLOTS  # at most what the worker had already fetched

    # Kill the GPU worker mid-book, start another: the book completes. Its in-flight segments come back
    # with the broker's redelivery; a message the worker had just popped but not yet recorded as
    # unacknowledged (kombu's Redis transport) is lost with it, and only the maintenance sweep sends it
    # again, as the CPU workers' periodic sweep does in a deployment.
    gpu[0].stop(signal.SIGKILL)
    in_flight = [j for j in segment_jobs(worker_sessions, book).values()
                 if j.status in (JobStatus.PREPARING, JobStatus.RUNNING)]
    gpu.append(start_book_gpu_worker(gpu_settings, tmp_path, 1))
    view = wait_book(settings, worker_sessions, book, sweep=env[1])
    assert view.book.status == BookStatus.SUCCEEDED, view.book.error
    m4b = output_dir(ArtifactStore(settings.artifact_root), book) / "book.m4b"
    assert [t for t, _ in m4b_chapters(m4b)] == ["Part 1", "Part 2"]
    jobs = segment_jobs(worker_sessions, book)
    twice = {k for k, j in jobs.items() if j.attempts > 1}
    assert twice <= {k for k, j in jobs.items() if j.id in {f.id for f in in_flight}}
    assert len(twice) <= SLOTS
    with worker_sessions() as session:
        renders = queries.segment_renders(session=session, book_id=book)
    assert all(created == 1 for created, _ in renders.values())  # no segment got a second job


@pytest.mark.timeout(600)
def test_cli_renders_a_manifest_with_tokens_and_source_audio_into_the_out_folder(
        gpu, env, worker_sessions, tmp_path) -> None:
    settings, _, _ = env
    folder = tmp_path / "book"
    (folder / "one").mkdir(parents=True)
    (folder / "one" / "speech.wav").write_bytes((SAMPLES / "voice_b.wav").read_bytes())
    (folder / "book.json").write_text(json.dumps({"title": "Mixed", "author": "A", "chapters": [
        {"title": "Tokens", "segments": [{"tokens": [11 * i % VOCAB_SIZE for i in range(60)]}]},
        {"title": "Re-voiced", "segments": [{"audio": "one/speech.wav"}]}]}))
    (tmp_path / "ref.wav").write_bytes(REFERENCE)
    out = tmp_path / "out"
    cli_env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "app.cli", "book", "render", str(folder / "book.json"),
                           "--voice", str(tmp_path / "ref.wav"), "--out", str(out), "--local", "--wait"],
                          cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    book_id = done.stdout.split()[0]
    assert sorted(p.name for p in out.iterdir()) == [
        "book.m4b", "chapter-001.flac", "chapter-002.flac", "chapters.json", "chapters.vtt", "metadata.json"]
    assert [t for t, _ in m4b_chapters(out / "book.m4b")] == ["Tokens", "Re-voiced"]
    assert sf.info(str(out / "chapter-001.flac")).frames >= 60 * 960
    # The source audio was tokenized at 25 tokens per second, then rendered.
    revoiced = max(segment_jobs(worker_sessions, book_id).values(), key=lambda j: j.n_tokens)
    seconds = sf.info(str(folder / "one" / "speech.wav")).duration
    assert abs(revoiced.n_tokens - 25 * seconds) <= 2
    status = subprocess.run([sys.executable, "-m", "app.cli", "book", "status", book_id, "--local"],
                            cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "succeeded" in status.stdout and "Re-voiced" in status.stdout


@pytest.mark.timeout(600)
def test_throughput_of_a_20_segment_chapter(gpu, env, worker_sessions) -> None:
    """Prints audio minutes rendered per wall minute (tiny preset, dummy weights, this machine's CPU)."""
    settings, _, _ = env
    book = submit(env, worker_sessions, token_manifest(1, 20, 250, salt=int(time.time()) + 1))
    view = wait_book(settings, worker_sessions, book)
    assert view.book.status == BookStatus.SUCCEEDED, view.book.error
    wall = (view.book.finished_at - view.book.started_at).total_seconds()
    print(f"\nTHROUGHPUT: 20 segments, {view.audio_seconds:.0f} s of audio in {wall:.1f} s wall: "
          f"{view.audio_seconds / wall:.2f} audio minutes per wall minute (preset tiny, {SLOTS} slots, cpu)")
    assert view.audio_seconds == pytest.approx(200.0)


@pytest.mark.timeout(600)
def test_a_job_at_the_books_own_priority_waits_only_for_the_books_window(gpu, env, worker_sessions) -> None:
    """5 chapters of 16 segments: about 32 are queued at a time, so a priority-0 job submitted early
    finishes before the later chapters' segments start."""
    from tasks.books import LOOKAHEAD_SEGMENTS

    settings = env[0]
    book = submit(env, worker_sessions, token_manifest(5, 16, 100, salt=int(time.time()) + 2))
    started = time.monotonic()
    while not any(j.status == JobStatus.SUCCEEDED for j in segment_jobs(worker_sessions, book).values()):
        assert time.monotonic() - started < 300
        time.sleep(0.2)
    job = run_interactive(env, worker_sessions, [9] * 100, seed=2, priority=0)
    ahead = [j for j in segment_jobs(worker_sessions, book).values()
             if j.started_at is not None and j.started_at < job.started_at]
    assert len(ahead) <= LOOKAHEAD_SEGMENTS + 16 + SLOTS  # the window, the chapter crossing it, in flight
    assert wait_book(settings, worker_sessions, book).book.status == BookStatus.SUCCEEDED
    after = [j for j in segment_jobs(worker_sessions, book).values() if j.started_at > job.finished_at]
    assert len(after) >= 80 - (LOOKAHEAD_SEGMENTS + 16 + SLOTS + 1)
