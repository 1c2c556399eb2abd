"""The web page's layout in Chromium (headless, Playwright), on the API alone (tasks to a recording sender,
no workers): what a user saw wrong, measured in the rendered page, with a screenshot saved.

- the M4B and MP3 bitrate boxes are a few digits wide, with "kbit/s" on their line, not under them;
- the Year box shows its whole placeholder;
- a job cancelled while it was queued says so under "Older jobs", not "1 %" (or any percentage).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.dev import SAMPLES
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from tests.conftest import make_test_settings, service_missing
from tests.support.net import serving


@pytest.fixture
def url(sqlite_url: str, artifacts: ArtifactStore, redis_session_lock: None) -> Iterator[str]:
    settings: Settings = make_test_settings(database_url=sqlite_url, artifact_root=artifacts.root)
    with serving(settings) as base:
        yield base


@pytest.fixture
def page(url: str) -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        service_missing("no `chromium` on PATH for the web page's layout test (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_missing("the playwright package is missing (pip install -e '.[test]')")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(url)
        yield page
        browser.close()


BOX = "el => { const r = el.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; }"


@pytest.mark.parametrize("name", ["bitrate_kbps", "mp3_bitrate_kbps"])
def test_a_bitrate_box_is_a_few_digits_wide_with_its_unit_beside_it(page: Any, name: str,
                                                                     tmp_path: Path) -> None:
    box = page.locator(f"#book-form input[name={name}]")
    _, box_y, box_w, box_h = box.evaluate(BOX)
    font_px = float(box.evaluate("el => parseFloat(getComputedStyle(el).fontSize)"))
    assert box_w < 7 * font_px, (box_w, font_px)  # was the browser's default of about 15 characters
    _, unit_y, unit_w, unit_h = box.locator("xpath=..").evaluate(BOX)  # the box and "kbit/s"
    assert unit_h < 1.5 * box_h and abs(unit_y - box_y) < 0.5 * box_h, (unit_y, unit_h, box_y, box_h)
    assert unit_w > box_w + 2 * font_px  # the unit's text is on the box's line
    page.screenshot(path=tmp_path / "book-form.png", full_page=True)


def test_the_year_box_shows_its_whole_placeholder(page: Any) -> None:
    year = page.locator("#book-form input[name=year]")
    year.fill(str(year.get_attribute("placeholder")))  # a value in the placeholder's place, measured
    assert year.evaluate("el => el.scrollWidth <= el.clientWidth"), year.evaluate(
        "el => [el.scrollWidth, el.clientWidth]")


def test_a_job_cancelled_while_queued_says_so_not_a_percentage(page: Any, url: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with httpx.Client(base_url=url, timeout=30) as api:
        voice = api.post("/v1/voices", files={"reference": ("r.wav", (SAMPLES / "voice_a.wav").read_bytes(),
                                                               "audio/wav")}).json()["id"]
        job = api.post("/v1/jobs", json={"voice_id": voice, "tokens": [1, 2, 3] * 100}).json()["id"]
        assert api.post(f"/v1/jobs/{job}/cancel").json()["status"] == "cancelled"
    page.click("#more-jobs")
    summary = page.locator(f"#items article.job[data-id='{job}'] .summary")
    expect(summary).to_contain_text("cancelled before any audio")
    assert "%" not in summary.inner_text()
    page.screenshot(path=tmp_path / "older-jobs.png", full_page=True)
