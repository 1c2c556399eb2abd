"""/docs with the network cut off: Debian's Chromium (headless, Playwright) loads the page from a real
uvicorn server and every file it fetches comes from that server (Swagger UI from the package, not a
CDN); the operations are listed, the speech endpoint among them. Any request to another host is
refused and recorded; so is DNS (Chromium resolves nothing but 127.0.0.1). The web page's voice picker
shows a voice's name, in the same browser."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from app.settings import Settings
from tests.conftest import make_test_settings, service_missing
from tests.support.net import serving

OFFLINE_ARGS = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--no-proxy-server"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = shutil.which("chromium")
    if path is None:
        service_missing("no `chromium` on PATH (apt-get install chromium; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_missing("the playwright package is missing (pip install -e '.[test]')")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=OFFLINE_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def api(sqlite_url: str, tmp_path: Path, redis_session_lock: None) -> Iterator[str]:
    settings: Settings = make_test_settings(database_url=sqlite_url, artifact_root=tmp_path / "artifacts")
    with serving(settings) as url:
        yield url


def test_docs_load_offline_from_the_app_and_list_the_operations(browser: Any, api: str) -> None:
    outside: list[str] = []
    context = browser.new_context()

    def only_local(route: Any) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort("internetdisconnected")

    context.route("**/*", only_local)
    page = context.new_page()
    fetched: list[str] = []
    page.on("requestfinished", lambda request: fetched.append(request.url))
    page.goto(f"{api}/docs")
    page.wait_for_selector(".opblock", timeout=60_000)
    summaries = page.locator(".opblock-summary-path").all_inner_texts()
    context.close()
    assert outside == [], outside
    assert any(u.endswith("/docs/assets/swagger-ui-bundle.js") for u in fetched)
    assert any(u.endswith("/openapi.json") for u in fetched)
    paths = {s.replace("\u200b", "").strip() for s in summaries}
    assert {"/v1/jobs", "/v1/voices/{voice_id}", "/v1/audio/speech", "/v1/models"} <= paths
    spec = httpx.get(f"{api}/openapi.json").json()
    assert len(summaries) == sum(len(methods) for methods in spec["paths"].values())


def test_the_page_names_no_cdn_and_redoc_is_gone(api: str) -> None:
    page = httpx.get(f"{api}/docs").text
    assert "cdn" not in page.lower() and "http://" not in page and "https://" not in page
    assert httpx.get(f"{api}/redoc").status_code == 404
    assert httpx.get(f"{api}/docs/assets/swagger-ui.css").status_code == 200


def test_the_web_page_shows_a_voices_name_in_the_picker(browser: Any, api: str) -> None:
    from app.dev import SAMPLES

    reference = (SAMPLES / "voice_a.wav").read_bytes()
    upload = httpx.post(f"{api}/v1/voices", files={"reference": ("a.wav", reference)})
    voice_id = upload.json()["id"]
    assert httpx.patch(f"{api}/v1/voices/{voice_id}", json={"name": "Ada"}).status_code == 200
    page = browser.new_page()
    page.goto(f"{api}/")
    option = page.locator(f'#voice-id option[value="{voice_id}"]')
    option.wait_for(state="attached", timeout=60_000)
    assert option.inner_text().startswith(f"Ada ({voice_id[:8]}")
    page.close()
