"""The quality gate in books end to end (issue 46) on real services: PostgreSQL, Redis, the session's CPU
worker (book.* tasks; book.chapter hears each chapter) and a GPU worker subprocess (tiny preset, dummy
weights) under the test hook WAVEFARM_TEST_QUIET_RENDERS, which writes the renders it names 60 dB
quieter: silence to the gate.

- a segment quiet on its first seed only is rendered again with the next seed and reported re-rendered;
  one quiet on every seed is rendered WAVEFARM_QUALITY_RERENDERS (2) times more, kept and reported
  failed, with where to play it; the report says once that only the signal checks ran (dummy weights);
- a report-only book hears the same failure and renders nothing again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime

import pytest
from sqlalchemy import func, select

from app.books.quality_view import DUMMY_NOTE, book_quality
from app.broker.celery_config import make_celery
from app.db.models import BookStatus, Job, JobStatus, utcnow
from app.settings import Settings
from app.speech import VOCAB_SIZE
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from tests.integration.conftest import WorkerProcess, start_gpu_worker
from tests.integration.test_book_render import submit, wait_book

QUIET = "40@0,50,42@0"  # tokens: 40 on the book's seed (0) only; 50 on every seed; 42 on seed 0


@pytest.fixture(scope="module")
def quiet_settings(worker_settings: Settings) -> Settings:
    return worker_settings.model_copy(update={
        "model_preset": "tiny", "prep_wait_ms": 9_000, "micro_batch_size": 4, "worker_slots": 4,
        "progress_interval_s": 0.2, "test_quiet_renders": QUIET})


@pytest.fixture(scope="module")
def quiet_gpu(quiet_settings: Settings, cpu_worker: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = start_gpu_worker(quiet_settings, "gpu-quality", tmp_path_factory.mktemp("gpu-quality"))
    yield worker
    worker.stop()
    print(f"== {worker.nodename}\n{worker.tail()}")


@pytest.fixture
def env(quiet_settings: Settings, quiet_gpu: WorkerProcess, worker_sessions):
    store = FeatureStore.from_url(quiet_settings.feature_store_url, ttl_s=quiet_settings.feature_ttl_s)
    app = make_celery(quiet_settings)
    yield quiet_settings, app, store
    app.close()
    store.close()


def quiet_book(counts: list[int]) -> bytes:
    """One chapter of token segments of these lengths (the hook picks renders by length), their tokens
    salted by the clock: the integration database is shared with earlier tests, whose segments of the
    same content (and so the same keys) would be found rendered already."""
    salt = int(time.time() * 1000)
    return json.dumps({"title": "Quiet", "author": "T", "chapters": [{"title": "Part 1", "segments": [
        {"tokens": [(7 * n + salt) % VOCAB_SIZE] * n} for n in counts]}]}).encode()


def _renders(sessions, since: datetime) -> dict[int, list[int]]:
    """Every job rendered since `since`, by token count -> their seeds (each render of a segment is its
    own job; jobs of earlier tests in the shared database are not counted)."""
    with sessions() as session:
        rows = session.execute(select(Job.n_tokens, Job.seed, Job.status).where(Job.submitted_at >= since)
                               .order_by(Job.seed)).all()
    assert {status for _, _, status in rows} == {JobStatus.SUCCEEDED}
    found: dict[int, list[int]] = {}
    for n, seed, _ in rows:
        found.setdefault(n, []).append(seed)
    return found


def _report(settings: Settings, sessions, book_id: str):
    with sessions() as session:
        return book_quality(session=session, artifacts=ArtifactStore(settings.artifact_root), book_id=book_id)


@pytest.mark.timeout(600)
def test_a_segment_quiet_on_one_seed_is_rendered_again_and_one_quiet_on_every_seed_is_kept_failed(
        env, worker_sessions) -> None:
    settings, since = env[0], utcnow()
    book_id = submit(env, worker_sessions, quiet_book([30, 40, 50]), filename="tokens.json")
    view = wait_book(settings, worker_sessions, book_id)
    assert view.book.status == BookStatus.SUCCEEDED, view.book.error
    assert _renders(worker_sessions, since) == {30: [0], 40: [0, 1], 50: [0, 1, 2]}
    report = _report(settings, worker_sessions, book_id)
    assert report.mode == "on"
    assert report.totals == {"passed": 1, "rerendered": 1, "failed": 1, "unheard": 0}
    [kept] = report.worst
    assert kept.attempts == 3 and any(r.startswith("silence:") for r in kept.reasons)
    with worker_sessions() as session:
        last = session.scalar(select(Job.id).where(Job.n_tokens == 50, Job.seed == 2,
                                                   Job.submitted_at >= since))
    assert kept.audio == f"/v1/jobs/{last}/audio"
    assert report.notes == [DUMMY_NOTE]  # dummy weights: said once, for the whole book
    assert DUMMY_NOTE not in view.notes  # the book's own notes go into its tags: not the gate's


@pytest.mark.timeout(600)
def test_a_report_only_book_hears_the_quiet_segment_and_renders_nothing_again(env, worker_sessions) -> None:
    settings, since = env[0], utcnow()
    book_id = submit(env, worker_sessions, quiet_book([32, 42]), filename="tokens.json", quality="report")
    view = wait_book(settings, worker_sessions, book_id)
    assert view.book.status == BookStatus.SUCCEEDED, view.book.error
    assert _renders(worker_sessions, since) == {32: [0], 42: [0]}
    report = _report(settings, worker_sessions, book_id)
    assert (report.mode, report.totals) == ("report", {"passed": 1, "rerendered": 0, "failed": 1,
                                                       "unheard": 0})
    assert [w.attempts for w in report.worst] == [1]
    with worker_sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.submitted_at >= since)) == 2
