"""`app.submission.jobs`: submission (rows, the stored reference, both tasks queued after the commit),
idempotency,
refusals before anything is stored, long token lists, a broker that refuses."""

from dataclasses import replace
from typing import Any

import pytest
import redis
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from app.db import queries as q
from app.db.models import Job, Voice, VoiceStatus
from app.errors import BadAudio, BadInput, BadTokens, Conflict, NotFound
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.feature_store import FeatureStore
from app.submission.jobs import INLINE_TOKENS_MAX, cancel_job, job_tokens, submit_job
from app.submission.request import JobRequest
from tests.app.helpers import count, queued
from tests.support.audio import wav_bytes


def test_submission_creates_rows_stores_the_reference_and_enqueues_both_tasks(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis, artifacts: ArtifactStore
):
    job_id = submit(tokens=[0, 4218, 6560], seed=5, output_format="flac", priority=7)
    job = q.require_job(session=session, job_id=job_id)
    voice = q.require_voice(session=session, voice_id=job.voice_id)
    assert (job.status, job.tokens, job.seed, job.output_format, job.priority) == (
        "queued",
        [0, 4218, 6560],
        5,
        "flac",
        7,
    )
    assert voice.status == VoiceStatus.PENDING and voice.uses == 1
    assert voice.reference_path and artifacts.read_bytes(voice.reference_path) == wav_bytes()
    prepare, synth = queued(broker_redis, settings.queue_cpu), queued(broker_redis, settings.queue_gpu)
    assert [(m["task"], m["args"]) for m in prepare] == [("voice.prepare", [voice.id])]
    assert [(m["task"], m["args"], m["id"]) for m in synth] == [("synth", [job_id], job_id)]
    assert synth[0]["priority"] == 2  # job priority 7 of 9 -> broker priority 2 (0 is served first)


def test_the_same_request_with_the_same_idempotency_key_returns_the_same_job_and_enqueues_once(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis
):
    first = submit(idempotency_key="client-42", seed=5, priority=2)
    assert submit(idempotency_key="client-42", seed=5, priority=2) == first
    assert submit(idempotency_key="client-42", priority=2) == first  # no seed asked for: any seed is fine
    voice_id = q.require_job(session=session, job_id=first).voice_id
    assert submit(idempotency_key="client-42", priority=2, voice_id=voice_id) == first  # the voice by its id
    assert count(session, Job) == 1 and len(queued(broker_redis, settings.queue_gpu)) == 1


@pytest.mark.parametrize(("change", "named"), [
    ({"tokens": [9, 9]}, "tokens"), ({"priority": 3}, "priority"),
    ({"output_format": "flac"}, "output format"), ({"seed": 6}, "seed"), ({"voice_id": "0" * 64}, "voice"),
    ({"reference_bytes": wav_bytes(freq=330.0)}, "voice"),
    ({"tokens": [1, 2, 3, 4], "priority": 1}, "tokens, priority"),
])
def test_an_idempotency_key_reused_with_another_request_is_a_conflict(
    submit, session: Session, settings: Settings, broker_redis: redis.Redis, change: dict, named: str
):
    first = submit(idempotency_key="client-43", seed=5)
    with pytest.raises(Conflict, match=f"'client-43' was used for job {first}, which has another {named}; "):
        submit(**{"idempotency_key": "client-43", "seed": 5, **change})
    assert count(session, Job) == 1 and len(queued(broker_redis, settings.queue_gpu)) == 1


def test_a_request_that_loses_the_insert_race_for_its_key_is_judged_the_same_way(
    submit, session: Session, monkeypatch: pytest.MonkeyPatch
):
    """A concurrent duplicate finds no job at its first look and meets the winner's row at its insert."""
    first = submit(idempotency_key="client-44", seed=5)
    monkeypatch.setattr(q, "get_job_by_idempotency_key", lambda **_: None)  # the look before the insert
    assert submit(idempotency_key="client-44", seed=5) == first
    with pytest.raises(Conflict, match="which has another tokens"):
        submit(idempotency_key="client-44", seed=5, tokens=[7])
    assert count(session, Job) == 1


def test_a_stored_voice_is_read_counted_and_its_job_written_in_one_statement_and_a_replay_counts_no_use(
    submit, session: Session, monkeypatch: pytest.MonkeyPatch
):
    first = submit(idempotency_key="client-45", seed=5)
    voice_id = q.require_job(session=session, job_id=first).voice_id
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.lstrip())

    event.listen(session.get_bind(), "before_cursor_execute", seen)
    try:
        submit(voice_id=voice_id, seed=6)
    finally:
        event.remove(session.get_bind(), "before_cursor_execute", seen)
    written = [s for s in statements if " voices" in s or " jobs" in s]
    if session.get_bind().dialect.name == "postgresql":  # one round trip: the UPDATE feeds the INSERT
        assert len(written) == 1 and written[0].startswith("WITH used AS"), statements
        assert "UPDATE voices" in written[0] and "INSERT INTO jobs" in written[0]
    else:  # SQLite cannot write in a WITH: two statements, the voice first
        kinds = [s.split(" (")[0].split(" SET")[0] for s in written]
        assert kinds == ["UPDATE voices", "INSERT INTO jobs"], statements
    monkeypatch.setattr(q, "get_job_by_idempotency_key", lambda **_: None)  # lost the insert race
    assert submit(idempotency_key="client-45", seed=5, voice_id=voice_id) == first
    session.expire_all()
    assert q.require_voice(session=session, voice_id=voice_id).uses == 2  # the first job and the second


