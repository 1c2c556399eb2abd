"""Fixtures of the database tests: a voice row; an empty database (no tables yet) on SQLite and PostgreSQL."""

import os

import pytest
from sqlalchemy.orm import Session

from app.db import queries as q
from tests.app.db.helpers import vid
from tests.conftest import pg_database


@pytest.fixture
def voice(session: Session) -> str:
    q.get_or_create_voice(session=session, voice_id=vid(), reference_path=f"references/{vid(99)}.wav")
    session.commit()
    return vid()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mig.sqlite'}"
        return
    with pg_database(f"wavefarm_test_{os.getpid()}_mig") as url:
        yield url
