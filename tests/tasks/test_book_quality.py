"""The quality gate in books (issue 46): before a chapter is assembled, `book.chapter` hears its segments;
a failing one is rendered again with another seed up to WAVEFARM_QUALITY_RERENDERS times, then kept with
its failure recorded; a book's gate may be report-only (never rendered again) or off (not heard); with
dummy weights only the signal checks run and the report says so once. The GPU worker is played in
process: a 'broken' segment's job gets digital silence, the signal checks' plainest failure. These tests
run on dummy weights (no model folder): the signal checks are what they exercise."""

from __future__ import annotations

from celery import Celery

import tasks.books as books
from app.api.local import LocalClient
from app.books.quality_view import DUMMY_NOTE, DUMMY_REASON, OFF_NOTE, book_quality
from app.books.service import BookOptions
from app.books.status import book_status
from app.context import Context
from app.db import queries
from app.db.models import JobStatus, Segment
from app.storage.keys import COUNTER_QUALITY
from tests.app.api.helpers import make_client
from tests.support.books import finish_segments
from tests.tasks.test_books import manifest_book, submit


def _render(ctx: Context, book_id: str, silent: set[int]) -> dict[int, str]:
    """Finish every live segment job: silence for segments of `silent` token counts, a sine for the rest."""
    return finish_segments(ctx, book_id, lambda _key, n_tokens: n_tokens in silent)


def _segment(ctx: Context, job_id: str) -> Segment:
    with ctx.sessions() as session:
        row = session.query(Segment).filter(Segment.quality_job_id == job_id).one()
        session.expunge(row)
        return row


def test_a_silent_segment_is_rendered_again_with_another_seed_and_then_passes(
        ctx: Context, celery: Celery) -> None:
    book_id = submit(ctx, celery, manifest_book([[30, 40]]))
    books.plan(book_id, ctx)
    first = _render(ctx, book_id, silent={40})
    assert books.check_chapter(book_id, 0, ctx) == "waiting"  # not assembled with a silent segment
    heard = _segment(ctx, first[40])
    assert (heard.quality_verdict, heard.quality_attempts) == ("fail", 1)
    assert heard.quality_report is not None and heard.quality_report["checks"]["silence"]["verdict"] == "fail"
    assert heard.job_id != first[40]  # a new job renders it
    with ctx.sessions() as session:
        again = queries.require_job(session=session, job_id=heard.job_id or "")
        old = queries.require_job(session=session, job_id=first[40])
        assert again.status == JobStatus.QUEUED and again.seed != old.seed
    second = _render(ctx, book_id, silent=set())
    assert list(second) == [40]  # only the failed segment was rendered again
    assert books.check_chapter(book_id, 0, ctx) == "assembled"
    passed = _segment(ctx, second[40])
    assert (passed.quality_verdict, passed.quality_attempts) == ("pass", 2)
    assert _segment(ctx, first[30]).quality_verdict == "pass"
    with ctx.sessions() as session:
        totals = book_quality(session=session, artifacts=ctx.artifacts, book_id=book_id).totals
    assert totals == {"passed": 1, "rerendered": 1, "failed": 0, "unheard": 0}


def test_a_segment_failing_every_render_is_kept_marked_after_the_rerenders(
        ctx: Context, celery: Celery) -> None:
    silent_before = ctx.store.counters(COUNTER_QUALITY).get("silence:fail", 0)
    book_id = submit(ctx, celery, manifest_book([[30, 40]]))
    books.plan(book_id, ctx)
    jobs = [_render(ctx, book_id, silent={40})[40]]
    for _ in range(2):  # WAVEFARM_QUALITY_RERENDERS' default
        assert books.check_chapter(book_id, 0, ctx) == "waiting"
        jobs.append(_render(ctx, book_id, silent={40})[40])
    assert len(set(jobs)) == 3
    assert books.check_chapter(book_id, 0, ctx) == "assembled"  # kept, its failure recorded
    kept = _segment(ctx, jobs[-1])
    assert (kept.job_id, kept.quality_verdict, kept.quality_attempts) == (jobs[-1], "fail", 3)
    assert books.check_chapter(book_id, 0, ctx) == "assembled"  # heard once: no fourth render
    for client in make_client(ctx.settings):  # the report names it, its reason and where to play it
        answer = client.get(f"/v1/books/{book_id[:8]}/quality")
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert report["totals"] == {"passed": 1, "rerendered": 0, "failed": 1, "unheard": 0}
        assert report["chapters"] == [{"index": 0, "passed": 1, "rerendered": 0, "failed": 1, "unheard": 0}]
        [worst] = report["worst"]
        assert worst["attempts"] == 3 and worst["audio"] == f"/v1/jobs/{jobs[-1]}/audio"
        assert any(r.startswith("silence:") for r in worst["reasons"])
        assert client.get(worst["audio"]).status_code == 200
        assert client.get("/v1/books/00000000-0000-4000-8000-000000000000/quality").status_code == 404
        metrics = client.get("/metrics").text  # every check and verdict, counted by the CPU worker
        assert 'wavefarm_quality_checks_total{check="words",verdict="pass"} ' in metrics
        silent = f'wavefarm_quality_checks_total{{check="silence",verdict="fail"}} {silent_before + 3}.0'
        assert silent in metrics
    local = LocalClient(ctx.settings)  # `wavefarm book status --local` reads the same report
    try:
        assert local.book_quality(book_id[:8]) == report
    finally:
        local.ctx.close()


