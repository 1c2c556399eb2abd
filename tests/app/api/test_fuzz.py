"""Bad input, generated: schemathesis drives every operation of the published OpenAPI schema (valid and
invalid requests) against the real app on real Redis and SQLite, and the CLI gets random arguments.

Whatever comes in: never a 500, every refusal is a 4xx with a reason, and the app keeps answering.
Tasks go to a recording sender (no broker round trip needed to judge a response).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from app import cli
from app.api.main import create_app
from app.dev import SAMPLES
from app.settings import Settings
from tests.support.runtime import RecordingSender

EXAMPLES = 25  # per operation and mode; the whole module stays well under a minute on two shared cores




@pytest.fixture
def fuzz_app(tmp_path: Path, redis_session_lock: None, feature_redis: redis.Redis) -> Iterator[FastAPI]:
    from app.db import upgrade
    from tests.conftest import make_test_settings

    url = f"sqlite:///{tmp_path / 'fuzz.sqlite'}"
    upgrade(url)
    settings = make_test_settings(database_url=url, artifact_root=tmp_path / "artifacts",
                                  max_tokens=5000)
    app = create_app(settings, sender=RecordingSender())
    with TestClient(app) as client:  # runs the lifespan; a voice exists so some ids are real
        ref = (SAMPLES / "voice_a.wav").read_bytes()
        assert client.post("/v1/voices", files={"file": ("a.wav", ref, "audio/wav")}).status_code == 201
        yield app


def _published_operations() -> list[tuple[str, str]]:
    """Every (method, path) of the schema, read from an app that connects to nothing (collection time)."""
    settings = Settings(database_url="sqlite://", artifact_root=Path("/nonexistent/wavefarm-fuzz"))
    spec = create_app(settings, sender=RecordingSender()).openapi()
    return sorted((m.upper(), p) for p, methods in spec["paths"].items() for m in methods)


OPERATIONS = _published_operations()
CORE = {("GET", "/v1/voices"), ("POST", "/v1/voices"), ("GET", "/v1/voices/{voice_id}"), ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"), ("GET", "/v1/jobs/{job_id}/audio"),
        ("POST", "/v1/jobs/{job_id}/cancel"), ("GET", "/healthz"), ("GET", "/metrics")}


def _check(case: Any, response: Any) -> None:
    case.validate_response(response, checks=(not_a_server_error,))
    if response.status_code >= 400:
        body = response.json()
        assert body.get("error") and body.get("reason"), body  # a 4xx says why


def test_every_published_operation_is_fuzzed(fuzz_app: FastAPI) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    published = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert published == set(OPERATIONS) and CORE <= published


NO_INPUT = {("GET", "/healthz"), ("GET", "/metrics")}  # nothing to make invalid


@pytest.mark.parametrize("method, path, mode", [
    (m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if not (mode == GenerationMode.NEGATIVE and (m, p) in NO_INPUT)])
def test_no_request_gets_a_500_and_every_refusal_says_why(fuzz_app: FastAPI, method: str, path: str,
                                                         mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operation = schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @hsettings(max_examples=EXAMPLES, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        _check(case, case.call())

    fuzz()


def test_the_app_still_answers_after_the_fuzzing(fuzz_app: FastAPI) -> None:
    with TestClient(fuzz_app) as client:
        assert client.get("/healthz").status_code == 200


TOKEN_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True), st.text(max_size=5),
    st.booleans(), st.none(), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@given(tokens=st.one_of(st.lists(TOKEN_VALUES, max_size=8), TOKEN_VALUES,
                        st.lists(st.integers(0, 6560), min_size=5001, max_size=5002)))
@hsettings(max_examples=60, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_tokens_of_any_shape_are_accepted_or_refused_with_a_4xx(fuzz_app: FastAPI, tokens: Any) -> None:
    with TestClient(fuzz_app, raise_server_exceptions=False) as client:
        voice_id = client.get("/v1/voices").json()[0]["id"]
        body = json.dumps({"voice_id": voice_id, "tokens": tokens}, allow_nan=True)
        response = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        valid = (isinstance(tokens, list) and 0 < len(tokens) <= 5000
                 and all(type(t) is int and 0 <= t <= 6560 for t in tokens))
        if valid:
            assert response.status_code == 202, response.text
        else:
            assert response.status_code in (413, 422), response.text
            assert response.json()["reason"]
        form = client.post("/v1/jobs", data={"voice_id": voice_id},
                           files={"tokens": ("t.json", body.encode(), "application/json")})
        assert form.status_code == (202 if valid else 422), form.text


@pytest.mark.parametrize("tokens, reason", [
    ([-1], "token 0 is -1"), ([6561], "token 0 is 6561"), ([2**64], "token 0"), (["1"], "not an integer"),
    ([1.0], "not an integer"), ([True], "not an integer"), ([], "empty"), ("1,2", "list"),
    ([1] * 5001, "at most 5000"),
])
def test_token_refusals_name_the_problem(fuzz_app: FastAPI, tmp_path: Path, tokens: Any, reason: str) -> None:
    with TestClient(fuzz_app) as client:
        voice_id = client.get("/v1/voices").json()[0]["id"]
        response = client.post("/v1/jobs", data={"voice_id": voice_id},
                               files={"tokens": ("t.json", json.dumps(tokens).encode(), "application/json")})
        assert response.status_code == 422 and reason in response.json()["reason"], response.text


# -- the CLI ------------------------------------------------------------------------------------------
ARG = st.one_of(st.sampled_from(["--voice", "--tokens", "--seed", "--priority", "--format", "--local",
                                 "--api", "-o", "status", "cancel", "jobs", "submit", "voices", "--add",
                                 "../../etc/passwd", "/dev/null", "0" * 64, "-1", "1e999", ""]),
                st.text(max_size=12))


@given(argv=st.lists(ARG, max_size=6))
@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_cli_refuses_bad_arguments_with_a_message_not_a_traceback(argv: list[str], settings: Settings,
                                                                      monkeypatch, capsys) -> None:
    from app.settings import get_settings
    from tests.conftest import settings_env

    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    if argv and argv[0] in ("submit", "status", "cancel", "jobs", "voices"):
        argv = [argv[0], "--local", *argv[1:]]  # the database directly: no API server in this test
    elif argv and argv[0] not in ("-v", "--verbose"):
        argv = ["status", "--local", *argv]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        get_settings.cache_clear()
    assert code in (0, 1, 2), code
