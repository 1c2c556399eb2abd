"""Settings: WAVEFARM_* variables, defaults, refusals."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, get_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("WAVEFARM_"):
            monkeypatch.delenv(name)
    get_settings.cache_clear()


def test_defaults_put_the_sqlite_file_beside_the_artifact_root():
    s = Settings()
    assert s.artifact_root == Path("./var/artifacts")
    assert s.database_url == f"sqlite:///{Path('./var/wavefarm.sqlite').resolve()}"
    assert (s.broker_url, s.result_backend, s.feature_store_url) == (
        "redis://127.0.0.1:6379/0",
        "redis://127.0.0.1:6379/1",
        "redis://127.0.0.1:6379/2",
    )
    assert s.model_dir is None and s.model_preset == "full" and (s.device, s.dtype) == ("cpu", "fp32")
    assert (s.micro_batch_size, s.worker_slots, s.voice_cache_capacity, s.job_max_attempts) == (8, 8, 8, 3)
    assert s.prep_wait_ms == 2000 and s.feature_ttl_s == 7 * 24 * 3600
    assert s.api_token is None


def test_every_field_reads_its_wavefarm_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("WAVEFARM_ARTIFACT_ROOT", str(tmp_path / "a"))
    monkeypatch.setenv("WAVEFARM_MODEL_DIR", str(tmp_path / "m"))
    monkeypatch.setenv("WAVEFARM_MODEL_PRESET", "tiny")
    monkeypatch.setenv("WAVEFARM_DEVICE", "cuda")
    monkeypatch.setenv("WAVEFARM_DTYPE", "bf16")
    monkeypatch.setenv("WAVEFARM_MICRO_BATCH_SIZE", "16")
    monkeypatch.setenv("WAVEFARM_FEATURE_TTL_S", "60")
    monkeypatch.setenv("WAVEFARM_API_TOKEN", "s3cret")
    s = Settings()
    assert s.database_url == f"sqlite:///{tmp_path / 'wavefarm.sqlite'}"
    assert s.model_dir == tmp_path / "m" and s.model_preset == "tiny"
    assert (s.device, s.dtype, s.micro_batch_size, s.feature_ttl_s) == ("cuda", "bf16", 16, 60)
    assert s.api_token is not None and s.api_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)


def test_an_explicit_database_url_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WAVEFARM_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert Settings().database_url == "postgresql+psycopg://u@h/db"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DEVICE", "tpu"),
        ("DTYPE", "int8"),
        ("MICRO_BATCH_SIZE", "0"),
        ("MODEL_PRESET", "huge"),
        ("VISIBILITY_TIMEOUT_S", "1"),
        ("OPENAI_VOICES", "alloy"),
        ("OPENAI_VOICES", "alloy=Ada,=bob"),
    ],
)
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str):
    monkeypatch.setenv(f"WAVEFARM_{name}", value)
    with pytest.raises(ValidationError):
        Settings()


def test_get_settings_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WAVEFARM_WORKER_SLOTS", "3")
    first = get_settings()
    monkeypatch.setenv("WAVEFARM_WORKER_SLOTS", "5")
    assert get_settings() is first and first.worker_slots == 3


def test_openai_voices_read_as_a_case_folded_mapping(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WAVEFARM_OPENAI_VOICES", " Alloy=Ada , echo = 3f2a9c01,")
    assert Settings().openai_voice_map() == {"alloy": "Ada", "echo": "3f2a9c01"}
