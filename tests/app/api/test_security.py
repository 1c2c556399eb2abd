"""Access control and paths: no request names a server-side file, and no name a client sends (ids, upload
file names, form fields, token files) can reach outside the artifact root. Real app, Redis and database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.api.main import create_app
from app.dev import SAMPLES
from app.settings import Settings
from app.storage.artifacts import ArtifactStore
from app.storage.keys import cancel_key, check_job_id, check_voice_id, feature_key
from tests.support.runtime import RecordingSender

TRAVERSALS = ["../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/etc/passwd",
              "..\\..\\windows\\win.ini", "outputs/../../x", "a" * 64 + "/../../x", "%00", "....//....//x"]




@pytest.fixture
def client(settings: Settings, feature_redis: redis.Redis) -> Iterator[TestClient]:
    with TestClient(create_app(settings, sender=RecordingSender())) as c:
        yield c


@pytest.fixture
def voice_id(client: TestClient) -> str:
    ref = (SAMPLES / "voice_a.wav").read_bytes()
    return client.post("/v1/voices", files={"file": ("a.wav", ref, "audio/wav")}).json()["id"]


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_the_schema_accepts_no_server_side_path(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    names: set[str] = set()
    for methods in spec["paths"].values():
        for op in methods.values():
            names.update(p["name"] for p in op.get("parameters", []))
            for content in op.get("requestBody", {}).get("content", {}).values():
                schema = content["schema"]
                if "$ref" in schema:
                    schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
                names.update(schema.get("properties", {}))
    assert not {n for n in names if any(w in n.lower() for w in ("path", "dir", "url", "location"))}, names


@pytest.mark.parametrize("name", TRAVERSALS)
@pytest.mark.parametrize("template", ["/v1/jobs/{}", "/v1/jobs/{}/audio", "/v1/voices/{}"])
def test_ids_that_try_to_traverse_are_not_found(client: TestClient, template: str, name: str) -> None:
    response = client.get(template.format(name))
    assert response.status_code in (404, 405), response.text  # never a file, never a 500
    assert "root:" not in response.text
    assert client.post(f"/v1/jobs/{name}/cancel").status_code in (404, 405)


@pytest.mark.parametrize("bad, status", [("../" * 21 + "x", 422), ("0" * 63 + "/", 422),
                                         ("A" * 64, 404), ("g" * 64, 404)])  # these two could be names
def test_a_submitted_voice_id_that_is_not_a_sha256_is_refused(client: TestClient, bad: str,
                                                              status: int) -> None:
    response = client.post("/v1/jobs", json={"voice_id": bad, "tokens": [1, 2, 3]})
    assert response.status_code == status and response.json()["reason"], response.text


def test_an_upload_file_name_is_never_used(client: TestClient, settings: Settings) -> None:
    ref = (SAMPLES / "voice_b.wav").read_bytes()
    before = files_under(settings.artifact_root)
    for name in ("../../../escaped.wav", "/tmp/escaped.wav", "..\\escaped.wav"):
        assert client.post("/v1/voices", files={"file": (name, ref, "audio/wav")}).status_code in (200, 201)
    added = files_under(settings.artifact_root) - before
    assert [p.relative_to(settings.artifact_root).parts[0] for p in added] == ["references"]
    assert all(p.stem != "escaped" for p in added)
    assert not Path("/tmp/escaped.wav").exists()
    assert not (settings.artifact_root.parent / "escaped.wav").exists()


def test_form_fields_naming_paths_are_refused(client: TestClient, voice_id: str) -> None:
    for field in ("output_path", "tokens_path", "reference_path", "artifact_root"):
        response = client.post("/v1/jobs", data={"voice_id": voice_id, field: "/etc/passwd"},
                               files={"tokens": ("../../t.json", b"[1,2,3]", "application/json")})
        assert response.status_code == 422 and "unknown form fields" in response.json()["reason"]
    for field in ("output_path", "tokens_path", "reference_path"):
        response = client.post("/v1/jobs", json={"voice_id": voice_id, "tokens": [1], field: "/etc/passwd"})
        assert response.status_code == 422, response.text


def test_a_long_token_list_is_stored_under_the_job_id_not_a_client_name(client: TestClient, voice_id: str,
                                                                        settings: Settings) -> None:
    response = client.post("/v1/jobs", data={"voice_id": voice_id},
                           files={"tokens": ("../../../../evil.json", json.dumps([5] * 4200).encode(),
                                             "application/json")})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert (settings.artifact_root / "tokens" / f"{job_id}.json").is_file()
    assert not any(p.name == "evil.json" for p in settings.artifact_root.parent.rglob("evil.json"))


@pytest.mark.parametrize("relpath", ["../x", "references/../../etc/passwd", "/etc/passwd",
                                     "outputs/" + "0" * 36 + ".wav/../../x", "tmp/x", "references/x.wav",
                                     "outputs/../outputs/" + "0" * 36 + ".wav"])
def test_the_artifact_store_refuses_paths_outside_its_layout(tmp_path: Path, relpath: str) -> None:
    store = ArtifactStore(tmp_path)
    with pytest.raises(ValueError):
        store.path(relpath)
    with pytest.raises(ValueError):
        store.read_bytes(relpath)


@pytest.mark.parametrize("job_id", ["../x", "{12345678-1234-1234-1234-123456789abc}",
                                    "12345678-1234-1234-1234-123456789ABC",
                                    "123456781234123412341234567890ab",
                                    "12345678-1234-1234-1234-123456789abc/../x", ""])
def test_job_ids_must_be_canonical_before_naming_a_file_or_key(job_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        check_job_id(job_id)
    with pytest.raises(ValueError):
        ArtifactStore(tmp_path).output_relpath(job_id, "wav")
    with pytest.raises(ValueError):
        cancel_key(job_id)


@pytest.mark.parametrize("voice_id", ["../x", "*", "0" * 63, "0" * 64 + "\n", "0" * 64 + ":x"])
def test_voice_ids_must_be_sha256_before_naming_a_key(voice_id: str) -> None:
    with pytest.raises(ValueError):
        check_voice_id(voice_id)
    with pytest.raises(ValueError):
        feature_key(voice_id)


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer ", "Bearer wrong", "Basic czNjcmV0",
                                    "bearer s3cre", "Bearer s3cret2", "Bearer " + "s" * 100_000])
def test_every_route_but_health_and_metrics_needs_the_token(settings: Settings, feature_redis: redis.Redis,
                                                            header: str | None) -> None:
    locked = settings.model_copy(update={"api_token": SecretStr("s3cret")})
    with TestClient(create_app(locked, sender=RecordingSender())) as c:
        headers = {} if header is None else {"Authorization": header}
        for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/voices"), ("POST", "/v1/jobs"),
                             ("GET", "/v1/jobs/" + "0" * 8 + "-0000-0000-0000-" + "0" * 12),
                             ("POST", "/v1/voices")):
            response = c.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, header, response.text)
            assert response.json()["error"] == "Unauthorized"
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_the_token_check_and_the_context_run_on_the_event_loop(
        settings: Settings, feature_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submission hands off to the thread pool once, for its own work: the route's dependencies (the
    token check, the context) are async, where a plain `def` one is a hand-off there and back each."""
    import anyio.to_thread

    handed: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(getattr(func, "func", func), "__name__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    locked = settings.model_copy(update={"api_token": SecretStr("s3cret")})
    with TestClient(create_app(locked, sender=RecordingSender())) as c:
        token = {"Authorization": "Bearer s3cret"}
        reference = ("ref.wav", (SAMPLES / "voice_a.wav").read_bytes(), "audio/wav")
        voice_id = c.post("/v1/voices", files={"reference": reference}, headers=token).json()["id"]
        monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
        response = c.post("/v1/jobs", json={"voice_id": voice_id, "tokens": [1, 2, 3]}, headers=token)
        assert response.status_code == 202, response.text
        assert handed == ["_submit"]
        assert c.post("/v1/jobs", json={"voice_id": voice_id, "tokens": [1]}).status_code == 401


def test_a_worker_message_with_a_malformed_voice_id_is_refused(settings: Settings) -> None:
    from tasks.voice import prepare

    assert prepare.run("../../etc/passwd") == "../../etc/passwd"  # logged and dropped, nothing read