@pytest.mark.parametrize(
    "tokens",
    [[], [-1], [6561], [1, 2, 99999], ["1"], [1.0], [True], [None], "123", b"\x01", 5, None],
)
def test_bad_tokens_are_refused_before_anything_is_stored(
    submit, session: Session, tokens, artifacts: ArtifactStore
):
    with pytest.raises(BadTokens):
        submit(tokens=tokens)
    assert count(session, Job) == 0 and count(session, Voice) == 0
    assert list((artifacts.root / "references").iterdir()) == []


def test_more_tokens_than_the_limit_are_refused(submit, settings: Settings):
    with pytest.raises(BadTokens, match="at most"):
        submit(tokens=[1] * (settings.max_tokens + 1))


def test_long_token_lists_live_in_the_artifact_store(submit, session: Session, artifacts: ArtifactStore):
    tokens = list(range(INLINE_TOKENS_MAX + 1))
    job = q.require_job(session=session, job_id=submit(tokens=tokens))
    assert job.tokens is None and job.tokens_path == f"tokens/{job.id}.json" and job.n_tokens == len(tokens)
    assert job_tokens(job=job, artifacts=artifacts) == tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"output_format": "mp3"},
        {"priority": 10},
        {"priority": -1},
        {"seed": -1},
        {"idempotency_key": ""},
        {"idempotency_key": "k" * 129},
        {"voice_id": "0" * 64, "reference_bytes": b"x"},
        {"voice_id": "../x"},
    ],
)
def test_bad_options_are_refused(submit, kwargs):
    with pytest.raises(BadInput):
        submit(**kwargs)


def test_an_unknown_voice_id_is_not_found_and_leaves_nothing_behind(
    submit, session: Session, artifacts: ArtifactStore
):
    """The voice is found by the job's own insert (one statement on PostgreSQL), after a long token list
    went to the artifact store: the list is removed again, and no row is written."""
    for tokens in ([1, 2, 3], list(range(INLINE_TOKENS_MAX + 1))):
        with pytest.raises(NotFound, match="no voice"):
            submit(voice_id="0" * 64, tokens=tokens)
    session.rollback()
    assert count(session, Job) == 0 and count(session, Voice) == 0
    assert not (artifacts.root / "tokens").exists() or list((artifacts.root / "tokens").iterdir()) == []


def test_unusable_audio_is_refused_and_nothing_is_stored(
    submit, session: Session, artifacts: ArtifactStore, settings: Settings
):
    for data in (b"not audio", wav_bytes(seconds=0.1), b"\0" * (settings.max_reference_bytes + 1)):
        with pytest.raises(BadAudio):
            submit(reference_bytes=data)
    assert count(session, Voice) == 0 and list((artifacts.root / "references").iterdir()) == []


class BrokenBroker:
    def send_task(self, name: str, args: Any = None, **options: Any) -> Any:
        raise ConnectionError("broker down")


def test_a_job_the_broker_refused_is_withdrawn(
    ctx, settings: Settings, session: Session, store: FeatureStore, artifacts: ArtifactStore
):
    with pytest.raises(ConnectionError):
        submit_job(
            ctx=replace(ctx, sender=BrokenBroker()), session=session,
            request=JobRequest(tokens=[1], reference_bytes=wav_bytes(), idempotency_key="retry-me"),
        )
    assert count(session, Job) == 0
    voice = session.scalars(select(Voice)).one()
    assert voice.uses == 0 and store.claim_prepare(voice.id, 10)  # the claim was released


@pytest.mark.parametrize("shared", [True, False], ids=["voice-shared", "voice-abandoned"])
def test_a_cancel_committed_while_redis_is_away_answers_the_cancelled_job(
    ctx, submit, session: Session, settings: Settings, store: FeatureStore, caplog: pytest.LogCaptureFixture,
    shared: bool
):
    """The database is the record; the cancel flag is a hint the GPU worker also reads from the job's row.
    Shared: only the flag needs Redis; abandoned: reclaiming the voice's features does too (the sweep's)."""
    job_id = submit()
    if shared:
        submit(tokens=[4, 5])
    away = FeatureStore.from_url("redis://127.0.0.1:1/0", ttl_s=60)  # nothing listens there
    job = cancel_job(ctx=replace(ctx, store=away), session=session, job_id=job_id)
    assert job.id == job_id and job.status == "cancelled"
    assert q.require_job(session=session, job_id=job_id).status == "cancelled"
    assert "cancelled, but Redis did not answer" in caplog.text
    assert cancel_job(ctx=ctx, session=session, job_id=job_id).status == "cancelled"
    assert store.is_cancelled(job_id)  # with Redis back, a repeated cancel sets the flag
