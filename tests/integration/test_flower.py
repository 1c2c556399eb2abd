"""Flower through the project's CLI (`wavefarm flower`) on the test broker, with basic auth from
FLOWER_BASIC_AUTH: a real synthesis job (the session's CPU worker, a GPU worker subprocess, tiny preset,
dummy weights) is read back from Flower's HTTP API by its job id, and the API refuses anonymous clients.

Flower knows a task only from the events it received after it subscribed to the broker's event
exchange (Redis pub/sub: nothing is replayed). So before submitting, the test waits until Flower
answers, lists the GPU worker and has received a marker event published by the test itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.broker.wire import SYNTH_TASK
from app.db import queries
from app.db.models import JobStatus
from app.dev import SAMPLES, services
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.feature_store import FeatureStore
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from gpu_worker.worker.process import make_gpu_celery
from tests.conftest import REPO, SESSION_TAG, settings_env
from tests.integration.conftest import WorkerProcess, running_gpu_worker
from tests.support.context import context_for
from tests.support.net import free_port

USER, PASSWORD = "flower-test", f"pw-{uuid.uuid4().hex[:12]}"
AUTH = (USER, PASSWORD)
REFERENCE = (SAMPLES / "voice_a.wav").read_bytes()
# The console script `pip install -e .` puts beside this interpreter: what an operator runs.
WAVEFARM = Path(sys.executable).with_name("wavefarm")


@dataclass
class Flower:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        return f"--- flower log (exit status {self.proc.poll()}) ---\n{services.log_tail(self.log, lines)}"

    def get(self, path: str, auth: tuple[str, str] | None = AUTH) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", auth=auth, timeout=10)




def poll(check: Callable[[], Any], timeout: float, what: str, flower: Flower, interval: float = 0.5) -> Any:
    """Call `check` until it returns something truthy (returned), failing after `timeout` with `what`,
    the last value or error seen and Flower's log."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        assert flower.proc.poll() is None, f"flower exited while waiting for {what}\n{flower.tail()}"
        try:
            last = check()
        except httpx.TransportError as exc:  # not listening yet, or a request cut short
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}\n"
                        f"{flower.tail()}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def gpu_settings(worker_settings: Settings) -> Settings:
    # A long prep wait: the job waits for the session's CPU worker to prepare its voice.
    return worker_settings.model_copy(update={
        "model_preset": "tiny", "prep_wait_ms": 120_000, "micro_batch_size": 4, "worker_slots": 2,
        "progress_interval_s": 0.2})


@pytest.fixture
def gpu_worker(gpu_settings: Settings, cpu_worker: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    with running_gpu_worker(gpu_settings, f"gpu-flower-{SESSION_TAG}", tmp_path) as worker:
        yield worker


@pytest.fixture
def flower(gpu_settings: Settings, tmp_path: Path) -> Iterator[Flower]:
    """`wavefarm flower --port P` on the test broker, in its own process group; SIGTERM, then SIGKILL."""
    assert WAVEFARM.is_file(), f"no `wavefarm` console script beside {sys.executable}: pip install -e ."
    port = free_port()
    log = tmp_path / "flower.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}  # no stray Flower options
    env.update(settings_env(gpu_settings), PYTHONPATH=str(REPO), FLOWER_BASIC_AUTH=f"{USER}:{PASSWORD}")
    with open(log, "wb") as out:  # a file, not a pipe nobody reads: a full pipe would block Flower
        proc = subprocess.Popen([str(WAVEFARM), "flower", "--port", str(port)], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    flower = Flower(f"http://127.0.0.1:{port}", proc, log)
    try:
        poll(lambda: flower.get("/healthcheck").status_code == 200, 60, "flower to answer", flower)
        yield flower
    finally:
        services.stop_process(proc)  # SIGTERM to its group, SIGKILL after 15 s
        print(flower.tail())


def wait_until_flower_receives_events(flower: Flower, settings: Settings) -> None:
    """Publish a marker `task-sent` event until Flower's API knows the marker task: from then on Flower
    is subscribed to the event exchange and sees every event the producer and the workers send."""
    marker = f"flower-marker-{uuid.uuid4()}"
    app = make_gpu_celery(settings)
    try:
        def marker_seen() -> bool:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-sent", uuid=marker, name="flower-test.marker")
            return flower.get(f"/api/task/info/{marker}").status_code == 200

        poll(marker_seen, 60, "flower to receive events (a marker task-sent event)", flower, interval=1.0)
    finally:
        app.close()


@pytest.mark.timeout(480)
def test_flower_shows_a_finished_synthesis_job_by_its_id_and_refuses_anonymous_clients(
        flower: Flower, gpu_worker: WorkerProcess, gpu_settings: Settings, worker_sessions) -> None:
    settings = gpu_settings
    # Flower reaches the broker and the worker: the GPU worker answers its inspect broadcast.
    def workers_with_gpu() -> dict[str, Any] | None:
        response = flower.get("/api/workers?refresh=1")
        assert response.status_code == 200, (response.status_code, response.text)
        found: dict[str, Any] = response.json()
        return found if gpu_worker.nodename in found else None

    workers = poll(workers_with_gpu, 60, "the GPU worker in /api/workers", flower)
    assert settings.queue_gpu in {q["name"] for q in workers[gpu_worker.nodename]["active_queues"]}
    wait_until_flower_receives_events(flower, settings)

    app = make_gpu_celery(settings)
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
    tokens = torch.randint(0, VOCAB_SIZE, (50,), generator=torch.Generator().manual_seed(50)).tolist()
    try:
        with worker_sessions() as session:
            job_id = submit_job(ctx=context_for(settings, app, sessions=worker_sessions, store=store),
                                session=session,
                                request=JobRequest(
                                    tokens=tokens, reference_bytes=REFERENCE, seed=5, output_format="wav"))
        result = app.AsyncResult(job_id).get(timeout=240)
    finally:
        app.close()
        store.close()
    assert result["status"] == "succeeded", result
    with worker_sessions() as session:
        assert queries.require_job(session=session, job_id=job_id).status == JobStatus.SUCCEEDED

    # The synth task's id is the job id; its last event (task-succeeded) may trail the result a little.
    def succeeded() -> dict[str, Any] | None:
        response = flower.get(f"/api/task/info/{job_id}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, (response.status_code, response.text)
        info: dict[str, Any] = response.json()
        return info if info.get("state") == "SUCCESS" else None

    info = poll(succeeded, 60, f"job {job_id} in SUCCESS at /api/task/info", flower)
    assert info["uuid"] == job_id and info["name"] == SYNTH_TASK
    assert info["worker"] == gpu_worker.nodename
    assert info["received"] and info["started"] and info["succeeded"]  # every stage's event arrived
    assert job_id in info["result"] and "succeeded" in info["result"]  # the synth task's return value

    # Basic auth guards the API: no credentials or wrong ones are refused. (Flower's API handlers answer
    # a bare 401, without the WWW-Authenticate challenge its UI pages send.)
    anonymous = flower.get(f"/api/task/info/{job_id}", auth=None)
    assert anonymous.status_code == 401 and job_id not in anonymous.text
    assert flower.get(f"/api/task/info/{job_id}", auth=(USER, "wrong")).status_code == 401
    assert flower.get("/api/workers", auth=None).status_code == 401
