"""Job submissions run in a few threads of their own (`settings.submit_threads`): past that many, a
submission waits on the event loop for a thread, so a burst of concurrent requests never has more than
that many threads writing (and handing the GIL to each other). Every request is still answered."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
import redis

from app.api.deps import submit_threads
from app.api.main import create_app
from app.dev import SAMPLES
from app.settings import Settings
from app.submission import jobs
from tests.support.runtime import RecordingSender


def test_unset_it_is_two_on_sqlite_and_eight_on_postgresql(settings: Settings) -> None:
    assert submit_threads(settings) == (2 if settings.database_url.startswith("sqlite") else 8)
    assert submit_threads(settings.model_copy(update={"submit_threads": 5})) == 5


@pytest.mark.parametrize("threads", [1, 3])
def test_a_burst_of_submissions_never_runs_in_more_threads_than_set(
        settings: Settings, feature_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        threads: int) -> None:
    app = create_app(settings.model_copy(update={"submit_threads": threads}), sender=RecordingSender())
    running, most, lock = [0], [0], threading.Lock()
    real_submit = jobs.submit

    def submit(**kwargs: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)  # long enough for the burst to pile up behind the threads
            return real_submit(**kwargs)
        finally:
            with lock:
                running[0] -= 1

    async def burst() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            reference = ("ref.wav", (SAMPLES / "voice_a.wav").read_bytes(), "audio/wav")
            voice = (await client.post("/v1/voices", files={"reference": reference})).json()["id"]
            monkeypatch.setattr(jobs, "submit", submit)
            answers = await asyncio.gather(*(client.post("/v1/jobs", json={"voice_id": voice, "tokens": [i]})
                                             for i in range(8)))
            batch = await client.post("/v1/jobs/batch", json=[{"voice_id": voice, "tokens": [9]}])
            return [a.status_code for a in answers] + [batch.status_code]

    assert asyncio.run(burst()) == [202] * 8 + [200]
    assert most[0] == threads
