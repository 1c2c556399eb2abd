"""The web page in a real browser: Debian's Chromium, headless, driven by Playwright, against the real
stack (`wavefarm serve` under uvicorn, a CPU worker and a GPU worker with tiny dummy weights, all
processes, started by scripts/service_stack.py) on an API that needs a token.

- a book (the 3-chapter Markdown sample) uploaded through the page's form with a reference file renders;
  the page shows every chapter's player, and the whole book's, with audio that loads (its duration is the
  chapter's), and download links that fetch the files with the token; a screenshot is saved;
- a job from a tokens file with a stored voice picked from the list plays and downloads; a long one is
  cancelled from its card; a typed text renders and its card shows its notes (stand-in tokenizer, dummy
  weights); a broken tokens file's refusal is shown under the form; the token, remembered,
  is still there after a reload;
- "Older jobs" / "Older books" list what the server holds (not only this browser's), page by page with
  the API's cursor, each once, newest first; a banner says the stack's GPU worker runs dummy weights.

The stack is this module's own (its queues, a SQLite file, an artifact root): the integration folder's
session CPU worker cannot be shared from here without a second copy of it on the same queue.
No Chromium (or no Playwright): skipped, and a failure under WAVEFARM_TEST_SERVICES=required.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from app.db import upgrade
from app.dev import SAMPLES
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.conftest import REPO, SESSION_TAG, make_test_settings, service_missing
from tests.support.net import free_port

sys.path.insert(0, str(REPO / "scripts"))
import service_stack  # noqa: E402

TOKEN = "web-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOOK_TIMEOUT_MS = 420_000
# Every <audio> matched has loaded its metadata (or failed: then the page shows why).
AUDIO_LOADED = """selector => {
  const players = [...document.querySelectorAll(selector)];
  return players.length > 0 && players.every(a => a.readyState >= 1 && a.duration > 0);
}"""


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        service_missing("no `chromium` on PATH for the web page's browser test "
                        "(apt-get install chromium; .ci/run installs it)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        service_missing("the playwright package is missing (pip install -e '.[test]')")
    return str(path)


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def stack(chromium: str, redis_session_lock: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """API, CPU worker and GPU worker (tiny preset) as processes on this module's queues; -> the URL."""
    root = tmp_path_factory.mktemp("web-stack")
    url = f"sqlite:///{root / 'web.sqlite'}"
    upgrade(url)
    ArtifactStore(root / "artifacts").ensure_layout()
    settings = make_test_settings(database_url=url, artifact_root=root / "artifacts",
                                  tag=f"{SESSION_TAG}-web", model_preset="tiny", worker_slots=4,
                                  micro_batch_size=4, progress_interval_s=0.3, api_token=SecretStr(TOKEN))
    port = free_port()
    with service_stack.running_stack(settings, root / "logs", port, cpu_concurrency=2) as logs:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for name, path in logs.items():
                print(f"== {name}\n{service_stack.services.log_tail(path, 30)}")


@pytest.fixture
def page(browser: Any, stack: str) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.goto(stack)
    yield page
    context.close()


def give_token(page: Any, *, remember: bool = False) -> None:
    from playwright.sync_api import expect

    page.fill("#token", TOKEN)
    page.set_checked("#remember", remember)
    page.click("#auth-form button[type=submit]")
    expect(page.locator("#auth-message")).to_be_hidden()


def audio_durations(page: Any, selector: str) -> list[float]:
    page.wait_for_function(AUDIO_LOADED, arg=selector, timeout=30_000)
    return list(page.eval_on_selector_all(selector, "players => players.map(a => a.duration)"))


