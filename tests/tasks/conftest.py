"""What the task tests share: `res`, the tasks' clients (`app.context.Context`, as `tasks.voice.resources`
builds them in a worker) on the test's settings, database, store, artifacts and Celery producer."""

from __future__ import annotations

import pytest

from app.context import Context


@pytest.fixture
def res(ctx: Context) -> Context:
    return ctx