def _quality(ctx: Context, book_id: str):
    with ctx.sessions() as session:
        return book_quality(session=session, artifacts=ctx.artifacts, book_id=book_id)


def test_with_dummy_weights_only_the_signal_checks_run_and_the_report_says_so_once(
        ctx: Context, celery: Celery) -> None:
    """Noise from dummy weights is never listened to (so never rendered again for being noise); the
    report carries one plain note, and the book's own notes (its tags, chapters.json) do not."""
    assert ctx.settings.model_dir is None
    book_id = submit(ctx, celery, manifest_book([[30, 40], [50]]))
    books.plan(book_id, ctx)
    first = _render(ctx, book_id, silent=set())
    assert [books.check_chapter(book_id, i, ctx) for i in range(2)] == ["assembled"] * 2
    heard = _segment(ctx, first[40])
    assert (heard.job_id, heard.quality_verdict, heard.quality_attempts) == (first[40], "pass", 1)
    checks = (heard.quality_report or {})["checks"]
    assert {n: checks[n]["verdict"] for n in ("silence", "length", "quality", "words")} == {
        "silence": "pass", "length": "pass", "quality": "skipped", "words": "skipped"}
    assert checks["quality"]["reason"] == DUMMY_REASON
    report = _quality(ctx, book_id)
    assert (report.mode, report.notes) == ("on", [DUMMY_NOTE])  # once for the book, not per segment
    assert report.checks["silence"] == {"pass": 3, "fail": 0, "skipped": 0}
    assert report.checks["quality"] == {"pass": 0, "fail": 0, "skipped": 3}
    assert books.assemble(book_id, ctx) == "succeeded"
    with ctx.sessions() as session:
        assert DUMMY_NOTE not in book_status(session=session, artifacts=ctx.artifacts, book_id=book_id).notes


def test_a_report_only_book_hears_and_reports_a_failure_but_never_renders_it_again(
        ctx: Context, celery: Celery) -> None:
    book_id = submit(ctx, celery, manifest_book([[30, 40]]), options=BookOptions(quality="report"))
    books.plan(book_id, ctx)
    first = _render(ctx, book_id, silent={40})
    assert books.check_chapter(book_id, 0, ctx) == "assembled"  # with its silent segment, marked
    kept = _segment(ctx, first[40])
    assert (kept.job_id, kept.quality_verdict, kept.quality_attempts) == (first[40], "fail", 1)
    assert _render(ctx, book_id, silent=set()) == {}  # nothing was sent to render again
    report = _quality(ctx, book_id)
    assert report.mode == "report" and report.totals == {"passed": 1, "rerendered": 0, "failed": 1,
                                                         "unheard": 0}
    assert [w.audio for w in report.worst] == [f"/v1/jobs/{first[40]}/audio"]
    assert report.checks["silence"] == {"pass": 1, "fail": 1, "skipped": 0}


def test_a_book_with_the_gate_off_is_not_heard_and_its_report_says_the_gate_was_off(
        ctx: Context, celery: Celery) -> None:
    book_id = submit(ctx, celery, manifest_book([[30, 40]]), options=BookOptions(quality="off"))
    books.plan(book_id, ctx)
    first = _render(ctx, book_id, silent={40})
    assert books.check_chapter(book_id, 0, ctx) == "assembled"
    with ctx.sessions() as session:
        rows = session.query(Segment).filter(Segment.job_id.in_(list(first.values()))).all()
        assert [(r.quality_verdict, r.quality_attempts) for r in rows] == [(None, 0)] * 2
    report = _quality(ctx, book_id)
    assert (report.mode, report.notes, report.worst) == ("off", [OFF_NOTE], [])
    assert report.totals == {"passed": 0, "rerendered": 0, "failed": 0, "unheard": 2}
