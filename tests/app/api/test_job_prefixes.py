"""A job is found by a unique prefix of its id (what the CLI and the web page print) wherever an id is
taken; a prefix several ids begin with is refused with the candidates."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import update

from app.db.models import Job
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.settings import Settings
from tests.app.api.helpers import submit, upload_voice

IDS = ("abcd1111-0000-4000-8000-000000000001", "abcd2222-0000-4000-8000-000000000002")


def test_a_unique_prefix_finds_the_job_and_an_ambiguous_one_lists_the_candidates(
        client: TestClient, settings: Settings, reference: bytes) -> None:
    voice_id = upload_voice(client, reference).json()["id"]
    made = [submit(client, voice_id).json()["id"] for _ in IDS]
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as s:  # ids chosen to share a prefix
        for old, new in zip(made, IDS, strict=True):
            s.execute(update(Job).where(Job.id == old).values(id=new))
    engine.dispose()
    assert client.get(f"/v1/jobs/{IDS[0][:8]}").json()["id"] == IDS[0]
    assert client.get(f"/v1/jobs/{IDS[1][:5]}").json()["id"] == IDS[1]
    ambiguous = client.get("/v1/jobs/abcd")
    assert ambiguous.status_code == 422 and all(i in ambiguous.json()["reason"] for i in IDS)
    cancelled = client.post(f"/v1/jobs/{IDS[1][:8]}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{IDS[1][:8]}/audio").status_code == 409  # found: not succeeded
    assert client.get("/v1/jobs/abc").status_code == 404  # too short to be a prefix
    assert client.get("/v1/jobs/ffff0000").status_code == 404
