"""/docs without a CDN: Swagger UI's files come from the `swagger-ui-bundle-v2` package (Swagger UI's
own dist folder, Apache-2.0) and are served from this app under /docs/assets, so an offline deployment
has its interactive docs. FastAPI's default /docs and /redoc load their scripts from jsdelivr: both are
turned off in `create_app` and this page takes /docs's place.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """Swagger UI at /docs on `app.openapi_url`, every file it loads served by `app` itself."""
    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger-ui")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - API docs",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
                                   oauth2_redirect_url="/docs/oauth2-redirect")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
