"""The web page at `/`: one server-rendered HTML page, its three scripts and its style sheet
(`app/api/web/`).

The page is a client of the JSON API like the CLI is: its script submits books and single jobs, polls
their status every second, plays and downloads the results and cancels them, all through /v1. This module
only serves those files; it holds no state and calls no service.

The page and its files are public, even when the API has a token: the page says whether one is needed
and asks for it, and its script sends `Authorization: Bearer <token>` on every /v1 call. Nothing is
fetched from elsewhere (the Content-Security-Policy allows this origin only), and there is no build step.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from string import Template

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, HTMLResponse

from app.api.deps import Ctx
from app.settings import Settings

router = APIRouter(include_in_schema=False)  # pages, not part of the API's contract

WEB = Path(__file__).with_name("web")
JS, CSS = "text/javascript; charset=utf-8", "text/css; charset=utf-8"
# In the page's order: api.js, then cards.js, then app.js, each using what the ones before declare.
ASSETS = {"api.js": JS, "cards.js": JS, "app.js": JS, "style.css": CSS}
# Scripts, styles and requests: this origin only. Media also from blob: URLs (audio fetched with the
# token, which an <audio src> cannot send).
CSP = ("default-src 'self'; media-src 'self' blob:; img-src 'self' data:; object-src 'none'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


@cache
def _template() -> Template:
    return Template((WEB / "index.html").read_text(encoding="utf-8"))


@cache
def asset_url(name: str) -> str:
    """`/web/<name>?v=<content hash>`: a changed file is a new URL, so a browser never runs a stale one."""
    digest = hashlib.sha256((WEB / name).read_bytes()).hexdigest()[:12]
    return f"/web/{name}?v={digest}"


def token_required(settings: Settings) -> bool:
    """The rule of `app.api.deps.authorize`: an unset or empty token leaves the API open."""
    return settings.api_token is not None and bool(settings.api_token.get_secret_value())


@router.get("/", response_class=HTMLResponse)
def index(ctx: Ctx) -> HTMLResponse:
    page = _template().substitute(api_script=asset_url("api.js"), cards_script=asset_url("cards.js"),
                                  script=asset_url("app.js"),
                                  style=asset_url("style.css"),
                                  token_required="true" if token_required(ctx.settings) else "false")
    return HTMLResponse(page, headers=PAGE_HEADERS)


@router.get("/web/{name}")
def asset(name: str) -> FileResponse:
    """The page's scripts and style sheet; any other name is 404 (no path reaches past these)."""
    if name not in ASSETS:
        raise HTTPException(404, detail=f"no such file: {name!r}")
    return FileResponse(WEB / name, media_type=ASSETS[name], headers={"X-Content-Type-Options": "nosniff"})
