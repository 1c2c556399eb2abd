"""The GPU worker's tests: `sessions` is the SQLite file `make_runtime`'s runtimes use (the root
conftest's `sessions` covers both databases; here the in-process runtimes need their own)."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker


@pytest.fixture
def sessions(sqlite_sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    return sqlite_sessions
