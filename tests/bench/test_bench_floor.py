"""scripts/bench_floor.py: the floor app `bench_api.py --floor` measures wavefarm against does what a
submission must (a validated body, one row, one published message) and refuses what a body must not be;
the ratio summary pairs each round's two runs. (The benchmark itself is run by hand: docs/SCALING.md.)"""

import base64
import json
import sys
import uuid
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_floor  # noqa: E402

from tests.conftest import BROKER_DB, redis_url  # noqa: E402


def test_the_floor_app_inserts_one_row_and_publishes_one_message(tmp_path: Path,
                                                                 broker_redis: redis.Redis) -> None:
    database = f"sqlite:///{tmp_path / 'floor.sqlite'}"
    queue = f"floor-test-{uuid.uuid4().hex[:8]}"
    app = bench_floor.make_floor_app(database, redis_url(BROKER_DB), queue)
    try:
        with TestClient(app) as client:
            answer = client.post("/v1/jobs", json={"voice_id": "v" * 64, "tokens": [1, 2, 3], "seed": 7})
            assert answer.status_code == 202 and answer.json()["n_tokens"] == 3
            assert client.post("/v1/jobs", json={"voice_id": "v", "tokens": []}).status_code == 422
        with create_engine(database).connect() as conn:
            rows = conn.execute(select(bench_floor.floor_jobs)).all()
        assert [(r.id, r.tokens, r.seed) for r in rows] == [(answer.json()["id"], [1, 2, 3], 7)]
        lists = list(broker_redis.scan_iter(f"{queue}*"))  # kombu keeps a list per priority step
        messages = [json.loads(m) for key in lists for m in broker_redis.lrange(key, 0, -1)]
        assert [json.loads(base64.b64decode(m["body"])) for m in messages] == [{"job": answer.json()["id"]}]
    finally:
        for key in broker_redis.scan_iter(f"{queue}*"):
            broker_redis.delete(key)


@pytest.mark.parametrize("floor_cpu", [2.0, 0.0])
def test_the_summary_gives_each_rounds_cpu_ratio(floor_cpu: float) -> None:
    rows = [{"app": app, "round": n, "concurrency": 8, "cpu_ms_per_request": cpu, "per_s": 10.0}
            for n in (1, 2) for app, cpu in (("wavefarm", 3.0 * n), ("floor", floor_cpu))]
    [summary] = bench_floor.ratio_summary(rows)
    expected = [1.5, 3.0] if floor_cpu else []
    assert summary["cpu_ratio_per_round"] == expected and summary["concurrency"] == 8
