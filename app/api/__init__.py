"""The HTTP API (FastAPI). `create_app(settings)` in `app.api.main`; never imports the model.

Importing this package stays cheap (the GPU worker imports `app.api.metrics` for metric names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.settings import Settings


def create_app(settings: Settings, **kwargs: Any) -> FastAPI:
    from app.api.main import create_app as factory

    return factory(settings, **kwargs)
