"""The CPU workers' Celery app: `celery -A tasks.celery_app worker -Q cpu`.

The configuration (queues, JSON only, acks late) lives in `app.broker.celery_config`, shared with the GPU
worker and the producers; this module only names the CPU task modules, reads the settings and adds
the periodic maintenance sweep (`tasks.schedule`) to the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

from app.broker.celery_config import make_celery as _make_celery
from app.settings import Settings, get_settings
from tasks.schedule import PeriodicSweep

CPU_TASK_MODULES = ("tasks.voice", "tasks.text", "tasks.maintenance", "tasks.books")


def make_celery(settings: Settings, include: Sequence[str] = CPU_TASK_MODULES) -> Celery:
    """The CPU workers' app; a worker started from it also sends the periodic maintenance sweep."""
    app = _make_celery(settings, include)
    app.steps["worker"].add(PeriodicSweep)
    return app


celery_app = make_celery(get_settings())


@worker_process_init.connect
def limit_torch_threads(**_: Any) -> None:
    """Each prefork child (one per core by default) runs torch on `cpu_worker_threads` threads.

    torch's default is one thread per core in every child: N children then oversubscribe N cores. And a
    child forked from a parent that had already run a parallel torch op hangs in its first one with the
    default thread count (libgomp's pool does not survive fork); with the count set here it does not.
    """
    threads = get_settings().cpu_worker_threads
    if threads:
        import torch

        torch.set_num_threads(threads)
