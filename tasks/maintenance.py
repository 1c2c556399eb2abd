"""`maintenance.sweep`: the Celery adapter of `app.maintenance.sweep` (no arguments; the report out)."""

from __future__ import annotations

from typing import Any

from app.maintenance import run_sweep
from app.settings import get_settings
from app.wire import SWEEP_TASK
from tasks.celery_app import celery_app


@celery_app.task(name=SWEEP_TASK)
def sweep_task() -> dict[str, Any]:
    return run_sweep(get_settings(), celery_app).as_dict()