def download(page: Any, link: Any, tmp_path: Path) -> Path:
    """Click a download link of the page (it fetches with the token) -> the file the browser saved."""
    with page.expect_download(timeout=30_000) as info:
        link.click()
    tmp_path.mkdir(parents=True, exist_ok=True)
    saved = tmp_path / info.value.suggested_filename
    info.value.save_as(saved)
    return saved


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_book_uploaded_through_the_page_renders_and_every_chapter_plays_and_downloads(
        page: Any, stack: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    # Without the token the page says the server needs one (its voice list was refused with 401).
    expect(page.locator("#auth-message")).to_contain_text("Unauthorized: missing or wrong bearer token")
    give_token(page)
    book_file = tmp_path / "lighthouse.md"
    book_file.write_text(MARKDOWN_BOOK)
    page.set_input_files("#reference", SAMPLES / "voice_a.wav")
    page.set_input_files("#book-file", book_file)
    page.fill("#book-form input[name=narrator]", "Ben Narrow")
    page.check("#book-form input[name=mp3]")
    page.click("#book-form button[type=submit]")

    card = page.locator("article.book")
    expect(card.locator(".status")).to_have_text("succeeded", timeout=BOOK_TIMEOUT_MS)
    book = httpx.get(f"{stack}/v1/books/{card.get_attribute('data-id')}", headers=AUTH).json()
    expect(card.locator("tr.chapter")).to_have_count(3)
    expect(card.locator("header h3")).to_contain_text("read by Ben Narrow")
    for c in book["chapters"]:  # each chapter's measured loudness, as the API reports it
        expect(card.locator(f'tr.chapter[data-index="{c["index"]}"] .summary')).to_contain_text(
            f'{c["loudness_lufs"]:.1f} LUFS, peak {c["true_peak_dbtp"]:.1f} dBTP')
    chapters = audio_durations(page, "article.book tr.chapter audio")
    assert chapters == pytest.approx([c["seconds"] for c in book["chapters"]], abs=0.05)
    (whole,) = audio_durations(page, "article.book .whole audio")
    assert whole == pytest.approx(sum(chapters), abs=0.5)

    links = card.locator(".files a")
    names = links.all_text_contents()
    assert set(names) == {"chapter-001.flac", "chapter-002.flac", "chapter-003.flac", "book.m4b",
                          "chapter-001.mp3", "chapter-002.mp3", "chapter-003.mp3",
                          "chapters.json", "chapters.vtt", "metadata.json"}
    notes = card.locator(".notes")  # no model folder here: the card says what the audio is
    expect(notes).to_contain_text("Note: rendered with dummy weights")
    expect(notes).to_contain_text("Note: tokens from the stand-in tokenizer")
    quality = card.locator(".quality")  # the gate heard every segment: its signal checks only, and says so
    expect(quality.locator(".quality-summary")).to_contain_text(
        f"Quality gate on: {book['segments_total']} passed · 0 re-rendered · 0 failed (kept) · 0 not heard")
    expect(quality.locator(".quality-note")).to_contain_text("Note: dummy weights: only the signal checks")
    for i, name in enumerate(names):
        href = links.nth(i).get_attribute("href")
        assert httpx.get(f"{stack}{href}", headers=AUTH).status_code == 200, href
        saved = download(page, links.nth(i), tmp_path / "downloads")
        assert saved.name == name and saved.stat().st_size > 0
    chapter_index = json.loads((tmp_path / "downloads" / "chapters.json").read_text())
    assert len(chapter_index["chapters"]) == 3
    expect(card.locator(".message:not([hidden])")).to_have_count(0)
    page.screenshot(path=tmp_path / "web.png", full_page=True)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_job_from_a_tokens_file_with_a_stored_voice_plays_and_a_long_one_is_cancelled(
        page: Any, stack: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    give_token(page, remember=True)
    page.reload()
    assert page.input_value("#token") == TOKEN, "a remembered token outlives a reload"
    expect(page.locator("#auth-message")).to_be_hidden()

    # The API's refusal is shown under the form, as its Problem says it.
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2,")
    page.set_input_files("#reference", SAMPLES / "voice_b.wav")
    page.set_input_files("#tokens-file", broken)
    page.click("#job-form button[type=submit]")
    message = page.locator("#job-form .message")
    expect(message).to_have_text("BadTokens: tokens are not JSON: JSONDecodeError")

    # A long job with an uploaded reference, cancelled from its card.
    long_tokens = tmp_path / "long.json"
    long_tokens.write_text(json.dumps([i % VOCAB_SIZE for i in range(0, 4000 * 7, 7)]))
    page.set_input_files("#tokens-file", long_tokens)
    page.click("#job-form button[type=submit]")
    expect(message).to_be_hidden()
    long_card = page.locator("article.job").first
    long_card.locator("button.cancel").click()
    expect(long_card.locator(".status")).to_have_text("cancelled", timeout=30_000)
    expect(long_card.locator("button.cancel")).to_be_hidden()
    expect(long_card.locator(".message:not([hidden])")).to_have_count(0)

    # The uploaded voice is now in the list: pick it, and send the sample tokens.
    page.set_input_files("#reference", [])
    long_job = httpx.get(f"{stack}/v1/jobs/{long_card.get_attribute('data-id')}", headers=AUTH).json()
    voice_id = long_job["voice_id"]
    expect(page.locator(f'#voice-id option[value="{voice_id}"]')).to_have_count(1)
    page.select_option("#voice-id", voice_id)
    tokens = json.loads((SAMPLES / "tokens_a.json").read_text())
    page.set_input_files("#tokens-file", SAMPLES / "tokens_a.json")
    page.click("#job-form button[type=submit]")
    card = page.locator("article.job").first
    expect(card.locator(".status")).to_have_text("succeeded", timeout=240_000)
    (seconds,) = audio_durations(page, "article.job:first-child audio")
    assert seconds == pytest.approx(len(tokens) / 25, abs=0.01)
    saved = download(page, card.locator("a.download"), tmp_path)
    assert saved.suffix == ".wav" and saved.stat().st_size > 44
    assert httpx.get(f"{stack}/v1/jobs/{card.get_attribute('data-id')}", headers=AUTH).json()["voice_id"] \
        == voice_id

    # Typed text, with the same voice: tokenized on the CPU worker, then rendered; the card says plainly
    # that this stack's tokens and audio are stand-ins.
    page.set_input_files("#tokens-file", [])
    page.fill("#job-form textarea[name=text]", "The wind blew N.N.E., force 7.")
    page.click("#job-form button[type=submit]")
    expect(message).to_be_hidden()
    text_card = page.locator("article.job").first
    expect(text_card.locator(".status")).to_have_text("succeeded", timeout=240_000)
    notes = text_card.locator(".notes li")
    expect(notes).to_have_count(2)
    expect(notes.nth(0)).to_contain_text("stand-in tokenizer")
    expect(notes.nth(1)).to_contain_text("dummy weights")
    text_job = httpx.get(f"{stack}/v1/jobs/{text_card.get_attribute('data-id')}", headers=AUTH).json()
    assert text_job["kind"] == "text" and text_job["n_tokens"] > 0
    (spoken,) = audio_durations(page, "article.job:first-child audio")
    assert spoken == pytest.approx(text_job["n_tokens"] / 25, abs=0.01)
    page.screenshot(path=tmp_path / "jobs.png", full_page=True)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_older_jobs_and_books_page_through_everything_on_the_server(page: Any, stack: str) -> None:
    """Jobs this browser never submitted, listed a page at a time with the API's cursor."""
    from playwright.sync_api import expect

    with httpx.Client(base_url=stack, headers=AUTH, timeout=30) as api:
        voice = api.post("/v1/voices", files={"reference": ("r.wav", (SAMPLES / "voice_a.wav").read_bytes(),
                                                               "audio/wav")}).json()["id"]
        for seed in range(23):  # more than a page (20)
            job = {"voice_id": voice, "tokens": [1, 2, 3], "seed": seed}
            assert api.post("/v1/jobs", json=job).is_success
        every_job = [j["id"] for j in api.get("/v1/jobs", params={"limit": 1000}).json()]
        every_book = [b["id"] for b in api.get("/v1/books", params={"limit": 200}).json()]
    give_token(page)
    more = page.locator("#more-jobs")
    more.click()
    expect(page.locator("#items article.job")).to_have_count(20)
    for _ in range(10):  # 23 jobs and any earlier tests': a few pages
        if not more.is_enabled():
            break
        more.click()
        page.wait_for_timeout(300)
    expect(more).to_have_text("All jobs shown")
    shown = page.eval_on_selector_all("#items article.job", "cards => cards.map(c => c.dataset.id)")
    assert shown == every_job  # each once, newest first
    page.click("#more-books")
    expect(page.locator("#more-books")).to_have_text("All books shown")
    assert page.eval_on_selector_all("#items article.book", "cs => cs.map(c => c.dataset.id)") == every_book
    expect(page.locator("#more-error")).to_be_hidden()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_banner_says_the_gpu_worker_runs_dummy_weights(page: Any, stack: str) -> None:
    from playwright.sync_api import expect

    assert httpx.get(f"{stack}/healthz").json()["dummy_weights_workers"] == 1  # the stack's tiny preset
    expect(page.locator("#dummy-banner")).to_contain_text("1 GPU worker runs dummy weights")
