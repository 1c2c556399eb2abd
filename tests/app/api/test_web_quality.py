"""The web page's book card shows the quality gate's report (issue 46), in Chromium (headless,
Playwright) on the API alone: the book is rendered in this process as the tasks' tests do (book.chapter
hears it for real; the GPU worker is played: one segment is silent on its first render only, one on every
render), then listed under "Older books". The card says the gate's mode and its totals (passed,
re-rendered, failed, not heard), the note that only the signal checks ran on dummy weights, each check's
verdicts, and the segment kept with its failure: why, its text, and a player whose audio loads.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

import tasks.books as books
from app.books.quality_view import DUMMY_NOTE
from app.context import Context
from tests.conftest import service_missing
from tests.support.books import finish_segments
from tests.support.net import serving
from tests.tasks.test_books import output_plan, submit, tokenize_live_jobs

BOOK = """# The Keeper

## Night

The keeper lit the lamp at dusk and wound the clock.

The storm broke over the rocks a little after midnight.

By morning the sea was calm again and the gulls came back.
"""


def _render(ctx: Context, book_id: str, silent: set[str]) -> None:
    """Finish every live segment job: digital silence for the segments keyed in `silent`, a sine for
    the rest (the GPU worker played in process)."""
    tokenize_live_jobs(ctx, book_id)
    finish_segments(ctx, book_id, lambda key, _n_tokens: key in silent)


def _heard_book(ctx: Context, celery: Celery) -> tuple[str, str]:
    """A book of four segments (the chapter's title is read too): two pass, one is re-rendered once, one
    fails every render and is kept; -> (its id, the kept segment's text)."""
    book_id = submit(ctx, celery, BOOK.encode(), filename="keeper.md")
    books.plan(book_id, ctx)
    segments = [s for _, s in output_plan(ctx, book_id).segments()]
    for segment in segments:
        books.tokenize(book_id, [segment.key], ctx)
    assert len(segments) == 4
    once, always = segments[2].key, segments[3].key
    _render(ctx, book_id, silent={once, always})
    for _ in range(2):  # WAVEFARM_QUALITY_RERENDERS' default
        assert books.check_chapter(book_id, 0, ctx) == "waiting"
        _render(ctx, book_id, silent={always})
    assert books.check_chapter(book_id, 0, ctx) == "assembled"
    assert books.assemble(book_id, ctx) == "succeeded"
    return book_id, segments[3].text


@pytest.fixture
def page(ctx: Context) -> Iterator[tuple[Any, str]]:
    chromium = shutil.which("chromium")
    if chromium is None:
        service_missing("no `chromium` on PATH for the web page's quality test (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_missing("the playwright package is missing (pip install -e '.[test]')")
    with serving(ctx.settings) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(url)
        yield page, url
        browser.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the page, not the database, is tested
def test_the_book_card_shows_the_gates_totals_its_note_and_the_kept_failure_to_play(
        ctx: Context, celery: Celery, page: tuple[Any, str], tmp_path: Path) -> None:
    from playwright.sync_api import expect

    book_id, text = _heard_book(ctx, celery)
    browser_page, url = page
    report = httpx.get(f"{url}/v1/books/{book_id}/quality").json()
    assert report["totals"] == {"passed": 2, "rerendered": 1, "failed": 1, "unheard": 0}
    browser_page.click("#more-books")
    quality = browser_page.locator(f"#items article.book[data-id='{book_id}'] .quality")
    expect(quality.locator(".quality-summary")).to_have_text(
        "Quality gate on: 2 passed · 1 re-rendered · 1 failed (kept) · 0 not heard")
    expect(quality.locator(".quality-note")).to_have_text(f"Note: {DUMMY_NOTE}")
    expect(quality.locator("li[data-check=silence]")).to_have_text("silence: 3 passed, 1 failed")
    expect(quality.locator("li[data-check=quality]")).to_have_text("quality: 4 skipped")
    [worst] = report["worst"]
    kept = quality.locator(f"li.worst[data-key='{worst['key']}']")
    expect(kept).to_contain_text("Chapter 1, segment")
    expect(kept).to_contain_text("3 renders · silence: the clip's level is")
    expect(kept.locator("q")).to_have_text(text)
    assert kept.locator("audio").get_attribute("data-path") == worst["audio"]
    browser_page.wait_for_function(
        "a => a.readyState >= 1 && a.duration > 0", arg=kept.locator("audio").element_handle(),
        timeout=30_000)
    browser_page.screenshot(path=tmp_path / "book-quality.png", full_page=True)
