"""`maintenance.sweep`: the Celery adapter of `app.reconcile.sweep.sweep` (no arguments; the report out)."""

from __future__ import annotations

from typing import Any

from app.broker.wire import SWEEP_TASK
from app.reconcile.sweep import run_sweep
from app.settings import get_settings
from tasks.celery_app import celery_app


@celery_app.task(name=SWEEP_TASK)
def sweep_task() -> dict[str, Any]:
    return run_sweep(get_settings(), celery_app).as_dict()
