"""The series the alert rules and the dashboard read (deploy/prometheus): live GPU workers, books and the
chapters of live books, what sweeps found, the feature store's memory; and the whole exposition passes
`promtool check metrics`."""

from __future__ import annotations

import re
from datetime import timedelta

from fastapi.testclient import TestClient

from app.db import queries
from app.db.models import BookStatus, JobStatus, Worker, utcnow
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.reconcile.report import SWEEP_FINDINGS, SweepReport, count_findings
from app.settings import Settings
from app.storage import keys
from app.storage.feature_store import FeatureStore
from tests.app.api.helpers import make_client, submit, upload_voice
from tests.support.prom import promtool


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} is not in the exposition"
    return float(match.group(1))


def add_workers(settings: Settings) -> None:
    """Two GPU workers: one beating now, one silent for ten minutes (gone)."""
    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            queries.register_worker(session=session, name="gpu@live", slots=4)
            queries.register_worker(session=session, name="gpu@gone", slots=4)
            session.get_one(Worker, "gpu@gone").heartbeat_at = utcnow() - timedelta(minutes=10)
    finally:
        engine.dispose()


def test_live_gpu_workers_books_and_every_job_status_are_exported(client: TestClient, settings: Settings,
                                                                  reference: bytes) -> None:
    text = client.get("/metrics").text
    assert sample(text, "wavefarm_gpu_workers_live") == 0
    for status in JobStatus:  # a status no job has yet reads 0: the failure ratio has both sides
        assert sample(text, "wavefarm_jobs", f'{{status="{status.value}"}}') == 0
    for status in BookStatus:
        assert sample(text, "wavefarm_books", f'{{status="{status.value}"}}') == 0
    assert sample(text, "wavefarm_book_chapters", '{state="pending"}') == 0
    add_workers(settings)
    submit(client, upload_voice(client, reference).json()["id"])
    text = client.get("/metrics").text
    assert sample(text, "wavefarm_gpu_workers_live") == 1
    assert sample(text, "wavefarm_jobs", '{status="queued"}') == 1


def test_sweep_findings_are_counted_and_every_kind_is_exported(client: TestClient,
                                                                settings: Settings) -> None:
    text = client.get("/metrics").text
    for kind in SWEEP_FINDINGS:
        assert sample(text, "wavefarm_sweep_found_total", f'{{kind="{kind}"}}') == 0
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=60)
    try:
        count_findings(store, SweepReport(jobs_requeued=["a", "b"], orphans_removed=["x"]))
        count_findings(store, SweepReport(jobs_requeued=["c"]))
        assert store.count(keys.COUNTER_SWEEP, "jobs_requeued") == 3
    finally:
        store.close()
    text = client.get("/metrics").text
    assert sample(text, "wavefarm_sweep_found_total", '{kind="jobs_requeued"}') == 3
    assert sample(text, "wavefarm_sweep_found_total", '{kind="orphans_removed"}') == 1
    assert sample(text, "wavefarm_sweep_found_total", '{kind="jobs_resumed"}') == 0


def test_the_feature_store_memory_and_its_limit_are_the_redis_servers(client: TestClient,
                                                                      settings: Settings) -> None:
    store = FeatureStore.from_url(settings.feature_store_url, ttl_s=60)
    try:
        info = store.client.info("memory")
    finally:
        store.close()
    text = client.get("/metrics").text
    assert sample(text, "wavefarm_feature_store_max_bytes") == info["maxmemory"]
    used = sample(text, "wavefarm_feature_store_used_bytes")
    assert used > 0 and 0.5 < used / info["used_memory"] < 2  # the server's own figure, read moments apart


def test_a_down_feature_store_drops_its_series_and_says_so(settings: Settings) -> None:
    broken = settings.model_copy(update={"feature_store_url": "redis://127.0.0.1:1/0"})
    for client in make_client(broken):
        text = client.get("/metrics").text
        assert sample(text, "wavefarm_source_up", '{source="feature_store"}') == 0
        assert "wavefarm_feature_store_used_bytes" not in text and "wavefarm_sweep_found_total" not in text
        assert sample(text, "wavefarm_source_up", '{source="database"}') == 1


def test_the_api_exposition_passes_promtool_check_metrics(client: TestClient, reference: bytes) -> None:
    submit(client, upload_voice(client, reference).json()["id"])
    client.get("/healthz")
    done = promtool("check", "metrics", stdin=client.get("/metrics").text)
    assert done.returncode == 0, done.stdout + done.stderr
