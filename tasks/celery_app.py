"""The CPU workers' Celery app: `celery -A tasks.celery_app worker -Q cpu`.

The configuration (queues, JSON only, acks late) lives in `app.celery_config`, shared with the GPU
worker and the producers; this module only names the CPU task modules and reads the settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from app.celery_config import make_celery as _make_celery
from app.settings import Settings, get_settings

CPU_TASK_MODULES = ("tasks.voice", "tasks.maintenance", "tasks.books")


def make_celery(settings: Settings, include: Sequence[str] = CPU_TASK_MODULES) -> Celery:
    return _make_celery(settings, include)


celery_app = make_celery(get_settings())
