"""A worker says at start which broker, database, feature store and queues it serves (passwords hidden),
so two stacks mixed on one Redis show up in their logs: a CPU worker and a GPU worker as processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import make_url

from app.settings import Settings
from app.submission.routing import worker_queue
from tests.integration.conftest import start_gpu_worker, start_worker


def _line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if "database " in line
             and " queues " in line]
    assert len(lines) == 1, log.read_text(errors="replace")[-3000:]
    return lines[0]


@pytest.mark.timeout(300)
def test_cpu_and_gpu_workers_log_their_broker_database_and_queues(settings: Settings, tmp_path: Path) -> None:
    url = make_url(settings.database_url)
    if url.drivername.startswith("postgresql"):  # trust auth: a password is accepted, and must not show
        url = url.set(password="hunter2")
    secret = settings.model_copy(update={"database_url": url.render_as_string(hide_password=False)})
    cpu = start_worker(secret, "cpu-where", tmp_path, ["-A", "tasks.celery_app", "worker", "-Q",
                                                       settings.queue_cpu, "-P", "solo"])
    cpu.stop()
    said = _line(cpu.log)
    database = make_url(secret.database_url).render_as_string(hide_password=True)
    assert f"database {database}" in said and "hunter2" not in cpu.log.read_text()
    assert f"broker {settings.broker_url}" in said and f"queues {settings.queue_cpu}" in said
    gpu = start_gpu_worker(settings, "gpu-where", tmp_path, concurrency=1,
                           extra_env={"WAVEFARM_MODEL_PRESET": "tiny"})
    gpu.stop()
    own = worker_queue(settings, gpu.nodename)
    assert f"queues {', '.join(sorted([settings.queue_gpu, own]))}" in _line(gpu.log)
